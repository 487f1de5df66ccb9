"""Streamed files written to temp: the one place a full disk becomes a one-line error."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import IO

from sm121_build.core.errors import Sm121Error


class TempSpaceError(Sm121Error):
    """A temporary folder filled up while a file was written to it."""


def write_stream(handle: IO[bytes], dest: Path, what: str, mode: int | None = None) -> None:
    """Copy `handle` to `dest` (then chmod it to `mode`); on failure remove the partial file
    and raise one line naming the folder (and, for a full disk, how to move it)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with handle, open(dest, "wb") as out:
            shutil.copyfileobj(handle, out, 1 << 20)
        if mode is not None:
            dest.chmod(mode)
    except OSError as error:
        dest.unlink(missing_ok=True)
        if error.errno == errno.ENOSPC:
            raise TempSpaceError(f"no space left in {dest.parent} while writing {what}: free "
                                 "space there or point TMPDIR at a larger disk") from None
        raise Sm121Error(f"cannot write {what} under {dest.parent}: "
                         f"{error.strerror or error}") from None
