"""Files the tool writes for the user (`--report`, `--summary-md`): regular files only.

A symlink, FIFO or device named as an output is refused before any work
(`cli.params.require_writable`); at write time a path that became one since is refused too,
without blocking (a FIFO with no reader would hang the run after its work is done).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import click

from sm121_build.core.errors import Sm121Error

LOCK_WAIT_S = 60.0  # a lock is held for a read and a write: milliseconds


def not_regular(path: Path) -> str | None:
    """What the path is when it exists and is not a regular file ("a symlink", "a FIFO"...)."""
    try:
        mode = path.lstat().st_mode
    except OSError:  # absent, or under a file: the write will say why
        return None
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "not a regular file"


class NotWritten(Sm121Error):
    """A result that could not be written (a full disk, a folder that refuses it): the
    message names the file; nothing of it was left (`why`: what the system said)."""

    def __init__(self, path: Path, why: str, left: str) -> None:
        super().__init__(f"{path}: {why}: not written ({left})")
        self.path, self.why = path, why


def _said(exc: OSError) -> str:
    return exc.strerror or str(exc)


def append_text(path: Path, text: str) -> None:
    """Append to a regular file (created when absent), whole or not at all: a write that
    fails (a full disk) cuts the file back to what it held, so `$GITHUB_STEP_SUMMARY`
    never keeps half a table.  Never follows a symlink or blocks."""
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        what = not_regular(path)
        raise Sm121Error(f"{path}: {what or _said(exc)}: not written") from None
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise Sm121Error(f"{path}: {not_regular(path) or 'not a regular file'}: not written")
        try:
            write_all(fd, text.encode("utf-8", errors="backslashreplace"))
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, found.st_size)
            raise NotWritten(path, _said(exc), "it holds what it held before") from None
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """Every byte of `data` to `fd` (a write the disk cut short is continued, and then
    fails with the disk's error: never a short write taken for a whole one)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def replace_text(path: Path, text: str) -> None:
    """Write a regular file atomically (a reader never sees half of it)."""
    what = not_regular(path)
    if what:
        raise Sm121Error(f"{path}: {what}: not written (name a regular file)")
    replace_bytes(path, text.encode("utf-8", errors="backslashreplace"))


def replace_bytes(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write a file durably and atomically: `replace_file` with these bytes."""
    replace_file(path, lambda out: out.write(data), mode)


def _umask() -> int:
    """This process's umask, read without changing it (Linux says it in /proc; elsewhere it
    is set and put back at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _mode_for(path: Path) -> int:
    """The mode a result takes when none is asked: the file's it replaces, else what a new
    file gets (0666 less the umask), as a shell's `>` would give it."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return 0o666 & ~_umask()


def replace_file(path: Path, write: Callable[[BinaryIO], object],
                 mode: int | None = None) -> None:
    """Write a file durably and atomically: a temporary file beside it (created exclusively,
    so never through a link) that `write` fills, fsync'd, given `mode` (none: the mode of
    the file it replaces, else a new file's), renamed over the name, the folder fsync'd.
    A name that is a link or not a regular file is refused; an OSError (a full disk) leaves
    the old file as it was and no temporary file behind, and is `NotWritten`, naming the
    file."""
    what = not_regular(path)
    if what:
        raise Sm121Error(f"{path}: {what}: not written over")
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = None
    try:
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(handle, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temporary, _mode_for(path) if mode is None else mode)
        os.replace(temporary, path)
        temporary = None
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
    except OSError as exc:
        # (a read of a source the write copies names its own file)
        source = f"{exc.filename}: " if exc.filename and exc.filename != temporary else ""
        raise NotWritten(path, source + _said(exc), "the old file, if any, is as it was") \
            from None
    finally:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)


def write_below(root: Path, path: Path, data: bytes) -> None:
    """Write `path` atomically, never through a link below `root`: each folder between
    `root` and the file is opened without following links (made where missing), the file
    is created exclusively beside its name and renamed over it.  A link there (ELOOP,
    ENOTDIR) or a full disk is an OSError, and nothing is left behind; the user's own path
    to `root` may hold links."""
    *folders, name = path.relative_to(root).parts
    root.mkdir(parents=True, exist_ok=True)
    at = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for folder in folders:
            with contextlib.suppress(FileExistsError):
                os.mkdir(folder, dir_fd=at)
            inner = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=at)
            os.close(at)
            at = inner
        temporary = f".{name}.{os.urandom(8).hex()}"  # threads may store at once
        handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                         0o600, dir_fd=at)
        try:
            with os.fdopen(handle, "wb") as out:
                out.write(data)
            os.replace(temporary, name, src_dir_fd=at, dst_dir_fd=at)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=at)
    finally:
        os.close(at)


@contextlib.contextmanager
def held_lock(path: Path, seconds: float | None = None) -> Iterator[None]:
    """An exclusive lock (flock) on `path`, made where missing and never opened through a
    link, held while the block runs; another process (or thread) waits for it, at most
    `seconds` (LOCK_WAIT_S when not given; then a TimeoutError: a holder that never lets
    go is a hung run, and no wait here is endless).  Released when its holder ends,
    however it ends."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        limit = LOCK_WAIT_S if seconds is None else seconds
        deadline = time.monotonic() + limit
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"held by another process for {limit:g} s") \
                        from None
                time.sleep(0.05)
        yield
    finally:
        os.close(handle)


def refuse_links_below(root: Path, target: Path) -> None:
    """`root` and every folder between it and `target` must not be a link (one already in
    an output folder, leading out of it); the user's own path to `root` may hold links."""
    folders = [root, *(root / p for p in reversed(target.relative_to(root).parents[:-1]))]
    for folder in folders:
        if folder.is_symlink():
            raise Sm121Error(f"{folder} is a link: nothing is written through a link")


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        found = path.stat()
    except OSError:
        return None
    return found.st_dev, found.st_ino


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


_INPUTS = "sm121.inputs"  # the command's context: every path an option names to be read


def declare_input(path: Path, ctx: click.Context | None) -> None:
    """Record `path` (a key, an interpreter, a folder an option names to be read) as an
    input of the command `ctx` runs: no output of it may be written over, into or through
    it (`refuse_onto_inputs`, `Results`).  `cli.params.InputPath` calls this for every
    option that names a file the command reads."""
    if ctx is not None:
        ctx.meta.setdefault(_INPUTS, []).append(path)


def declared_inputs() -> tuple[Path, ...]:
    """The inputs the running command's options named (`declare_input`)."""
    ctx = click.get_current_context(silent=True)
    return () if ctx is None else tuple(ctx.meta.get(_INPUTS, ()))


def refuse_onto_inputs(output: Path, inputs: tuple[Path, ...], what: str) -> None:
    """An output may be no input, by any spelling (the same file by its resolved path or
    its inode, a hard link of it), nor lie inside an input folder (links resolved).  The
    inputs are `inputs` and every path the command's options name to be read
    (`declared_inputs`: keys, interpreters, folders)."""
    resolved = output.resolve()
    same = _identity(output)
    for source in (*inputs, *declared_inputs()):
        where_source = source.resolve()
        inside = source.is_dir() and _inside(resolved, where_source)
        if inside or resolved == where_source or (same is not None
                                                  and same == _identity(source)):
            where = "inside" if inside else "the same file as"
            raise Sm121Error(f"{what} {output} is {where} the input {source}: nothing is "
                             "written over, into or through an input; give a folder of its "
                             "own")


def _claim_key(target: Path) -> Path:
    """One spelling of a result's path (absolute, `.` and `..` folded)."""
    return Path(os.path.normpath(target.absolute()))


class Results:
    """Where one command's results go, under `root` (`--out`): each result claims its path
    before any work (two results never map to one path), and is written by `write` (atomic,
    never through a link under `root`, never onto or into an input)."""

    def __init__(self, root: Path, inputs: tuple[Path, ...]) -> None:
        if root.is_symlink():
            raise Sm121Error(f"--out {root} is a link; nothing is written through a link")
        if root.exists() and not root.is_dir():
            raise Sm121Error(f"--out {root} is not a folder")
        refuse_onto_inputs(root, inputs, "--out")
        self.root = root
        self.inputs = inputs
        self._claimed: dict[Path, str] = {}

    def claim(self, relative: Path, source: str) -> Path:
        """The path the result of `source` goes to; refused when another result has it, or
        when it is an input or lies through one."""
        target = self.root / relative
        key = _claim_key(target)
        other = self._claimed.get(key)
        if other is not None and other != source:
            raise Sm121Error(f"{other} and {source} would both be written to {target}: give "
                             "them in separate runs or with separate --out folders")
        self._claimed[key] = source
        refuse_links_below(self.root, target)
        refuse_onto_inputs(target, self.inputs, "the result")
        return target

    def write(self, target: Path, write: Callable[[BinaryIO], object],
              mode: int | None = None) -> None:
        """Write a claimed result (checked again: a link may have appeared since)."""
        if _claim_key(target) not in self._claimed:
            raise Sm121Error(f"{target}: written without being claimed (a bug)")
        refuse_links_below(self.root, target)
        refuse_onto_inputs(target, self.inputs, "the result")
        replace_file(target, write, mode)
