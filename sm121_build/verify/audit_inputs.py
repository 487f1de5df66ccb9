"""Turn an audit target (.so, directory, wheel, image tarball, engine image) into ELF files.

Whatever has to be unpacked goes to one temporary directory that is removed on exit,
error or Ctrl-C included.  An image in the engine is streamed, never exported: only the
directories the `--include` patterns can match are read (a pattern's fixed leading folders;
a pattern that starts with `*/NAME` is looked for under the image's Python package
directories, where vLLM lives), the whole filesystem only when no pattern has a fixed part.
Only ELF files that carry device code stay in temp; the others are dropped once read.
"""

from __future__ import annotations

import fnmatch
import os
import posixpath
import re
import stat
import sys
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from sm121_build.errors import CorruptBinaryError, Sm121Error
from sm121_build.image import layers
from sm121_build.image.refs import looks_like_image_ref
from sm121_build.image.spill import write_stream
from sm121_build.steps import Progress
from sm121_build.verify.fatbin import HostBinary, is_elf

if TYPE_CHECKING:
    from sm121_build.image.engine import Engine, ImageInfo, ImageReader

GLOB_CHARS = re.compile(r"[*?\[]")

SHARED_OBJECT = re.compile(r"\.so(\.\d+)*$")
FILE_LIKE = re.compile(r"\.(so(\.\d+)*|whl|tar|tar\.gz|tgz|o|cubin)$")


@dataclass(frozen=True)
class Binary:
    """An ELF file to audit: the name to show and where its bytes are now."""

    name: str
    path: Path
    host_only_size: int | None = None  # set when the file was dropped: an ELF of no device code


def _wanted(include: tuple[str, ...]) -> Callable[[str], bool]:
    def wanted(path: str) -> bool:
        if not SHARED_OBJECT.search(path):
            return False
        # paths are relative; a pattern may also name them absolutely (`/opt/x/*`)
        return not include or any(fnmatch.fnmatch(path, pattern) or
                                  fnmatch.fnmatch("/" + path, pattern) for pattern in include)
    return wanted


@contextmanager
def binaries(target: str, include: tuple[str, ...] = (), platform: str | None = None,
             engine: Callable[[], Engine] | None = None,
             show_progress: bool = False) -> Iterator[list[Binary]]:
    """Yield the ELF files a target holds; temporary copies are removed afterwards."""
    path = Path(target)
    wanted = _wanted(include)
    if path.is_dir():
        yield _walk(path, wanted)
        return
    if path.exists() and not path.is_file():
        raise Sm121Error(f"{path}: not a regular file (a FIFO, socket or device); audit reads "
                         "files, directories, wheels, image tarballs and images")
    if path.is_file():
        if is_elf(path):
            yield [Binary(str(path), path)]
            return
        with tempfile.TemporaryDirectory(prefix="sm121-audit-") as tmp:
            try:
                if zipfile.is_zipfile(path):
                    found = _unzip(path, Path(tmp), wanted)
                elif tarfile.is_tarfile(path):
                    found = _untar(path, Path(tmp), wanted, platform, show_progress)
                else:
                    raise Sm121Error(
                        f"{path}: not an ELF file, wheel, or image tarball; audit takes one of "
                        "those, a directory, or an image in the local Docker engine")
            except (zipfile.BadZipFile, tarfile.TarError, EOFError, zlib.error) as exc:
                raise CorruptBinaryError(f"{path}: damaged archive ({exc})") from None
            yield found
        return
    if target.startswith((".", "/", "~")) or FILE_LIKE.search(target):
        raise Sm121Error(f"{target}: no such file or directory")
    if not looks_like_image_ref(target):
        raise Sm121Error(f"{target}: no such file, and not a valid image reference")
    if engine is None:
        from sm121_build.image.engine import (
            Engine,  # the Docker SDK is imported only when an image is read
        )

        engine = Engine.connect
    connected = engine()
    info = connected.image(target)
    with tempfile.TemporaryDirectory(prefix="sm121-audit-") as tmp:
        progress = Progress(f"reading {target}")  # live on a terminal, else plain lines
        with connected.reader(info.id, progress.add) as files:
            found = _stream_image(info, files, include, wanted, Path(tmp), progress)
        progress.done()
        yield found


