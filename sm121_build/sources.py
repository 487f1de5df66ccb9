"""Turn an audit target (.so, directory, wheel, image tarball, engine image) into ELF files.

Whatever has to be unpacked goes to one temporary directory that is removed on exit,
error or Ctrl-C included.
"""

from __future__ import annotations

import fnmatch
import os
import re
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from . import layers
from .errors import Sm121Error
from .fatbin import is_elf
from .refs import looks_like_image_ref

if TYPE_CHECKING:
    from .engine import Engine

SHARED_OBJECT = re.compile(r"\.so(\.\d+)*$")
FILE_LIKE = re.compile(r"\.(so(\.\d+)*|whl|tar|tar\.gz|tgz|o|cubin)$")


@dataclass(frozen=True)
class Binary:
    """An ELF file to audit: the name to show and where its bytes are now."""

    name: str
    path: Path


def _wanted(include: tuple[str, ...]) -> Callable[[str], bool]:
    def wanted(path: str) -> bool:
        if not SHARED_OBJECT.search(path):
            return False
        return not include or any(fnmatch.fnmatch(path, pattern) for pattern in include)
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
    if path.is_file():
        if is_elf(path):
            yield [Binary(str(path), path)]
            return
        with tempfile.TemporaryDirectory(prefix="sm121-audit-") as tmp:
            if zipfile.is_zipfile(path):
                yield _unzip(path, Path(tmp), wanted)
            elif tarfile.is_tarfile(path):
                yield _untar(path, Path(tmp), wanted, platform, show_progress)
            else:
                raise Sm121Error(
                    f"{path}: not an ELF file, wheel, or image tarball; audit takes one of "
                    "those, a directory, or an image in the local Docker engine")
        return
    if target.startswith((".", "/", "~")) or FILE_LIKE.search(target):
        raise Sm121Error(f"{target}: no such file or directory")
    if not looks_like_image_ref(target):
        raise Sm121Error(f"{target}: no such file, and not a valid image reference")
    if engine is None:
        from .engine import Engine  # the Docker SDK is imported only when an image is read

        engine = Engine.connect
    connected = engine()
    info = connected.image(target)
    with tempfile.TemporaryDirectory(prefix="sm121-audit-") as tmp:
        archive = Path(tmp) / "image.tar"
        with _bar(show_progress, None, f"saving {target}") as bar:
            connected.save(info.id, archive, bar.update)
        files = _untar(archive, Path(tmp) / "rootfs", wanted, info.platform, show_progress)
        archive.unlink()
        yield files


def _walk(root: Path, wanted: Callable[[str], bool]) -> list[Binary]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            if not full.is_symlink() and wanted(rel) and is_elf(full):
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
