"""`sm121-build audit TARGET`: will the kernels in it load on the target GPU?"""

from __future__ import annotations

import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import click

from sm121_build.audit import report
from sm121_build.audit.unpack import AuditedFile, Reading, binaries
from sm121_build.cli.params import (
    InputPath,
    cuda_version,
    gpu_name,
    platform_value,
    require_writable,
)
from sm121_build.core.console import notice, results_to_stderr, say, say_json
from sm121_build.core.errors import CorruptBinaryError, RequirementNotMet, Sm121Error
from sm121_build.core.interrupts import held
from sm121_build.core.outputs import append_text, refuse_onto_inputs
from sm121_build.cuda.binary import BinaryReport, Policy, audit_binary, host_only_report
from sm121_build.cuda.compat import (
    DEFAULT_ARCH,
    DEFAULT_CUDA,
    DEFAULT_DRIVER_CUDA,
    DEFAULT_GPU,
    parse_cuda_version,
    parse_target,
)

if TYPE_CHECKING:
    from sm121_build.audit.judge import SourceUnderAudit

NO_FILTER = Reading()


def run_audit(target: str, policy: Policy, with_kernels: bool,
              reading: Reading = NO_FILTER) -> tuple[list[BinaryReport], list[str]]:
    """Reports of every ELF file the target holds, and `name: why` of each one that could not
    be read: one corrupt file among many is reported, not fatal (a lone file still is)."""
    reports: list[BinaryReport] = []
    unreadable: list[str] = []
    # a file an image's stream keeps is audited at once, by one thread, while the stream
    # goes on (reading a file and the engine's next one overlap)
    ahead: dict[str, Future[BinaryReport]] = {}
    pool = ThreadPoolExecutor(1)

    def on_kept(binary: AuditedFile) -> None:
        ahead[binary.name] = pool.submit(audit_binary, binary.path, binary.name, policy,
                                         with_kernels)

    try:
        with binaries(target, reading._replace(on_kept=on_kept)) as found:
            for binary in found:
                if binary.skipped is not None:
                    unreadable.append(f"{binary.name}: {binary.skipped}")
                    continue
                if binary.host_only_size is not None:
                    reports.append(host_only_report(binary.name, binary.host_only_size,
                                                    with_kernels))
                    continue
                try:
                    read = ahead.pop(binary.name, None)
                    reports.append(read.result() if read is not None else
                                   audit_binary(binary.path, binary.name, policy, with_kernels))
                    reports[-1].package = binary.package
                    reports[-1].claimed_by = binary.claimed_by
                except CorruptBinaryError as exc:
                    if binary.path == Path(target):  # the one file asked for: its own error
                        raise
                    unreadable.append(f"{binary.name}: {exc}")
    finally:  # no thread outlives the run (interrupted while the stream went on, one may
        # have read a file whose temp folder was removed: its result is dropped)
        with held():
            pool.shutdown(wait=True, cancel_futures=True)
    return reports, unreadable


def _defaults(gpu: str | None, driver: str | None) -> tuple[str, str]:
    """The GPU and driver to judge for: as given, else this machine's (said), else sm_121
    under a CUDA 13.0 driver."""
    if gpu is not None and driver is not None:
        return gpu, driver
    from sm121_build.cuda.nvidia_smi import gpu_defaults

    found_gpu, found_driver = gpu_defaults()
    taken = [f"{what} {value}" for what, given, value in (("--target", gpu, found_gpu),
                                                           ("--driver", driver, found_driver))
             if given is None and value is not None]
    if taken:
        notice(f"judging with this machine's GPU (nvidia-smi): {', '.join(taken)}; "
               "give --target/--driver to judge for another")
    return (gpu if gpu is not None else found_gpu or DEFAULT_GPU,
            driver if driver is not None else found_driver or DEFAULT_DRIVER_CUDA)


@click.command()
@click.argument("target")
@click.option("--target", "gpu", callback=gpu_name,
              help=f"GPU to judge for: {DEFAULT_GPU}, sm_120, sm_100, sm_90... [default: this "
                   f"machine's GPU (nvidia-smi), else {DEFAULT_GPU}]")
@click.option("--driver", callback=cuda_version,
              help="CUDA driver version (limits which PTX can be JIT-compiled) [default: "
                   f"this machine's driver (nvidia-smi), else {DEFAULT_DRIVER_CUDA}]")
@click.option("--format", "fmt", type=click.Choice(["table", "cuobjdump", "json"]),
              default="table", show_default=True,
              help="cuobjdump: exactly the lines of `cuobjdump -lelf -lptx FILE`.")