def walk_roots(include: tuple[str, ...], info: ImageInfo, files: ImageReader) -> list[str]:
    """The directories (or files) of an image that can hold a path the patterns match."""
    from sm121_build.image.facts import python_sites

    if not include:
        return ["/"]
    roots: list[str] = []
    for pattern in include:
        parts = [p for p in pattern.split("/") if p]
        fixed = _literal_prefix(parts)
        if fixed:
            roots.append("/" + "/".join(fixed))
            continue
        rest = _literal_prefix(parts[1:]) if parts and parts[0] == "*" else []
        if not rest:
            return ["/"]
        found = [c for site in python_sites(info, files)
                 if files.stat(c := posixpath.join(site, *rest)) is not None]
        if not found:  # `*/vllm_flash_attn/*.so`: not at a site's top; read everything
            return ["/"]
        roots += found
    roots = sorted(set(roots))
    return [r for r in roots if not any(r != o and r.startswith(o.rstrip("/") + "/")
                                        for o in roots)]


def _literal_prefix(parts: list[str]) -> list[str]:
    """The leading path segments that hold no glob characters."""
    literal = []
    for part in parts:
        if GLOB_CHARS.search(part):
            break
        literal.append(part)
    return literal


def _stream_image(info: ImageInfo, files: ImageReader, include: tuple[str, ...],
                  wanted: Callable[[str], bool], dest: Path, progress: Progress) -> list[Binary]:
    """Stream the roots; keep the wanted ELF files that carry device code, and list the
    others by name and size only (`host_only_size`), so the table still counts them."""
    found: list[Binary] = []
    kept: set[str] = set()
    for root in walk_roots(include, info, files):
        if files.stat(root) is None:
            continue
        parent = posixpath.dirname(root.rstrip("/")) or "/"
        with files.tar(root) as archive:
            for member in archive:
                rel = posixpath.normpath(posixpath.join(parent, member.name)).lstrip("/")
                if not rel or rel == "." or not wanted(rel):
                    continue
                target = dest / rel
                if member.islnk():
                    linked = posixpath.normpath(posixpath.join(
                        parent, member.linkname)).lstrip("/")
                    if linked in kept:
                        target.parent.mkdir(parents=True, exist_ok=True)
                        os.link(dest / linked, target)
                        kept.add(rel)
                        found.append(Binary("/" + rel, target))
                    continue
                handle = archive.extractfile(member) if member.isfile() else None
                if handle is None:
                    continue
                write_stream(handle, target, "/" + rel)
                if not is_elf(target):
                    target.unlink()
                    continue
                if not _has_device_code(target):
                    found.append(Binary("/" + rel, target, target.stat().st_size))
                    target.unlink()
                    continue
                kept.add(rel)
                found.append(Binary("/" + rel, target))
                progress.update(found=len(found))
    return found


def _has_device_code(path: Path) -> bool:
    try:
        with HostBinary.open(path) as binary:
            return bool(binary.entries)
    except Sm121Error:
        return True  # let the audit itself report it


def _walk(root: Path, wanted: Callable[[str], bool]) -> list[Binary]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            if full.is_symlink() or not wanted(rel):
                continue
            if not stat.S_ISREG(full.lstat().st_mode):  # a FIFO would block the read forever
                print(f"skipped: {rel}: not a regular file", file=sys.stderr)
            elif is_elf(full):
                found.append(Binary(rel, full))
    return found


def _unzip(archive: Path, dest: Path, wanted: Callable[[str], bool]) -> list[Binary]:
    found = []
    with zipfile.ZipFile(archive) as wheel:
        for info in wheel.infolist():
            if info.is_dir() or not wanted(info.filename):
                continue
            name = os.path.normpath(info.filename)
            if name.startswith("..") or os.path.isabs(name):
                continue
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with wheel.open(info) as source, open(target, "wb") as out:
                while chunk := source.read(1 << 20):
                    out.write(chunk)
            if is_elf(target):
                found.append(Binary(info.filename, target))
    return found


def _untar(archive: Path, dest: Path, wanted: Callable[[str], bool], platform: str | None,
           show_progress: bool) -> list[Binary]:
    dest.mkdir(parents=True, exist_ok=True)
    with _bar(show_progress, None, "reading layers") as bar:
        fs = layers.extract_files(archive, dest, wanted, platform, bar.update)
    return [Binary("/" + p, dest / p) for p in sorted(fs.extracted) if is_elf(dest / p)]


class _NoBar:
    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int) -> None:
        return None


def _bar(enabled: bool, length: int | None, label: str) -> Any:
    if not enabled:
        return _NoBar()
    return click.progressbar(length=length, label=label, file=sys.stderr)
