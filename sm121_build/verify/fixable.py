"""Would rebuilding an extension help the target GPU?  The audit's last word per .so.

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
(build/judge.py): "fixable", "optional", "no sm_12x implementation", "no rule", "native".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Literal

from sm121_build.build.render import DEFAULT_EXTENSIONS, extension_target
from sm121_build.source.patch import fixable_targets
from sm121_build.verify.audit import BinaryReport
from sm121_build.verify.compat import Target

# The last two only with the source (`audit --source`, build/judge.py)
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
