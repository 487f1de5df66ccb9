"""Know the build's outcome before compiling: find vLLM's arch guards and evaluate them with CMake.

A guard is a call of `cuda_archs_loose_intersection(VAR "LIST" "${CUDA_ARCHS}")`, or of a
function the source defines around it (`cuda_archs_sm90plus(VAR "${CUDA_ARCHS}")`), in any of the
scanned CMake files: found with a reader of the CMake language (any spacing, calls split over
lines, comments between arguments, any branch), with `${VAR}` arguments resolved where the files
set them once to a literal list.  Each is evaluated with the pinned source's own function
(`cmake/utils.cmake`) through `cmake -P`, for the arch list the build will use.  Its semantics
changed between releases, so no re-implementation is attempted: CMake answers.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import NamedTuple

from sm121_build.core.children import Program, run
from sm121_build.core.errors import Sm121Error, ToolchainError
from sm121_build.core.inputs import InputRefused
from sm121_build.core.vllm import MIN_CMAKE
from sm121_build.cuda.compat import DEFAULT_CUDA, ArchList
from sm121_build.source.cmake_lang import (
    Argument,
    CMakeSyntaxError,
    Command,
    commands,
    read_source,
    variables_in,
)
from sm121_build.source.cmake_run import UTILS_AT, CMakeScript, current_runner
from sm121_build.source.tree import require_contained

GUARD_FUNCTION = "cuda_archs_loose_intersection"
PLAIN_SM12X = re.compile(r"^12\.\d+$")
SM12X_ENTRY = re.compile(r"^12\.\d+")
NARROWING = "CUDA_ARCHS"
TARGET_REF = "${CUDA_ARCHS}"
DEFAULT_FILES = ("CMakeLists.txt", "cmake/**/*.cmake")
UTILS = "cmake/utils.cmake"
# list() operations that change a variable in ways not followed (APPEND/PREPEND/INSERT are)
LIST_MODIFIERS = {"remove_item", "remove_at", "filter", "transform", "remove_duplicates",
                  "pop_back", "pop_front", "sort", "reverse"}


@dataclass(frozen=True)
class Call:
    """One guard call as written in the source, its arguments resolved where possible."""

    file: str
    line: int
    function: str
    variable: str
    arch_list: str | None  # the list argument as CMake sees it; None: inside a wrapper
    list_arg: Argument | None  # where that argument is written (None for a wrapper)
    evaluated_args: tuple[str, ...] | None  # what the evaluation passes; None: cannot
    branch: str
    levels: tuple[Level, ...]  # the enclosing branches, as the evaluation replays them
    unresolved: str  # why it cannot be evaluated ("" when it can)
    may_give_sm12x: bool  # some entry the list can hold is a 12.x arch (True when unknown)
    # set()/list(APPEND …) commands replayed before the call, each inside its branches, for
    # a list variable built up by CUDA version (0.33.0's DEEPGEMM_SUPPORT_ARCHS)
    prelude: tuple[Step, ...] = ()


@dataclass(frozen=True)
class Guard:
    """A guard call and what it yields for the requested archs (None: not evaluable)."""

    call: Call
    result: tuple[str, ...] | None
    taken: bool = True  # False: the CUDA version rules its branch out; result is ()

    @property
    def file(self) -> str:
        return self.call.file

    @property
    def line(self) -> int:
        return self.call.line

    @property
    def variable(self) -> str:
        return self.call.variable

    @property
    def arch_list(self) -> str:
        if self.call.arch_list is not None:
            return self.call.arch_list
        return f"(in {self.call.function})"

    @property
    def branch(self) -> str:
        return self.call.branch

    @property
    def targets(self) -> tuple[str, ...]:
        return self.result or ()

    @property
    def plain_sm12x(self) -> tuple[str, ...]:
        return tuple(a for a in self.targets if PLAIN_SM12X.match(a))

    @property
    def location(self) -> str:
        return f"{self.file}:{self.line}"


def cmake_candidates() -> list[str]:
    """Where cmake may be, best first: the `cmake` PyPI package's own binary (no Python
    launcher: ~7 ms a call instead of ~150 ms), this environment's launcher, then PATH."""
    found = []
    try:
        import cmake as cmake_package
        found.append(str(Path(cmake_package.CMAKE_BIN_DIR) / "cmake"))
    except (ImportError, AttributeError):
        pass
    return [*found, str(Path(sys.executable).parent / "cmake"), "cmake"]


