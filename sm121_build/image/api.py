"""What the rest of the tool may ask of a container engine, with no Docker in it.

`ImageEngine` is the protocol the pipeline, inspect, verification and prune are written
against; `engine.Engine` implements it over the Docker SDK, and the unit tests implement it
over folders (devkit/fakeengine.py).  The records here (image config, history step, path
stat) are plain data, so code that only reads them never imports the Docker SDK.
"""

from __future__ import annotations

import contextlib
import posixpath
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

# Go's os.FileMode type bits, as the engine's archive endpoint reports them.
MODE_DIR, MODE_SYMLINK = 1 << 31, 1 << 27
MODE_TYPE = MODE_DIR | MODE_SYMLINK | (1 << 26) | (1 << 25) | (1 << 24) | (1 << 21) | (1 << 19)
MAX_LINKS = 16
# The repository of the private tags an engine gives a base for a build's FROM line
# (`ImageEngine.pinned`): `sm121-build-pin/<image ID's first 12>:<pid>-<random>`.
PIN_REPO = "sm121-build-pin"
# The image config's runtime fields, in the order of `ImageInfo.runtime`: the engine's key and
# the name a user reads.
RUNTIME_FIELDS = (("Entrypoint", "entrypoint"), ("Cmd", "cmd"), ("WorkingDir", "workdir"),
                  ("User", "user"), ("ExposedPorts", "exposed ports"))


@dataclass(frozen=True)
class ImageInfo:
    """What the engine knows about an image, without running it."""

    ref: str
    id: str
    repo_digests: tuple[str, ...]
    os: str
    architecture: str
    variant: str
    labels: dict[str, str]
    layers: tuple[str, ...]
    env: tuple[str, ...] = field(default=())
    runtime: tuple[str, ...] = field(default=())  # RUNTIME_FIELDS, each as JSON
    created: str = ""  # the image config's `created` (RFC 3339), "" when unknown

    @property
    def platform(self) -> str:
        suffix = f"/{self.variant}" if self.variant else ""
        return f"{self.os}/{self.architecture}{suffix}"

    @property
    def digest_ref(self) -> str:
        """A reference that pins the exact image: repo@sha256 when known, else the ID."""
        return self.repo_digests[0] if self.repo_digests else self.id


@dataclass(frozen=True)
class ConfinedJob:
    """A program to run in a throwaway container that can only compute (`run_confined`)."""

    what: str  # for messages: "the source tree's CMake"
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    seconds: float  # killed after this
    scratch: str = "/scratch"  # its only writable folder: a 16 MiB tmpfs
    memory: int = 256 << 20


@dataclass(frozen=True)
class Bind:
    """A folder of this host seen inside a container at `inside` (read-only unless
    `writable`)."""

    host: Path
    inside: str
    writable: bool = False


@dataclass(frozen=True)
class GpuJob:
    """A program to run in a throwaway container of an image with this machine's GPUs
    (`run_with_gpu`): as `user`, no network, a read-only root, the `binds` its only folders
    from outside."""

    what: str  # for messages: "the cubin loader"
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    seconds: float  # killed after this
    binds: tuple[Bind, ...]
    user: str  # `uid:gid`: what it writes into a writable bind is the caller's


@dataclass(frozen=True)
class ConfinedResult:
    """How a confined job ended: its exit status (None: killed at its time limit) and
    output."""

    status: int | None
    stdout: str
    stderr: str


@dataclass(frozen=True)
class HistoryStep:
    """One step of an image's history: what made it and how many bytes its layer adds."""

    created_by: str
    size: int


@dataclass(frozen=True)
class PathStat:
    """One path inside an image: the archive endpoint's stat."""

    path: str
    size: int
    mode: int
    link_target: str

    @property
    def is_dir(self) -> bool:
        return bool(self.mode & MODE_DIR)

    @property
    def is_symlink(self) -> bool:
        return bool(self.mode & MODE_SYMLINK)

    @property
    def is_file(self) -> bool:
        return not self.mode & MODE_TYPE


def link_path(link: str, target: str) -> str:
    """Where a symlink at `link` pointing to `target` leads (absolute, normalised)."""
    return posixpath.normpath(target if target.startswith("/") else
                              posixpath.join(posixpath.dirname(link), target))


class PathLookups:
    """Symlink-following lookups on top of a `stat` that does not follow them, as the
    engine's archive endpoint does (every implementation of `ImageFiles` shares these)."""

    def stat(self, path: str) -> PathStat | None:
        raise NotImplementedError

    def resolve(self, path: str) -> PathStat | None:
        """The stat of what `path` names, following symlinks (as the image would)."""
        for _ in range(MAX_LINKS):
            found = self.stat(path)
            if found is None or not found.is_symlink:
                return found
            path = link_path(path, found.link_target)
        return None

    def canonical(self, path: str) -> str:
        """The path with every symlinked folder on the way replaced by its target."""
        done = "/"
        for part in [p for p in path.split("/") if p]:
            current = posixpath.join(done, part)
            for _ in range(MAX_LINKS):
                found = self.stat(current)
                if found is None or not found.is_symlink:
                    break
                current = link_path(current, found.link_target)
            done = current
        return done


class ImageFiles(Protocol):
    """An image's files, read one path at a time (absolute paths, as inside the image)."""

    def stat(self, path: str) -> PathStat | None: ...

    def resolve(self, path: str) -> PathStat | None: ...

    def canonical(self, path: str) -> str: ...

    def read_bytes(self, path: str, limit: int = ...) -> bytes | None: ...

    def tar(self, path: str) -> contextlib.AbstractContextManager[tarfile.TarFile]: ...

    def copy_file(self, path: str, dest: Path) -> PathStat | None: ...


StatusLine = Callable[[str], None]


class ImageEngine(Protocol):
    """The container engine as the tool uses it: images by reference, their files, builds
    (untagged), tags, and removal of only what a run created."""

    def image(self, ref: str) -> ImageInfo: ...

    def image_id(self, ref: str) -> str | None: ...

    def exists(self, ref: str) -> bool: ...

    def pull(self, ref: str, status: StatusLine | None = None) -> str: ...

    def push(self, ref: str) -> None: ...

    def resolve_digest(self, ref: str) -> str: ...

    def find_by_label(self, key: str, value: str) -> list[ImageInfo]: ...

    def reader(self, image_id: str, on_read: Callable[[int], None] | None = None
               ) -> contextlib.AbstractContextManager[ImageFiles]: ...

    def history(self, image_id: str) -> list[HistoryStep]: ...

    def run_confined(self, image_id: str, job: ConfinedJob) -> ConfinedResult: ...

    def run_with_gpu(self, image_id: str, job: GpuJob) -> ConfinedResult: ...

    def build(self, context: Path, dockerfile: Path, log: Path,
              status: StatusLine | None = None) -> str: ...

    def buildkit_client(self) -> str | None: ...

    def pinned(self, image_id: str) -> contextlib.AbstractContextManager[str]: ...

    def tag(self, image_id: str, tag: str) -> None: ...

    def tags_of(self, image_id: str) -> tuple[str, ...]: ...

    def untag(self, tag: str) -> None: ...

    def image_ids(self) -> set[str]: ...

    def remove_created(self, image_id: str, before: set[str]) -> None: ...

    def remove_unused(self, image_id: str) -> str | None: ...

    def in_use(self, image_id: str) -> str | None:
        """Why the image cannot be removed without force (an image built on it, a container
        of it), or None."""
        ...
