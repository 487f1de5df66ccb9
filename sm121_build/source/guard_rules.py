"""Rewrite vLLM's arch guards by rule (YAML data under patches/): decided, atomic, idempotent.

A rule names a guard family by its output variable (`FP4_SM120_ARCHS`, `QUTLASS_ARCHS`, …),
the files to scan, and what a 12.x entry of such a guard's list becomes when the guard would
hand ptxas a plain 12.x target.  Every call of the guard functions in those files is found
and evaluated with the source's own CMake (`guards.evaluate`); only calls whose result holds a
plain 12.x target are rewritten, only in their list argument, with the first candidate form
after which CMake gives no plain 12.x target.  All files are written or none; the result is
re-evaluated.  Version-keyed literal patches (`exceptions`) remain for real exceptions.
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

from sm121_build.core.errors import PatchDrift, Sm121Error
from sm121_build.core.interrupts import temp_dir
from sm121_build.core.shipped import shipped_dir
from sm121_build.core.vllm import read_version_file
from sm121_build.cuda.compat import (
    DEFAULT_ARCH,
    DEFAULT_CUDA,
    ArchList,
    Target,
    loads_natively,
    parse_target,
)
from sm121_build.source.cmake_lang import Argument, read_source, real_file, source_text_bytes
from sm121_build.source.guards import (
    SM12X_ENTRY,
    UTILS,
    Guard,
    effective_archs,
    evaluate,
    intersect,
    scan_files,
)
from sm121_build.source.ptx_sass import (
    MacroResult,
    MacroRule,
    apply_macro_rule,
    is_macro_rule,
    parse_rule,
)

Outcome = Literal["applied", "not needed", "not applicable"]
RuleAction = Literal["rewrite", "add"]
REQUESTED_SM12X = re.compile(r"^(12\.\d+)[af]?$")
# The source trees a rule may apply to: vLLM itself, or an external project it builds.
PROJECTS = ("vllm", "vllm-flash-attn")


@dataclass(frozen=True)
class Patch:
    """A literal, version-keyed exception to the rules."""

    file: str
    find: str
    replace: str
    counts: tuple[int, ...]
    versions: SpecifierSet
    if_exists: bool

    @property
    def find_re(self) -> re.Pattern[str]:
        return _tolerant(self.find)


@dataclass(frozen=True)
class Rule:
    name: str
    family: re.Pattern[str]  # the guard variables it covers
    files: tuple[str, ...]  # glob patterns, relative to the source tree
    rewrite: tuple[str, ...]  # candidate forms of the 12.x entries, in order; {arch}: 12.x
    exceptions: tuple[Patch, ...]
    digest: str
    # "rewrite": a call giving a plain 12.x target has its 12.x entries replaced;
    # "add": a call giving the GPU no native code has the first form that does appended
    action: RuleAction = "rewrite"
    project: str = "vllm"  # the tree it applies to (PROJECTS)
    targets: tuple[str, ...] = ()  # the extension targets its guards feed

    def needs(self, guard: Guard, gpu: Target) -> bool:
        """Whether the rule must change this (evaluated) call."""
        if self.action == "rewrite":
            return bool(guard.plain_sm12x)
        return guard.taken and guard.result is not None and \
            not any(loads_natively(t, gpu) for t in guard.targets)

    def covers(self, guard: Guard) -> bool:
        return bool(self.family.match(guard.variable))

    def exceptions_for(self, version: Version) -> list[Patch]:
        return [p for p in self.exceptions if p.versions.contains(version, prereleases=True)]


@dataclass(frozen=True)
class Rewrite:
    guard: Guard
    new_list: str
    result: tuple[str, ...]

    @property
    def list_arg(self) -> Argument:
        arg = self.guard.call.list_arg
        assert arg is not None  # rewrites are made only for calls whose list is written out
        return arg


@dataclass
class RuleResult:
    name: str
    outcome: Outcome
    detail: str
    replacements: int = 0
    diff: str = ""
    before: list[Guard] = field(default_factory=list)
    after: list[Guard] = field(default_factory=list)
    rewrites: list[Rewrite] = field(default_factory=list)
    action: RuleAction = "rewrite"


def _tolerant(text: str) -> re.Pattern[str]:
    """Whitespace-tolerant literal: runs of blanks match any whitespace, also around ( )."""
    parts = [re.escape(token) for token in text.split()]
    pattern = r"\s+".join(parts)
    pattern = pattern.replace(r"\(", r"\(\s*").replace(r"\)", r"\s*\)")
    return re.compile(pattern.replace(r"\s*\s+", r"\s*").replace(r"\s+\s*", r"\s*"))


def patches_dir() -> Path:
    return shipped_dir("patches")


def _counts(raw: Any) -> tuple[int, ...]:
    values = raw if isinstance(raw, list) else [raw]
    if not values or not all(isinstance(v, int) and v >= 1 for v in values):
        raise ValueError(f"count must be a positive integer or a list of them, got {raw!r}")
    return tuple(values)


def _strings(raw: Any, what: str) -> tuple[str, ...]:
    if not isinstance(raw, list) or not raw or not all(isinstance(v, str) and v for v in raw):
        raise ValueError(f"{what} must be a non-empty list of strings, got {raw!r}")
    return tuple(raw)


def _rule(raw: Any, text: str) -> Rule:
    if not isinstance(raw, dict):
        raise ValueError("expected a mapping")
    unknown = set(raw) - {"name", "family", "files", "rewrite", "add", "exceptions",
                          "project", "targets"}
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(sorted(unknown))}")
    actions = [a for a in ("rewrite", "add") if a in raw]
    if len(actions) != 1:
        raise ValueError("give exactly one of rewrite: (replace 12.x entries) or add: "
                         "(append a 12.x entry)")
    action: RuleAction = "add" if actions == ["add"] else "rewrite"
    rewrite = _strings(raw[action], action)
    suffix = r"[af]" if action == "rewrite" else r"[af]?"
    for form in rewrite:
        entries = form.replace("{arch}", DEFAULT_ARCH).split(";")
        if not all(re.fullmatch(rf"12\.\d+{suffix}", e) for e in entries):
            raise ValueError(f"{action} form {form!r} is not " + (
                "arch-specific 12.x entries (e.g. '{arch}a', '12.0a')" if action == "rewrite"
                else "12.x entries (e.g. '{arch}', '12.0')"))
    project = str(raw.get("project", "vllm"))
    if project not in PROJECTS:
        raise ValueError(f"project {project!r} is not one of {', '.join(PROJECTS)}")
    targets = _strings(raw["targets"], "targets") if "targets" in raw else ()
    exceptions = tuple(
        Patch(file=p["file"], find=p["find"], replace=p["replace"], counts=_counts(p["count"]),
              versions=SpecifierSet(p["versions"]), if_exists=bool(p.get("if_exists")))
        for p in raw.get("exceptions") or [])
    return Rule(str(raw["name"]), re.compile(raw["family"]), _strings(raw["files"], "files"),
                rewrite, exceptions, hashlib.sha256(text.encode()).hexdigest(), action,
                project, targets)


@cache
def _load_all(directory: Path | None = None) -> tuple[tuple[Rule, ...], tuple[MacroRule, ...]]:
    folder = directory or patches_dir()
    rules: list[Rule] = []
    macros: list[MacroRule] = []
    for path in sorted(folder.glob("*.yaml")):
        text = path.read_text()
        try:
            raw = yaml.safe_load(text)
            if is_macro_rule(raw):
                macros.append(parse_rule(raw, text))
            else:
                rules.append(_rule(raw, text))
        except (KeyError, TypeError, ValueError, yaml.YAMLError, re.error) as exc:
            raise Sm121Error(f"patch rule {path} is malformed: {exc}") from None
    return tuple(rules), tuple(macros)


def load_rules(directory: Path | None = None) -> tuple[Rule, ...]:
    """The guard rules (rewrite / add)."""
    return _load_all(directory)[0]


def load_macro_rules(directory: Path | None = None) -> tuple[MacroRule, ...]:
    """The macro-insert rules (sass-from-ptx)."""
    return _load_all(directory)[1]


def rules_digest() -> str:
    """One hash over all rules: part of a build's content key."""
    rules, macros = _load_all()
    digests = [r.digest for r in rules] + [m.digest for m in macros]
    return hashlib.sha256("".join(digests).encode()).hexdigest()[:16]


