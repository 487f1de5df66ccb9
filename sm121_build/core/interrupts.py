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
"""

from __future__ import annotations

import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

HELD = frozenset({signal.SIGINT, signal.SIGTERM})
_STATE = {"holding": 0, "pending": False}


def install(on_signal: Callable[[], None]) -> None:
    """The run's handler of both signals: `on_signal` (end the programs), then the interrupt,
    deferred while `held()`."""

    def handler(signum: int, frame: FrameType | None) -> None:
        for each in HELD:
            signal.signal(each, signal.SIG_IGN)
        on_signal()
        if _STATE["holding"]:
            _STATE["pending"] = True
            return
        raise KeyboardInterrupt

    for each in HELD:
        signal.signal(each, handler)


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
    """The command has ended: both signals ignored from here to the process's end."""
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
