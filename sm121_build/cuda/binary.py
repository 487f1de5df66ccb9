"""Audit ELF files: which kernels will load on a target GPU (native cubin, PTX JIT, none)."""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from sm121_build.core.errors import CorruptBinaryError
from sm121_build.cuda.compat import (
    DEFAULT_GPU_DRIVER,
    DEFAULT_TARGET,
    VERDICT_RANK,
    ArchList,
    Target,
    Verdict,
    best,
    cubin_loads,
    dotted_arch,
    entry_verdict,
    parse_target,
    ptx_loads,
)
from sm121_build.cuda.elf import Buffer
from sm121_build.cuda.fatbin import (
    FATBIN_SECTIONS,
    Entry,
    HostBinary,
    RawKind,
    cuobjdump_listing,
)
from sm121_build.cuda.fatbin_rewrite import read_layout
from sm121_build.cuda.ptxas_cost import Estimate, cost_table, digest, ptx_kind

FileVerdict = Literal["native", "jit", "partial", "none"]
# the oldest driver a run is judged with: the default GPU's first (a DGX Spark's)
DEFAULT_DRIVER = DEFAULT_GPU_DRIVER


@dataclass(frozen=True)
class Policy:
    """The GPU a run serves and the oldest driver it is judged with: what the audit judges
    against, and for the main job, `aot IMAGE`, `inject`, kernels images and `dockerfile`
    the one value that says which GPU (`--gpu`): its tag suffix, arch list, manifest field,
    label and kernels-image key all come from here, and back (`gpu_of_manifest`)."""

    target: Target
    driver: tuple[int, int]

    def verdict(self, entry: Entry) -> Verdict:
        return entry_verdict(entry, self.target, self.driver)

    @property
    def suffix(self) -> str:
        """The tag suffix of its images: `sm121` (`vllm-openai:nightly-sm121`)."""
        return f"sm{self.target.arch}"

    @property
    def arch_list(self) -> ArchList:
        """The arch list its files are made for: `12.1` (what a kernels image records)."""
        return ArchList.parse(f"{self.target.major}.{self.target.minor}")

    @property
    def has_source_rules(self) -> bool:
        """Whether the guard rules (patches/) cover it: a source build is for the default
        GPU (the Spark's sm_121) alone; any other GPU gets aot only (the plan says so)."""
        return self.target.has_source_rules

    @property
    def is_default(self) -> bool:
        """The GPU a run serves unless --gpu names another; its reports and keys stay as
        they were before --gpu existed."""
        return self.target.is_default

    def __str__(self) -> str:
        return str(self.target)


def gpu_policy(text: str, driver: tuple[int, int] = DEFAULT_DRIVER) -> Policy:
    """`--gpu sm_120` (or `12.0`, `120`) as the run's GPU, judged with `driver`."""
    return Policy(parse_target(text), driver)


def gpu_of_arch_list(arch_list: ArchList) -> Policy | None:
    """The GPU files made for `arch_list` serve, when it names exactly one (`12.1`, `12.1a`,
    `12.0f`): what an older manifest with no `gpu` field was made for."""
    items = arch_list.items
    parsed = dotted_arch(items[0].replace("+PTX", "")) if len(items) == 1 else None
    return Policy(Target(parsed[0]), DEFAULT_DRIVER) if parsed else None


@dataclass
class BinaryReport:
    """One ELF file's device code and what the target can load of it."""

    name: str
    size: int
    entries: list[Entry]
    cuobjdump: list[str]
    containers: dict[Verdict, int]  # containers with loadable code or none (LTO-IR apart)
    kernels: dict[str, Verdict] | None = None
    reach: AotReach | None = None  # what `aot` would do with the file (`aot_reach`)
    package: str | None = None  # the distribution that installs it, where known
    claimed_by: tuple[str, ...] = ()  # every distribution whose RECORD lists it

    @property
    def lto_fatbins(self) -> int:
        """Containers of LTO-IR alone: linked at run time by nvJitLink (cuFFT's callbacks,
        cuSPARSE), never loaded by the driver as they are."""
        kinds: dict[int, set[str]] = defaultdict(set)
        for entry in self.entries:
            kinds[entry.container].add(entry.kind)
        return sum(1 for found in kinds.values() if found == {"lto"})

    def sections(self) -> dict[str, int]:
        """Containers per section of the file (`.nv_fatbin`, `.data`, ...), in file order."""
        seen: dict[int, str] = {}
        for entry in self.entries:
            seen.setdefault(entry.container, entry.section)
        return dict(Counter(seen.values()))

    @property
    def has_device_code(self) -> bool:
        return bool(self.entries)

    def arch_counts(self, kind: str) -> dict[str, int]:
        counts = Counter(e.sm for e in self.entries if e.kind == kind)
        return dict(sorted(counts.items(), key=lambda item: _arch_key(item[0])))

    @property
    def verdict(self) -> FileVerdict:
        """native / jit when every translation unit loads so; partial when some load
        nothing; none when nothing loads.  (Kernel counts, when read, refine the picture.)"""
        counts = self.kernel_counts() if self.kernels else self.containers
        present = [v for v, n in counts.items() if n]
        if not present or present == ["none"]:
            return "none"
        if "none" in present:
            return "partial"
        return "jit" if "jit" in present else "native"

    def kernel_counts(self) -> dict[Verdict, int]:
        counts: dict[Verdict, int] = {"native": 0, "jit": 0, "none": 0}
        for verdict in (self.kernels or {}).values():
            counts[verdict] += 1
        return counts


