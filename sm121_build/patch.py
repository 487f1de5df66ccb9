"""Apply patch sets (YAML data under patches/) to a vLLM checkout: decided, atomic, idempotent.

A set is applied only when the explain evaluation says it is needed; every patch of the set
that applies to the vLLM version must match the expected number of times (drift is an
error, never a silent unpatched build); all files are written or none; the result is
re-evaluated and must no longer hand a plain 12.x target to ptxas.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from email.parser import HeaderParser
from functools import cache
from pathlib import Path
from typing import Any, Literal

import yaml
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from .errors import Sm121Error
from .explain import DEFAULT_CUDA, Guard, evaluate
from .inspect import read_version_file
from .shipped import shipped_dir

Outcome = Literal["applied", "already applied", "not needed", "not applicable"]


@dataclass(frozen=True)
class Patch:
    file: str
    find: str
    replace: str
    counts: tuple[int, ...]
    versions: SpecifierSet
    if_exists: bool

    @property
    def find_re(self) -> re.Pattern[str]:
        return _tolerant(self.find)

    @property
    def replace_re(self) -> re.Pattern[str]:
        return _tolerant(self.replace)


@dataclass(frozen=True)
class PatchSet:
    name: str
    guards: re.Pattern[str]
    patches: tuple[Patch, ...]
    digest: str

    def for_version(self, version: Version) -> list[Patch]:
        return [p for p in self.patches if p.versions.contains(version, prereleases=True)]


@dataclass
class SetResult:
    name: str
    outcome: Outcome
    detail: str
    replacements: int = 0
    diff: str = ""
    before: list[Guard] = field(default_factory=list)
    after: list[Guard] = field(default_factory=list)


def _tolerant(text: str) -> re.Pattern[str]:
    """Whitespace-tolerant literal: runs of blanks match any whitespace, also around ( )."""
    parts = [re.escape(token) for token in text.split()]
    pattern = r"\s+".join(parts)
    pattern = pattern.replace(r"\(", r"\(\s*").replace(r"\)", r"\s*\)")
    return re.compile(pattern)


def patches_dir() -> Path:
    return shipped_dir("patches")


def _counts(raw: Any) -> tuple[int, ...]:
    values = raw if isinstance(raw, list) else [raw]
    if not values or not all(isinstance(v, int) and v >= 1 for v in values):
        raise ValueError(f"count must be a positive integer or a list of them, got {raw!r}")
    return tuple(values)


@cache
def load_sets(directory: Path | None = None) -> tuple[PatchSet, ...]:
    folder = directory or patches_dir()
    sets = []
    for path in sorted(folder.glob("*.yaml")):
        text = path.read_text()
        try:
            raw = yaml.safe_load(text)
            patches = tuple(
                Patch(file=p["file"], find=p["find"], replace=p["replace"],
                      counts=_counts(p["count"]), versions=SpecifierSet(p.get("versions", "")),
                      if_exists=bool(p.get("if_exists", False)))
                for p in raw["patches"])
            sets.append(PatchSet(raw["name"], re.compile(raw["guards"]), patches,
                                 hashlib.sha256(text.encode()).hexdigest()))
        except (KeyError, TypeError, ValueError, yaml.YAMLError, re.error) as exc:
            raise Sm121Error(f"patch set {path} is malformed: {exc}") from None
    return tuple(sets)


def sets_digest() -> str:
    """One hash over all patch sets: part of a build's content key."""
    return hashlib.sha256("".join(s.digest for s in load_sets()).encode()).hexdigest()[:16]


def parse_version(text: str) -> Version:
    try:
        return Version(text)
    except InvalidVersion:
        raise Sm121Error(f"vLLM version {text!r} is not a PEP 440 version") from None


def _breaking(guards: list[Guard], pattern: re.Pattern[str]) -> list[Guard]:
    return [g for g in guards if pattern.match(g.variable) and g.plain_sm12x]


def _relevant(guards: list[Guard], pattern: re.Pattern[str]) -> list[Guard]:
    return [g for g in guards if pattern.match(g.variable) and "12." in g.arch_list]


