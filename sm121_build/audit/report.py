"""Render audit reports: a readable table, cuobjdump's listing, JSON, Markdown."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

from sm121_build.core.console import md, md_code, shown
from sm121_build.core.units import human_size
from sm121_build.cuda.binary import (
    AotAble,
    BinaryReport,
    FileVerdict,
    Policy,
    aot_able,
    unreachable_words,
)

if TYPE_CHECKING:  # the decide step (CMake rules, YAML) is loaded when a verdict is asked
    from sm121_build.rebuild.decide import Rebuild

# Verdicts given by the source (`audit --source`) in place of the binary-only ones, by name
Verdicts = dict[str, "Rebuild"]

VERDICT_WORDS: dict[FileVerdict, str] = {
    "native": "native",
    "jit": "loads through PTX JIT (slow first start)",
    "partial": "PARTIAL: some kernels have no loadable code",
    "none": "NO loadable code",
}


def _counts(counts: dict[str, int]) -> str:
    """`sm_90 x3, sm_121 x1` (keys from outside, a section's name, shown escaped)."""
    return ", ".join(f"{shown(sm)} x{n}" for sm, n in counts.items()) or "-"


def _rebuild(report: BinaryReport, policy: Policy, verdicts: Verdicts | None) -> Rebuild | None:
    if verdicts and report.name in verdicts:
        return verdicts[report.name]
    from sm121_build.rebuild.decide import rebuild_verdict

    return rebuild_verdict(report, policy.target)


def _aot_words(able: AotAble, policy: Policy) -> str:
    kernels = f"{able.kernels} JIT-only kernel(s), " if able.kernels is not None else ""
    return (f"{able.fatbins} fatbin(s) with PTX and no {policy.target} cubin ({kernels}"
            f"{human_size(able.ptx_bytes)} of PTX): `sm121-build aot FILE --target "
            f"{policy.target}` makes them native, {able.cost.words()}")


def _where_and_lto(report: BinaryReport) -> list[str]:
    """Where the file keeps its fatbins, when not all in `.nv_fatbin` (where cuobjdump
    stops), and its LTO-IR, which only nvJitLink links."""
    lines = []
    sections = report.sections()
    if set(sections) - {".nv_fatbin", ""}:
        lines.append(f"  found in {_counts(sections)} fatbin(s) (cuobjdump lists "
                     ".nv_fatbin only)")
    lto = report.arch_counts("lto")
    if lto:
        lines.append(f"  lto-ir   {_counts(lto)}: {sum(lto.values()):,} entries, linked at "
                     "run time by nvJitLink, not loaded by the driver "
                     f"({report.lto_fatbins:,} fatbin(s) of LTO-IR alone)")
    return lines


def _aot_lines(report: BinaryReport, policy: Policy) -> list[str]:
    able = aot_able(report, policy.target)
    reach = report.reach
    lines = []
    if able is not None:
        lines.append(f"  aot      aot-able: {_aot_words(able, policy)}")
    elif reach is not None and reach.refused:
        lines.append(f"  aot      not aot-able: {reach.refused}")
    if reach is not None and reach.unreachable:
        lines.append(f"  aot      {unreachable_words(reach.unreachable)}")
    return lines


def _aot_json(able: AotAble | None) -> dict[str, Any] | None:
    return None if able is None else {"fatbins": able.fatbins, "kernels": able.kernels,
                                      "ptx_bytes": able.ptx_bytes,
                                      "cpu_seconds": round(able.cpu_seconds, 1)}


def package_of(name: str) -> str:
    """The Python package an audited path belongs to: the folder under site-packages or
    dist-packages (images), else the top folder (a wheel's or a folder's), else `.`."""
    parts = PurePosixPath(name).parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts[:-1]:
            at = parts.index(marker) + 1
            return parts[at] if at < len(parts) - 1 else marker
    return parts[0] if len(parts) > 1 else "."


@dataclass(frozen=True)
class Package:
    """How much of one package's device code loads on the GPU, and what would change that:
    `aot` (files, CPU-seconds of ptxas), or only another build of it."""

    name: str
    files: Counter[FileVerdict]  # files with device code, by verdict
    kernels: dict[str, int] | None  # native / jit / none, when kernel names were read
    aot_files: int = 0
    aot_cpu_seconds: float = 0.0
    beyond_aot: int = 0  # files aot leaves short of native: only a build for the GPU helps

    def line(self) -> str:
        total = sum(self.files.values())
        files = ", ".join(f"{n:,} {v}" for v, n in sorted(self.files.items())
                          if n) or "none"
        kernels = ""
        if self.kernels is not None:
            k = self.kernels
            kernels = (f"; kernels {k['native']:,} of {sum(k.values()):,} native, "
                       f"{k['jit']:,} JIT only, {k['none']:,} with no loadable code")
        fix = ""
        if self.aot_files:
            fix += (f"; aot: {self.aot_files:,} file(s), about {self.aot_cpu_seconds:,.0f} "
                    "CPU-s of ptxas")
        if self.beyond_aot:
            fix += f"; {self.beyond_aot:,} file(s) only a build for the GPU makes native"
        return f"  {shown(self.name)}: {self.files['native']:,} of {total:,} file(s) native " \
               f"({files}){kernels}{fix}"


def _short_after_aot(report: BinaryReport) -> bool:
    """Whether a file stays short of native once aot has done what it can: code that loads
    nothing, JIT-only fatbins aot cannot reach, or a file aot refuses."""
    reach = report.reach
    if report.verdict == "native":
        return False
    counts = report.kernel_counts() if report.kernels is not None else report.containers
    return bool(counts["none"]) or reach is None or bool(reach.unreachable) \
        or bool(reach.refused) or not reach.chosen


def packages(reports: list[BinaryReport]) -> list[Package]:
    by_name: dict[str, list[BinaryReport]] = {}
    for report in reports:
        if report.has_device_code:
            by_name.setdefault(report.package or package_of(report.name), []).append(report)
    out = []
    for name, members in sorted(by_name.items()):
        kernels: dict[str, int] | None = None
        if all(r.kernels is not None for r in members):
            kernels = {"native": 0, "jit": 0, "none": 0}
            for report in members:
                for verdict, n in report.kernel_counts().items():
                    kernels[verdict] += n
        able = [a for r in members if r.reach is not None
                and (a := aot_able(r, r.reach.target)) is not None]
        out.append(Package(name, Counter(r.verdict for r in members), kernels, len(able),
                           sum(a.cpu_seconds for a in able),
                           sum(1 for r in members if _short_after_aot(r))))
    return out


def table(reports: list[BinaryReport], policy: Policy, show_kernels: bool,
          verdicts: Verdicts | None = None) -> str:
    lines = [f"target {policy.target}, CUDA driver {policy.driver[0]}.{policy.driver[1]}"]
    with_code = [r for r in reports if r.has_device_code]
    for report in with_code:
        lines.append("")
        lines.append(f"{shown(report.name)}  ({human_size(report.size)})")
        lines.append(f"  cubins   {_counts(report.arch_counts('elf'))}")
        lines.append(f"  ptx      {_counts(report.arch_counts('ptx'))}")
        lines.extend(_where_and_lto(report))
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
                    lines.append(f"    {verdict:<6} {shown(kernel)}")
        rebuild = _rebuild(report, policy, verdicts)
        if rebuild is not None and rebuild.verdict != "native":
            lines.append(f"  rebuild  {rebuild.verdict}: {rebuild.reason}")
        lines.extend(_aot_lines(report, policy))
    if len(with_code) > 1 or any(r.package for r in with_code):
        lines.append("")
        lines.append(f"per package, on {policy.target}:")
        lines.extend(package.line() for package in packages(reports))
    skipped = len(reports) - len(with_code)
    if skipped:
        lines.append("")
        lines.append(f"{skipped} other ELF file(s) carry no device code")
    if not reports:
        lines.append("no ELF files found")
    return "\n".join(shown(line) for line in lines)  # one line each: a name's newline escaped


def cuobjdump(reports: list[BinaryReport]) -> str:
    """Exactly `cuobjdump -lelf -lptx FILE` output (a name's control characters escaped, one
    line each); several files get a `# name` header each."""
    with_code = [r for r in reports if r.cuobjdump]
    if len(with_code) == 1:
        return "\n".join(shown(line) for line in with_code[0].cuobjdump)
    return "\n".join(shown(line) for r in with_code for line in (f"# {r.name}", *r.cuobjdump))


def as_json(reports: list[BinaryReport], policy: Policy,
            verdicts: Verdicts | None = None) -> dict[str, Any]:
    return {
        "target": str(policy.target),
        "driver": f"{policy.driver[0]}.{policy.driver[1]}",
        "packages": [{"name": p.name, "files": {v: p.files[v] for v in VERDICT_WORDS},
                      "kernels": p.kernels,
                      "aot": {"files": p.aot_files,
                              "cpu_seconds": round(p.aot_cpu_seconds, 1)},
                      "beyond_aot": p.beyond_aot} for p in packages(reports)],
        "binaries": [
            {
                "name": r.name,
                "package": r.package,
                "claimed_by": list(r.claimed_by),
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
                     "section": e.section, "verdict": policy.verdict(e)}
                    for e in r.entries
                ],
                "kernels": r.kernels,
                "kernel_counts": r.kernel_counts() if r.kernels is not None else None,
                "rebuild": rebuild.__dict__ if (rebuild := _rebuild(r, policy, verdicts))
                else None,
                "aot": _aot_json(aot_able(r, policy.target)),
                "aot_refused": r.reach.refused if r.reach else None,
                "aot_unreachable": r.reach.unreachable if r.reach else None,
                "sections": r.sections(),
                "lto_fatbins": r.lto_fatbins,
            }
            for r in reports
        ],
    }


