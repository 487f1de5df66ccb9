"""Ctrl-C and SIGTERM held back across the few steps that must not be cut in two.

A KeyboardInterrupt that lands between `mkdtemp` and the code that removes the folder again
(or between Python's probe of the temp folder and its removal) leaves a folder or a file
behind; one that lands before the command's own handler is in place ends in a traceback.
`held()` delays both signals over such a step; they are delivered, and handled as usual,
the moment it ends.  Only the main thread can hold them (others run on unchanged).
"""

from __future__ import annotations

import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

HELD = frozenset({signal.SIGINT, signal.SIGTERM})


@contextmanager
def held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait until the block ends (main thread; elsewhere: no effect)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def hold_from_start() -> None:
    """Hold both signals from here until `release()` (the command's handler is in place)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, HELD)


def release() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD)


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