@cache
def find_cmake(candidates: tuple[str, ...] | None = None) -> str:
    """The first cmake >= MIN_CMAKE (a system one may be older); found once per process."""
    for candidate in candidates or cmake_candidates():
        try:
            done = run(Program((candidate, "--version"), 30.0, "cmake --version"))
        except OSError:
            continue
        if done.returncode or done.timed_out:
            continue
        match = re.search(r"version (\d+)\.(\d+)", done.text)
        if match and (int(match.group(1)), int(match.group(2))) >= MIN_CMAKE:
            return candidate
    raise ToolchainError(
        f"cmake >= {MIN_CMAKE[0]}.{MIN_CMAKE[1]} not found: `pip install cmake` (vLLM needs it)")


def scan_files(source: Path, patterns: tuple[str, ...] = DEFAULT_FILES) -> list[str]:
    """The files (relative, sorted, each once) the patterns name in a source tree; a tree
    with a link that leads out of it is refused first (`tree.require_contained`)."""
    require_contained(source)
    found: list[str] = []
    for pattern in patterns:
        for path in sorted(source.glob(pattern)):
            rel = path.relative_to(source).as_posix()
            if path.is_file() and rel not in found:
                found.append(rel)
                if len(found) > MAX_SCANNED_FILES:
                    raise Sm121Error(f"{source}: more than {MAX_SCANNED_FILES} files match "
                                     f"{', '.join(patterns)} (vLLM has ~40): not a source "
                                     "tree this tool reads")
    return found


MAX_SCANNED_FILES = 2000


