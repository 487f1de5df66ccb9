"""What a PTX module costs ptxas, in CPU-seconds: measured where known, else estimated.

aot's estimate, its live line and its schedule (`ptxas_schedule`) need each module's cost
before it is compiled.  Bytes alone mislead: CUTLASS GEMM PTX (vLLM's `_C`) takes several
times more ptxas CPU per byte than flash-attention's.  So, as the build's ETA uses recorded
builds (`data/ninja/`), aot uses recorded compiles: `data/ptxas_costs.json` holds the
CPU-seconds ptxas took on each module of the vLLM releases measured there (by
`benchmarks/device/ptxas_costs_measure.py` on the lent machine, tabled by
`benchmarks/aot_costs_table.py`: each process's own CPU time, so a busy machine does not
inflate it), keyed by the digest of the PTX entry as the file stores it and of the PTX
text.  A module not in the table is its size times a rate per
kind of PTX, fitted on the same measurements.  CPU time, not wall time: what a module costs
does not depend on how many run beside it.

The table's seconds are those of the machine it was measured on; `pace` scales them to this
one (the ratio measured here over predicted, kept by aot from its last run).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache

from sm121_build.core.shipped import package_data

KNOWN_SPREAD = 0.2  # a measured module compiled again: +13-18 % measured run to run (16-way)
RATE_SPREAD = 0.6  # a module estimated by size and kind alone


@dataclass(frozen=True)
class Estimate:
    """The estimated CPU-seconds of some modules, and how many of them were measured
    before (the rest estimated by size and kind)."""

    cpu_seconds: float = 0.0
    modules: int = 0
    measured: int = 0
    measured_seconds: float = 0.0  # the share of cpu_seconds from measured modules

    def __add__(self, other: Estimate) -> Estimate:
        return Estimate(self.cpu_seconds + other.cpu_seconds, self.modules + other.modules,
                        self.measured + other.measured,
                        self.measured_seconds + other.measured_seconds)

    def scaled(self, pace: float) -> Estimate:
        return Estimate(self.cpu_seconds * pace, self.modules, self.measured,
                        self.measured_seconds * pace)

    @property
    def spread(self) -> float:
        """How far off it may be, as a share: measured modules' spread and the rest's,
        weighted by their seconds."""
        if self.cpu_seconds <= 0:
            return 0.0
        known = self.measured_seconds / self.cpu_seconds
        return known * KNOWN_SPREAD + (1 - known) * RATE_SPREAD

    def words(self) -> str:
        """`about 3,710 CPU-s of ptxas (81 of 83 modules measured before; ±16 %)`."""
        how = "measured before" if self.measured == self.modules else \
            f"measured before, {self.modules - self.measured} by size"
        return (f"about {self.cpu_seconds:,.0f} CPU-s of ptxas ({self.measured} of "
                f"{self.modules} module(s) {how}; ±{100 * self.spread:.0f} %)")


@dataclass(frozen=True)
class CostTable:
    """Measured CPU-seconds by digest, the rates per kind for the rest, and where the
    table was measured (machine, ptxas, date, command)."""

    seconds: dict[str, float]  # digest (stored entry or PTX text) -> CPU-seconds
    rates: dict[str, float]  # kind -> CPU-seconds per MB of PTX
    measured_on: str

    def cost(self, size: int, digests: Iterable[str], kind: str) -> Estimate:
        """One module's estimate: the table's seconds for any of its digests, else its
        size at its kind's rate."""
        for digest in digests:
            found = self.seconds.get(digest)
            if found is not None:
                return Estimate(found, 1, 1, found)
        rate = self.rates.get(kind, self.rates["unknown"])
        return Estimate(size / 1e6 * rate, 1, 0, 0.0)


# kinds of PTX told apart by the text, first match wins (flash-attention is built on
# CUTLASS's cute too, but compiles several times faster per byte than CUTLASS's GEMMs); a
# module whose text was not read (None) is "unknown"
_KINDS = ((b"flash", "flash"), (b"cutlass", "cutlass"))


def ptx_kind(text: bytes | None) -> str:
    """`flash` (flash-attention), `cutlass` (CUTLASS templates: slow per byte), `other`;
    `unknown` without the text."""
    if text is None:
        return "unknown"
    for marker, kind in _KINDS:
        if marker in text:
            return kind
    return "other"


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@cache
def cost_table() -> CostTable:
    """The shipped table (`data/ptxas_costs.json`)."""
    return table_from(json.loads(package_data("ptxas_costs.json")))


def table_from(raw: dict[str, object]) -> CostTable:
    """A table from its JSON form: `modules` (rows with `ptx`, `stored` (one digest or a
    list: the same PTX stored in several files), `cpu_seconds`), `rates` (kind -> CPU-s per
    MB, `unknown` among them) and `measured_on`."""
    seconds: dict[str, float] = {}
    modules = raw.get("modules")
    rates = raw.get("rates")
    if not isinstance(modules, list) or not isinstance(rates, dict) or "unknown" not in rates:
        raise ValueError("a ptxas cost table needs `modules` and `rates` with `unknown`")
    for row in modules:
        cpu = float(row["cpu_seconds"])
        stored = row.get("stored") or []
        for key in [row.get("ptx"), *(stored if isinstance(stored, list) else [stored])]:
            if key:
                seconds[str(key)] = cpu
    return CostTable(seconds, {str(k): float(v) for k, v in rates.items()},
                     str(raw.get("measured_on", "")))
