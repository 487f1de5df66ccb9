"""`sm121-build --local --source SRC --out OUT`: the build step on this machine, no Docker.

The same script the builder stage runs (build_extensions.py), on a patched copy of SRC, with
this machine's torch and nvcc.  For testing the build step on its own, and for machines that
build kernels for images elsewhere (the .so files go to OUT; `sm121-build inject` needs a
manifest, which only an image build writes).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import click

from sm121_build.build import build_extensions
from sm121_build.build.render import DEFAULT_EXTENSIONS, extension_target, source_targets
from sm121_build.errors import BuildFailed, Sm121Error
from sm121_build.image.facts import cuda_h_version
from sm121_build.source.external import copy_into, projects_for, read_pin, stand_in_envs
from sm121_build.source.guards import DEFAULT_CUDA, cmake_arch_list
from sm121_build.source.patch import apply_all, apply_external, read_source_version
from sm121_build.verify.checks import SM121


def host_cuda_version(home: Path) -> str:
    """The toolkit version from `$CUDA_HOME/include/cuda.h`, else the default."""
    header = home / "include" / "cuda.h"
    found = cuda_h_version(header.read_text(errors="replace")) if header.exists() else None
    return found or DEFAULT_CUDA


def local_targets(source: Path, extra: tuple[str, ...]) -> list[str]:
    """_C / _moe_C (or the source's *_stable_libtorch names) plus --ext, as CMake targets."""
    defined = source_targets(source)
    targets = sorted(t for t in defined if DEFAULT_EXTENSIONS.match(f"{t}.abi3.so"))
    for name in extra:
        target = extension_target(name) if name.endswith(".so") else name
        if target not in defined:
            raise Sm121Error(f"{source} defines no CMake target {target} "
                             f"(it defines: {', '.join(sorted(defined)) or 'none'})")
        targets.append(target)
    if not targets:
        raise Sm121Error(f"{source} defines no _C / _moe_C target; is it a vLLM checkout?")
    return list(dict.fromkeys(targets))


def run_local(source: Path, out: Path, arch: str, extra: tuple[str, ...], jobs: int | None,
              no_patch: bool, build_args: tuple[str, ...],
              fa_source: Path | None = None) -> list[Path]:
    version = read_source_version(source)
    if version is None:
        raise Sm121Error(f"cannot read the vLLM version of {source} (no vllm/_version.py)")
    archs = cmake_arch_list(arch)
    home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    if not (home / "bin" / "nvcc").exists():
        raise Sm121Error(f"no nvcc under {home}: set CUDA_HOME to a CUDA 13 toolkit")
    targets = local_targets(source, extra)
    projects = projects_for(targets, fa_source)
    cuda = host_cuda_version(home)
    with tempfile.TemporaryDirectory(prefix="sm121-local-") as tmp:
        copy = Path(tmp) / "src"
        shutil.copytree(source, copy, ignore=shutil.ignore_patterns(".git", "build*"))
        if not no_patch:
            for result in apply_all(copy, version, archs, cuda_version=cuda):
                click.echo(f"    {result.name}: {result.outcome} ({result.detail})", err=True)
        sources: list[str] = []
        for project in projects:  # flash-attention at the commit the source pins, its rule
            tree = Path(tmp) / project.name
            got = copy_into(read_pin(copy, project), fa_source, tree)
            click.echo(f"    {project.name} {got.commit[:12]}: {got.path}", err=True)
            if not no_patch:
                handed, results = apply_external(copy, tree, project.name, version, archs,
                                                 cuda, SM121.target)
                for result in results:
                    click.echo(f"    {result.name} ({project.name}, CUDA_ARCHS {handed}): "
                               f"{result.outcome} ({result.detail})", err=True)
            sources += ["--define", f"{project.env}={tree}"]
        environ = {**os.environ, "TORCH_CUDA_ARCH_LIST": arch, "CUDA_HOME": str(home),
                   "CMAKE_CUDA_COMPILER": str(home / "bin" / "nvcc")}
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
        if build_extensions.main([*argv, *build_args], environ) != 0:
            raise BuildFailed(f"local build failed; full log: {out / 'build.log'}")
    return sorted(out.glob("*.so"))
