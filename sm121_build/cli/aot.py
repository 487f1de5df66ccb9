"""`sm121-build aot PATH…`: native SASS for the PTX a .so, folder or wheel already ships."""

from __future__ import annotations

import os
from pathlib import Path

import click
from click.core import ParameterSource

from sm121_build.cli.params import Count, InputPath, gpu_name, seconds_value
from sm121_build.core.console import notice
from sm121_build.core.errors import Sm121Error
from sm121_build.cuda.compat import DEFAULT_GPU, parse_target
from sm121_build.cuda.ptxas import find_toolchain

DEFAULT_TIMEOUT = "3600"  # per module: FA2's largest takes ~2 minutes on one core
# the options of files alone: an image's aot is the main job's (its ptxas, cache and limits)
FILE_OPTIONS = ("cuda_home", "jobs", "split", "timeout", "no_cache")


def _target(given: str | None) -> str:
    if given is not None:
        return given
    from sm121_build.cuda.nvidia_smi import gpu_defaults

    found, _driver = gpu_defaults()
    if found is not None:
        notice(f"compiling for this machine's GPU (nvidia-smi): {found}; give --target for "
               "another")
    return found or DEFAULT_GPU


def _check_inputs(paths: tuple[str, ...]) -> tuple[Path, ...]:
    """Each input a regular file or a folder (links followed), checked before any work: a
    FIFO, socket or device is refused at once, never opened for reading."""
    from sm121_build.core.inputs import kind_of

    for path in paths:
        kind = kind_of(path)
        if kind == "missing":
            raise Sm121Error(f"{path} does not exist (an image goes alone: one image, or "
                             ".so files, folders and wheels)")
        if kind == "other":
            raise Sm121Error(f"{path}: not a regular file or a folder (a FIFO, socket or "
                             "device); aot reads .so files, folders and wheels")
    return tuple(Path(p) for p in paths)


@click.command()
@click.argument("paths", nargs=-1, required=True)
@click.option("--out", type=click.Path(path_type=Path),
              help="Folder for the results: each rewritten .so at its path relative to what "
                   "was given; a wheel as a repaired wheel of the same name (for an image: "
                   "the verified files and their manifest, optional).")
@click.option("--tag", help="For an image: the result's tag (default: the base tag with "
                            "the GPU's suffix: -sm121, -sm120, ...).")
@click.option("--replace-tag", is_flag=True,
              help="For an image: move --tag off an image this tool did not give it (the "
                   "image itself stays).")
@click.option("--target", "--gpu", "gpu", callback=gpu_name,
              help=f"GPU to compile for: {DEFAULT_GPU}, sm_120, sm_90... [default: for files, this "
                   f"machine's GPU (nvidia-smi), else {DEFAULT_GPU}; for an image, {DEFAULT_GPU} "
                   "(the DGX Spark)]")
@click.option("--cuda-home", type=InputPath(exists=True, file_okay=False, path_type=Path),
              help="Where ptxas and fatbinary are (DIR/bin) [default: $CUDA_HOME, PATH, "
                   "PyPI's nvidia-cuda-nvcc, /usr/local/cuda]")
@click.option("-j", "--jobs", type=Count(1, 1024),
              default=lambda: len(os.sched_getaffinity(0)),
              help="Cores ptxas may use (processes, and --split-compile threads) "
                   "[default: every core]")
@click.option("--split/--no-split", default=True, show_default=True,
              help="Give a module that would otherwise set the wall clock ptxas's "
                   "--split-compile threads when cores would idle (the same code; more "
                   "memory, bounded by the machine's).")
@click.option("--timeout", default=DEFAULT_TIMEOUT, callback=seconds_value, metavar="SECONDS",
              show_default=True, help="Seconds one ptxas run may take (at most 86400).")
@click.option("--no-cache", is_flag=True, help="Compile every module, and keep none: by "
              "default a module this ptxas compiled before for the GPU is taken from "
              "$XDG_CACHE_HOME/sm121-build/aot.")
@click.option("--all-packages", is_flag=True,
              help="With an image: every aot-able file of the image, not only vLLM's "
                   "extensions (NVIDIA's libraries among them, under NVIDIA's licence terms; "
                   "what aot changes in a file: docs/guide/aot.md).")