def _arch_key(sm: str) -> tuple[int, str]:
    """`sm_100a` -> (100, "sm_100a"): numeric order, then plain before `a`/`f`."""
    digits = "".join(ch for ch in sm[3:] if ch in "0123456789")  # ASCII: `³` is a digit too
    return int(digits[:9] or "0"), sm  # (9 digits: no arch has more; int() refuses 4,301)


def audit_binary(path: Path, name: str, policy: Policy, with_kernels: bool) -> BinaryReport:
    with HostBinary.open(path) as binary:
        entries = binary.entries
        by_container: dict[int, list[Verdict]] = defaultdict(list)
        for entry in entries:
            if entry.kind != "lto":  # linked by nvJitLink, not loaded: counted apart
                by_container[entry.container].append(policy.verdict(entry))
        containers: dict[Verdict, int] = {"native": 0, "jit": 0, "none": 0}
        for verdicts in by_container.values():
            containers[best(verdicts)] += 1
        report = BinaryReport(
            name=name, size=path.stat().st_size, entries=entries,
            cuobjdump=cuobjdump_listing(path, entries, binary.raw), containers=containers)
        if with_kernels:
            report.kernels = _kernel_verdicts(binary, policy)
        report.reach = aot_reach(binary.mapped, entries, binary.raw, policy.target)
    return report


def host_only_report(name: str, size: int, with_kernels: bool) -> BinaryReport:
    """The report of an ELF file known to carry no device code (read and dropped already):
    what `audit_binary` gives for such a file."""
    return BinaryReport(name=name, size=size, entries=[], cuobjdump=[],
                        containers={"native": 0, "jit": 0, "none": 0},
                        kernels={} if with_kernels else None)


def _kernel_verdicts(binary: HostBinary, policy: Policy) -> dict[str, Verdict]:
    """Per kernel: the best entry of its own TU, then the worst over TUs that define it.

    A TU is a container of the registered fatbin section: the CUDA runtime registers each,
    and a kernel of two of them is two functions.  The fatbins a library keeps in its own
    sections (cuFFT's `.data`, cuBLASLt's `.cask_resource`) it loads itself, one of them
    for the GPU at hand: there a kernel counts once per section, at the best any of its
    fatbins gives, named `KERNEL [SECTION]` so it never merges with a registered one."""
    per_tu: dict[tuple[int | str, str], Verdict] = {}
    for entry, names in binary.every_kernel(workers=len(os.sched_getaffinity(0))):
        verdict = policy.verdict(entry)
        registered = not entry.section or entry.section in FATBIN_SECTIONS
        group: int | str = entry.container if registered else entry.section
        for kernel in names:
            key = (group, kernel if registered else f"{kernel} [{entry.section}]")
            previous = per_tu.get(key, "none")
            per_tu[key] = max(previous, verdict, key=VERDICT_RANK.__getitem__)
    kernels: dict[str, Verdict] = {}
    for (_group, kernel), verdict in per_tu.items():
        previous = kernels.get(kernel, "native")
        kernels[kernel] = min(previous, verdict, key=VERDICT_RANK.__getitem__)
    return dict(sorted(kernels.items()))


ANY_DRIVER = (99, 0)  # ahead of time no driver limits which PTX ptxas reads


def has_native_cubin(described: tuple[Entry, ...] | list[Entry], target: Target) -> bool:
    """Whether one container has a cubin the GPU loads."""
    return any(e.kind == "elf" and cubin_loads(e.arch, e.variant, target) for e in described)


def jit_ptx(described: tuple[Entry, ...] | list[Entry], target: Target) -> Entry | None:
    """The PTX the driver would JIT for one container (the newest it can) when no cubin of
    it loads natively: what `aot` compiles; None when a cubin loads or no PTX can."""
    if has_native_cubin(described, target):
        return None
    candidates = [e for e in described if e.kind == "ptx"
                  and ptx_loads(e.arch, e.variant, e.version, target, ANY_DRIVER)]
    return max(candidates, key=lambda e: (e.arch, e.version), default=None)