def rules_for(project: str = "vllm") -> tuple[Rule, ...]:
    return tuple(rule for rule in load_rules() if rule.project == project)


def covered(guard: Guard, project: str = "vllm") -> bool:
    """Whether any rule of the project covers the guard's family (FP4, QUTLASS, FA2, …)."""
    return any(rule.covers(guard) for rule in rules_for(project))


def breaks_ptxas(guard: Guard) -> bool:
    """A guard a rewrite rule covers handing a plain 12.x target to ptxas: `cvt … e2m1x2`
    fails."""
    return bool(guard.plain_sm12x) and any(
        rule.covers(guard) for rule in rules_for() if rule.action == "rewrite")


def fixable_targets() -> dict[str, str]:
    """Extension target -> the rule that builds it natively for sm_12x (`_vllm_fa2_C`)."""
    rules, macros = _load_all()
    named = [(r.name, r.targets) for r in rules] + [(m.name, m.targets) for m in macros]
    return {target: name for name, targets in named for target in targets}


def target_gpu(archs: ArchList) -> Target:
    """The GPU a requested arch list is for: its first 12.x entry (`12.1a` -> sm_121)."""
    found = next((m.group(1) for a in archs.cmake_items if (m := REQUESTED_SM12X.match(a))),
                 DEFAULT_ARCH)
    return parse_target(found)


