"""The source tree's CMake in a throwaway container: what every command evaluates guards with.

The container's image is made here, once per cmake: `FROM scratch` with this host's cmake,
the libraries `ldd` names for it and CMake's modules (no shell, nothing else), tagged
`sm121-build/cmake-evaluator:<digest>` and written to the ledger (so `prune` may remove it).
Each evaluation is one container (`Engine.run_confined`): no network, read-only root, uid
65534, no capabilities, one CPU, 256 MiB, 64 processes, a 16 MiB /scratch, a 1 MiB log, killed at
SM121_CMAKE_TIMEOUT.  The tree's files reach it as environment values (a remote engine
has no bind mounts; the root is read-only): a boot script writes them to a tmpfs and includes
them (/scratch).  Equal scripts are evaluated once per process.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sm121_build.core.children import Program, run
from sm121_build.core.errors import Sm121Error
from sm121_build.core.interrupts import temp_dir
from sm121_build.core.limits import Limits
from sm121_build.core.shipped import shipped_dir
from sm121_build.image import ledger
from sm121_build.image.api import ConfinedJob, ImageEngine
from sm121_build.source.cmake_run import (
    CMakeOutput,
    CMakeRunner,
    CMakeScript,
    HostCMake,
    on_host_asked,
)
from sm121_build.source.guards import find_cmake

EVALUATOR_REPO = "sm121-build/cmake-evaluator"
SCRATCH = "/scratch"  # the container's only writable folder (a tmpfs `run_confined` mounts)
DOCKERFILE = "cmake-evaluator.Dockerfile"
CHUNK = 64 << 10  # one environment string stays far below Linux's 128 KiB
MAX_TEXT = 1 << 20  # all of them below ARG_MAX
BOOT = """\
function(sm121_join prefix out)
  set(text "")
  math(EXPR last "$ENV{${prefix}_N} - 1")
  foreach(i RANGE ${last})
    string(APPEND text "$ENV{${prefix}_${i}}")
  endforeach()
  set(${out} "${text}" PARENT_SCOPE)
endfunction()
sm121_join(SM121_UTILS utils)
sm121_join(SM121_SCRIPT script)
file(MAKE_DIRECTORY "/scratch/src/cmake")
file(WRITE "/scratch/src/cmake/utils.cmake" "${utils}")
file(WRITE "/scratch/explain.cmake" "${script}")
include("/scratch/explain.cmake")
"""
_LDD_LINE = re.compile(r"(?:=>\s*)?(/\S+)\s+\(0x[0-9a-f]+\)")


def _chunks(prefix: str, text: str) -> list[tuple[str, str]]:
    parts = [text[i:i + CHUNK] for i in range(0, len(text), CHUNK)] or [""]
    return [(f"{prefix}_N", str(len(parts))),
            *((f"{prefix}_{i}", part) for i, part in enumerate(parts))]


def _libraries(binary: Path) -> list[Path]:
    """The shared libraries (and the loader) `binary` loads, as `ldd` resolves them here."""
    try:
        done = run(Program(("ldd", str(binary)), 30.0, "ldd"))
    except OSError as exc:
        raise Sm121Error(f"cannot list the libraries of {binary} (ldd: {exc})") from None
    if done.timed_out:
        raise Sm121Error(f"cannot list the libraries of {binary} (ldd ran past 30 s)")
    out = done.text
    return [Path(m.group(1)) for m in map(_LDD_LINE.search, out.splitlines()) if m]


@dataclass(frozen=True)
class _Evaluator:
    """What the evaluator image holds, found on this host."""

    binary: Path
    modules: tuple[Path, ...]
    libraries: tuple[Path, ...]

    @classmethod
    def find(cls) -> _Evaluator:
        binary = Path(find_cmake()).resolve()
        modules = tuple(sorted((binary.parent.parent / "share").glob("cmake-*")))
        if not modules:
            raise Sm121Error(f"{binary}: no CMake modules beside it (share/cmake-*)")
        return cls(binary, modules, tuple(_libraries(binary)))

    def tag(self) -> str:
        digest = hashlib.sha256((shipped_dir("dockerfiles") / DOCKERFILE).read_bytes())
        digest.update(BOOT.encode())
        for path in (self.binary, *self.modules, *self.libraries):
            stat = path.stat()
            digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
        return f"{EVALUATOR_REPO}:{digest.hexdigest()[:16]}"

    def context(self, folder: Path) -> None:
        root = folder / "root"
        (root / "sm121" / "bin").mkdir(parents=True)
        shutil.copy2(self.binary, root / "sm121" / "bin" / "cmake")
        for modules in self.modules:
            shutil.copytree(modules, root / "sm121" / "share" / modules.name, symlinks=True)
        for library in self.libraries:
            (root / library.relative_to("/")).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(library, root / library.relative_to("/"))  # the file, not a link
            (root / library.relative_to("/")).chmod(0o755)
        (root / "sm121" / "boot.cmake").write_text(BOOT)
        shutil.copyfile(shipped_dir("dockerfiles") / DOCKERFILE, folder / "Dockerfile")


def evaluator_image(engine: ImageEngine) -> str:
    """The evaluator image's tag, made (and written to the ledger) when not here yet."""
    found = _Evaluator.find()
    tag = found.tag()
    if engine.exists(tag):
        return tag
    with temp_dir("sm121-cmake-evaluator-") as tmp:
        folder = Path(tmp)
        found.context(folder)
        image_id = engine.build(folder, folder / "Dockerfile", folder / "build.log")
    ledger.record_built(image_id, [tag], "", "cmake evaluator")
    engine.tag(image_id, tag)
    return tag


@dataclass
class ContainerCMake:
    """`cmake -P` in a throwaway container (the module's docstring); the engine is asked
    for only when a tree is first evaluated."""

    connect: Callable[[], ImageEngine]
    seconds: float
    _engine: ImageEngine | None = None
    _image: str = ""
    _done: dict[CMakeScript, CMakeOutput] = field(default_factory=dict)

    def run(self, script: CMakeScript) -> CMakeOutput:
        if script in self._done:
            return self._done[script]
        utils = script.utils.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        text = script.text(SCRATCH)
        if len(utils) + len(text) > MAX_TEXT:
            raise Sm121Error(f"the tree's cmake/utils.cmake and the guards to evaluate are "
                             f"{len(utils) + len(text)} characters, above {MAX_TEXT}: refused")
        if self._engine is None:
            self._engine = self.connect()
            self._image = evaluator_image(self._engine)
        result = self._engine.run_confined(self._image, ConfinedJob(
            "the source tree's CMake", ("/sm121/bin/cmake", "-P", "/sm121/boot.cmake"),
            (*_chunks("SM121_UTILS", utils), *_chunks("SM121_SCRIPT", text)), self.seconds))
        output = CMakeOutput(result.status, result.stdout, result.stderr)
        self._done[script] = output
        return output


def source_runner(connect: Callable[[], ImageEngine]) -> CMakeRunner:
    """What a command evaluates a tree's CMake with: a throwaway container, unless the user
    asked for this host (SM121_CMAKE_ON_HOST=1)."""
    limits = Limits.from_environment()
    if on_host_asked():
        return HostCMake(find_cmake, limits.cmake_s)
    return ContainerCMake(connect, limits.cmake_s)
