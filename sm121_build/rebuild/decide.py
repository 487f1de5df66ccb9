"""Before compiling: would a rebuild give sm_121 anything the stock extensions lack, and
what aot of the stock files leaves that only a rebuild could change?

vLLM's own arm64 images are built with `12.0` under CUDA 13, which sm_121 loads natively, so
a 20-90 minute compile can gain nothing.  Per extension (`judge_extensions`), with the
pinned source's own CMake (`guards.evaluate`): the targets each guard that feeds the
extension would give sm_121 against what its stock cubins already load natively; an
extension is built only when that gains native kernels, and any doubt (a guard the
evaluation cannot read, a target the source does not define) is said.  Against aot
(`aot_does_as_well`, `left_by_aot`): a build is not worth it where aot of the stock file
makes as many kernels native.

From a binary alone (the audit's last word per .so, `rebuild_verdict`):

- "native": every kernel already loads natively; nothing to gain.
- "fixable": kernels only JIT-compile (or do not load) and sm121-build can rebuild the
  extension natively: a target a rule extends (`targets:` of a rule in patches/, e.g.
  `_vllm_fa2_C`), or vLLM's own `_C`/`_moe_C` with no native kernel at all (the main job).
- "partly native": `_C`/`_moe_C` with some kernels native; the rest are left out of sm_12x
  by vLLM's own guards (Marlin, Machete, sm_90/sm_100 GEMMs), and the main job decides with
  the source's guards whether a rebuild gains anything.
- "other GPUs only": every cubin and PTX is arch- or family-specific to another GPU
  (`sm_90a`, `sm_100f`: wgmma, tcgen05, ...).  That is what the binary shows; whether the
  source has an sm_12x path (0.33.0's `_qutlass_C` ships sm_100f only, yet its CMake builds
  sm_120f for a 12.x-only list) needs the source: the main job decides with the pinned
  source's guards, and says "no sm_12x implementation" only when no guard gives one.
- "no rule": code sm_12x cannot run natively, and no rule here to rebuild it.

With `audit --source DIR` the main job's decide step gives the verdict instead
(audit/judge.py): "fixable", "optional", "no sm_12x implementation", "no rule", "native".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from sm121_build.core.vllm import DEFAULT_EXTENSIONS, extension_target
from sm121_build.cuda.binary import BinaryReport
from sm121_build.cuda.compat import ArchList, Target, entry_verdict, loads_natively
from sm121_build.source.cmake_lang import read_source
from sm121_build.source.external import source_targets
from sm121_build.source.guard_rules import fixable_targets, load_macro_rules
from sm121_build.source.guard_targets import defined_targets, feeds, guard_owners
from sm121_build.source.guards import Call, Guard, effective_archs, evaluate, find_calls

NEWEST_DRIVER = (99, 9)  # "could any driver JIT it": only the code's kind and arch matter


# --- per extension: what the default run builds -------------------------------------------

# A rebuild whose only gain is a handful of JIT-only kernels (0.33.0's _moe_C: 1 of 2,456,
# marlin_moe_wna16::MarlinDefault) costs a full compile of the extension (10-20 min on 16
# cores) for code the driver JIT-compiles only if it is ever launched: below this share of
# the extension's kernels it is offered (`--ext NAME`), not built by default.
MIN_JIT_SHARE = 0.01

# Why an extension is built or kept: "build"; "native" (nothing to gain); "unbuildable" (the
# source defines no such target, or no rule builds its project); "below share" (only a few
# JIT-only kernels: offered with --ext); "no gain" (no guard gives it code the GPU loads)
PlanOutcome = Literal["build", "native", "unbuildable", "below share", "no gain"]


@dataclass(frozen=True)
class ExtensionVerdict:
    """One stock extension: its kernels before, the build's expected result, and why."""

    name: str  # the file, relative to the vLLM package
    target: str
    before: dict[str, int]  # native / jit / none kernels of the stock file
    after: dict[str, int]  # expected after the build (the stock counts when not built)
    build: bool
    reason: str  # why it is built, or why not
    remains: tuple[str, ...] = ()  # why what stays non-native stays so
    outcome: PlanOutcome = "build"
    foreign: tuple[str, ...] = ()  # the other GPUs' archs of what loads nothing (sm_90a...)

    def as_record(self) -> dict[str, Any]:
        return {"name": self.name, "target": self.target, "before": self.before,
                "after": self.after, "build": self.build, "reason": self.reason,
                "remains": list(self.remains)}

    def line(self) -> str:
        b, a = self.before, self.after
        counts = (f"native {b['native']}→{a['native']}, JIT {b['jit']}→{a['jit']}, "
                  f"none {b['none']}→{a['none']} of {sum(b.values())}")
        return f"{self.name}: {'build' if self.build else 'keep'} ({counts}): {self.reason}"