def parse_version(text: str) -> Version:
    try:
        return Version(text)
    except InvalidVersion:
        raise Sm121Error(f"vLLM version {text!r} is not a PEP 440 version") from None


def candidate_entries(form: str, archs: ArchList) -> list[str]:
    """A rewrite form's entries for the requested archs (`{arch}a` -> `12.1a`)."""
    requested = list(dict.fromkeys(m.group(1) for a in archs.cmake_items
                                   if (m := REQUESTED_SM12X.match(a))))
    entries: list[str] = []
    for part in form.split(";"):
        for value in ([part.replace("{arch}", r) for r in requested] if "{arch}" in part
                      else [part]):
            if value not in entries:
                entries.append(value)
    return entries


def rewritten_list(guard: Guard, entries: list[str]) -> str:
    """The guard's list with its 12.x entries replaced by `entries` (at the first one's
    place), every other entry kept as written.  Entries that come from a variable are
    written out: the argument then becomes the literal list."""
    call = guard.call
    assert call.list_arg is not None and call.arch_list is not None
    written = call.list_arg.value.split(";")
    literal_sm12x = [e for e in written if SM12X_ENTRY.match(e)]
    expanded_sm12x = [e for e in call.arch_list.split(";") if SM12X_ENTRY.match(e)]
    source = written if len(literal_sm12x) == len(expanded_sm12x) else call.arch_list.split(";")
    out: list[str] = []
    for entry in source:  # the new entries go where the first 12.x one was
        for kept in entries if SM12X_ENTRY.match(entry) else [entry]:
            if kept not in out:
                out.append(kept)
    return ";".join(out)


def _argument_text(guard: Guard, new_list: str, text: str) -> str:
    arg = guard.call.list_arg
    assert arg is not None
    if arg.kind == "quoted":
        return f'"{new_list}"'
    if arg.kind == "bracket":
        raw = text[arg.start:arg.end]
        opening = raw[:raw.index("[", 1) + 1]
        return f"{opening}{new_list}{opening.replace('[', ']')}"
    return new_list


