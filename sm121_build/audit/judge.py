"""`audit --source DIR`: rebuild verdicts that rest on the source's own guards.

From a binary alone the audit says what it sees (`cuda/binary.py`): which archs, `a`/`f`
or plain, PTX or not.  Whether a rebuild can give the GPU native code is a question about
the source: the pinned tree's CMake, with the guard rules applied as the main job applies
them, evaluated for the arch list the build would use.  This is the main job's own decide
step (`decide.judge_extensions`) run on the audited files, so the audit and the build cannot
disagree:

- fixable: the build gives native code the file lacks (what `sm121-build --base IMAGE`
  builds by default);
- optional: a few JIT-only kernels only (under `decide.MIN_JIT_SHARE`): `--ext NAME`;
- no sm_12x implementation: the source's guards give the target no code the GPU loads, and
  what loads nothing is arch/family-specific code of other GPUs;
- no rule: the source defines no such target, or no rule here builds its project;
- native: nothing to gain.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from packaging.version import InvalidVersion, Version

from sm121_build.core.errors import Sm121Error
from sm121_build.core.interrupts import temp_dir
from sm121_build.core.vllm import projects
from sm121_build.cuda.binary import BinaryReport
from sm121_build.cuda.compat import ArchList, Target
from sm121_build.cuda.wheel import wheel_name
from sm121_build.rebuild.decide import ExtensionVerdict, Rebuild, decide_inputs, judge_extensions
from sm121_build.source.guard_rules import PatchFor, apply_for_build, read_source_version
from sm121_build.source.tree import require_contained


def source_version(source: Path, target: str) -> str:
    """The vLLM version of `source`, checked before any work: a vLLM tree (CMakeLists.txt,
    a version), of the audited wheel's version when the target is a vLLM wheel."""
    if not source.is_dir() or not (source / "CMakeLists.txt").is_file():
        raise Sm121Error(f"--source {source}: not a vLLM source tree (no CMakeLists.txt)")
    require_contained(source)
    version = read_source_version(source)
    if version is None:
        raise Sm121Error(f"--source {source}: no vLLM version found (vllm/_version.py or "
                         "PKG-INFO)")
    wheel = wheel_name(Path(target))  # a wheel's name pip would not take: refused here
    if wheel is not None and wheel.distribution == "vllm" and not _same_version(
            wheel.version, version):
        raise Sm121Error(f"--source {source} is vLLM {version}, {Path(target).name} is "
                         f"{wheel.version}: the verdicts need the source the files were "
                         "built from")
    return version


def _same_version(wheel: Version, source: str) -> bool:
    """Whether a source's version string (as its tree writes it) is the wheel's version."""
    try:
        return Version(source) == wheel
    except InvalidVersion:
        return source == str(wheel)


def package_name(name: str) -> str | None:
    """An audited path's name relative to the vLLM package (`vllm/x/_C.abi3.so` ->
    `x/_C.abi3.so`), or None outside it."""
    parts = PurePosixPath(name).parts
    if "vllm" not in parts:
        return None
    last = len(parts) - 1 - parts[::-1].index("vllm")
    return "/".join(parts[last + 1:]) or None


@dataclass(frozen=True)
class SourceUnderAudit:
    """`audit --source`: the vLLM tree the audited files were built from, its version, and
    the GPU and CUDA toolkit its guards are evaluated for."""

    tree: Path
    version: str
    gpu: Target
    cuda: str

    @property
    def arch(self) -> ArchList:
        """The arch list a rebuild would use: the GPU's own (`12.1`)."""
        return ArchList.parse(f"{self.gpu.major}.{self.gpu.minor}")


def source_verdicts(reports: list[BinaryReport],
                    under: SourceUnderAudit) -> dict[str, Rebuild]:
    """Per audited vLLM extension (by its audited name): the verdict of the main job's
    decide step on the source (its CMake files copied, the rules applied to the copy)."""
    source, version, cuda, gpu = under.tree, under.version, under.cuda, under.gpu
    stock: dict[str, BinaryReport | None] = {}
    audited: dict[str, str] = {}
    for report in reports:
        name = package_name(report.name)
        if name and report.has_device_code and report.kernels is not None:
            stock[name], audited[name] = report, report.name
    if not stock:
        return {}
    with temp_dir("sm121-audit-source-") as tmp:
        tree = Path(tmp) / "src"
        tree.mkdir()
        shutil.copy2(source / "CMakeLists.txt", tree / "CMakeLists.txt")
        if (source / "cmake").is_dir():
            shutil.copytree(source / "cmake", tree / "cmake", symlinks=True)
        apply_for_build(tree, {}, PatchFor(version, under.arch, cuda, gpu))
        verdicts = judge_extensions(stock, decide_inputs(tree, under.arch, cuda, gpu),
                                   {t: p.name for p in projects() for t in p.targets})
    return {audited[p.name]: judged(p, gpu) for p in verdicts}


def judged(verdict: ExtensionVerdict, gpu: Target) -> Rebuild:
    remains = "".join(f"; {why}" for why in verdict.remains)
    if verdict.outcome == "build":
        return Rebuild("fixable", f"{verdict.reason}{remains} (sm121-build --base IMAGE builds "
                       "it)")
    if verdict.outcome == "native":
        return Rebuild("native", verdict.reason)
    if verdict.outcome == "below share":
        return Rebuild("optional", f"{verdict.reason}{remains}")
    if verdict.outcome == "no gain" and verdict.foreign:
        jit = verdict.before["jit"]
        return Rebuild("no sm_12x implementation",
                       f"no guard of the source gives {verdict.target} code {gpu} loads; its "
                       f"{verdict.before['none']} kernel(s) that load nothing are only for "
                       f"{', '.join(verdict.foreign)} (arch/family-specific instructions of "
                       "other GPUs)" + (f"; {jit} kernel(s) stay JIT-only" if jit else ""))
    return Rebuild("no rule", f"{verdict.reason}{remains}")