def apply_set(patch_set: PatchSet, source: Path, version: str, archs: str,
              check: bool = False, cuda_version: str = DEFAULT_CUDA) -> SetResult:
    """Decide with the explain evaluation, then apply all of the set's patches or none."""
    parsed = parse_version(version)
    before = evaluate(source, archs, cuda_version)
    result = SetResult(patch_set.name, "not applicable", "", before=before, after=before)
    if not _relevant(before, patch_set.guards):
        result.detail = "no FP4/QUTLASS guard for SM12x in this source"
        return result
    breaking = _breaking(before, patch_set.guards)
    patches = patch_set.for_version(parsed)
    already = [p for p in patches if _exists_or_required(source, p)
               and not p.find_re.search((source / p.file).read_text())
               and p.replace_re.search((source / p.file).read_text())]
    if not breaking:
        if already and len(already) == len([p for p in patches
                                            if _exists_or_required(source, p)]):
            result.outcome, result.detail = "already applied", "guards already arch-specific"
        else:
            result.outcome = "not needed"
            result.detail = (f"no FP4/QUTLASS guard yields a plain 12.x target for {archs}")
        return result
    originals: dict[str, str] = {}
    patched: dict[str, str] = {}
    for patch in patches:
        path = source / patch.file
        if not path.exists():
            if patch.if_exists:
                continue
            raise Sm121Error(f"patch drift: {patch.file} missing in vLLM {version} source")
        current = patched.get(patch.file) or originals.setdefault(patch.file, path.read_text())
        found = len(patch.find_re.findall(current))
        if found not in patch.counts:
            expected = " or ".join(str(c) for c in patch.counts)
            raise Sm121Error(
                f"patch drift in {patch.file} for vLLM {version}: expected {expected} "
                f"match(es) of {patch.find!r}, found {found}; not building unpatched")
        patched[patch.file] = patch.find_re.sub(patch.replace, current)
        result.replacements += found
    if not patched:
        raise Sm121Error(
            f"patch drift: {', '.join(f'{g.file}:{g.line} {g.variable}' for g in breaking)} "
            f"yield a plain 12.x target for vLLM {version}, and no patch of set "
            f"{patch_set.name} applies to that version")
    result.diff = "".join(
        "".join(difflib.unified_diff(originals[name].splitlines(True), new.splitlines(True),
                                     f"a/{name}", f"b/{name}"))
        for name, new in patched.items())
    result.after = _evaluate_patched(source, archs, patched, cuda_version)
    still = _breaking(result.after, patch_set.guards)
    if still:
        raise Sm121Error(
            f"patch set {patch_set.name} leaves {still[0].file}:{still[0].line} "
            f"{still[0].variable} yielding {';'.join(still[0].result)} for vLLM {version}")
    if not check:
        _write_all(source, patched)
    result.outcome = "applied"
    result.detail = f"{result.replacements} replacement(s) in {len(patched)} file(s)"
    return result


def _exists_or_required(source: Path, patch: Patch) -> bool:
    return (source / patch.file).exists() or not patch.if_exists


def _evaluate_patched(source: Path, archs: str, texts: dict[str, str],
                      cuda_version: str) -> list[Guard]:
    with tempfile.TemporaryDirectory(prefix="sm121-patched-") as tmp:
        copy = Path(tmp)
        shutil.copytree(source / "cmake", copy / "cmake")
        if (source / "CMakeLists.txt").exists():
            shutil.copy2(source / "CMakeLists.txt", copy / "CMakeLists.txt")
        for name, text in texts.items():
            (copy / name).write_text(text)
        return evaluate(copy, archs, cuda_version)


def _write_all(source: Path, texts: dict[str, str]) -> None:
    """All files or none: stage every file next to its target, then rename each into place."""
    staged: list[tuple[Path, Path]] = []
    try:
        for name, text in texts.items():
            target = source / name
            handle, tmp = tempfile.mkstemp(prefix=".sm121-", dir=target.parent)
            with os.fdopen(handle, "w") as out:
                out.write(text)
            shutil.copymode(target, tmp)
            staged.append((Path(tmp), target))
        originals = {target: target.read_text() for _, target in staged}
        done: list[Path] = []
        try:
            for tmp_path, target in staged:
                os.replace(tmp_path, target)
                done.append(target)
        except OSError:
            for target in done:
                target.write_text(originals[target])
            raise
    finally:
        for tmp_path, _ in staged:
            tmp_path.unlink(missing_ok=True)


def apply_all(source: Path, version: str, archs: str, check: bool = False,
              cuda_version: str = DEFAULT_CUDA) -> list[SetResult]:
    return [apply_set(s, source, version, archs, check, cuda_version) for s in load_sets()]


def read_source_version(source: Path) -> str | None:
    """The vLLM version of a source tree (`vllm/_version.py` or an sdist's PKG-INFO)."""
    version_py = source / "vllm" / "_version.py"
    if version_py.exists() and (version := read_version_file(version_py.read_text())[0]):
        return version
    pkg_info = source / "PKG-INFO"
    if pkg_info.exists():
        found: str | None = HeaderParser().parsestr(pkg_info.read_text())["Version"]
        return found
    return None