def parse(path: Path, rel: str) -> tuple[str, list[Command]]:
    """A CMake file's text and its commands."""
    try:
        text = read_source(path)
        return text, commands(text)
    except CMakeSyntaxError as exc:
        raise Sm121Error(f"{rel}: cannot read it as CMake: {exc}") from None
    except InputRefused as exc:
        why = str(exc).removeprefix(f"{path}: ")
        raise Sm121Error(f"{rel}: cannot read it: {why}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise Sm121Error(f"{rel}: cannot read it: {exc}") from None


@dataclass
class _Definitions:
    """What the scanned files assign to each variable, outside function bodies."""

    sets: dict[str, list[str | None]]  # each set(): its literal value, None if not literal
    extra: dict[str, list[str | None]]  # list(APPEND/PREPEND/INSERT …) values
    modified: set[str]  # changed by another list() operation
    # every set()/list() of a variable: (file, line, the step; None under a condition the
    # evaluation cannot decide)
    steps: dict[str, list[tuple[str, int, Step | None]]] = field(default_factory=dict)

    def replay(self, name: str, rel: str, line: int) -> tuple[Step, ...] | None:
        """The commands that build a variable, to run before a call at rel:line: only when
        each is a literal set()/list(APPEND|PREPEND|INSERT) in that file before the call, in
        branches that test nothing but the CUDA version."""
        steps = self.steps.get(name, [])
        values = self.sets.get(name, []) + self.extra.get(name, [])
        if name in self.modified or not steps or any(v is None for v in values) or any(
                f != rel or at >= line or step is None for f, at, step in steps):
            return None
        return tuple(step for _, _, step in steps if step is not None)

    def value(self, name: str) -> str | None:
        """The one literal value of a variable set once and never changed."""
        values = self.sets.get(name, [])
        if len(values) == 1 and name not in self.modified and name not in self.extra:
            return values[0]
        return None

    def possible(self, name: str) -> list[str] | None:
        """Every entry the variable can hold; None when something is not literal."""
        values = self.sets.get(name, []) + self.extra.get(name, [])
        if name in self.modified or not values or any(v is None for v in values):
            return None
        return [e for v in values if v for e in v.split(";") if e]


def _literal(arguments: tuple[Argument, ...]) -> str | None:
    if any(variables_in(a.value) or a.kind == "paren" for a in arguments):
        return None
    return ";".join(a.value for a in arguments)


def _collect(parsed: dict[str, list[Command]], texts: dict[str, str] | None = None
             ) -> tuple[_Definitions, dict[str, str]]:
    """Variable assignments outside functions, and the guard functions: the base one plus
    every function whose body calls a guard function (name -> defining file)."""
    defs = _Definitions({}, {}, set())
    bodies: dict[str, tuple[str, list[Command]]] = {}
    for rel, cmds in parsed.items():
        current: list[Command] | None = None
        text = (texts or {}).get(rel)
        branches = _branches(cmds, text) if text is not None else \
            [("", (), False)] * len(cmds)
        for cmd, (_shown, levels, decided) in zip(cmds, branches, strict=True):
            if current is None and text is not None and cmd.words and (
                    cmd.key == "set" or (cmd.key == "list" and len(cmd.words) >= 2)):
                name = cmd.words[0].value if cmd.key == "set" else cmd.words[1].value
                defs.steps.setdefault(name, []).append(
                    (rel, cmd.line, (text[cmd.start:cmd.end], levels) if decided else None))
            if cmd.key in ("function", "macro") and cmd.words:
                current = []
                bodies[cmd.words[0].value.lower()] = (rel, current)
            elif cmd.key in ("endfunction", "endmacro"):
                current = None
            elif current is not None:
                current.append(cmd)
            elif cmd.key == "set" and cmd.words:
                rest = cmd.words[1:]
                scoped = any(a.value in ("PARENT_SCOPE", "CACHE") for a in rest)
                defs.sets.setdefault(cmd.words[0].value, []).append(
                    None if scoped else _literal(rest))
            elif cmd.key == "list" and len(cmd.words) >= 2:
                op, name = cmd.words[0].value.lower(), cmd.words[1].value
                if op in ("append", "prepend"):
                    defs.extra.setdefault(name, []).append(_literal(cmd.words[2:]))
                elif op == "insert":
                    defs.extra.setdefault(name, []).append(_literal(cmd.words[3:]))
                elif op in LIST_MODIFIERS:
                    defs.modified.add(name)
    functions = {GUARD_FUNCTION: ""}
    changed = True
    while changed:
        changed = False
        for name, (rel, body) in bodies.items():
            if name not in functions and any(c.key in functions for c in body):
                functions[name] = rel
                changed = True
    return defs, functions


Level = tuple[tuple[str, ...], str]  # (sibling conditions before, own condition)
Step = tuple[str, tuple[Level, ...]]  # a command as written, and its enclosing branches
KNOWN_WORDS = re.compile(r"^(?:\$\{CMAKE_CUDA_COMPILER_VERSION\}|CMAKE_CUDA_COMPILER_VERSION|"
                         r"VERSION_(?:LESS|GREATER|EQUAL|LESS_EQUAL|GREATER_EQUAL)|"
                         r"AND|OR|NOT|DEFINED|\d+(?:\.\d+)*|[()])$")


def _known(cmd: Command) -> str | None:
    """A condition the evaluation can decide (it tests only the CUDA version), else None."""
    words = [a.value for a in cmd.arguments]
    if words and all(KNOWN_WORDS.match(w) for w in words) and any(
            "CMAKE_CUDA_COMPILER_VERSION" in w for w in words):
        return " ".join(words)
    return None


def _condition(cmd: Command, text: str) -> tuple[str, str]:
    """An if()/elseif() condition as written (blanks folded), and as replayed: the condition
    itself when it tests only the CUDA version, else TRUE."""
    shown = " ".join(text[cmd.arguments[0].start:cmd.arguments[-1].end].split()) \
        if cmd.arguments else ""
    return shown, _known(cmd) or "TRUE"


def _branches(cmds: list[Command], text: str
              ) -> list[tuple[str, tuple[Level, ...], bool]]:
    """Per command: its innermost enclosing if()/elseif()/else() as written, the chain of
    enclosing branches as the evaluation replays it, and whether every condition on that
    chain is one the evaluation decides.  A condition on anything but the CUDA version is
    taken as possibly true (and a sibling before it as possibly false), so a call is skipped
    only where the CUDA version rules its branch out."""
    shown: list[str] = []
    levels: list[tuple[list[str], str]] = []
    known: list[bool] = []
    out = []
    for cmd in cmds:
        if cmd.key == "if":
            condition, replayed = _condition(cmd, text)
            shown.append(condition)
            levels.append(([], replayed))
            known.append(_known(cmd) is not None)
        elif cmd.key == "elseif" and shown:
            condition, replayed = _condition(cmd, text)
            shown[-1] = f"elseif {condition}"
            priors, own = levels[-1]
            levels[-1] = ([*priors, own] if own != "TRUE" else priors, replayed)
            known[-1] = known[-1] and _known(cmd) is not None
        elif cmd.key == "else" and shown:
            shown[-1] = f"else of {shown[-1]}"
            priors, own = levels[-1]
            levels[-1] = ([*priors, own] if own != "TRUE" else priors, "TRUE")
        elif cmd.key == "endif" and shown:
            shown.pop()
            levels.pop()
            known.pop()
        out.append((shown[-1] if shown else "", tuple((tuple(p), o) for p, o in levels),
                    all(known)))
    return out


def find_calls(source: Path, patterns: tuple[str, ...] = DEFAULT_FILES) -> list[Call]:
    """Every guard call of the scanned files, in file order (narrowing calls excluded)."""
    read = {rel: parse(source / rel, rel) for rel in scan_files(source, patterns)}
    parsed = {rel: cmds for rel, (_text, cmds) in read.items()}
    if UTILS not in parsed and (source / UTILS).is_file():  # its wrappers, whatever is scanned
        parsed[UTILS] = parse(source / UTILS, UTILS)[1]
    defs, functions = _collect(parsed, {rel: text for rel, (text, _c) in read.items()})
    calls = []
    for rel, (text, cmds) in read.items():
        depth = 0
        for cmd, (branch, levels, _decided) in zip(cmds, _branches(cmds, text), strict=True):
            if cmd.key in ("function", "macro"):
                depth += 1
            elif cmd.key in ("endfunction", "endmacro"):
                depth = max(depth - 1, 0)
            elif depth == 0 and cmd.key in functions:
                call = _call(_Written(rel, cmd, branch, levels), functions[cmd.key], defs)
                if call is not None:
                    calls.append(call)
    return calls


def _expand(value: str, defs: _Definitions, at: tuple[str, int] | None = None
            ) -> tuple[str | None, str, tuple[Step, ...]]:
    """A value with every `${VAR}` but the target list replaced; or why it cannot be.  With
    `at` (file, line), a variable built up by literal set()/list(APPEND …) before the call is
    left in place, and the commands that build it are returned to be replayed."""
    prelude: list[Step] = []
    for name in variables_in(value):
        if name == NARROWING:
            continue
        resolved = defs.value(name)
        if resolved is None:
            steps = defs.replay(name, *at) if at is not None else None
            if steps is None:
                return None, f"${{{name}}} is not set once to a literal list in the scanned " \
                    "files", ()
            prelude += steps
            continue
        value = value.replace(f"${{{name}}}", resolved)
    return value, "", tuple(prelude)


def _possible_sm12x(value: str, defs: _Definitions) -> bool:
    """Whether an entry of the list can be a 12.x arch: a literal one (`12.0${SUFFIX}` too),
    or one a variable in it can hold."""
    entries = [e for e in value.split(";") if e]
    for name in variables_in(value):
        if name == NARROWING:
            continue
        possible = defs.possible(name)
        if possible is None:
            return True
        entries += possible
    return any(SM12X_ENTRY.match(e) for e in entries)


class _Written(NamedTuple):
    """Where a command is written: its file, itself, and the branches around it."""

    rel: str
    cmd: Command
    branch: str
    levels: tuple[Level, ...]


def _call(written: _Written, defined_in: str, defs: _Definitions) -> Call | None:
    """A guard call (the guard function, or a wrapper of it defined in `defined_in`), its
    arguments resolved with `defs`."""
    rel, cmd, branch, levels = written
    function = cmd.key
    words = cmd.words
    if not words:
        return None
    variable = words[0].value
    if variable == NARROWING:
        return None  # vLLM's own narrowing of the requested archs: see effective_archs
    unresolved = ""
    if not re.fullmatch(r"\w+", variable):
        unresolved = f"its output variable {variable!r} is not a plain name"
    is_base = function == GUARD_FUNCTION
    list_arg = words[1] if is_base and len(words) == 3 else None
    if is_base and list_arg is None:
        unresolved = unresolved or f"expected 3 arguments, found {len(words)}"
    if not is_base and defined_in != UTILS:
        unresolved = unresolved or f"{function} is defined in {defined_in}, not {UTILS}"
    args: list[str] = []
    prelude: list[Step] = []
    for arg in words[1:]:
        expanded, why, steps = _expand(arg.value, defs, (rel, cmd.line))
        unresolved = unresolved or why
        args.append(expanded or "")
        prelude += steps
    split = [a.value for a in words[1:] if a.kind == "unquoted" and ("${" in a.value
                                                                      or ";" in a.value)]
    if split:
        unresolved = unresolved or f"its argument {split[0]} is unquoted: CMake splits it"
    target_ok = TARGET_REF in [a.value for a in words[1:]] and (
        list_arg is None or words[2].value == TARGET_REF)
    if not target_ok:
        unresolved = unresolved or f"its target list is not \"{TARGET_REF}\""
    arch_list = None
    may = True
    if list_arg is not None:
        expanded, _, _steps = _expand(list_arg.value, defs)
        arch_list = expanded if expanded is not None else list_arg.value
        may = _possible_sm12x(list_arg.value, defs)
    return Call(rel, cmd.line, function, variable, arch_list, list_arg,
                None if unresolved else tuple(args), branch, levels, unresolved, may,
                tuple(prelude))


def supported_archs_block(source: Path) -> list[str]:
    """The top-level commands of CMakeLists.txt that set or extend CUDA_SUPPORTED_ARCHS
    before the source narrows CUDA_ARCHS to it (whole `if()` chains, in order).

    vLLM narrows the requested archs to that list (by CUDA version) before any guard runs:
    with CUDA 13 some releases list `12.0` but not `12.1`, so `12.1` builds as `12.0`.
    vLLM writes the list in one if() chain; flash-attention sets a base list and then
    appends to it by CUDA version.
    """
    path = source / "CMakeLists.txt"
    if not path.exists():
        return []
    text, cmds = parse(path, "CMakeLists.txt")
    blocks: list[str] = []
    depth, start = 0, 0
    touches = False
    for cmd in cmds:
        words = [w.value for w in cmd.words]
        if cmd.key == GUARD_FUNCTION and words[:1] == ["CUDA_ARCHS"]:
            break  # the narrowing itself: what follows it does not change it
        edits = (cmd.key == "set" and words[:1] == ["CUDA_SUPPORTED_ARCHS"]) or (
            cmd.key == "list" and words[1:2] == ["CUDA_SUPPORTED_ARCHS"])
        if cmd.key == "if":
            if depth == 0:
                start, touches = cmd.start, False
            depth += 1
        elif cmd.key == "endif" and depth:
            depth -= 1
            if depth == 0 and touches:
                blocks.append(text[start:cmd.end])
        elif edits and depth == 0:
            blocks.append(text[cmd.start:cmd.end])
        touches = touches or edits
    return blocks


def effective_archs(source: Path, archs: ArchList, cuda_version: str = DEFAULT_CUDA) -> ArchList:
    """The CUDA_ARCHS vLLM's CMake derives from the requested archs.  What the tree's CMake
    gives is parsed as any arch list: an entry that is not one is refused."""
    said = _run(source, archs, cuda_version, [])[1]
    try:
        return ArchList.parse(said)
    except Sm121Error:
        raise Sm121Error(f"{source}: its CMake narrows the arch list {archs} to {said!r}, "
                         "which is not an arch list") from None


def evaluate(source: Path, archs: ArchList, cuda_version: str = DEFAULT_CUDA,
             patterns: tuple[str, ...] = DEFAULT_FILES,
             calls: list[Call] | None = None) -> list[Guard]:
    """Run each guard call through the source's own functions.

    The requested archs are first narrowed as vLLM's CMakeLists.txt does (the
    CUDA_SUPPORTED_ARCHS list for `cuda_version`), so every guard sees the CUDA_ARCHS a
    real configure would give it.  Calls that cannot be evaluated get the result None.
    """
    found = find_calls(source, patterns) if calls is None else calls
    invocations = [(c.function, c.evaluated_args, c.levels, c.prelude) for c in found
                   if c.evaluated_args is not None]
    if not invocations:
        return [Guard(c, None) for c in found]
    results = _run(source, archs, cuda_version, invocations)[0]
    guards = []
    index = 0
    for call in found:
        if call.evaluated_args is None:
            guards.append(Guard(call, None))
        else:
            guards.append(Guard(call, results.get(index, ()), index in results))
            index += 1
    return guards


def intersect(source: Path, archs: ArchList, lists: list[str],
              cuda_version: str = DEFAULT_CUDA) -> list[tuple[str, ...]]:
    """What the source's cuda_archs_loose_intersection gives each list for the archs."""
    if not lists:
        return []
    results = _run(source, archs, cuda_version,
                   [(GUARD_FUNCTION, (arch_list, TARGET_REF), (), ()) for arch_list in lists])[0]
    return [results[i] for i in range(len(lists))]  # no branches: each list gives a line


Invocation = tuple[str, tuple[str, ...], tuple[Level, ...], tuple[Step, ...]]


def _within(body: str, levels: tuple[Level, ...]) -> str:
    """CMake text run only where its enclosing branches (as replayed) are taken."""
    for priors, own in reversed(levels):
        chain = "".join(f"{'else' if i else ''}if({c})\n" for i, c in enumerate(priors))
        body = f"{chain}{'else' if priors else ''}if({own})\n{body}\nendif()"
    return body


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


# where a runner's copy of the tree's utils.cmake is, as CMake's messages name it
_UTILS_COPY = rf"\S*{re.escape(UTILS_AT)}"


def _run(source: Path, archs: ArchList, cuda_version: str,
         invocations: list[Invocation]) -> tuple[dict[int, tuple[str, ...]], str]:
    utils = source.resolve() / UTILS
    if not utils.exists():
        raise Sm121Error(f"{source}: no {UTILS}; is this a vLLM source tree?")
    if not re.fullmatch(r"\d+\.\d+", cuda_version):
        raise Sm121Error(f"unknown CUDA version {cuda_version!r}: expected e.g. {DEFAULT_CUDA}")
    script = [f"set(CUDA_ARCHS {_quote(archs.cmake)})",
              f'set(CMAKE_CUDA_COMPILER_VERSION "{cuda_version}")']
    supported = supported_archs_block(source)
    if supported:
        script += [*supported,
                   'cuda_archs_loose_intersection(CUDA_ARCHS "${CUDA_SUPPORTED_ARCHS}" '
                   '"${CUDA_ARCHS}")']
    script.append('message(STATUS "SM121ARCHS|${CUDA_ARCHS}")')
    for index, (function, args, levels, prelude) in enumerate(invocations):
        script += [_within(command, step_levels) for command, step_levels in prelude]
        script.append(_within(
            f"set(SM121OUT)\n{function}(SM121OUT {' '.join(map(_quote, args))})\n"
            f'message(STATUS "SM121GUARD|{index}|${{SM121OUT}}")', levels))
    # the tree's code runs where the command's context says: a throwaway container
    result = current_runner().run(CMakeScript(read_source(utils), "\n".join(script) + "\n"))
    if result.status is None:
        raise Sm121Error(f"cmake -P of {utils} gave no result within its time limit (a loop "
                         "in the tree's CMake?): stopped")
    if result.status != 0:  # the runner's copy of utils.cmake named as the tree's own
        said = re.sub(rf"(?<![^\s(]){_UTILS_COPY}", str(utils), result.stderr)
        raise Sm121Error(f"cmake -P could not evaluate {utils}: {cmake_error(said)}")
    results: dict[int, tuple[str, ...]] = {}
    effective = ""
    for out_line in result.stdout.splitlines():
        if "SM121GUARD|" in out_line:
            key, _, value = out_line.split("SM121GUARD|", 1)[1].partition("|")
            if key.isascii() and key.isdigit() and len(key) <= 9:  # else not ours: forged
                results[int(key)] = tuple(a for a in value.split(";") if a)
        elif "SM121ARCHS|" in out_line:
            effective = out_line.split("SM121ARCHS|", 1)[1].strip()
    return results, effective


def cmake_error(stderr: str) -> str:
    """CMake's first error on one line: its place and its message, not the call stack
    (`CMake Error at utils.cmake:3 (message): broken`); else the last line of output."""
    lines = stderr.splitlines()
    for index, line in enumerate(lines):
        if line.startswith("CMake Error"):
            message = []
            for more in lines[index + 1:]:
                if not more.startswith(" "):
                    break
                message.append(more.strip())
            return " ".join([line.strip(), *message])
    return next((line.strip() for line in reversed(lines) if line.strip()), "no output")


