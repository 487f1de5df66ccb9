"""The one way the tool starts a program (ptxas, fatbinary, cmake, git, ldd, nvidia-smi, the
docker CLI): `run(Program(...))`.

Every program runs in a process group of its own (`start_new_session`), so a wrapper and
whatever it starts (PyPI's and conda's ptxas shims, a `docker build` and its helpers) end
together: the whole group is killed when the deadline passes, when the run is interrupted
(`end_all`, called by the command's Ctrl-C/SIGTERM handler: no program outlives the run),
and after the program itself exits (a grandchild it left is not kept).  One that leaves the
group (`setsid`) is still found: the command line makes this process its descendants'
subreaper (`adopt_orphans`, Linux's PR_SET_CHILD_SUBREAPER), so an orphan becomes its child
and is killed with the program that left it (every other child of the tool's process is a
program started here, which the door's test makes sure of).  A program's end is its own
exit, not its pipes' closing: a grandchild that keeps stdout open cannot make a finished
ptxas look hung.  The deadline is kept by the thread that waits, with `select` and a polled
wait: no timer thread, nothing that keeps the process alive after the run.  Output is read
as it comes and bounded: the first and the last `KEPT` bytes of each stream are kept, the
middle is counted and dropped, so a program that never stops printing costs 2 × `KEPT`
bytes, not the machine's memory; a caller that needs all of it (a hash of `git diff`, the
build log) takes each chunk through `sink`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from sm121_build.core.interrupts import held

KEPT = 64 * 1024  # bytes kept at each end of each stream
_READ = 64 * 1024
_POLL_S = 0.02
_DRAIN_S = 0.5  # after the program exits, what its pipes still hold is read this long
_SUBREAPER = 36  # prctl's PR_SET_CHILD_SUBREAPER
_SWEEP_S = 5.0  # how long orphans are swept for: each pass kills one generation, and groups


STDIN_MAX = 4096  # what a program is given on its stdin, at most: less than a pipe holds


@dataclass(frozen=True)
class Program:
    """What to run: its arguments, the seconds it may take (then its group is killed), and
    how messages name it.  Its stdin is /dev/null, or `stdin` (at most `STDIN_MAX` bytes,
    written whole at its start: a pipe holds them, so a program that never reads them holds
    nothing up); `merge` sends stderr into stdout, in the order the program wrote them (a
    build log)."""

    args: tuple[str, ...]
    seconds: float
    what: str
    cwd: Path | None = None
    env: Mapping[str, str] | None = None
    merge: bool = False
    stdin: bytes = b""

    def __post_init__(self) -> None:
        if len(self.stdin) > STDIN_MAX:
            raise ValueError(f"{self.what}: {len(self.stdin)} bytes of stdin, more than a "
                             f"pipe holds ({STDIN_MAX})")


@dataclass(frozen=True)
class Ended:
    """How a program ended: its exit status (negative: the signal that ended it), what it
    printed (at most `KEPT` bytes from each end of each stream; `dropped` bytes left out of
    the middle), whether its deadline ended it, and what its process tree used (`wait4`)."""

    returncode: int
    stdout: bytes
    stderr: bytes
    dropped: int
    timed_out: bool
    cpu_seconds: float
    peak_rss: int  # bytes

    @property
    def text(self) -> str:
        """stdout as text (undecodable bytes replaced)."""
        return self.stdout.decode("utf-8", "replace")

    def said(self, width: int = 300) -> str:
        """What it said, on one line: stderr, else stdout, whitespace folded, cut to `width`."""
        words = (self.stderr or self.stdout).decode("utf-8", "replace").split()
        return " ".join(words)[:width] or "no output"


class Kept:
    """A stream's first and last `limit` bytes; what lies between is counted, not kept."""

    def __init__(self, limit: int = KEPT) -> None:
        self.limit = limit
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        room = self.limit - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if not chunk:
            return
        self.tail += chunk
        over = len(self.tail) - self.limit
        if over > 0:
            self.dropped += over
            del self.tail[:over]

    def value(self) -> bytes:
        if not self.dropped:
            return bytes(self.head + self.tail)
        return bytes(self.head) + f"\n[… {self.dropped} bytes left out …]\n".encode() + \
            bytes(self.tail)