def aot(  # noqa: PLR0913 (a click command: a parameter per option)
        paths: tuple[str, ...], out: Path | None, tag: str | None, replace_tag: bool,
        gpu: str | None, cuda_home: Path | None, jobs: int, split: bool, timeout: float,
        no_cache: bool, all_packages: bool) -> None:
    """Compile the PTX of JIT-only kernels for the GPU ahead of time, into the same file.

    For each fatbin with no cubin the GPU loads but PTX it can JIT, ptxas compiles that PTX
    (as the driver would at first start) and the cubin is added beside the stock code; host
    code, symbols, stock cubins and PTX stay byte for byte.  Each file is verified before it
    is written; one that cannot be rewritten is one error line and is not written.

    PATHS are .so files, folders and wheels; or one image in the local engine, whose
    extensions are aot'd and injected into an untouched copy tagged like the main job's
    (the main job's aot actions, with no source).
    """
    from sm121_build.image.refs import looks_like_image_ref, names_a_file
    from sm121_build.jobs.aot_work.aot_files import AotRequest, run_aot, say_results

    if len(paths) == 1 and not os.path.lexists(paths[0]) and not names_a_file(paths[0]) \
            and looks_like_image_ref(paths[0]):  # (a mistyped path: said not to exist below)
        _refuse_file_options(click.get_current_context())
        _aot_image(paths[0], out, (tag, replace_tag), gpu, all_packages)
        return
    if all_packages:
        raise click.UsageError("--all-packages takes the files of an image: give one image "
                               "(files, folders and wheels are aot'd whole already)")
    files = _check_inputs(paths)
    if out is None:
        raise click.UsageError("--out is required for files, folders and wheels")
    if tag is not None or replace_tag:
        raise click.UsageError("--tag and --replace-tag name the result of an image: no image "
                               "was given")
    target = parse_target(_target(gpu))
    from sm121_build.core.outputs import Results

    Results(out, files)  # --out checked against the inputs before any work
    toolchain = find_toolchain(cuda_home)
    from sm121_build.core.paths import cache_dir

    cache = None if no_cache else cache_dir() / "aot"
    outcome = run_aot(AotRequest(files, out, target, toolchain, jobs, timeout, cache,
                                 split=split))
    say_results(outcome)
    if outcome.failed:
        raise SystemExit(Sm121Error.exit_code)
    if not outcome.files:
        notice(f"nothing to compile: every fatbin aot can reach in {', '.join(paths)} loads "
               f"natively on {target} or has no PTX it can JIT")


def _refuse_file_options(ctx: click.Context) -> None:
    """An image's aot is the main job's, which takes none of the options of files: one
    given is refused, never ignored (`--cuda-home` named a ptxas the run did not use)."""
    given = [max(param.secondary_opts if param.name == "split" and not ctx.params["split"]
                 else param.opts, key=len) for param in ctx.command.params
             if param.name in FILE_OPTIONS and ctx.get_parameter_source(param.name or "")
             not in (None, ParameterSource.DEFAULT)]
    if given:
        raise click.UsageError(f"{', '.join(given)}: for files, folders and wheels; an "
                               "image's aot is the main job's (this machine's newest "
                               "ptxas, the aot cache, every core)")


def _aot_image(base: str, out: Path | None, tagging: tuple[str | None, bool],
               gpu: str | None, all_packages: bool) -> None:
    """An image: the main job with its aot actions alone (no source), for the GPU given
    (sm_121 by default, as the main job)."""
    from sm121_build.cli.params import gpu_value, require_outputs
    from sm121_build.image.refs import (
        default_tag,
        require_not_base,
        validate_image_ref,
        validate_tag,
    )
    from sm121_build.jobs.main_run.main_plan import Options
    from sm121_build.jobs.main_run.run import RunRequest, run_main

    validate_image_ref(base)
    tag, replace_tag = tagging
    policy = gpu_value(None, None, DEFAULT_GPU if gpu is None else gpu)
    result_tag = validate_tag(tag) if tag else default_tag(base, policy.suffix)
    require_not_base(result_tag, base)
    require_outputs(out, None, None)
    # the main job's path (run_main), its aot actions alone: no kernels image around it
    run_main(RunRequest(Options(base=base, tag=result_tag, arch=policy.arch_list, out=out,
                                aot_only=True, replace_tag=replace_tag,
                                all_packages=all_packages, gpu=policy)))
