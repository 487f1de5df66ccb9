"""`sm121-build local --source SRC --out OUT`: the build step on this machine, no Docker.

The same script the builder stage runs (build_extensions.py), on a patched copy of SRC, with
this machine's torch and nvcc.  For testing the build step on its own, and for machines that
build kernels for images elsewhere (the .so files go to OUT; `sm121-build inject` needs a
manifest, which only an image build writes).
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from sm121_build.core.compile_progress import shipped_histories
from sm121_build.core.console import BuildStatus, escaped_prints, note
from sm121_build.core.errors import BuildFailed, Sm121Error
from sm121_build.core.inputs import read_input
from sm121_build.core.interrupts import temp_dir
from sm121_build.core.limits import Limits
from sm121_build.core.vllm import extension_target
from sm121_build.cuda.compat import DEFAULT_CUDA, DEFAULT_TARGET, ArchList
from sm121_build.image.facts import cuda_h_version
from sm121_build.jobs.formats.render import choose_extensions, default_file
from sm121_build.jobs.payload import build_extensions
from sm121_build.source.cmake_run import HostCMake, evaluating_with
from sm121_build.source.external import (
    projects_for,
    read_pin,
    source_targets,
    stand_in_envs,
)
from sm121_build.source.git_pin import copy_into
from sm121_build.source.guard_rules import PatchFor, apply_for_build, read_source_version
from sm121_build.source.guards import find_cmake
from sm121_build.source.tree import require_contained


def host_cuda_version(home: Path) -> str:
    """The toolkit version from `$CUDA_HOME/include/cuda.h`, else the default."""
    header = home / "include" / "cuda.h"
    found = cuda_h_version(read_input(header, 16 << 20, "cuda.h").decode(errors="replace")) \
        if header.exists() else None
    return found or DEFAULT_CUDA


def local_targets(source: Path, extra: tuple[str, ...]) -> list[str]:
    """_C / _moe_C (or the source's *_stable_libtorch names) plus --ext, as CMake targets:
    the image build's choice (`render.choose_extensions`), as if an image carried every
    extension the source defines."""
    if not (source / "CMakeLists.txt").exists():
        raise Sm121Error(f"{source} has no CMakeLists.txt; is it a vLLM checkout?")
    defined = frozenset(source_targets(source))
    every = tuple(default_file(t) for t in sorted(defined))
    return [extension_target(e) for e in choose_extensions(every, extra, defined)]


@dataclass(frozen=True)
class LocalBuild:
    """`sm121-build local`: the tree, where the files go, the arch list, the extensions asked
    for beyond the default ones, MAX_JOBS, whether the rules are applied, the build script's
    own arguments (`--offline`, `--cutlass`), and a flash-attention checkout."""

    source: Path
    out: Path
    arch: ArchList
    extra: tuple[str, ...] = ()
    jobs: int | None = None
    no_patch: bool = False
    build_args: tuple[str, ...] = ()
    fa_source: Path | None = None


def run_local(asked: LocalBuild) -> list[Path]:
    source, out, arch, extra, jobs = (asked.source, asked.out, asked.arch, asked.extra,
                                      asked.jobs)
    no_patch, build_args, fa_source = asked.no_patch, asked.build_args, asked.fa_source
    version = read_source_version(source)
    if version is None:
        raise Sm121Error(f"cannot read the vLLM version of {source} (no vllm/_version.py)")
    home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    if not (home / "bin" / "nvcc").exists():
        raise Sm121Error(f"no nvcc under {home}: set CUDA_HOME to a CUDA 13 toolkit")
    targets = local_targets(source, extra)
    projects = projects_for(targets, fa_source)
    cuda = host_cuda_version(home)
    with temp_dir("sm121-local-") as tmp:
        copy = Path(tmp) / "src"
        require_contained(source)  # the copy keeps links as links, all inside
        shutil.copytree(source, copy, ignore=shutil.ignore_patterns(".git", "build*"),
                        symlinks=True)
        sources: list[str] = []
        trees: dict[str, Path] = {}
        for project in projects:  # flash-attention at the commit the source pins
            trees[project.name] = Path(tmp) / project.name
            got = copy_into(read_pin(copy, project), fa_source, trees[project.name])
            note(f"{project.name} {got.commit[:12]}: {got.path}")
            sources += ["--define", f"{project.env}={trees[project.name]}"]
        # `local` runs the tree's whole CMake on this host anyway: its guards may too
        with evaluating_with(HostCMake(find_cmake, Limits.from_environment().cmake_s)):
            if not no_patch:
                want = PatchFor(version, arch, cuda, DEFAULT_TARGET)
                for line in apply_for_build(copy, trees, want):
                    note(line)
        # the compilers' own temp files (nvcc's tmpxft_*, gcc's cc*.s) go into this run's
        # folder: a compiler killed by an interrupt never removes them, the folder goes
        scratch = Path(tmp) / "tmp"
        scratch.mkdir()
        environ = {**os.environ, "TORCH_CUDA_ARCH_LIST": arch.torch, "CUDA_HOME": str(home),
                   "CMAKE_CUDA_COMPILER": str(home / "bin" / "nvcc"),
                   "TMPDIR": str(scratch), "TMP": str(scratch), "TEMP": str(scratch)}
        if jobs:
            environ["MAX_JOBS"] = str(jobs)
        argv = ["--source", str(copy), "--out", str(out), "--build-dir", str(Path(tmp) / "b")]
        for target in targets:
            argv += ["--target", target]
        argv += sources
        for env in stand_in_envs(p.env for p in projects):
            argv += ["--stand-in", env]
        cmake = Path(sys.executable).parent / "cmake"
        if cmake.exists():
            argv += ["--cmake", str(cmake)]
        # ninja's progress, as in an image; what the script prints (the compiler's messages
        # it quotes among them) leaves through the text door, escaped
        with BuildStatus(shipped_histories()) as status, escaped_prints():
            failed = build_extensions.main([*argv, *build_args], environ, status) != 0
        if failed:
            raise BuildFailed(f"local build failed; full log: {out / 'build.log'}")
    return sorted(out.glob("*.so"))
