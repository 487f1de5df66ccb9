"""The one way in: every file the tool reads from outside is opened here, and every
compressed payload is inflated here.

An input is opened without blocking (a FIFO, a tty or a device answers at once, and is
refused as not a regular file), checked to be a regular file (or a folder where one is
expected), and read in bounded windows, never more than the format declares or the caller
bounds it by.  A compressed payload is inflated to at most the size its container declares:
a frame that states more, or yields more, is refused in one line, never inflated first; and
what a whole run holds inflated at once is bounded too (`inflating`), not only each entry;
a reader that needs no more than a window at once gets the payload so (`inflate_windows`).
The errors are `InputRefused` (a bad input: exit 2), or the caller's own class.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import stat
import threading
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import BinaryIO, Literal

import lz4.block
import zstandard

from sm121_build.core.errors import CorruptBinaryError

WINDOW = 1 << 20  # bytes read at a time
_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)


class InputRefused(CorruptBinaryError):
    """An input that is not what it must be: not a regular file, too large, unreadable (a
    `CorruptBinaryError`, so every reader of binaries reports it as it reports damage)."""


def what_it_is(mode: int) -> str:
    """A file type in words ("a FIFO", "a directory", ...)."""
    for test, words in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
                        (stat.S_ISLNK, "a symlink"), (stat.S_ISSOCK, "a socket"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return words
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def open_regular(path: str | os.PathLike[str], what: str = "input") -> int:
    """A read-only descriptor of a regular file (the caller closes it).  Opened with
    O_NONBLOCK, so a FIFO with no writer or a device never blocks the run; anything but a
    regular file (after links) is an `InputRefused` naming what it is."""
    try:
        fd = os.open(path, _FLAGS)
    except OSError as exc:
        raise InputRefused(f"{path}: cannot open: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise InputRefused(f"{path}: {what} is {what_it_is(mode)}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(path: str | os.PathLike[str], what: str = "input") -> BinaryIO:
    """A regular file opened for reading as a binary file object (`open_regular`'s checks);
    the caller closes it (a `with` block)."""
    return os.fdopen(open_regular(path, what), "rb")


@contextlib.contextmanager
def opened(path: str | os.PathLike[str], what: str = "input") -> Iterator[tuple[int, int]]:
    """(descriptor, size) of a regular file, closed on exit."""
    fd = open_regular(path, what)
    try:
        yield fd, os.fstat(fd).st_size
    finally:
        os.close(fd)


def walk(top: str | os.PathLike[str], onerror: Callable[[OSError], None] | None = None
         ) -> Iterator[tuple[str, list[str], list[str]]]:
    """`os.walk(top)` top-down, links not followed, without recursion: a folder nested a
    thousand deep (Python 3.11's own walk recurses into a RecursionError) is walked like any
    other; a caller may prune `dirnames` in place, as with os.walk."""
    stack = [os.fspath(top)]
    while stack:
        folder = stack.pop()
        try:
            with os.scandir(folder) as entries:
                listed = list(entries)
        except OSError as exc:
            if onerror is not None:
                onerror(exc)
            continue
        dirnames: list[str] = []
        filenames: list[str] = []
        links: set[str] = set()
        for entry in listed:
            try:  # as os.walk: a link to a folder is listed as a folder, never entered
                is_dir = entry.is_dir()
                if is_dir and entry.is_symlink():
                    links.add(entry.name)
            except OSError:
                is_dir = False
            (dirnames if is_dir else filenames).append(entry.name)
        yield folder, dirnames, filenames
        stack.extend(os.path.join(folder, name) for name in reversed(dirnames)
                     if name not in links)


def read_input(path: str | os.PathLike[str], limit: int, what: str = "input") -> bytes:
    """A regular file's bytes, when it holds at most `limit` of them (else refused before
    anything is read), read in windows."""
    with opened(path, what) as (fd, size), _reading(path, what):
        if size > limit:
            raise InputRefused(f"{path}: {what} holds {size} bytes, more than the {limit} "
                               "it may")
        return _read_exactly(fd, size, f"{path}")


def read_head(path: str | os.PathLike[str], count: int, what: str = "input") -> bytes:
    """The first `count` bytes (or fewer: the whole file) of a regular file."""
    with opened(path, what) as (fd, _size), _reading(path, what):
        return os.read(fd, count)


@contextlib.contextmanager
def _reading(path: str | os.PathLike[str], what: str) -> Iterator[None]:
    """A read the disk refuses (EIO, a file on a lost mount) is this file's refusal, named:
    the other files of a folder are still read."""
    try:
        yield
    except InputRefused:
        raise
    except OSError as exc:
        raise InputRefused(f"{path}: {what} cannot be read: {exc.strerror or exc}") \
            from None


def _read_exactly(fd: int, size: int, where: str) -> bytes:
    """`size` bytes (what fstat said: a file that grows meanwhile is read no further), in
    one allocation where the kernel hands them over at once (no copy of a joined list)."""
    first = os.read(fd, size) if size else b""
    if len(first) == size:
        return first
    parts: list[bytes] = [first]
    got = len(first)
    while got < size:
        chunk = os.read(fd, min(WINDOW, size - got))
        if not chunk:
            raise InputRefused(f"{where}: cut short while read ({got} of {size} bytes)")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def map_input(path: str | os.PathLike[str], what: str = "input") -> tuple[mmap.mmap | bytes, int]:
    """A regular file mapped read-only (b"" when empty), and its size: pages are read when
    touched, so a parser reads only what it looks at."""
    with opened(path, what) as (fd, size):
        if size == 0:
            return b"", 0
        try:
            return mmap.mmap(fd, 0, access=mmap.ACCESS_READ), size
        except (OSError, ValueError) as exc:
            raise InputRefused(f"{path}: {what} cannot be mapped: {exc}") from None


def require_folder(path: str | os.PathLike[str], what: str = "folder") -> Path:
    """The path, when it is a folder (after links); else refused naming what it is."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise InputRefused(f"{path}: {what}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(mode):
        raise InputRefused(f"{path}: {what} is {what_it_is(mode)}, not a folder")
    return Path(path)


def kind_of(path: str | os.PathLike[str]) -> Literal["file", "folder", "missing", "other"]:
    """What a path is, links followed, without opening it."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "missing"
    if stat.S_ISREG(mode):
        return "file"
    return "folder" if stat.S_ISDIR(mode) else "other"


# -- what an archive may write out -----------------------------------------------------------

# an archive (a wheel, an image tarball) may inflate to at most this many times its stored
# bytes (a shared object compresses 3-10x, an image layer 2-4x; a bomb thousands of times),
# once past the floor
MAX_RATIO = 200
RATIO_FLOOR = 64 << 20


class Inflated:
    """What a reader of one archive has written out or held so far, against its budget:
    `MAX_RATIO` times the archive's own bytes, past the floor (many members, each under a
    per-member rule, or one hard-linked many times, still cannot fill the disk from a small
    archive).  Threads share it."""

    def __init__(self, source: Path, stored: int, what: str = "wheel") -> None:
        self.source = source
        self.what = what
        self.left = MAX_RATIO * stored + RATIO_FLOOR
        self.lock = threading.Lock()

    def take(self, count: int) -> None:
        with self.lock:
            self.left -= count
            if self.left < 0:
                raise CorruptBinaryError(
                    f"{self.source}: its members inflate to more than {MAX_RATIO}x the "
                    f"{self.what}'s bytes (a decompression bomb); refused")


# -- the one way to decompress ---------------------------------------------------------------

Compression = Literal["lz4", "zstd"]
_THREAD = threading.local()
# What the payloads inflated by every thread of the run may hold at once: each entry is
# bounded by its container (512x its stored bytes, 2 GiB), but two honest 540 MB entries
# read by two threads were 1.1 GB at once
INFLATE_BUDGET = 1 << 30
_HELD = [0]  # inflated bytes held now, under `inflating`
_CHANGED = threading.Condition()


@contextlib.contextmanager
def inflating(size: int) -> Iterator[None]:
    """`size` bytes of the run's `INFLATE_BUDGET`, held for the block (where a payload is
    inflated, read and dropped): it waits while the other threads hold so much that `size`
    more would pass the budget, never while none is held (one payload larger than the
    whole budget is inflated alone)."""
    with _CHANGED:
        while _HELD[0] and _HELD[0] + size > INFLATE_BUDGET:
            _CHANGED.wait()
        _HELD[0] += size
    try:
        yield
    finally:
        with _CHANGED:
            _HELD[0] -= size
            _CHANGED.notify_all()


def _zstd() -> zstandard.ZstdDecompressor:
    """One decompressor per thread (one object may not be used by two threads at once)."""
    decompressor: zstandard.ZstdDecompressor | None = getattr(_THREAD, "zstd", None)
    if decompressor is None:
        decompressor = _THREAD.zstd = zstandard.ZstdDecompressor()
    return decompressor


def inflate(raw: bytes | memoryview, compression: Compression, declared: int,
            where: str) -> bytes:
    """`raw` decompressed, never to more than `declared` bytes (what the container's header
    says the payload is): a frame that states a larger size is refused before anything is
    inflated, one that states none is inflated in windows and stopped one byte past the
    bound.  Damage of any kind is a `CorruptBinaryError` naming `where`."""
    try:
        if compression == "lz4":  # the block format: the output buffer is the bound
            return bytes(lz4.block.decompress(raw, uncompressed_size=declared))
        stated = zstandard.frame_content_size(raw)
        if stated > declared:
            raise CorruptBinaryError(
                f"{where}: its zstd frame states {stated} bytes, more than the {declared} its "
                "header declares (a decompression bomb?); refused")
        if stated >= 0:  # zstd checks the frame yields exactly what it states
            return bytes(_zstd().decompress(raw))
        return _zstd_windowed(raw, declared, where)
    except (lz4.block.LZ4BlockError, zstandard.ZstdError, MemoryError, OverflowError,
            ValueError) as exc:
        why = f"{type(exc).__name__}: {exc}" if isinstance(exc, MemoryError) else str(exc)
        raise CorruptBinaryError(f"{where} does not decompress: {why}") from None


# A zstd frame whose decoder would keep more than this to refer back to is inflated whole
# (zstandard's streaming decoder refuses windows past 128 MiB; a one-shot inflate needs none)
MAX_STREAM_WINDOW = 1 << 27


@contextlib.contextmanager
def inflate_windows(raw: bytes | memoryview, compression: Compression | None, declared: int,
                    where: str) -> Iterator[Iterator[bytes]]:
    """`inflate`'s bytes a `WINDOW` at a time, for a reader that needs no more than that
    at once (PTX text's `.entry` names): within the run's budget (`inflating`) it holds
    one window, and for zstd the frame's own window (what its decoder keeps to refer back
    to, ~MBs for what nvcc writes), never the whole payload.  The same bounds as
    `inflate`: a frame that states more than `declared` is refused before anything is
    inflated, one that yields more is stopped one window past it, damage is a
    `CorruptBinaryError` naming `where`.  An lz4 block (one unit) and a zstd frame of a
    window past `MAX_STREAM_WINDOW` come as one window: the payload, inflated whole."""
    whole = compression == "lz4"
    window = WINDOW
    if compression == "zstd":
        try:
            stated = zstandard.frame_content_size(raw)
            window = zstandard.get_frame_parameters(raw).window_size + WINDOW
        except zstandard.ZstdError as exc:
            raise CorruptBinaryError(f"{where} does not decompress: {exc}") from None
        if stated > declared:
            raise CorruptBinaryError(
                f"{where}: its zstd frame states {stated} bytes, more than the {declared} its "
                "header declares (a decompression bomb?); refused")
        whole = window > MAX_STREAM_WINDOW + WINDOW
    with inflating(min(declared, window) if not whole else declared):
        if whole:
            yield iter((inflate(raw, compression or "lz4", declared, where),))
        elif compression is None:
            yield (bytes(raw[at:at + WINDOW]) for at in range(0, len(raw), WINDOW))
        else:
            windows = _zstd_windows(raw, declared, stated, where)
            try:
                yield windows
            finally:
                windows.close()  # the reader, and its hold on `raw`, let go now


def _zstd_windows(raw: bytes | memoryview, declared: int, stated: int,
                  where: str) -> Generator[bytes, None, None]:
    """The frame's bytes a window at a time; a frame cut short yields fewer bytes than it
    states, which the streaming decoder does not notice: counted here."""
    count = 0
    try:
        with _zstd().stream_reader(raw, read_size=WINDOW) as reader:
            while chunk := reader.read(WINDOW):
                count += len(chunk)
                if count > declared:
                    raise CorruptBinaryError(
                        f"{where}: its zstd frame yields more than the {declared} bytes its "
                        "header declares (a decompression bomb?); refused")
                yield chunk
        if 0 <= stated != count:
            raise CorruptBinaryError(f"{where} does not decompress: its zstd frame yields "
                                     f"{count} bytes, not the {stated} it states (cut short)")
    except (zstandard.ZstdError, MemoryError, ValueError) as exc:
        why = f"{type(exc).__name__}: {exc}" if isinstance(exc, MemoryError) else str(exc)
        raise CorruptBinaryError(f"{where} does not decompress: {why}") from None


def _zstd_windowed(raw: bytes | memoryview, declared: int, where: str) -> bytes:
    out = bytearray()
    with zstandard.ZstdDecompressor().stream_reader(raw) as reader:
        while True:
            chunk = reader.read(min(WINDOW, declared + 1 - len(out)))
            if not chunk:
                return bytes(out)
            out += chunk
            if len(out) > declared:
                raise CorruptBinaryError(
                    f"{where}: its zstd frame yields more than the {declared} bytes its header "
                    "declares (a decompression bomb?); refused")


def sha256_of(path: Path) -> str:
    """The sha256 of a file, read through the door."""
    return copied_sha256(path, None)


def copied_sha256(source: Path, out: BinaryIO | None) -> str:
    """The sha256 of a file, read through the door in windows, each window also written to
    `out` when one is given (a copy and its digest in one pass)."""
    digest = hashlib.sha256()
    with open_file(source, "artifact") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
            if out is not None:
                out.write(chunk)
    return digest.hexdigest()
