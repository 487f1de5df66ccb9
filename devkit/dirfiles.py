"""A stand-in for the engine's per-path reads (`engine.ImageReader`) over a local folder.

The engine boundary is replaced, nothing else: stat and tar streams come from a real
directory tree (real symlinks, real tar), with the archive endpoint's Go-style mode bits and
its resolution of symlinked folders on the way; symlink following is the engine module's
own (`PathLookups`), so inspect's discovery logic runs without Docker.  The same logic
runs against a real engine in tests/integration/test_image_reader.py.
"""

from __future__ import annotations

import io
import os
import posixpath
import shutil
import stat
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sm121_build.image.api import PathLookups, PathStat

GO_DIR, GO_SYMLINK = 1 << 31, 1 << 27


class DirectoryFiles(PathLookups):
    """An image's filesystem, as the folder `root` holds it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.stats: list[str] = []

    def _local(self, path: str) -> Path:
        # intermediate symlinks resolve inside the image, as the engine does
        parts = [p for p in posixpath.normpath(path).split("/") if p]
        current = "/"
        for index, part in enumerate(parts):
            current = posixpath.join(current, part)
            local = self.root / current.lstrip("/")
            if index < len(parts) - 1 and local.is_symlink():
                target = os.readlink(local)
                current = posixpath.normpath(target if target.startswith("/") else
                                             posixpath.join(posixpath.dirname(current), target))
        return self.root / current.lstrip("/")

    def stat(self, path: str) -> PathStat | None:
        self.stats.append(path)
        local = self._local(path)
        try:
            info = local.lstat()
        except OSError:
            return None
        mode = stat.S_IMODE(info.st_mode)
        link = ""
        if stat.S_ISDIR(info.st_mode):
            mode |= GO_DIR
        elif stat.S_ISLNK(info.st_mode):
            mode |= GO_SYMLINK
            link = os.readlink(local)
        return PathStat("/" + str(local.relative_to(self.root)), info.st_size, mode, link)

    def read_bytes(self, path: str, limit: int = 64 << 20) -> bytes | None:
        found = self.resolve(path)
        if found is None or not found.is_file or found.size > limit:
            return None
        return self._local(found.path).read_bytes()

    def copy_file(self, path: str, dest: Path) -> PathStat | None:
        found = self.resolve(path)
        if found is None or not found.is_file:
            return None
        shutil.copyfile(self._local(found.path), dest)
        return found

    @contextmanager
    def tar(self, path: str) -> Iterator[tarfile.TarFile]:
        local = self._local(path)
        if not local.exists() and not local.is_symlink():
            raise FileNotFoundError(path)
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as out:
            out.add(local, arcname=local.name)
        buffer.seek(0)
        with tarfile.open(fileobj=buffer, mode="r|") as archive:
            yield archive


def make_tree(root: Path, files: dict[str, bytes | str]) -> Path:
    """Files (bytes) and symlinks (str: the link target) under root."""
    for name, content in files.items():
        path = root / name.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            path.symlink_to(content)
        else:
            path.write_bytes(content)
    return root
