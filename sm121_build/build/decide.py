"""Before compiling: would a rebuild give sm_121 anything the stock extensions lack?

vLLM's own arm64 images are built with `12.0` under CUDA 13, which sm_121 loads natively, so
a 20-90 minute compile can gain nothing.  The argument, made with the pinned source's own
CMake (`guards.evaluate`): the image's extensions were built from this very source and
CUDA toolkit, for an arch list whose 12.x part shows in their cubins (sm_120, sm_120a, ...).
If, for the main arch list and for every arch guard of the source, each target the
requested build would give that sm_121 loads natively is also what that stock arch list
gives, then every kernel the build would compile for sm_121 was compiled so in the image.

The rule is conservative: any extension missing from the image, an image without 12.x
cubins, a guard call the evaluation cannot read, or any doubt means "rebuild".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sm121_build.source.guards import effective_archs, evaluate, find_calls
from sm121_build.verify.audit import BinaryReport
from sm121_build.verify.compat import Target, loads_natively


@dataclass(frozen=True)
class Decision:
    rebuild: bool
    reason: str
    extensions: dict[str, dict[str, int]] = field(default_factory=dict)  # native / total
    stock_archs: tuple[str, ...] = ()  # the 12.x arch list the stock cubins show
    build_targets: tuple[str, ...] = ()  # what the build would give sm_121, all guards

    def as_record(self) -> dict[str, Any]:
        return {"rebuild": self.rebuild, "reason": self.reason, "extensions": self.extensions,
                "stock_archs": list(self.stock_archs), "build_targets": list(self.build_targets)}

    def lines(self) -> list[str]:
        return [f"{name}: {c['native']}/{c['total']} kernels already native on sm_121"
                for name, c in self.extensions.items()]


def stock_family_archs(reports: dict[str, BinaryReport], gpu: Target) -> tuple[str, ...]:
    """The plain arch list entries of the GPU's family the stock build used (from cubins)."""
    archs = {f"{e.arch // 10}.{e.arch % 10}" for r in reports.values() for e in r.entries
             if e.kind == "elf" and e.arch // 10 == gpu.major}
    return tuple(sorted(archs))


def decide(stock: dict[str, BinaryReport | None], source: Path, arch: str, cuda: str,
           gpu: Target) -> Decision:
    """Whether to compile: False only when it is shown that nothing would change.

    `source` is the tree as it will be built (the guard rules applied): the stock side is
    evaluated on it too, since a rule only rewrites guards that would hand ptxas a plain
    12.x target, which no stock build of the original source could have compiled."""
    counts = {name: {"native": r.kernel_counts()["native"], "total": len(r.kernels or {})}
              for name, r in stock.items() if r is not None}
    missing = [name for name, report in stock.items() if report is None]
    if missing:
        return Decision(True, f"the image has no {', '.join(missing)}", counts)
    reports = {name: r for name, r in stock.items() if r is not None}
    family = stock_family_archs(reports, gpu)
    if not family:
        return Decision(True, f"the stock extensions carry no sm_{gpu.major}x cubins", counts)
    not_native = [n for n, c in counts.items() if c["native"] == 0]
    if not_native:
        return Decision(True, f"{', '.join(not_native)}: no kernel native on {gpu}", counts,
                        family)
    calls = find_calls(source)
    stock_guards = evaluate(source, ";".join(family), cuda, calls=calls)
    build_guards = evaluate(source, arch, cuda, calls=calls)
    unread = [g.location for g in build_guards if g.result is None and g.call.may_give_sm12x]
    if unread or len(stock_guards) != len(build_guards):
        return Decision(True, "the source's arch guards cannot all be evaluated ("
                        f"{len(build_guards)} guard calls, {len(build_guards) - len(unread)} "
                        f"read){': ' + ', '.join(unread) if unread else ''}", counts, family)
    pairs = [("CUDA_ARCHS", tuple(effective_archs(source, ";".join(family), cuda).split(";")),
              tuple(effective_archs(source, arch, cuda).split(";")))]
    pairs += [(f"{b.variable} ({b.location})", s.targets, b.targets)
              for s, b in zip(stock_guards, build_guards, strict=True)]
    targets: set[str] = set()
    for name, had, would in pairs:
        gain = [t for t in would if loads_natively(t, gpu) and t not in had]
        targets |= {t for t in would if loads_natively(t, gpu)}
        if gain:
            return Decision(True, f"{name} would give {', '.join(gain)}, which the stock "
                            f"build ({';'.join(family)}) did not", counts, family,
                            tuple(sorted(targets)))
    return Decision(False, f"every target a {arch} build of this source gives {gpu} "
                    f"({', '.join(sorted(targets)) or 'none'}) is already in the stock build "
                    f"({';'.join(family)})", counts, family, tuple(sorted(targets)))
