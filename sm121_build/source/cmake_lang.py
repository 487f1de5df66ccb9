"""Read CMake files as CMake does: command invocations with their arguments and positions.

Only the language's lexical structure (CMake 3 "cmake-language(7)"): comments (`#` to the end
of the line, `#[[ … ]]` bracket comments), command invocations `name(args)` split over any
number of lines, quoted (`"…"` with `\\` escapes), bracket (`[=[ … ]=]`) and unquoted arguments,
and nested parentheses.  Each argument keeps its offsets in the file text, so a caller can
rewrite exactly one argument and leave every other byte as it was.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sm121_build.core.errors import Sm121Error
from sm121_build.core.inputs import read_input

ArgKind = Literal["quoted", "unquoted", "bracket", "paren"]
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
BRACKET_OPEN = re.compile(r"\[(=*)\[")
VARIABLE_REF = re.compile(r"\$\{(\w+)\}")


@dataclass(frozen=True)
class Argument:
    kind: ArgKind
    value: str  # the text CMake sees (quotes and bracket delimiters removed)
    start: int  # offsets of the whole argument, delimiters included
    end: int


@dataclass(frozen=True)
class Command:
    name: str  # as written; CMake command names are case-insensitive
    arguments: tuple[Argument, ...]
    line: int
    start: int
    end: int

    @property
    def key(self) -> str:
        return self.name.lower()

    @property
    def words(self) -> tuple[Argument, ...]:
        """The arguments without the parentheses of nested groups."""
        return tuple(a for a in self.arguments if a.kind != "paren")


class CMakeSyntaxError(ValueError):
    """Text that is not CMake: an unterminated argument, comment or invocation."""


def commands(text: str) -> list[Command]:
    return list(_Reader(text).read())


class _Reader:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self._counted = (0, 1)  # (offset, its line) of the last line_of

    def line_of(self, offset: int) -> int:
        """The line of an offset, counted on from the last one asked for (commands come in
        order: counting from the start each time was quadratic in the file's size)."""
        last, line = self._counted
        if offset < last:
            last, line = 0, 1
        line += self.text.count("\n", last, offset)
        self._counted = (offset, line)
        return line

    def read(self) -> Iterator[Command]:
        text = self.text
        while self.pos < len(text):
            char = text[self.pos]
            if char == "#":
                self._comment()
            elif char.isalpha() or char == "_":
                start = self.pos
                name = IDENTIFIER.match(text, self.pos)
                if name is None:  # a letter CMake's identifiers do not take (`é`)
                    self.pos += 1
                    continue
                self.pos = name.end()
                while self.pos < len(text) and text[self.pos] in " \t":
                    self.pos += 1
                if self.pos < len(text) and text[self.pos] == "(":
                    self.pos += 1
                    arguments = self._arguments(start)
                    yield Command(name.group(), arguments, self.line_of(start), start, self.pos)
            else:
                self.pos += 1

    def _comment(self) -> None:
        bracket = BRACKET_OPEN.match(self.text, self.pos + 1)
        if bracket:
            self.pos = self._bracket_end(bracket, self.pos)
        else:
            newline = self.text.find("\n", self.pos)
            self.pos = len(self.text) if newline < 0 else newline

    def _bracket_end(self, opening: re.Match[str], start: int) -> int:
        close = f"]{opening.group(1)}]"
        end = self.text.find(close, opening.end())
        if end < 0:
            raise CMakeSyntaxError(f"line {self.line_of(start)}: unterminated bracket")
        return end + len(close)

    def _arguments(self, command_start: int) -> tuple[Argument, ...]:
        text = self.text
        found: list[Argument] = []
        depth = 0
        while True:
            if self.pos >= len(text):
                raise CMakeSyntaxError(
                    f"line {self.line_of(command_start)}: unterminated command invocation")
            char = text[self.pos]
            if char in " \t\r\n":
                self.pos += 1
            elif char == "#":
                self._comment()
            elif char == "(":
                found.append(Argument("paren", "(", self.pos, self.pos + 1))
                depth += 1
                self.pos += 1
            elif char == ")":
                self.pos += 1
                if depth == 0:
                    return tuple(found)
                depth -= 1
                found.append(Argument("paren", ")", self.pos - 1, self.pos))
            elif char == '"':
                found.append(self._quoted())
            elif (bracket := BRACKET_OPEN.match(text, self.pos)) is not None:
                start = self.pos
                self.pos = self._bracket_end(bracket, start)
                body = text[bracket.end():self.pos - len(bracket.group(0))]
                found.append(Argument("bracket", body.removeprefix("\n"), start, self.pos))
            else:
                found.append(self._unquoted())

    def _quoted(self) -> Argument:
        text = self.text
        start = self.pos
        self.pos += 1
        while self.pos < len(text) and text[self.pos] != '"':
            self.pos += 2 if text[self.pos] == "\\" else 1
        if self.pos >= len(text):
            raise CMakeSyntaxError(f"line {self.line_of(start)}: unterminated quoted argument")
        self.pos += 1
        return Argument("quoted", text[start + 1:self.pos - 1], start, self.pos)

    def _unquoted(self) -> Argument:
        text = self.text
        start = self.pos
        while self.pos < len(text) and text[self.pos] not in ' \t\r\n()#"':
            self.pos += 2 if text[self.pos] == "\\" else 1
        return Argument("unquoted", text[start:self.pos], start, self.pos)


def variables_in(value: str) -> list[str]:
    """The `${NAME}` references of an argument's value."""
    return VARIABLE_REF.findall(value)


MAX_SOURCE_FILE = 4 << 20  # vLLM 0.33.0's largest CMake file (CMakeLists.txt): ~60 KB


def read_source(path: Path, errors: str = "surrogateescape") -> str:
    """A CMake (or any source) file of a tree as text, through the one way in (a regular
    file, opened without blocking, at most `MAX_SOURCE_FILE` bytes: a larger one is one
    line); bytes that are not UTF-8 (a Latin-1 comment) are kept as they are, and written
    back unchanged by `source_text_bytes`."""
    return read_input(path, MAX_SOURCE_FILE, "source file").decode("utf-8", errors=errors)


def source_text_bytes(text: str) -> bytes:
    return text.encode("utf-8", errors="surrogateescape")


def real_file(tree: Path, rel: str) -> Path:
    """Where a patch of `tree/rel` must write: the file itself, or the file a symlink names
    when that is inside the tree (a symlink is never replaced by a copy)."""
    path = tree / rel
    if not path.is_symlink():
        return path
    target = path.resolve()
    if not target.is_relative_to(tree.resolve()):
        raise Sm121Error(f"{path} is a symlink to {target}, outside the source tree: not "
                         "patched through it (copy the file into the tree)")
    return target
