"""Audit ELF files: which kernels will load on a target GPU (native cubin, PTX JIT, none)."""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sm121_build.cuda.compat import (
    SM121,
    VERDICT_RANK,
    Target,
    Verdict,
    best,
    cubin_loads,
    entry_verdict,
    ptx_loads,
)
from sm121_build.cuda.fatbin import Entry, HostBinary, cuobjdump_listing

FileVerdict = Literal["native", "jit", "partial", "none"]


@dataclass(frozen=True)
class Policy:
    """The GPU and driver an audit judges against."""

    target: Target
    driver: tuple[int, int]

    def verdict(self, entry: Entry) -> Verdict:
        return entry_verdict(entry, self.target, self.driver)


@dataclass
class BinaryReport:
    """One ELF file's device code and what the target can load of it."""

    name: str
    size: int
    entries: list[Entry]
    cuobjdump: list[str]
    containers: dict[Verdict, int]
    kernels: dict[str, Verdict] | None = None

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
    return int("".join(ch for ch in sm[3:] if ch.isdigit())), sm


def audit_binary(path: Path, name: str, policy: Policy, with_kernels: bool) -> BinaryReport:
    with HostBinary.open(path) as binary:
        entries = binary.entries
        by_container: dict[int, list[Verdict]] = defaultdict(list)
        for entry in entries:
            by_container[entry.container].append(policy.verdict(entry))
        containers: dict[Verdict, int] = {"native": 0, "jit": 0, "none": 0}
        for verdicts in by_container.values():
            containers[best(verdicts)] += 1
        report = BinaryReport(
            name=name, size=path.stat().st_size, entries=entries,
            cuobjdump=cuobjdump_listing(path, entries, binary.raw), containers=containers)
        if with_kernels:
            report.kernels = _kernel_verdicts(binary, policy)
    return report


def host_only_report(name: str, size: int, with_kernels: bool) -> BinaryReport:
    """The report of an ELF file known to carry no device code (read and dropped already):
    what `audit_binary` gives for such a file."""
    return BinaryReport(name=name, size=size, entries=[], cuobjdump=[],
                        containers={"native": 0, "jit": 0, "none": 0},
                        kernels={} if with_kernels else None)


def _kernel_verdicts(binary: HostBinary, policy: Policy) -> dict[str, Verdict]:
    """Per kernel: the best entry of its own TU, then the worst over TUs that define it."""
    per_tu: dict[tuple[int, str], Verdict] = {}
    for entry, names in binary.every_kernel(workers=len(os.sched_getaffinity(0))):
        verdict = policy.verdict(entry)
        for kernel in names:
            key = (entry.container, kernel)
            previous = per_tu.get(key, "none")
            per_tu[key] = max(previous, verdict, key=VERDICT_RANK.__getitem__)
    kernels: dict[str, Verdict] = {}
    for (_container, kernel), verdict in per_tu.items():
        previous = kernels.get(kernel, "native")
        kernels[kernel] = min(previous, verdict, key=VERDICT_RANK.__getitem__)
    return dict(sorted(kernels.items()))


ANY_DRIVER = (99, 0)  # ahead of time no driver limits which PTX ptxas reads
# ptxas 13.0's own time for PTX, for sm_121 on a 2-core CI machine (2026-11-25): 2,017 CPU-s
# for vLLM 0.33.0's FA2 (681.6 MB of PTX), 258 CPU-s for its `_C`/`_moe_C` (34.7 MB); for
# sm_90 on the lent H100's CPUs 0.22.0's FA2 took 2,443 CPU-s for 436.1 MB
PTXAS_CPU_SECONDS_PER_MB = 3.2


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

    @property
    def cpu_seconds(self) -> float:
        return self.ptx_bytes / 1e6 * PTXAS_CPU_SECONDS_PER_MB


def aot_able(report: BinaryReport, target: Target) -> AotAble | None:
    by_container: dict[int, list[Entry]] = defaultdict(list)
    for entry in report.entries:
        by_container[entry.container].append(entry)
    chosen = [found for found in (jit_ptx(e, target) for e in by_container.values()) if found]
    if not chosen:
        return None
    kernels = report.kernel_counts()["jit"] if report.kernels is not None else None
    return AotAble(len(chosen), kernels, sum(e.size for e in chosen))


# what the tool judges against: sm_121, and the oldest driver a DGX Spark ships with
SPARK = Policy(SM121, (13, 0))
