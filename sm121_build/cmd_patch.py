"""`sm121-build patch SRC_DIR`: apply the patch sets; `--explain` shows every guard."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from .explain import DEFAULT_CUDA, Guard, cmake_arch_list, effective_archs, evaluate
from .patch import SetResult, apply_all, read_source_version


def _guard_line(guard: Guard, after: Guard | None) -> str:
    result = ";".join(guard.result) or "(none)"
    mark = "  << plain 12.x: ptxas rejects e2m1x2" if guard.breaks_ptxas else ""
    line = (f"  {guard.file}:{guard.line:<5} {guard.variable:<28} \"{guard.arch_list}\" "
            f"-> {result}{mark}")
    if after is not None and after.result != guard.result:
        line += f", after patch -> {';'.join(after.result) or '(none)'}"
    if guard.branch:
        line += f"   [{guard.branch}]"
    return line


def _after(result: SetResult, guard: Guard) -> Guard:
    return next((g for g in result.after if (g.file, g.line) == (guard.file, guard.line)), guard)


@click.command()
@click.argument("source", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option("--arch", default="12.1", show_default=True,
              help="TORCH_CUDA_ARCH_LIST for the build, e.g. 12.1 or 12.1a.")
@click.option("--version", "vllm_version", help="vLLM version of SOURCE (read from it if unset).")
@click.option("--check", is_flag=True, help="Report only; write nothing.")
@click.option("--explain", is_flag=True,
              help="Evaluate every arch guard with the source's own CMake function.")
@click.option("--all-guards", is_flag=True, help="With --explain: also non-FP4 guards.")
@click.option("--cuda-version", default=DEFAULT_CUDA, show_default=True,
              help="CUDA toolkit the build uses: vLLM narrows the arch list per CUDA version.")
def patch(source: Path, arch: str, vllm_version: str | None, check: bool, explain: bool,
          all_guards: bool, cuda_version: str) -> None:
    """Apply the patch sets in patches/ to a vLLM checkout (atomic, idempotent)."""
    archs = cmake_arch_list(arch)
    version = vllm_version or read_source_version(source)
    if version is None:
        raise click.UsageError(f"cannot read the vLLM version of {source}; pass --version")
    results: list[SetResult] = apply_all(source, version, archs, check=check or explain,
                                         cuda_version=cuda_version)
    if explain:
        effective = effective_archs(source, archs, cuda_version)
        narrowed = f" (narrowed by vLLM's CUDA {cuda_version} list from {archs})" if (
            effective != archs) else ""
        click.echo(f"vLLM {version}, CUDA_ARCHS={effective}{narrowed}: what each guard gives "
                   "nvcc")
        for result in results:
            after = {(g.file, g.line): g for g in result.after}
            for guard in (result.before or evaluate(source, archs, cuda_version)):
                if all_guards or guard.is_fp4:
                    click.echo(_guard_line(guard, after.get((guard.file, guard.line))))
        dropped = [g for r in results for g in r.before if g.breaks_ptxas
                   and not any(a.startswith("12.") for a in _after(r, g).result)]
        if dropped:
            click.echo(f"note: after the patch, {len(dropped)} FP4/QUTLASS guard(s) give no "
                       f"SM12x target for {archs}: those kernels are left out of the build; "
                       "--arch 12.1a keeps them where the source allows it")
    for result in results:
        verb = "would apply" if (check or explain) and result.outcome == "applied" else None
        click.echo(f"{result.name}: {verb or result.outcome} ({result.detail})")
        if result.diff and not explain:
            sys.stdout.write(result.diff)