@dataclass(frozen=True)
class PatchFor:
    """What a tree is patched for: the vLLM version (its version-keyed exceptions; for an
    external project, vLLM's), the CMake arch list (for an external project, the CUDA_ARCHS
    vLLM hands it), the CUDA toolkit's version and the GPU (by default that of the first
    12.x arch)."""

    version: str
    archs: ArchList
    cuda_version: str = DEFAULT_CUDA
    gpu: Target | None = None

    @property
    def target(self) -> Target:
        return self.gpu or target_gpu(self.archs)

    def handed(self, archs: ArchList) -> PatchFor:
        """The same build, for a project vLLM hands `archs`."""
        return PatchFor(self.version, archs, self.cuda_version, self.gpu)


def apply_rule(rule: Rule, source: Path, want: PatchFor, check: bool = False) -> RuleResult:
    """Decide with the guards' evaluation, then rewrite every breaking call or none."""
    version, archs, cuda_version = want.version, want.archs, want.cuda_version
    parsed = parse_version(version)
    files = scan_files(source, rule.files)
    originals = {rel: read_source(source / rel) for rel in files}
    texts = _apply_exceptions(rule, version, parsed, dict(originals))
    before = _evaluate(source, _changed(texts, originals), files, want, rule.files)
    mine = [g for g in before if rule.covers(g)]
    unreadable = [g for g in mine if g.result is None and g.call.may_give_sm12x]
    if unreadable:
        g = unreadable[0]
        raise PatchDrift(f"{g.location}: cannot evaluate {g.variable} ({g.call.unresolved}); "
                         f"rule {rule.name} covers it, so not building blind")
    gpu = want.target
    if rule.action == "add":
        built = effective_archs(source, archs, cuda_version).cmake_items
        relevant = [g for g in mine if g.taken] if any(
            REQUESTED_SM12X.match(a) for a in built) else []
    else:
        relevant = [g for g in mine if g.taken and (
            any(SM12X_ENTRY.match(e) for e in g.arch_list.split(";")) or g.targets)]
    rewrites = []
    for guard in (g for g in relevant if rule.needs(g, gpu)):
        if guard.call.list_arg is None:
            gives = f"plain {';'.join(guard.plain_sm12x)}" if rule.action == "rewrite" \
                else ";".join(guard.targets) or "nothing"
            raise PatchDrift(f"{guard.location}: {guard.variable} gives {gives} through "
                             f"{guard.call.function}, whose list is inside that function: "
                             f"rule {rule.name} cannot {rule.action} "
                             f"{'it' if rule.action == 'rewrite' else 'to it'}")
        rewrites.append(_choose(rule, source, guard, want))
    # last first: a rewrite that changes a list's length moves every later offset in its file
    for rewrite in sorted(rewrites, key=lambda r: (r.guard.file, r.list_arg.start),
                          reverse=True):
        text = texts[rewrite.guard.file]
        texts[rewrite.guard.file] = text[:rewrite.list_arg.start] + _argument_text(
            rewrite.guard, rewrite.new_list, text) + text[rewrite.list_arg.end:]
    changed = _changed(texts, originals)
    if not changed:
        detail = (
            f"no guard the rule covers {_need_text(rule, gpu, 'gives')} for {archs.cmake} "
            f"with CUDA {cuda_version}" if relevant else
            "no guard the rule covers has an SM12x entry in this source" if rule.action ==
            "rewrite" else f"no guard the rule covers is built for a {archs.cmake} build here")
        return RuleResult(rule.name, "not needed" if relevant else "not applicable", detail,
                          before=before, after=before, action=rule.action)
    after = _evaluate(source, changed, files, want, rule.files)
    _check_after(rule, before, after, version, gpu)
    diff = "".join(
        "".join(difflib.unified_diff(originals[rel].splitlines(True), new.splitlines(True),
                                     f"a/{rel}", f"b/{rel}"))
        for rel, new in changed.items())
    if not check:
        _write_all(source, changed)
    replacements = len(rewrites) + sum(
        1 for p in rule.exceptions_for(parsed) if p.file in changed)
    detail = (f"{len(rewrites)} guard call(s) "
              f"{'rewritten' if rule.action == 'rewrite' else 'given a target'} in "
              f"{len(changed)} file(s)")
    return RuleResult(rule.name, "applied", detail, replacements, diff, before, after, rewrites,
                      rule.action)


