"""`sm121-build patch SRC_DIR`: rewrite guards by rule; `--explain` shows every guard call."""

from __future__ import annotations

from pathlib import Path

import click

from sm121_build.cli.params import InputPath, arch_option
from sm121_build.core.console import say, shown
from sm121_build.cuda.compat import (
    DEFAULT_ARCH,
    DEFAULT_CUDA,
    DEFAULT_TARGET,
    ArchList,
    loads_natively,
)
from sm121_build.source.external import tree_project
from sm121_build.source.git_pin import require_vllm_tree
from sm121_build.source.guard_rules import (
    PatchFor,
    RuleResult,
    apply_all,
    apply_macros,
    breaks_ptxas,
    covered,
    read_source_version,
    rules_for,
)
from sm121_build.source.guards import Guard, effective_archs


def _targets(guard: Guard) -> str:
    if guard.result is None:
        return f"cannot evaluate: {guard.call.unresolved}"
    if not guard.taken:
        return "(branch not taken)"
    return ";".join(guard.targets) or "(none)"


def _guard_line(guard: Guard, result: RuleResult) -> str:
    mark = "  << plain 12.x: ptxas rejects e2m1x2" if breaks_ptxas(guard) else ""
    unloadable = [a for a in guard.targets if a.startswith("12.") and a not in guard.plain_sm12x
                  and not loads_natively(a, DEFAULT_TARGET)]
    if unloadable and covered(guard):
        mark += f"  << {', '.join(unloadable)}: {DEFAULT_TARGET} cannot load it"
    line = (f"  {guard.location:<42} {guard.variable:<28} \"{guard.arch_list}\" "
            f"-> {_targets(guard)}{mark}")
    rewrite = next((r for r in result.rewrites if r.guard.location == guard.location), None)
    if rewrite is not None:
        verb = "rewritten" if result.action == "rewrite" else "target added"
        line += f", {verb} \"{rewrite.new_list}\" -> {';'.join(rewrite.result) or '(none)'}"
    if guard.branch:
        line += f"   [{guard.branch}]"
    return shown(line)  # the tree's own text (arch lists, names) on one line, escaped


@click.command()
@click.argument("source", type=InputPath(file_okay=False, exists=True, path_type=Path))
@arch_option(f"TORCH_CUDA_ARCH_LIST for the build, e.g. {DEFAULT_ARCH} or {DEFAULT_ARCH}a.")
@click.option("--version", "vllm_version", help="vLLM version of SOURCE (read from it if unset).")
@click.option("--check", is_flag=True, help="Report only; write nothing.")
@click.option("--explain", is_flag=True,
              help="Evaluate every arch guard with the source's own CMake function.")
@click.option("--all-guards", is_flag=True, help="With --explain: also guards no rule covers.")
@click.option("--cuda-version", default=DEFAULT_CUDA, show_default=True,
              help="CUDA toolkit the build uses: vLLM narrows the arch list per CUDA version.")
def patch(  # noqa: PLR0913 (a click command: a parameter per option)
          source: Path, arch: ArchList, vllm_version: str | None, check: bool, explain: bool,
          all_guards: bool, cuda_version: str) -> None:
    """Rewrite a vLLM checkout's arch guards by the rules in patches/ (atomic, idempotent)."""
    project = tree_project(source)
    if project is None:
        require_vllm_tree(source)
    version = vllm_version or (read_source_version(source) if project is None else "0")
    if version is None:
        raise click.UsageError(f"cannot read the vLLM version of {source}; pass --version")
    name = project.name if project else "vllm"
    want = PatchFor(version, arch, cuda_version, DEFAULT_TARGET)
    results: list[RuleResult] = apply_all(source, want, check=check or explain, project=name)
    if explain:
        effective = effective_archs(source, arch, cuda_version)
        what = f"vLLM {version}" if project is None else f"{name} (as vLLM builds it)"
        whose = "vLLM's" if project is None else "its"
        narrowed = f" (narrowed by {whose} CUDA {cuda_version} list from {arch.cmake})" if (
            effective.cmake != arch.cmake) else ""
        say(f"{what}, CUDA_ARCHS={effective}{narrowed}: what each guard gives nvcc")
        listed: set[str] = set()
        for result in results:
            for guard in result.before:
                if (all_guards or covered(guard, name)) and guard.location not in listed:
                    listed.add(guard.location)
                    say(_guard_line(guard, result))
        no_native = [g for rule in rules_for(name) if rule.action == "add"
                     for r in results if r.name == rule.name
                     for g in r.before if rule.covers(g) and rule.needs(g, DEFAULT_TARGET)]
        if no_native and project is not None:
            say(f"note: {len(no_native)} guard(s) give {DEFAULT_TARGET} no native code "
                       "(PTX at best: JIT at first use); the rule adds a target")
        dropped = [r.guard for result in results for r in result.rewrites
                   if not any(a.startswith("12.") for a in r.result)]
        if dropped:
            say(f"note: after the rewrite, {len(dropped)} guard(s) give no SM12x target "
                       f"for {arch.cmake}: those kernels are left out of the build")
    for result in results:
        verb = "would apply" if (check or explain) and result.outcome == "applied" else None
        say(f"{shown(result.name)}: {verb or result.outcome} ({shown(result.detail)})")
        if result.diff and not explain:
            say(result.diff, nl=False)
    handed = effective_archs(source, arch, cuda_version)
    for macro in apply_macros(source, name, handed, DEFAULT_TARGET, check=check or explain):
        verb = "would apply" if (check or explain) and macro.outcome == "applied" else None
        say(f"{shown(macro.name)}: {verb or macro.outcome} ({shown(macro.detail)})")
        if macro.diff and not explain:
            say(macro.diff, nl=False)