@dataclass(frozen=True)
class AotAble:
    """What `sm121-build aot` would make native in one file."""

    fatbins: int
    kernels: int | None  # the JIT-only kernels, when kernel names were read
    ptx_bytes: int
    cost: Estimate = field(default_factory=Estimate)  # ptxas's CPU-seconds (`ptxas_cost`)

    @property
    def cpu_seconds(self) -> float:
        return self.cost.cpu_seconds


@dataclass(frozen=True)
class AotReach:
    """What `aot` does with one file, judged once for the audit and for `aot` itself: the
    PTX it compiles (one entry per container it makes native), why it cannot when the file
    has JIT-only code it would refuse, and the JIT-only containers it cannot reach (kept
    where no fatbin registration names them: a library's own `.data`, say)."""

    target: Target
    chosen: tuple[Entry, ...] = ()
    refused: str | None = None
    unreachable: dict[str, int] | None = None  # section -> JIT-only containers there
    cost: Estimate = field(default_factory=Estimate)  # what ptxas would take for `chosen`


NOT_A_SHARED_OBJECT = "aot reads shared objects (.so), folders of them and wheels"


def _jit_only(entries: list[Entry], target: Target) -> dict[int, Entry]:
    """Per container: the PTX the driver would JIT for it (`jit_ptx`), where it has some."""
    by_container: dict[int, list[Entry]] = defaultdict(list)
    for entry in entries:
        by_container[entry.container].append(entry)
    return {number: found for number, described in by_container.items()
            if (found := jit_ptx(described, target)) is not None}


def aot_reach(data: Buffer | None, entries: list[Entry], raw: RawKind,
              target: Target) -> AotReach:
    """The one aot-ability rule (the audit's "aot-able" and `aot`'s choice of modules both use it).
    `aot` compiles a container's PTX when no cubin of it loads on the target, only in a
    shared object whose `.nv_fatbin` containers are registered through `.nvFatBinSegment`
    and RELATIVE relocations it can move (`fatbin_rewrite.read_layout`); a file that is
    device code itself (PTX, a cubin, a fatbin) is not rewritten."""
    jit = _jit_only(entries, target)
    if not jit:
        return AotReach(target)
    elsewhere = Counter(e.section for e in jit.values() if e.section not in FATBIN_SECTIONS
                        and e.section)
    unreachable = dict(elsewhere) or None
    registered = [e for e in jit.values() if e.section == ".nv_fatbin"]
    if raw:
        return AotReach(target, refused=f"a {raw} file, not a shared object: "
                        f"{NOT_A_SHARED_OBJECT}")
    if not registered:
        return AotReach(target, unreachable=unreachable)
    if data is None:
        return AotReach(target, refused="its bytes were not kept to check its layout")
    try:
        read_layout(data, "the file", keep_bytes=False)
    except CorruptBinaryError as exc:  # NoFatbin among them: nothing registered to rewrite
        return AotReach(target, refused=str(exc).removeprefix("the file: "),
                        unreachable=unreachable)
    return AotReach(target, tuple(registered), unreachable=unreachable,
                    cost=stored_cost(data, registered))


def stored_cost(data: Buffer, entries: list[Entry]) -> Estimate:
    """ptxas's estimated CPU-seconds for PTX entries, from their bytes as stored (their
    digest in the table of measured modules; else their size: the text is not read)."""
    total = Estimate()
    table = cost_table()
    for entry in entries:
        stored = digest(data[entry.offset:entry.offset + entry.stored_size])
        total += table.cost(entry.size, (stored,), ptx_kind(None))
    return total


def unreachable_words(unreachable: dict[str, int]) -> str:
    """The JIT-only containers `aot` cannot reach, in words."""
    where = ", ".join(f"{n} in {section}" for section, n in unreachable.items())
    return (f"{sum(unreachable.values())} JIT-only fatbin(s) outside .nv_fatbin ({where}): "
            "the library loads them itself, so aot cannot add code to them; only a release "
            "built for the GPU makes them native")


def aot_able(report: BinaryReport, target: Target) -> AotAble | None:
    """What `aot` would make native in the file (`aot_reach`, judged when it was read),
    None when nothing."""
    reach = report.reach
    if reach is None or reach.target != target or not reach.chosen:
        return None
    # JIT-only kernels are counted per name, not per section: with some beyond aot's reach
    # the count would claim them too
    kernels = report.kernel_counts()["jit"] if report.kernels is not None \
        and not reach.unreachable else None
    return AotAble(len(reach.chosen), kernels, sum(e.size for e in reach.chosen), reach.cost)


# what the tool judges against: sm_121, and the oldest driver a DGX Spark ships with
DEFAULT_POLICY = Policy(DEFAULT_TARGET, DEFAULT_DRIVER)