LINE_WIDTH = 16 * 1024  # a line of a child's output or a log is read at most this long


class Lines:
    """Chunks of output as lines, for a caller that follows a log line by line; a line is
    cut at `width` bytes, so one that never ends is not held whole.  A log goes on with
    what follows the cut as a line of its own; a caller that must never read part of a
    line as a whole one (`on_cut`: a protocol a child speaks) is told of the cut line
    instead, and nothing of it is handed on, up to its newline."""

    def __init__(self, on_line: Callable[[str], None], width: int = LINE_WIDTH,
                 on_cut: Callable[[], None] | None = None) -> None:
        self.on_line = on_line
        self.on_cut = on_cut
        self.width = width
        self.partial = bytearray()
        self.skipping = False  # inside a cut line, with on_cut: up to its newline
        self.searched = 0  # bytes of `partial` already searched for a newline: none there

    def __call__(self, chunk: bytes) -> None:
        """The chunk's whole lines handed on, in time linear in the chunk: each byte is
        searched for a newline once, and what is handed on is removed once, at the end
        (not the rest copied after each line: a chunk of 64 KiB of newlines was 2 GiB of
        copies)."""
        self.partial += chunk
        start = 0
        while True:
            found = self.partial.find(b"\n", max(start, self.searched))
            if found < 0:  # none up to the end: a long line cut by width is not searched again
                self.searched = len(self.partial)
            cut = found - start if found >= 0 else -1  # from the line's start
            if self.skipping:
                if cut < 0:
                    start = len(self.partial)
                    break
                start, self.skipping = found + 1, False
                continue
            if cut < 0 and len(self.partial) - start < self.width:
                break
            if self.on_cut is not None and not 0 <= cut < self.width:
                self.on_cut()
                self.skipping = True
                continue
            end = start + (cut + 1 if 0 <= cut < self.width else self.width)
            line, start = bytes(self.partial[start:end]), end
            self.on_line(line.decode("utf-8", "replace"))
        del self.partial[:start]
        self.searched = len(self.partial)

    def close(self) -> None:
        if self.partial and not self.skipping:
            self.on_line(bytes(self.partial).decode("utf-8", "replace"))
        self.partial = bytearray()
        self.searched = 0


# The groups of the programs now running; `end_all` kills them.  An RLock: the signal handler
# that calls `end_all` runs on the main thread, maybe while that thread holds the lock.
_LOCK = threading.RLock()
_GROUPS: set[int] = set()
_ENDING = threading.Event()


class Ending(Exception):
    """A program was to start after the run was interrupted."""


def end_all() -> None:
    """The run is interrupted: kill every program's group now, and every orphan one left
    with us, and start none from here on."""
    with _LOCK:
        _ENDING.set()
        groups = list(_GROUPS)
    for group in groups:
        _kill(group)
    _end_orphans()


def running() -> frozenset[int]:
    """The process groups of the programs now running (`run`'s, any thread's)."""
    with _LOCK:
        return frozenset(_GROUPS)


def end_groups(groups: frozenset[int]) -> None:
    """Kill these programs' groups (programs a caller started whose work is moot: a sibling
    of theirs failed); each `run` of them returns as on a deadline."""
    for group in groups:
        _kill(group)


def adopt_orphans() -> None:
    """Orphans of the programs this process starts become its children (Linux), not
    init's, and are ended with the program that left them.  For the command line's process
    alone, whose every child is a program started here: a library's host (a test runner)
    may have children of its own, which no sweep may touch."""
    with contextlib.suppress(OSError, AttributeError):
        if ctypes.CDLL(None, use_errno=True).prctl(_SUBREAPER, 1, 0, 0, 0) == 0:
            _ADOPTING.append(True)