def _changed(texts: dict[str, str], originals: dict[str, str]) -> dict[str, str]:
    return {rel: text for rel, text in texts.items() if text != originals[rel]}


def _need_text(rule: Rule, gpu: Target, verb: str) -> str:
    return f"{verb} a plain 12.x target" if rule.action == "rewrite" else \
        f"{verb} {gpu} no native code"


def added_list(guard: Guard, entries: list[str]) -> str:
    """The guard's list with `entries` appended (those it does not hold yet)."""
    call = guard.call
    assert call.arch_list is not None
    written = [e for e in call.arch_list.split(";") if e]  # a variable's value written out
    return ";".join(written + [e for e in entries if e not in written])


def _choose(rule: Rule, source: Path, guard: Guard, want: PatchFor) -> Rewrite:
    make = rewritten_list if rule.action == "rewrite" else added_list
    gpu = want.target
    lists = [make(guard, candidate_entries(form, want.archs)) for form in rule.rewrite]
    results = intersect(source, want.archs, lists, want.cuda_version)
    for new_list, got in zip(lists, results, strict=True):
        if not rule.needs(Guard(guard.call, got), gpu):
            return Rewrite(guard, new_list, got)
    raise PatchDrift(f"{guard.location}: no form of rule {rule.name} stops {guard.variable} "
                     f"{_need_text(rule, gpu, 'giving')} (tried {', '.join(lists)})")


def _check_after(rule: Rule, before: list[Guard], after: list[Guard], version: str,
                 gpu: Target) -> None:
    """The patched source re-evaluated: nothing the rule covers still needs it, and every
    guard outside its family gives what it gave."""
    still = [g for g in after if rule.covers(g) and g.taken and rule.needs(g, gpu)]
    if still:
        raise PatchDrift(
            f"rule {rule.name} leaves {still[0].location} {still[0].variable} yielding "
            f"{';'.join(still[0].targets) or 'nothing'} for {version}")
    others = [(g.file, g.variable, g.arch_list, g.result) for g in before if not rule.covers(g)]
    kept = [(g.file, g.variable, g.arch_list, g.result) for g in after if not rule.covers(g)]
    if others != kept:
        raise PatchDrift(f"rule {rule.name} would change guards outside its family; not applied")


def _apply_exceptions(rule: Rule, version: str, parsed: Version,
                      texts: dict[str, str]) -> dict[str, str]:
    for patch in rule.exceptions_for(parsed):
        if patch.file not in texts:
            if patch.if_exists:
                continue
            raise PatchDrift(f"patch drift: {patch.file} missing in vLLM {version} source")
        found = len(patch.find_re.findall(texts[patch.file]))
        if found not in patch.counts:
            expected = " or ".join(str(c) for c in patch.counts)
            raise PatchDrift(
                f"patch drift in {patch.file} for vLLM {version}: expected {expected} "
                f"match(es) of {patch.find!r}, found {found}; not building unpatched")
        texts[patch.file] = patch.find_re.sub(patch.replace.replace("\\", "\\\\"),
                                              texts[patch.file])
    return texts


def _evaluate(source: Path, changed: dict[str, str], files: list[str], want: PatchFor,
              patterns: tuple[str, ...]) -> list[Guard]:
    """The guards of `source`, or of a scratch copy of its scanned `files` (and
    cmake/utils.cmake) with the `changed` texts, when there are any."""
    archs, cuda_version = want.archs, want.cuda_version
    if not changed:
        return evaluate(source, archs, cuda_version, patterns)
    with temp_dir("sm121-patched-") as tmp:
        copy = Path(tmp)
        for rel in [*files, UTILS]:
            if (source / rel).exists():
                (copy / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source / rel, copy / rel)
        for rel, text in changed.items():
            (copy / rel).write_bytes(source_text_bytes(text))
        return evaluate(copy, archs, cuda_version, patterns)