@dataclass(frozen=True)
class Inputs:
    """What the per-extension decision reads besides the stock files."""

    source: Path  # the vLLM tree as it will be built (its rules applied)
    arch: ArchList  # the requested list (CMake reads its `cmake` form)
    cuda: str
    gpu: Target
    defined: frozenset[str]  # the targets the source can build
    same_ptx: frozenset[str]  # projects whose trees get SASS from the same PTX
    rebuildable: frozenset[str]  # external-project targets a rule builds (fixable_targets)


def decide_inputs(source: Path, arch: ArchList, cuda: str, gpu: Target) -> Inputs:
    """The inputs for a tree as it will be built for the arch list `arch`."""
    same_ptx = frozenset(p for rule in load_macro_rules() for p in rule.projects)
    return Inputs(source, arch, cuda, gpu, frozenset(source_targets(source)), same_ptx,
                  frozenset(fixable_targets()))


def _stock_has(report: BinaryReport, target: str) -> bool:
    """Whether the stock file has cubins of a guard target (`12.0f` -> sm_120f)."""
    wanted = "sm_" + target.replace(".", "").replace("+PTX", "")
    return any(e.kind == "elf" and e.sm == wanted for e in report.entries)


def _foreign(report: BinaryReport, gpu: Target) -> list[str]:
    """The archs of the translation units nothing of which loads on the GPU, when each is
    arch- or family-specific code of another major (wgmma, tcgen05, ...)."""
    by_container: dict[int, list[Any]] = {}
    for entry in report.entries:
        by_container.setdefault(entry.container, []).append(entry)
    unloadable = [es for es in by_container.values() if all(
        entry_verdict(e, gpu, NEWEST_DRIVER) == "none"
        for e in es)]
    entries = [e for es in unloadable for e in es]
    if entries and all(e.variant and e.arch // 10 != gpu.major for e in entries):
        return sorted({e.sm for e in entries}, key=lambda sm: (len(sm), sm))
    return []


def judge_extensions(stock: dict[str, BinaryReport | None], inputs: Inputs,
                    project_of: dict[str, str]) -> list[ExtensionVerdict]:
    """Per stock extension with device code: build it when the build gives the GPU native
    code the stock file lacks.  `project_of`: target -> the tree that builds it ("vllm" or
    an external project's name).

    Gains: JIT-only kernels (PTX only) in a tree the sass-from-ptx rule applies to (SASS
    from the same PTX); a guard feeding the extension (or, for a target CMakeLists.txt
    defines, vLLM's narrowed arch list itself) that gives a target the GPU loads for which
    the stock file has no cubins; a guard feeding it that cannot be read (rebuilt to be
    safe).  A guard counts only for the extensions it feeds (`owners.guard_owners`)."""
    reports = {n: r for n, r in stock.items() if r is not None and r.has_device_code}
    calls = find_calls(inputs.source)
    owners = guard_owners(inputs.source, calls)
    build_guards = evaluate(inputs.source, inputs.arch, inputs.cuda, calls=calls)
    # the targets CMakeLists.txt defines compile their unguarded sources for CUDA_ARCHS
    # itself: vLLM's narrowing of the requested list, a guard of its own
    main = Guard(Call("CMakeLists.txt", 0, "(narrowing)", "CUDA_ARCHS", None, None, (), "",
                      (), "", True),
                 effective_archs(inputs.source, inputs.arch, inputs.cuda).cmake_items)
    top = {name for _, name in defined_targets(read_source(inputs.source / "CMakeLists.txt"))} \
        if (inputs.source / "CMakeLists.txt").is_file() else set()
    verdicts = []
    for name, report in reports.items():
        target = extension_target(name)
        mine = [g for g in build_guards if feeds(owners, g.location, target)]
        if target in top:
            mine.insert(0, main)
        verdicts.append(_judge_one(name, report, mine, inputs, project_of.get(target, "vllm")))
    return verdicts


def _judge_one(name: str, report: BinaryReport, guards: list[Guard], inputs: Inputs,
              project: str) -> ExtensionVerdict:
    target = extension_target(name)
    counted = report.kernel_counts() if report.kernels is not None else report.containers
    before: dict[str, int] = {k: counted.get(k, 0) for k in ("native", "jit", "none")}
    gpu = inputs.gpu
    if not before["jit"] and not before["none"]:
        return ExtensionVerdict(name, target, before, before, False,
                             f"every kernel is already native on {gpu}", outcome="native")
    foreign = _foreign(report, gpu)
    buildable = target in inputs.defined and (project == "vllm"
                                              or target in inputs.rebuildable)
    if not buildable:
        why = (f"the pinned source defines no {target}" if target not in inputs.defined else
               f"no rule here builds {target} ({project}) for {gpu}")
        return ExtensionVerdict(name, target, before, before, False, why,
                             _remains(before, foreign, gpu, jit_stays=True), "unbuildable",
                             tuple(foreign))
    gains: list[str] = []
    after = dict(before)
    if before["jit"] and project in inputs.same_ptx:
        gains.append(f"{before['jit']} JIT-only kernel(s) get sm_{gpu.major}x SASS from "
                     "the same PTX (rule sass-from-ptx)")
        after = {"native": before["native"] + before["jit"], "jit": 0, "none": before["none"]}
    new_targets: list[str] = []
    for built in guards:
        if built.result is None and built.call.may_give_sm12x:
            gains.append(f"the guard {built.variable} ({built.location}) cannot be read "
                         f"({built.call.unresolved}): rebuilt to be safe")
            continue
        for t in built.targets:
            if loads_natively(t, gpu) and not _stock_has(report, t):
                where = "the main arch list (CUDA_ARCHS)" if built.line == 0 else \
                    f"{built.variable} ({built.location})"
                new_targets.append(f"{where} gives {t}")
    if new_targets:
        gains.append(f"{'; '.join(dict.fromkeys(new_targets))}, which the stock file has no "
                     "cubins for")
        if not before["native"]:
            after = {"native": sum(before.values()), "jit": 0, "none": 0}
    total = sum(before.values())
    if gains and not new_targets and len(gains) == 1 and before["jit"] \
            and project in inputs.same_ptx and before["jit"] < MIN_JIT_SHARE * total:
        named = [k for k, v in (report.kernels or {}).items() if v == "jit"][:3]
        return ExtensionVerdict(
            name, target, before, before, False,
            f"only {before['jit']} of {total} kernels are JIT-only"
            f"{' (' + ', '.join(named) + ')' if named else ''}, under "
            f"{MIN_JIT_SHARE:.0%}: not worth a full compile by default; --ext {target} "
            "builds it", _remains(before, foreign, gpu, jit_stays=True), "below share",
            tuple(foreign))
    if not gains:
        why = ("no guard of the pinned source gives it code that loads on " f"{gpu}")
        return ExtensionVerdict(name, target, before, before, False, why,
                             _remains(before, foreign, gpu, jit_stays=True), "no gain",
                             tuple(foreign))
    return ExtensionVerdict(name, target, before, after, True, "; ".join(gains),
                         _remains(after, foreign, gpu, jit_stays=False), "build",
                         tuple(foreign))


def _remains(counts: dict[str, int], foreign: list[str], gpu: Target,
             jit_stays: bool) -> tuple[str, ...]:
    out = []
    if counts["jit"] and jit_stays:
        out.append(f"{counts['jit']} kernel(s) stay JIT-only (PTX compiled by the driver at "
                   "first use)")
    if counts["none"]:
        out.append(f"{counts['none']} kernel(s) have no code {gpu} loads: " + (
            f"only {', '.join(foreign)} (arch/family-specific instructions of other GPUs: "
            "no sm_12x implementation)" if foreign else
            "no guard of the source builds them for it"))
    return tuple(out)


# The last two only with the source (`audit --source`, audit/judge.py)
RebuildVerdict = Literal["native", "fixable", "partly native", "other GPUs only", "no rule",
                         "optional", "no sm_12x implementation"]


@dataclass(frozen=True)
class Rebuild:
    verdict: RebuildVerdict
    reason: str


def rebuild_verdict(report: BinaryReport, gpu: Target) -> Rebuild | None:
    """None for a file without device code."""
    if not report.has_device_code:
        return None
    counts = report.kernel_counts() if report.kernels is not None else report.containers
    lacking = counts["jit"] + counts["none"]
    if not lacking:
        return Rebuild("native", f"every kernel is native on {gpu}")
    what = "kernels" if report.kernels is not None else "fatbins"
    short = f"{lacking} of {sum(counts.values())} {what} not native on {gpu}"
    target = extension_target(report.name)
    rule = fixable_targets().get(target)
    if rule is not None:
        return Rebuild("fixable", f"{short}; rule {rule} builds {target} natively "
                       "(sm121-build --base IMAGE)")
    if DEFAULT_EXTENSIONS.match(PurePosixPath(report.name).name):
        if counts["native"]:
            return Rebuild("partly native", f"{short}; whether a rebuild gains anything the "
                           "binary cannot tell: `audit --source DIR` or sm121-build --base "
                           "IMAGE decides with the source's guards")
        return Rebuild("fixable", f"{short}; the main job rebuilds {target} "
                       "(sm121-build --base IMAGE)")
    # arch- or family-specific code of another major: only that GPU's instructions
    foreign = [e for e in report.entries if e.variant and e.arch // 10 != gpu.major]
    if foreign and len(foreign) == len(report.entries):
        only = ", ".join(sorted({e.sm for e in foreign}))
        decides = ": `audit --source DIR` or sm121-build --base IMAGE decides with the " \
            "source's guards" if "vllm" in PurePosixPath(report.name).parts else ""
        return Rebuild("other GPUs only",
                       f"{short}; its code is only for {only} (arch/family-specific "
                       "instructions of other GPUs); whether its source can build sm_12x code "
                       f"the binary cannot tell{decides}")
    return Rebuild("no rule", f"{short}; no rule here rebuilds {target}")


# --- against aot: what a source build adds to what aot of the stock files makes native ------

def stock_counts(stock: Mapping[str, BinaryReport | None], name: str) -> dict[str, int]:
    """A stock extension's kernels by verdict (native / jit / none; zeros when unread)."""
    report = stock.get(name)
    if report is None or report.kernels is None:
        return {"native": 0, "jit": 0, "none": 0}
    return {str(verdict): n for verdict, n in report.kernel_counts().items()}


def aot_does_as_well(verdict: ExtensionVerdict, aot_native: Mapping[str, int]) -> bool:
    """A source build of this extension makes no more kernels native than aot of its stock
    file (`aot_native`: per file aot takes, the kernels it makes native): aot it, no
    compile of the source."""
    return verdict.name in aot_native and \
        verdict.after["native"] <= verdict.before["native"] + aot_native[verdict.name]


def left_by_aot(aot_native: Mapping[str, int],
                stock: Mapping[str, BinaryReport | None]) -> dict[str, tuple[int, int]]:
    """Per stock extension with any, its kernels that stay non-native after aot: (still
    JIT-only, loading nothing); aot makes JIT-only kernels native and no others."""
    left = {}
    for name, report in stock.items():
        if report is None or report.kernels is None:
            continue
        counts = stock_counts(stock, name)
        jit, none = max(counts["jit"] - aot_native.get(name, 0), 0), counts["none"]
        if jit or none:
            left[name] = (jit, none)
    return left