def _end_orphans() -> None:
    """Kill and reap every child of this process that is no running program's leader: an
    orphan a program left (reparented here, `adopt_orphans`), with the whole process group
    it leads or sits in (a daemon that `setsid`'d and forked a chain inside its new group
    dies at once); again and again, since an orphan's own children are reparented here the
    moment it dies (a tree that calls `setsid` at each level), until none is left or
    `_SWEEP_S` has passed (a program that forks faster than it is killed)."""
    if not _ADOPTING:
        return
    ours = os.getpgrp()
    deadline = time.monotonic() + _SWEEP_S
    with _LOCK:
        while time.monotonic() < deadline:
            orphans = [pid for pid in _children() if pid not in _GROUPS]
            if not orphans:
                return
            for pid in orphans:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    group = os.getpgid(pid)
                    if group != ours and group not in _GROUPS:
                        os.killpg(group, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            for pid in orphans:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)


def _children() -> list[int]:
    """This process's children, as the kernel lists them for each of its threads."""
    found: list[int] = []
    for task in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        with contextlib.suppress(OSError, ValueError):
            found.extend(map(int, task.read_text().split()))
    return found


_ADOPTING: list[bool] = []


def _kill(group: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signal.SIGKILL)


def run(program: Program, sink: Callable[[bytes], None] | None = None) -> Ended:
    """Run `program` to its end or its deadline; OSError when it cannot be started.  Every
    chunk of stdout also goes to `sink` when one is given."""
    if _ENDING.is_set():
        raise Ending(f"{program.what} was not started: the run is being interrupted")
    # a Ctrl-C cannot fall between the start and the registration, nor an orphan sweep
    with held(), _LOCK:
        process = subprocess.Popen(
            program.args, stdin=subprocess.PIPE if program.stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if program.merge else subprocess.PIPE,
            cwd=program.cwd, env=None if program.env is None else dict(program.env),
            start_new_session=True)
        _GROUPS.add(process.pid)
        ending = _ENDING.is_set()
    if ending:
        _kill(process.pid)
    if process.stdin is not None:  # at most STDIN_MAX bytes: the pipe takes them at once
        with contextlib.suppress(OSError):  # (a program that ended first: a broken pipe)
            process.stdin.write(program.stdin)
        with contextlib.suppress(OSError):
            process.stdin.close()
    deadline = time.monotonic() + program.seconds
    out, err = Kept(), Kept()
    timed_out = True
    try:
        timed_out = not _read(process, deadline, (out, err), sink)
    finally:
        _kill(process.pid)  # on a deadline, an interrupt, and what the program left behind
        _pid, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()
        with _LOCK:
            _GROUPS.discard(process.pid)
        _end_orphans()
    return Ended(process.returncode, out.value(), err.value(), out.dropped + err.dropped,
                 timed_out, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024)


def _read(process: subprocess.Popen[bytes], deadline: float, kept: tuple[Kept, Kept],
          sink: Callable[[bytes], None] | None) -> bool:
    """Read stdout and stderr until the program has exited and its pipes are drained (or
    held open past `_DRAIN_S` by what it left), True; or until the deadline passes, False."""
    exited_at: float | None = None
    with selectors.DefaultSelector() as selector:
        for stream, keep in ((process.stdout, kept[0]), (process.stderr, kept[1])):
            if stream is not None:
                selector.register(stream, selectors.EVENT_READ, keep)
        while selector.get_map():
            now = time.monotonic()
            if exited_at is None and _exited(process.pid):
                exited_at = now
            if exited_at is not None and now - exited_at > _DRAIN_S:
                return True  # a grandchild holds the pipe open: the program itself ended
            left = deadline - now
            if left <= 0:
                return exited_at is not None
            for key, _events in selector.select(min(left, _POLL_S * 5)):
                chunk = os.read(key.fd, _READ)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                key.data.add(chunk)
                if sink is not None and key.data is kept[0]:
                    sink(chunk)
    return exited_at is not None or _wait_exit(process.pid, deadline)


def _exited(pid: int) -> bool:
    """Whether the process has exited (not reaped: its pid, and its group's, stay ours)."""
    found = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    return found is not None and found.si_pid == pid


def _wait_exit(pid: int, deadline: float) -> bool:
    """Wait, without reaping it, until the process has exited (True) or the deadline passed."""
    while not _exited(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True