def _write_all(source: Path, texts: dict[str, str]) -> None:
    """All files or none: stage every file next to its target, then rename each into place."""
    staged: list[tuple[Path, Path]] = []
    try:
        for name, text in texts.items():
            target = real_file(source, name)
            handle, tmp = tempfile.mkstemp(prefix=".sm121-", dir=target.parent)
            with os.fdopen(handle, "wb") as out:
                out.write(source_text_bytes(text))
            shutil.copymode(target, tmp)
            staged.append((Path(tmp), target))
        originals = {target: target.read_bytes() for _, target in staged}
        done: list[Path] = []
        try:
            for tmp_path, target in staged:
                os.replace(tmp_path, target)
                done.append(target)
        except OSError:
            for target in done:
                target.write_bytes(originals[target])
            raise
    finally:
        for tmp_path, _ in staged:
            tmp_path.unlink(missing_ok=True)


def apply_external(vllm_tree: Path, tree: Path, project: str,
                   want: PatchFor) -> tuple[ArchList, list[RuleResult]]:
    """An external project's rules on its tree, for the CUDA_ARCHS the vLLM tree hands it
    (vLLM narrows the requested archs before including the project).  Returns those archs
    and the results."""
    handed = effective_archs(vllm_tree, want.archs, want.cuda_version)
    return handed, apply_all(tree, want.handed(handed), project=project)


def apply_all(source: Path, want: PatchFor, check: bool = False,
              project: str = "vllm") -> list[RuleResult]:
    """Every rule of `project` on the tree (`PatchFor` says what for)."""
    return [apply_rule(r, source, want, check) for r in rules_for(project)]


def read_source_version(source: Path) -> str | None:
    """The vLLM version of a source tree (`vllm/_version.py` or an sdist's PKG-INFO)."""
    version_py = source / "vllm" / "_version.py"
    text = read_source(version_py, "replace") if version_py.exists() else ""
    if text and (version := read_version_file(text)[0]):
        return version
    pkg_info = source / "PKG-INFO"
    if pkg_info.exists():
        found: str | None = HeaderParser().parsestr(read_source(pkg_info, "replace"))["Version"]
        return found
    return None


def apply_for_build(source: Path, external: dict[str, Path], want: PatchFor,
                    vllm: bool = True) -> list[str]:
    """The build's patch step: vLLM's rules on `source`, then each external project's
    (`external`: project name -> its tree) for the archs vLLM hands it.  One line per rule."""
    lines: list[str] = []
    gpu = want.target
    if vllm:
        lines += [f"{r.name}: {r.outcome} ({r.detail})"
                  for r in apply_all(source, PatchFor(want.version, want.archs,
                                                      want.cuda_version))]
        effective = effective_archs(source, want.archs, want.cuda_version)
        lines += [f"{r.name}: {r.outcome} ({r.detail})"
                  for r in apply_macros(source, "vllm", effective, gpu)]
    for name, tree in external.items():
        handed, results = apply_external(source, tree, name, want)
        lines += [f"{r.name} ({name}, CUDA_ARCHS {handed}): {r.outcome} ({r.detail})"
                  for r in results]
        lines += [f"{r.name} ({name}, CUDA_ARCHS {handed}): {r.outcome} ({r.detail})"
                  for r in apply_macros(tree, name, handed, gpu)]
    return lines


def apply_macros(tree: Path, project: str, effective: ArchList, gpu: Target,
                 check: bool = False) -> list[MacroResult]:
    """The project's macro-insert rules (sass-from-ptx) on a tree, for the archs it builds."""
    return [apply_macro_rule(rule, tree, effective, gpu, check) for rule in load_macro_rules()
            if project in rule.projects]