def _md_counts(counts: dict[str, int]) -> str:
    return md(_counts(counts))


def _md_loadable(report: BinaryReport) -> str:
    """`native of all` kernels, `-` when they were not counted."""
    if report.kernels is None:
        return md("-")
    counts = report.kernel_counts()
    return md(f"{counts['native']} of {sum(counts.values())}")


def markdown(target: str, reports: list[BinaryReport], policy: Policy,
             verdicts: Verdicts | None = None) -> str:
    """A GitHub-flavoured Markdown table (for $GITHUB_STEP_SUMMARY) headed `Audit of
    target`; every value in it passes through the one escaper (`md`, `md_code`)."""
    rows = [f"### Audit of {md(target)}", "",
            f"| .so | cubins per arch | PTX | {md(str(policy.target))} | kernels loadable on "
            f"{md(str(policy.target))} | rebuild |",
            "| --- | --- | --- | --- | --- | --- |"]
    for r in reports:
        if not r.has_device_code:
            continue
        rebuild = _rebuild(r, policy, verdicts)
        rows.append(f"| {md_code(r.name)} | {_md_counts(r.arch_counts('elf'))} | "
                    f"{_md_counts(r.arch_counts('ptx'))} | {md(str(r.verdict))} | "
                    f"{_md_loadable(r)} | {md(str(rebuild.verdict) if rebuild else '-')} |")
    return "\n".join(rows) + "\n"
