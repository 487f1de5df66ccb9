"""Everything the tool tells a person goes through here: timed, titled steps (✓/✕, folded
into groups on GitHub Actions, as cibuildwheel's logger does), their detail lines, the
one-line `error: …` (plus an `::error::` annotation on Actions), a live one-line status for
long builds and reads on a terminal, and the results on stdout (`say`, `say_json`).

Text out is a door like files in: no other module prints (tests/unit/test_text_door.py).
Every line leaves here with each control character escaped (C0 and C1 controls, ESC, DEL,
the bidirectional overrides and line separators, bytes that are not UTF-8), and a CI
runner's workflow command (a line that would begin with `::`, a `##[` anywhere) with its
first character escaped (`\x3a`, `\x23`): a name from outside
cannot retitle the terminal, clear it, reorder what is read or command the runner.  A
one-line sink (`note`, `notice`, `result`, `report_error`, a step's title, the live line)
escapes a newline too, so a name cannot forge
a line there; a block (`say`: a table) keeps its own line breaks, so the renderer of a block
passes every name from outside through `shown` (plain text) or `md` (Markdown), which escape
newlines as well.  JSON leaves exact (`say_json`: json.dumps escapes what it must).

Every value from outside is bounded too: a message names one through `cut` (at most 200
characters, the rest said as `…(N more bytes)`), `shown` and `md` keep at most 1024, and a
one-line sink writes at most `LINE_LIMIT` bytes whatever it is given (its head and its
tail, the cut said): an 8 MB field of a manifest is never an 8 MB line."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import re
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from sm121_build.core.compile_progress import CompileProgress, History
from sm121_build.core.outputs import NotWritten, write_all

# C0 controls (newline and tab among them), DEL, C1 controls, the bidirectional marks,
# embeddings, overrides and isolates, the Unicode line and paragraph separators, and lone
# surrogates (a file name's bytes that are not UTF-8, 0x9b among them, as Python holds them)
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029"
                      "\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_BLOCK_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028"
                            "\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")  # keeps \n, \t
_MARKDOWN = re.compile(r"([\\`*_{}\[\]<>()#+\-.!|~&$])")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\x1b": "\\e"}
CUT = 200  # characters of one value from outside that a message names
NAME_LIMIT = 1024  # characters of one name that `shown` and `md` keep
LINE_LIMIT = 4000  # bytes a one-line sink writes at most (`error: ` and an indent beside)


def _size(text: str) -> int:
    """Bytes of `text` in UTF-8 (a byte that was not UTF-8, held as a lone surrogate, as
    one byte)."""
    try:
        return len(text.encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError:
        return len(text.encode("utf-8", "surrogatepass"))


def cut(value: object, limit: int = CUT, tail: int = 0) -> str:
    """A value from outside as a message names it: `str(value)`, at most `limit` characters
    of it kept and what was left out said (`…(N more bytes)`), so no value makes a line
    unbounded; `tail`: how many of those are its last (a path's file name is at its end).
    Escaping is the sink's (`shown`, `md`, the one-line sinks)."""
    text = str(value)
    if len(text) <= limit:
        return text
    tail = min(tail, limit)
    head = text[:limit - tail]
    end = text[len(text) - tail:] if tail else ""
    return f"{head}…({_size(text[len(head):len(text) - tail])} more bytes){end}"


def _bounded(line: str, limit: int = LINE_LIMIT) -> str:
    """A line (already escaped) of at most `limit` bytes: over it, its head and its tail
    (where a message's hint is) kept, what was left out said between them."""
    data = line.encode("utf-8", "surrogatepass")
    if len(data) <= limit:
        return line
    head, tail = data[:limit * 2 // 3], data[-(limit // 4):]
    left_out = len(data) - len(head) - len(tail)
    return (head.decode("utf-8", "ignore") + f" …({left_out} more bytes)… "
            + tail.decode("utf-8", "ignore"))


def _escaped(match: re.Match[str]) -> str:
    char = match.group()
    if 0xDC80 <= ord(char) <= 0xDCFF:  # a byte that was not UTF-8: shown as that byte
        return f"\\x{ord(char) - 0xDC00:02x}"
    return _NAMED.get(char) or (f"\\x{ord(char):02x}" if ord(char) < 0x100
                                else f"\\u{ord(char):04x}")


def shown(text: str, limit: int = NAME_LIMIT) -> str:
    """A name from outside as plain text on one line: every control character escaped
    (`\\n`, `\\e`, `\\x07`, `\\u202e`), at most `limit` characters of it kept (`cut`),
    nothing else changed."""
    return CONTROL.sub(_escaped, cut(text, limit, tail=limit // 4))


def shown_cut(value: object, limit: int = CUT) -> str:
    """A value from outside (a document's field, any type) in a message: its text (a
    string as it is, a number as its repr, a container as its kind and size), `cut` to
    `limit` characters, then `shown`.  A message's size never follows a value's."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, bool | int | float) or value is None:
        text = repr(value)
    else:
        size = len(value) if isinstance(value, list | dict | tuple) else "?"
        text = f"(a {type(value).__name__} of {size} items)"
    return shown(cut(text, limit))


def md(text: str, limit: int = NAME_LIMIT) -> str:
    """A value from outside as Markdown text: `shown`, then every character Markdown or a
    table cell gives a meaning (`|`, a backtick, `[`, `<`, `&` ...) escaped with a backslash."""
    return _MARKDOWN.sub(r"\\\1", shown(text, limit))


def md_code(text: str, limit: int = NAME_LIMIT) -> str:
    """A value from outside as a Markdown code span (`` `name` ``) when it can be one (no
    backtick, no `|`, no control character), else as `md` text; at most `limit` characters
    of it kept (`cut`)."""
    if "`" in text or "|" in text or CONTROL.search(text):
        return md(text, limit)
    return f"`{cut(text, limit, tail=limit // 4)}`"


# what a CI runner reads as a workflow command: `::command::` at a line's start, and its
# older form `##[command]` anywhere in a line
_COMMAND = re.compile(r"^(\s*):(?=:)", re.M)
_OLD_COMMAND = re.compile(r"#(?=#\[)")


def _commands_escaped(text: str) -> str:
    return _OLD_COMMAND.sub(r"\\x23", _COMMAND.sub(r"\1\\x3a", text))


def _line(text: str) -> str:
    """A one-line sink's text: every control character escaped, no workflow command, at
    most `LINE_LIMIT` bytes."""
    return _bounded(_commands_escaped(CONTROL.sub(_escaped, text)))


def _block(text: str) -> str:
    return _commands_escaped(_BLOCK_CONTROL.sub(_escaped, text))


def say(text: str = "", nl: bool = True) -> None:
    """A block of text for a person on stdout (a table, a listing, a diff): its own line
    breaks kept, every other control character escaped; whole or not at all (`_stdout`)."""
    end_status_line()
    _stdout(_block(text) + ("\n" if nl else ""))


def say_json(data: Any, indent: int | None = 2, sort_keys: bool = False) -> None:
    """JSON on stdout, exact (json.dumps escapes every control character itself; a CI
    runner's `##[command]` inside a string is written `\\u0023#[`, the same JSON); whole or
    not at all (`_stdout`)."""
    text = json.dumps(data, indent=indent, sort_keys=sort_keys).replace("##[", "\\u0023#[")
    _stdout(text + "\n")


def _regular_fd(stream: Any) -> int | None:
    """The stream's descriptor when it is a regular file (`> result.json`), else None (a
    terminal, a pipe, a test's capture)."""
    try:
        fd = int(stream.fileno())
        return fd if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return None


def _stdout(text: str) -> None:
    """Text to stdout.  Where stdout is a file, written whole or not at all: Python's
    stdout can take a write the disk cut short for a whole one (a full disk left half a
    JSON document and exit 0), so the bytes go to the descriptor until every one is
    written, and a write that fails cuts the file back and is `NotWritten`, naming it."""
    stream = sys.stdout
    fd = _regular_fd(stream)
    if fd is None:
        click.echo(text, nl=False)
        return
    stream.flush()
    size = os.fstat(fd).st_size
    start = size if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND else \
        os.lseek(fd, 0, os.SEEK_CUR)
    try:
        write_all(fd, text.encode(getattr(stream, "encoding", None) or "utf-8",
                                  "backslashreplace"))
    except OSError as exc:
        if start == size:  # (written at its end: cut back to what it held)
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
        name = "stdout"
        with contextlib.suppress(OSError):
            name = f"stdout ({os.readlink(f'/proc/self/fd/{fd}')})"
        raise NotWritten(Path(name), exc.strerror or str(exc),
                         "what it held before is as it was") from None


def on_github_actions() -> bool:
    return os.environ.get("GITHUB_ACTIONS") == "true"


class Steps:
    def __init__(self) -> None:
        self.actions = on_github_actions()
        self.timings: list[tuple[str, float, bool]] = []  # (title, seconds, finished)

    @contextmanager
    def step(self, title: str) -> Iterator[None]:
        """`==> title`, then `✓ title (1.2s)` or `✕ title (1.2s)` when it raised."""
        start = time.monotonic()
        title = _line(title)
        click.echo(f"::group::{title}" if self.actions else f"==> {title}", err=True)
        mark = "✕"
        try:
            yield
            mark = "✓"
        finally:
            end_status_line()
            if self.actions:
                click.echo("::endgroup::", err=True)
            took = time.monotonic() - start
            self.timings.append((title, round(took, 1), mark == "✓"))
            click.echo(f"    {mark} {title} ({took:.1f}s)", err=True)


_results = {"stderr": False}
_verbosity = {"level": 1}  # 0: -q, 1: default, 2: -v


_progress = {"mode": "auto"}  # --progress: auto (live on a terminal), plain, quiet


def set_verbosity(level: int) -> None:
    _verbosity["level"] = level


def set_progress(mode: str) -> None:
    _progress["mode"] = mode


def _live_terminal() -> bool:
    """Rewrite lines in place: on a terminal, unless --progress plain asked for lines."""
    return _progress["mode"] == "auto" and sys.stderr.isatty()


def _quiet_progress() -> bool:
    return _progress["mode"] == "quiet" or _verbosity["level"] == 0


def result(text: str) -> None:
    """A result line (`tagged …`): stdout, unless stdout carries JSON (`--json`), then
    stderr with the rest."""
    end_status_line()
    click.echo(_line(text), err=_results["stderr"])


def results_to_stderr() -> None:
    _results["stderr"] = True


def note(text: str) -> None:
    """A detail of the step under way: `    text` on stderr (stdout keeps the results);
    nothing under -q."""
    if _verbosity["level"] == 0:
        return
    end_status_line()
    click.echo(f"    {_line(text)}", err=True)


def notice(text: str) -> None:
    """A line of its own on stderr, outside any step (`note: …`, `interrupted …`)."""
    end_status_line()
    click.echo(_line(text), err=True)


def report_error(message: str) -> None:
    """The one way a failure is printed: `error: …` on stderr; on GitHub Actions also an
    `::error::` annotation (stdout, where the runner reads workflow commands)."""
    end_status_line()
    message = _line(message)
    click.echo(f"error: {message}", err=True)
    if on_github_actions():
        # (no newline is left to escape as %0A); bounded again, `%25` being longer
        text = _bounded(message.replace("%", "%25"))
        # stdout, where the runner reads workflow commands; stderr when stdout carries JSON
        click.echo(f"::error title=sm121-build::{text}", err=_results["stderr"])


_live = {"shown": False}


class _EscapedLines(io.TextIOBase):
    """A stream that code of its own printing (the build script `local` runs in this
    process, which may not import the package) writes to in place of sys.stdout/sys.stderr:
    each line it is given leaves on `target` as a one-line sink's (`_line`: every control
    character escaped, no workflow command, bounded); a line that never ends leaves at
    `LINE_LIMIT` characters, so nothing of it is held unbounded."""

    def __init__(self, target: Any) -> None:
        super().__init__()
        self.target = target
        self.partial = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.partial += text
        while "\n" in self.partial or len(self.partial) >= LINE_LIMIT:
            cut_at = self.partial.find("\n")
            end = cut_at if 0 <= cut_at < LINE_LIMIT else LINE_LIMIT
            line = self.partial[:end]
            self.partial = self.partial[end + 1 if end == cut_at else end:]
            self.target.write(_line(line) + "\n")
        return len(text)

    def flush(self) -> None:
        self.target.flush()

    def close_line(self) -> None:
        """What is left of an unfinished line, as a line of its own."""
        if self.partial:
            self.target.write(_line(self.partial) + "\n")
            self.partial = ""
        self.target.flush()


@contextmanager
def escaped_prints() -> Iterator[None]:
    """Inside: whatever is printed to sys.stdout or sys.stderr (by code that cannot use this
    door: `local`'s in-process build script and the compiler messages it quotes) leaves a
    line at a time with every control character escaped, on the stream it was printed to.
    This module's own live line still reaches the terminal as it is (`_terminal`)."""
    out, err = _EscapedLines(sys.stdout), _EscapedLines(sys.stderr)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield
    finally:
        out.close_line()
        err.close_line()


def _terminal() -> Any:
    """stderr as this module writes its live line there: the stream under `escaped_prints`
    (the line is escaped already; its `\\r` and erase sequence are the point)."""
    stream = sys.stderr
    return stream.target if isinstance(stream, _EscapedLines) else stream


def status_line(text: str) -> None:
    """Rewrite one terminal line with the latest build output (nothing when not a TTY, or
    under --progress plain/quiet)."""
    if _live_terminal() and not _quiet_progress():
        click.echo(f"\r\033[K    {_line(text)[:110]}", nl=False, file=_terminal())
        _live["shown"] = True


def end_status_line() -> None:
    if _live["shown"]:
        click.echo("", file=_terminal())
        _live["shown"] = False


class LiveLine:
    """A status text that changes often (a pull, a long read): rewritten in place on a
    terminal (at most every `gap` seconds); a plain line every `every` seconds elsewhere;
    nothing under --progress quiet or -q.  `last` keeps the newest text given."""

    def __init__(self, every: float = 30.0, gap: float = 0.0,
                 clock: Callable[[], float] = time.monotonic, tty: bool | None = None) -> None:
        self.every, self.gap, self.clock = every, gap, clock
        self.tty = _live_terminal() if tty is None else tty
        self.said = clock()
        self.last = ""

    def due(self) -> bool:
        """Whether a text given now would be shown (so a caller can skip making it)."""
        wait = self.gap if self.tty else self.every
        return not _quiet_progress() and self.clock() - self.said >= wait

    def say(self, text: str) -> None:
        self.said = self.clock()
        if self.tty:
            status_line(text)
        else:
            click.echo(f"    {_line(text)}", err=True)

    def __call__(self, text: str) -> None:
        self.last = text
        if self.due():
            self.say(text)


class BuildStatus:
    """The build step's live line, fed every output line: ninja's progress with an ETA once
    the output shows ninja steps (`compile_progress`), else the newest line.  On a terminal
    the line is rewritten at most five times a second; elsewhere (CI logs) a plain line at
    each tenth of a phase and every `every` seconds, never one per ninja step.  Used as a
    context manager it also speaks while the output is silent (one object compiling for 15
    minutes prints nothing): a timer thread repeats the line."""

    def __init__(self, histories: tuple[History, ...] = (), every: float = 60.0,
                 clock: Callable[[], float] = time.monotonic,
                 tty: bool | None = None) -> None:
        self.progress = CompileProgress(histories)
        self.every = every
        self.clock = clock
        self.tty = _live_terminal() if tty is None else tty
        self.last = self.last_plain = clock()
        self.tenths = (-1, 0)  # (phase, tenth) last said
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.timer: threading.Thread | None = None

    def __call__(self, line: str) -> None:
        with self.lock:
            now = self.clock()
            step = self.progress.feed(line, now)
            if _quiet_progress() and _verbosity["level"] != 2:
                return
            if _verbosity["level"] == 2:  # -v: the build's own lines, as they come
                end_status_line()
                click.echo(f"      {_line(line.rstrip())}", err=True)
                return
            if self.tty:
                if now - self.last >= 0.2:
                    self.last = now
                    status_line(self.progress.text(now) if step else line)
                return
            if step:
                tenth = (len(self.progress.phases), int(self.progress.share() * 10))
                if tenth != self.tenths or now - self.last_plain >= self.every:
                    self.tenths = tenth
                    self._plain(now)

    def tick(self) -> None:
        """Say the line again when nothing came for a while (the timer calls this)."""
        with self.lock:
            now = self.clock()
            if self.progress.current is None or _verbosity["level"] != 1 \
                    or _quiet_progress():
                return
            if self.tty and now - self.last >= 1.0:
                self.last = now
                status_line(self.progress.text(now))
            elif not self.tty and now - self.last_plain >= self.every:
                self._plain(now)

    def _plain(self, now: float) -> None:
        self.last_plain = now
        click.echo(f"    {_line(self.progress.text(now))}", err=True)

    def __enter__(self) -> BuildStatus:
        def run() -> None:
            while not self.stopped.wait(1.0):
                self.tick()

        self.timer = threading.Thread(target=run, name="build-status", daemon=True)
        self.timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        if self.timer is not None:
            self.timer.join()
        end_status_line()


class Progress:
    """A live line for long reads ("1.2 GB read, 3 ELF files"): rewritten in place on a
    terminal at most five times a second; elsewhere a plain line every 15 seconds."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.started = time.monotonic()
        self.line = LiveLine(every=15.0, gap=0.2)
        self.read = 0
        self.found = 0

    def _text(self) -> str:
        found = f", {self.found} ELF file(s) kept" if self.found else ""
        return (f"{self.label}: {self.read / 1e9:.2f} GB read{found} "
                f"({time.monotonic() - self.started:.0f}s)")

    def add(self, read: int) -> None:
        """`read` more bytes came in."""
        self.update(read=self.read + read)

    def update(self, read: int | None = None, found: int | None = None) -> None:
        self.read = self.read if read is None else read
        self.found = self.found if found is None else found
        if self.line.due():  # the text is made only when it is shown
            self.line.say(self._text())

    def done(self) -> None:
        end_status_line()
        if time.monotonic() - self.started >= 2.0:
            click.echo(f"    {_line(self._text())}", err=True)
