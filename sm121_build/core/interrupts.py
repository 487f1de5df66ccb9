"""Ctrl-C and SIGTERM: the one handler of a run, and the few steps it must not cut in two.

`install` puts the handler in place (the command line does, before any work): the first
signal ends every program the run started (`children.end_all`), ignores any more (so the
cleanup it starts is never cut short) and raises KeyboardInterrupt in the main thread,
which the command turns into one line and exit 130.  `held()` defers it over a step that
must not be split (a temp folder made but not yet owned by the code that removes it, a
program started but not yet registered): a signal that lands inside is raised the moment
the block ends.  The deferral is the handler's, not the kernel's: a worker thread (a
ThreadPoolExecutor's) may be the one the kernel delivers to, but Python runs the handler in
the main thread, where it sees the hold.  Before the handler is in place the entry module
blocks both signals (`hold_from_start`, `release`); after the command ends, `quiet` ignores
them, so one that lands while the interpreter finalizes (which restores the default action
for a Python handler) cannot end a finished run by the signal.

The clean-up an interrupt starts asks the engine to remove what the run made there; an
engine that has stopped answering would hold each such call for its whole time limit
(`SM121_ENGINE_TIMEOUT`, minutes).  `answer_within` is the one rule for how long a call
outside may wait once the run is interrupted: no longer than what is left of `CLEANUP_S`
from the signal, so the run still ends within 2 s of it and names what it could not remove.
"""

from __future__ import annotations

import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

HELD = frozenset({signal.SIGINT, signal.SIGTERM})
_STATE = {"holding": 0, "pending": False, "ended": False, "installed": False}
CLEANUP_S = 1.5  # from the first signal: what an interrupted run's calls outside may wait
LAST_CALL_S = 0.1  # a call made once that is spent still gets this long (and fails fast)
_SIGNALLED: list[float] = []  # the monotonic time of the run's first signal


def install(on_signal: Callable[[], None]) -> None:
    """The run's handler of both signals: `on_signal` (end the programs), then the interrupt,
    deferred while `held()`."""

    def handler(signum: int, frame: FrameType | None) -> None:
        for each in HELD:
            signal.signal(each, signal.SIG_IGN)
        _SIGNALLED.append(time.monotonic())
        on_signal()
        if _STATE["ended"]:  # the command has ended (its exit under way): nothing to stop
            return
        if _STATE["holding"]:
            _STATE["pending"] = True
            return
        raise KeyboardInterrupt

    for each in HELD:
        signal.signal(each, handler)
    _STATE["installed"] = True


def signalled() -> bool:
    """Whether the run has had its first Ctrl-C or SIGTERM."""
    return bool(_SIGNALLED)


def answer_within(seconds: float | None) -> float | None:
    """How long a call outside (an engine request) may wait for an answer: `seconds` (None:
    no limit), or once the run is interrupted at most what is left of `CLEANUP_S` since the
    signal (`LAST_CALL_S` when that is spent: the call is still made, and given up fast)."""
    if not _SIGNALLED:
        return seconds
    left = max(CLEANUP_S - (time.monotonic() - _SIGNALLED[0]), LAST_CALL_S)
    return left if seconds is None else min(seconds, left)


@contextmanager
def held() -> Iterator[None]:
    """An interrupt waits until the block ends (main thread; elsewhere: no effect, the
    handler runs in the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _STATE["holding"] += 1
    try:
        yield
    finally:
        _STATE["holding"] -= 1
        if not _STATE["holding"] and _STATE["pending"]:
            _STATE["pending"] = False
            raise KeyboardInterrupt


def hold_from_start() -> None:
    """Block both signals in this thread until `release()` (the handler is in place)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, HELD)


def release() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD)


def quiet() -> None:
    """The command has ended: both signals ignored from here to the process's end.  In this
    order, so no signal slips between the steps: the handler stops raising; blocking both
    runs the handler at once for one already caught (Python runs handlers when
    `pthread_sigmask` returns) and holds any later one in the kernel; ignoring then discards
    what the kernel holds (Python would otherwise report a signal caught under its handler
    and found ignored as "ignored due to race condition").  Without the run's handler (the
    commands called in a test's process) nothing changes."""
    if not _STATE["installed"]:
        return
    _STATE["ended"] = True
    signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
    for each in HELD:
        signal.signal(each, signal.SIG_IGN)


@contextmanager
def temp_dir(prefix: str) -> Iterator[Path]:
    """`tempfile.TemporaryDirectory` whose creation and removal a Ctrl-C cannot split: the
    folder exists only while the block runs, however it ends."""
    with held():
        handle = tempfile.TemporaryDirectory(prefix=prefix)
    try:
        yield Path(handle.name)
    finally:
        with held():
            handle.cleanup()
