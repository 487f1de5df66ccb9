"""The cases `prove` gives a harness that derives them (FA2's), and how they are shared out.

From a file's added kernels (by name) and the GPU the loader described (`GpuSizes`), the
cases that launch each kernel some call of the ops can launch (`payload/fa2_kernels.derive`,
run here, in this process: the children are only given the cases).  They are dealt to at
most `jobs` parts by module: each case goes with the added cubin of the first kernel it is
expected to launch, and a cubin's cases stay in one part, so that the stock side's driver
JIT-compiles each module in about one process, not in all.  The modules are dealt by their
cubins' size, the largest first, each to the part with the fewest bytes so far (what the
driver's JIT spends on a module grows with the code it makes).  A harness's fixed cases
that launch added kernels (FA2's) are dealt with their modules too, each to the part of the
module of its first kernel (`--fixed I,J`): run together in the first part, they made it the
long pole (FA2's stock side on a lent H200: 317 s, ~290 s of it the JIT of its 8 fixed
cases, against at most 167 s for each of the other 15 parts; dealt, every part ended by
201 s); a harness whose fixed cases launch none
(Marlin's) runs them in the first part.  Each part's cases are a file (`--cases`), written
where no child writes.

The kernels the dispatch never selects on this GPU (`Derived.dead`: a block another GPU's
shared memory picks, a combination the launch template never instantiates) are returned
with the rule as their evidence: no call of the file's ops can launch them.  The shared
memory that decides it is the GPU table's for the compute capability (`data/gpus.yaml`),
not what a child said (a loader that lies could otherwise make reachable kernels
"unreachable"); a GPU the table gives none for gets its cases from what the loader said,
and no kernel is called unreachable by the dispatch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sm121_build.cuda.compat import Target
from sm121_build.jobs.payload import fa2_kernels, marlin_kernels
from sm121_build.jobs.proofs.prove_child import Device

MODEL = "vllm-flash-attention 7d346be6"  # the dispatch fa2_kernels models
MARLIN_MODEL = "vLLM 0.22.0 marlin.cu"  # the dispatch marlin_kernels models


@dataclass(frozen=True)
class Part:
    """One process's share of a harness's cases: its `--cases` file (None: the harness's
    fixed cases alone), whether it runs fixed cases, how many derived cases, and which fixed
    cases (`only`: their positions; None: all of them)."""

    cases: Path | None
    fixed: bool
    derived: int = 0
    only: tuple[int, ...] | None = None

    def options(self, at: str | None) -> tuple[str, ...]:
        """The harness's options for this part, `at` being the cases file as the child
        sees it."""
        if self.cases is None or at is None:
            return ()
        if not self.fixed:
            return ("--cases", at, "--derived-only")
        if self.only is None:
            return ("--cases", at)
        return ("--cases", at, "--fixed", ",".join(map(str, self.only)))


@dataclass(frozen=True)
class DealtCases:
    """The parts a file's runs are split into, and the added kernels no op can launch on
    this GPU, each with the evidence; `said`: a line for the user where the cases are less
    than a derivation (the GPU's sizes were not said)."""

    parts: tuple[Part, ...]
    dead: Mapping[str, str] = field(default_factory=dict)
    said: str | None = None

    @property
    def derived(self) -> int:
        return sum(part.derived for part in self.parts)

    @property
    def derives(self) -> bool:
        """Whether the runs are given derived cases (`--cases`), not the fixed ones alone."""
        return self.parts[0].cases is not None


FIXED_ONLY = DealtCases((Part(None, True),))


@dataclass(frozen=True)
class Modules:
    """The file's added cubins this GPU loads: each kernel's cubin number (`of`), and each
    cubin's size in bytes (`size`)."""

    of: Mapping[str, int]
    size: Mapping[int, int] = field(default_factory=dict)


def _dealt(groups: Mapping[int, list[Any]], size: Mapping[int, int], jobs: int
           ) -> list[list[Any]]:
    """Whole groups (a module's cases) to at most `jobs` parts: the largest module first,
    each to the part with the fewest bytes so far (then the fewest cases)."""
    parts: list[list[Any]] = [[] for _ in range(max(1, min(jobs, len(groups))))]
    load = [0] * len(parts)
    for number, cases in sorted(groups.items(),
                                key=lambda g: (-size.get(g[0], 0), -len(g[1]), g[0])):
        at = min(range(len(parts)), key=lambda i: (load[i], len(parts[i]), i))
        parts[at].extend(cases)
        load[at] += size.get(number, 0)
    return parts


@dataclass(frozen=True)
class _Fixed:
    """A harness's fixed case among the dealt ones: its position (`--fixed`)."""

    at: int


@dataclass(frozen=True)
class Derivation:
    """A family's derived cases for a file (each with `key`, written by `asdict`), the
    added kernels each case is expected to launch (case name -> names, the harness's fixed
    cases' too), the added kernels the family's dispatch never selects on this GPU, each
    with the rule, and the names of the harness's fixed cases that are dealt with the rest,
    in the harness's order (`fixed`: their positions are `--fixed`'s; none: the first part
    runs the harness's fixed cases)."""

    cases: Sequence[Any]
    expects: Mapping[str, list[str]]
    dead: Mapping[str, str]
    fixed: tuple[str, ...] = ()


def _fa2(names: list[str], device: Device, smem: tuple[int, int]) -> Derivation:
    """FA2's cases (after the harness's fixed ones, which are kept ahead and not given)."""
    assert device.sizes is not None
    gpu = fa2_kernels.Gpu(device.major, device.minor, smem[0], smem[1], device.sizes.sms)
    fixed = fa2_kernels.fixed_cases()
    derived = fa2_kernels.derive(names, gpu, first=fixed)
    return Derivation(derived.cases[len(fixed):], derived.expects, derived.dead(),
                      tuple(case.name for case in fixed))


def _marlin(names: list[str], device: Device, smem: tuple[int, int]) -> Derivation:
    """The Marlin GEMM cases of `_C` (the harness's fixed cases launch no GEMM kernel)."""
    assert device.sizes is not None
    sizes = marlin_kernels.Sizes(device.major, device.minor, smem[0], device.sizes.sms)
    derived = marlin_kernels.derive(names, sizes)
    return Derivation(derived.cases, derived.expects, derived.dead())


@dataclass(frozen=True)
class Family:
    """A harness's kernels: their name in what the user reads, the dispatch modeled, and
    the derivation."""

    name: str
    model: str
    derive: Callable[[list[str], Device, tuple[int, int]], Derivation]


FAMILIES = {"fa2": Family("FA2", MODEL, _fa2),
            "marlin": Family("Marlin", MARLIN_MODEL, _marlin)}


@dataclass(frozen=True)
class Dealing:
    """How a file's cases are shared out: at most `jobs` parts, their files written under
    `into` (a folder of this process's own)."""

    jobs: int
    into: Path


def deal_cases(family: Family, names: Sequence[str], modules: Modules, device: Device,
               dealing: Dealing) -> DealtCases:
    """The family's cases for `names` (the file's added kernels), dealt as `dealing`
    says."""
    jobs, into = dealing.jobs, dealing.into
    if device.sizes is None:
        return DealtCases(FIXED_ONLY.parts, said="the loader did not say the GPU's shared "
                        f"memory and SM count: the {family.name} harness runs its fixed "
                        "cases only")
    sizes = device.sizes
    known = Target(device.major * 10 + device.minor).facts.shared_memory
    block, per_sm = known or (sizes.smem_block, sizes.smem_sm)
    said = None
    if known is None:
        said = (f"the GPU table gives compute capability {device.major}.{device.minor} no "
                "shared memory: its cases follow what the loader said, and no kernel is "
                f"called unreachable by {family.name}'s dispatch")
    elif known != (sizes.smem_block, sizes.smem_sm):
        said = (f"the loader said {sizes.smem_block} and {sizes.smem_sm} bytes of shared "
                f"memory; the GPU table's for {device.major}.{device.minor} ({block} and "
                f"{per_sm}) are used")
    derived = family.derive(list(names), device, (block, per_sm))
    groups: dict[int, list[Any]] = {}
    for name, case in [*((c.name, c) for c in derived.cases),
                       *((name, _Fixed(at)) for at, name in enumerate(derived.fixed))]:
        numbers = [modules.of[k] for k in derived.expects.get(name, []) if k in modules.of]
        groups.setdefault(min(numbers, default=-1), []).append(case)
    parts = []
    for number, dealt in enumerate(_dealt(groups, modules.size, jobs) if groups else [[]]):
        cases = [c for c in dealt if not isinstance(c, _Fixed)]
        only = tuple(sorted(c.at for c in dealt if isinstance(c, _Fixed)))
        path = into / f"cases-{number:03d}.json"
        path.write_text(json.dumps({"cases": [
            {**asdict(c), "key": c.key} for c in cases]}))
        parts.append(Part(path, bool(only), len(cases), only) if derived.fixed
                     else Part(path, number == 0, len(cases)))
    evidence = f"the {family.name} dispatch ({family.model}) never selects it on compute " \
        f"capability {device.major}.{device.minor}"
    dead = {name: f"{evidence}: {why}" for name, why in derived.dead.items()} if known \
        else {}
    return DealtCases(tuple(parts), dead, said)