@click.option("--json", "as_json", is_flag=True, help="Same as --format json.")
@click.option("--kernels", is_flag=True, help="List every kernel with its verdict.")
@click.option("--no-kernels", is_flag=True,
              help="Headers only: skip reading kernel names (fast on huge files).")
@click.option("--require", type=click.Choice(["native", "jit"]),
              help="Exit 1 when any kernel would load worse than this.")
@click.option("--include", multiple=True, metavar="GLOB",
              help="Only .so paths matching GLOB (repeatable), e.g. '*/vllm/*'.")
@click.option("--platform", callback=platform_value,
              help="Platform to read from a multi-platform OCI tarball (linux/arm64).")
@click.option("--summary-md", type=click.Path(dir_okay=False, path_type=Path),
              help="Also append a Markdown table to this file (e.g. $GITHUB_STEP_SUMMARY).")
@click.option("--source", type=InputPath(path_type=Path),
              help="The vLLM source tree the files were built from (a checkout or an "
                   "unpacked sdist): rebuild verdicts from its guards, as the main job "
                   "decides, instead of what the binaries alone show.")
@click.option("--cuda", default=DEFAULT_CUDA, show_default=True, callback=cuda_version,
              help="With --source: the CUDA toolkit a rebuild would use (guards depend on "
                   f"it: with 13.x, {DEFAULT_ARCH} narrows to 12.0).")
def audit(  # noqa: PLR0913 (a click command: a parameter per option)
          target: str, gpu: str, driver: str, fmt: str, as_json: bool, kernels: bool,
          no_kernels: bool, require: str | None, include: tuple[str, ...],
          platform: str | None, summary_md: Path | None, source: Path | None,
          cuda: str) -> None:
    """Audit a .so, directory, wheel, image tarball or local image for a GPU target."""
    fmt = "json" if as_json else fmt
    if fmt == "json":
        results_to_stderr()  # stdout holds the JSON alone (an annotation goes to stderr)
    if summary_md is not None and os.path.lexists(target):  # never onto what it audits
        refuse_onto_inputs(summary_md, tuple(p for p in (Path(target), source) if p),
                           "--summary-md")
    require_writable(summary_md, "--summary-md")  # before the audit, not after it
    gpu, driver = _defaults(gpu, driver)
    policy = Policy(parse_target(gpu), parse_cuda_version(driver))
    parse_cuda_version(cuda)
    judge: SourceUnderAudit | None = None
    if source is not None:
        from sm121_build.audit.judge import SourceUnderAudit, source_version

        judge = SourceUnderAudit(source, source_version(source, target), policy.target, cuda)
    with_kernels = (fmt != "cuobjdump" and not no_kernels) or kernels or require is not None \
        or judge is not None
    reports, unreadable = run_audit(target, policy, with_kernels,
                                    Reading(include, platform, sys.stderr.isatty()))
    for line in unreadable:
        notice(f"unreadable: {line}")
    if include and not reports:  # a mistyped glob reads as "nothing to fix": said
        notice(f"--include {' '.join(include)}: no ELF file in {target} matches")
    verdicts: report.Verdicts | None = None
    if judge is not None:
        from sm121_build.audit.judge import source_verdicts

        verdicts = source_verdicts(reports, judge)
        notice(f"rebuild verdicts from the guards of vLLM {judge.version} at {judge.tree} "
               f"({judge.arch}, CUDA {cuda}, the rules applied)")
    if fmt == "cuobjdump":
        text = report.cuobjdump(reports)
        if text:
            say(text)
    elif fmt == "json":
        data = report.as_json(reports, policy, verdicts)
        if judge is not None:
            data["source"] = {"path": str(judge.tree), "version": judge.version,
                              "arch": str(judge.arch), "cuda": cuda}
        say_json(data)
    else:
        say(report.table(reports, policy, show_kernels=kernels, verdicts=verdicts))
    if summary_md:
        append_text(summary_md, report.markdown(target, reports, policy, verdicts))
    if unreadable:
        raise Sm121Error(f"{len(unreadable)} of {len(reports) + len(unreadable)} file(s) or "
                         f"folder(s) in {target} could not be audited (listed above)")
    if require and not reports:
        raise RequirementNotMet(
            f"--require {require}: no ELF file found in {target}"
            f"{' matching ' + ', '.join(include) if include else ''}: nothing was checked")
    if require:
        floor = {"native": ("native",), "jit": ("native", "jit")}[require]
        bad = sum(1 for r in reports for v in (r.kernels or {}).values() if v not in floor)
        if bad:
            raise RequirementNotMet(
                f"{bad} kernel(s) would not load as {require} on {policy.target}")
