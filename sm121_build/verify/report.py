"""Render audit reports: a readable table, cuobjdump's listing, JSON, Markdown."""

from __future__ import annotations

from typing import Any

from sm121_build.verify.audit import BinaryReport, FileVerdict, Policy
from sm121_build.verify.fixable import rebuild_verdict

VERDICT_WORDS: dict[FileVerdict, str] = {
    "native": "native",
    "jit": "loads through PTX JIT (slow first start)",
    "partial": "PARTIAL: some kernels have no loadable code",
    "none": "NO loadable code",
}


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{size} B"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{sm} x{n}" for sm, n in counts.items()) or "-"


def table(reports: list[BinaryReport], policy: Policy, show_kernels: bool) -> str:
    lines = [f"target {policy.target}, CUDA driver {policy.driver[0]}.{policy.driver[1]}"]
    with_code = [r for r in reports if r.has_device_code]
    for report in with_code:
        lines.append("")
        lines.append(f"{report.name}  ({_human(report.size)})")
        lines.append(f"  cubins   {_counts(report.arch_counts('elf'))}")
        lines.append(f"  ptx      {_counts(report.arch_counts('ptx'))}")
        tus = report.containers
        total = sum(tus.values())
        lines.append(
            f"  {policy.target!s:<8} {VERDICT_WORDS[report.verdict]}: {total} fatbins, "
            f"{tus['native']} native, {tus['jit']} JIT only, {tus['none']} with no loadable code")
        if report.kernels is not None:
            kc = report.kernel_counts()
            lines.append(
                f"  kernels  {sum(kc.values())}: {kc['native']} native, {kc['jit']} JIT only, "
                f"{kc['none']} with no loadable code")
            if show_kernels:
                for kernel, verdict in report.kernels.items():
                    lines.append(f"    {verdict:<6} {kernel}")
        rebuild = rebuild_verdict(report, policy.target)
        if rebuild is not None and rebuild.verdict != "native":
            lines.append(f"  rebuild  {rebuild.verdict}: {rebuild.reason}")
    skipped = len(reports) - len(with_code)
    if skipped:
        lines.append("")
        lines.append(f"{skipped} other ELF file(s) carry no device code")
    if not reports:
        lines.append("no ELF files found")
    return "\n".join(lines)


def cuobjdump(reports: list[BinaryReport]) -> str:
    """Exactly `cuobjdump -lelf -lptx FILE` output; several files get a `# name` header each."""
    with_code = [r for r in reports if r.cuobjdump]
    if len(with_code) == 1:
        return "\n".join(with_code[0].cuobjdump)
    return "\n".join(line for r in with_code for line in (f"# {r.name}", *r.cuobjdump))


def as_json(reports: list[BinaryReport], policy: Policy) -> dict[str, Any]:
    return {
        "target": str(policy.target),
        "driver": f"{policy.driver[0]}.{policy.driver[1]}",
        "binaries": [
            {
                "name": r.name,
                "size": r.size,
                "verdict": r.verdict if r.has_device_code else None,
                "fatbins": r.containers,
                "cubins": r.arch_counts("elf"),
                "ptx": r.arch_counts("ptx"),
                "entries": [
                    {"kind": e.kind, "arch": e.sm, "cuobjdump_arch": e.cuobjdump_arch,
                     "compression": e.compression, "stored_size": e.stored_size,
                     "size": e.size, "fatbin": e.container,
                     "version": f"{e.version[0]}.{e.version[1]}",
                     "verdict": policy.verdict(e)}
                    for e in r.entries
                ],
                "kernels": r.kernels,
                "kernel_counts": r.kernel_counts() if r.kernels is not None else None,
                "rebuild": rebuild.__dict__ if (rebuild := rebuild_verdict(r, policy.target))
                else None,
            }
            for r in reports
        ],
    }


def markdown(title: str, reports: list[BinaryReport], policy: Policy) -> str:
    """A GitHub-flavoured Markdown table (for $GITHUB_STEP_SUMMARY)."""
    rows = [f"### {title}", "",
            f"| .so | cubins per arch | PTX | {policy.target} | kernels loadable on "
            f"{policy.target} |",
            "| --- | --- | --- | --- | --- |"]
    for r in reports:
        if not r.has_device_code:
            continue
        kernels = "-"
        if r.kernels is not None:
            kc = r.kernel_counts()
            kernels = f"{kc['native']} of {sum(kc.values())}"
        rows.append(f"| `{r.name}` | {_counts(r.arch_counts('elf'))} | "
                    f"{_counts(r.arch_counts('ptx'))} | {r.verdict} | {kernels} |")
    return "\n".join(rows) + "\n"
