"""How sizes and durations are written for people (a bottom-layer helper: the audit table,
the pull line and the compile line all use it)."""

from __future__ import annotations


def human_size(size: float) -> str:
    """`512 B`, `1.5 KB`, `20.3 GB` (decimal units, as Docker and registries count)."""
    value = float(size)
    for unit in ("B", "KB", "MB"):
        if value < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"


def duration(seconds: float) -> str:
    """`42s`, `7m05s`, `1h15m`."""
    whole = max(int(seconds), 0)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
