"""One-line warnings a run gives before any work: a base that no longer moves, and PTX that
the target driver cannot JIT-compile."""

from __future__ import annotations

from datetime import datetime, timezone

from sm121_build.cuda.binary import BinaryReport
from sm121_build.cuda.compat import Target, max_ptx_isa

STALE_DAYS = 30  # a nightly tag not re-pushed for this long has most likely stopped moving
LIVE_TAGS = "vllm/vllm-openai:nightly (CUDA 13.0), :cu129-nightly, :cu134-nightly"


def age_warning(ref: str, created: str, now: datetime | None = None) -> str | None:
    """Said when the image config's `created` is more than STALE_DAYS old."""
    if not created:
        return None
    try:  # the engine gives nanoseconds ("2026-03-10T12:34:56.123456789Z"): seconds suffice
        when = datetime.strptime(created[:19], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc)
    except ValueError:
        return None
    days = ((now or datetime.now(timezone.utc)) - when).days
    if days <= STALE_DAYS:
        return None
    return (f"warning: {ref} was created {days} days ago ({when.date()}): this tag may no "
            f"longer move; vLLM's release pipeline moves {LIVE_TAGS}")


def ptx_warning(stock: dict[str, BinaryReport | None], gpu: Target,
                driver: tuple[int, int]) -> str | None:
    """Said when the stock files carry PTX for the GPU that is newer than the driver can
    JIT-compile (`cudaErrorUnsupportedPtxVersion` at first use)."""
    newest = max_ptx_isa(driver)
    if newest is None:
        return None
    files: dict[str, tuple[int, int]] = {}
    for name, report in stock.items():
        for entry in report.entries if report else ():
            reachable = (entry.arch // 10, entry.arch % 10) <= (gpu.major, gpu.minor)
            if entry.kind == "ptx" and not entry.variant and reachable and entry.version > newest:
                files[name] = max(files.get(name, entry.version), entry.version)
    if not files:
        return None
    isa = max(files.values())
    return (f"warning: {', '.join(sorted(files))} carry PTX ISA {isa[0]}.{isa[1]}, newer than a "
            f"CUDA {driver[0]}.{driver[1]} driver can JIT-compile (max {newest[0]}.{newest[1]}): "
            f"on such a {gpu} those kernels fail with cudaErrorUnsupportedPtxVersion; the "
            "rebuild compiles them to SASS ahead of time, which removes that failure")
