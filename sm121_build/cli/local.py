"""`sm121-build local --source SRC --out OUT`: no Docker, the tree built on this machine."""

from __future__ import annotations

import zipfile
from pathlib import Path

import click

from sm121_build.cli.params import InputPath, arch_option, extension_option, jobs_option
from sm121_build.core.console import say, shown
from sm121_build.cuda.compat import DEFAULT_ARCH, ArchList
from sm121_build.jobs.main_run.local_build import LocalBuild, run_local
from sm121_build.source.external import require_project_tree
from sm121_build.source.git_pin import require_vllm_tree


@click.command()
@click.option("--source", required=True,
              type=InputPath(file_okay=False, exists=True, path_type=Path),
              help="The vLLM checkout to build (a copy of it is patched and built).")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Where the built .so files go.")
@arch_option(f"TORCH_CUDA_ARCH_LIST; {DEFAULT_ARCH}a keeps NVFP4 kernels where the source allows.")
@extension_option("Also build this extension (e.g. _moe_C_stable_libtorch).")
@jobs_option()
@click.option("--no-patch", is_flag=True, help="Build without the guard rules (diagnosis).")
@click.option("--fa-source", type=InputPath(file_okay=False, exists=True, path_type=Path),
              help="Existing flash-attention checkout at the commit vLLM pins (else fetched "
                   "from the GIT_REPOSITORY vLLM's CMake names).")
@click.option("--offline", is_flag=True, help="Fetch nothing at configure time.")
@click.option("--cutlass", type=InputPath(exists=True, path_type=Path),
              help="CUTLASS checkout or the nvidia-cutlass wheel.")
def local(  # noqa: PLR0913 (a click command: a parameter per option)
          source: Path, out: Path, arch: ArchList, extra_ext: tuple[str, ...], jobs: int | None,
          no_patch: bool, fa_source: Path | None, offline: bool, cutlass: Path | None) -> None:
    """Patch a copy of SOURCE and build its extensions on this machine (its torch and nvcc)
    into OUT: no Docker, no image.  The tree's CMake runs here, as you ask by choosing
    this command."""
    if cutlass and not (cutlass.is_dir() or zipfile.is_zipfile(cutlass)):
        raise click.UsageError(f"--cutlass {cutlass}: neither a CUTLASS checkout nor the "
                               "nvidia-cutlass wheel")
    require_vllm_tree(source)
    from sm121_build.core.outputs import refuse_onto_inputs

    refuse_onto_inputs(out, tuple(p for p in (source, fa_source, cutlass) if p), "--out")
    if fa_source:
        require_project_tree(fa_source, "vllm-flash-attn")
    script_args = (["--offline"] if offline else []) + (
        ["--cutlass", str(cutlass)] if cutlass else [])
    for path in run_local(LocalBuild(source, out, arch, extra_ext, jobs, no_patch,
                                     tuple(script_args), fa_source)):
        say(f"built {shown(str(path))}")
