"""A proof document read back: from a file (`kernels publish --proof`) or a registry's signed
statement (`kernels verify`, `--kernels-from`), as outside input.  Every field is checked for
type and bound, and the verdict against the counts it rests on: a document that says
"proven" over a cubin that did not load, or over an added kernel never launched, is no
proof.  Its one line is what a user is shown: "proven on NVIDIA GB10 (sm_121), driver
580.95.05 (CUDA 13.0), 2026-11-28: ...", or "partial (proven for X of Y added kernels; Z
never launched) on ...".

A proof of format 2 (before coverage was measured) is read, but as `partial` whatever it
says: no one knows which of its added kernels a case launched ("coverage not measured")."""

from __future__ import annotations

import json
import posixpath
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from sm121_build.core.console import shown_cut
from sm121_build.core.errors import Sm121Error, VerificationError
from sm121_build.core.inputs import InputRefused, read_input
from sm121_build.core.strict_json import strict_loads
from sm121_build.image.cosign import TrustKey, Untrusted
from sm121_build.image.signed_files import signature_beside, signed_beside
from sm121_build.jobs.proofs.prove_document import FORMAT, coverage_line

# the in-toto predicate type a proof is attached to a kernels image under
PROOF_TYPE = "https://sm121-build.dev/proof/v1"
MAX_PROOF = 32 << 20  # bytes of a proof document: ~2 KB a file, ~300 B a cubin and an op
MAX_ITEMS = 100_000  # files, cubins of a file, ops
MAX_TEXT = 1_000
MAX_KERNEL_NAME = 64 << 10  # a mangled kernel name (CUTLASS's run to a few thousand)
MAX_KERNELS = 1_000_000  # names a file's coverage lists
OLD_FORMAT = 2  # read as partial: its coverage was not measured
UNMEASURED = "coverage not measured: a format-2 proof"
_TARGET = re.compile(r"sm_[0-9]{2,3}\Z", re.ASCII)
_CUDA = re.compile(r"[0-9]{1,3}\.[0-9]{1,3}\Z", re.ASCII)
_MADE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z\Z", re.ASCII)
MADE_FORMAT = "%Y-%m-%dT%H:%M:%SZ"  # what `prove` writes (UTC)
_SHA256 = re.compile(r"[0-9a-f]{64}\Z", re.ASCII)


class NotAProof(Sm121Error):
    """A document that is not a proof this tool writes (exit 2)."""


@dataclass(frozen=True)
class Counted:
    """How many of how many (`12/12`)."""

    good: int
    total: int

    @property
    def whole(self) -> bool:
        return self.good == self.total

    def __str__(self) -> str:
        return f"{self.good:,}/{self.total:,}"


@dataclass(frozen=True)
class KernelCoverage:
    """The added kernels of a proof's files: how many, how many a case compared equal
    launched, how many never launched and how many shown unreachable."""

    added: int
    compared: int
    never_launched: int
    unreachable: int

    def __str__(self) -> str:
        return coverage_line(self.added, self.compared, self.never_launched,
                             self.unreachable)


@dataclass(frozen=True)
class ProofSummary:
    """What a proof says, checked: the GPU and driver it ran on, when, its verdict, the
    files it proved (name, sha256), and the counts the verdict rests on."""

    gpu: str
    target: str
    driver: str | None
    driver_cuda: str
    made: str
    verdict: str
    files: tuple[tuple[str, str], ...]
    cubins: Counted  # added cubins loaded with the JIT disabled
    kernels: Counted  # their kernels found by name
    ops: Counted  # op cases bitwise equal to the stock JIT's
    coverage: KernelCoverage | None = None  # None: a format-2 proof (not measured)

    @property
    def how_much(self) -> str:
        """`proven for X of Y added kernels; Z never launched`, or that it is not known."""
        return UNMEASURED if self.coverage is None else str(self.coverage)

    def line(self) -> str:
        """`proven on NVIDIA GB10 (sm_121), driver 580.95.05 (CUDA 13.0), 2026-11-28: ...`;
        `partial (proven for X of Y added kernels; Z never launched) on ...`."""
        driver = f"driver {shown_cut(self.driver)} " if self.driver else "driver "
        verdict = f"partial ({self.how_much})" if self.verdict == "partial" else self.verdict
        launched = f"; {self.how_much}" if self.coverage is not None and \
            self.verdict == "proven" else ""  # a failed proof's coverage proves nothing
        return (f"{verdict} on {shown_cut(self.gpu)} ({self.target}), {driver}(CUDA "
                f"{self.driver_cuda}), {self.made[:10]}: {self.cubins} added cubins load with "
                f"the JIT off, {self.kernels} kernels found, {self.ops} op cases bitwise equal "
                f"to the stock JIT{launched}")

    def mismatch(self, files: Mapping[str, str]) -> str | None:
        """Why the proof is not of these files (name -> sha256), or None when it proves
        each of them, byte for byte, and nothing else: a proof of some of them is not whole."""
        for name, sha256 in self.files:
            if name not in files:
                return f"it proves {shown_cut(name)}, which these kernels do not have"
            if files[name] != sha256:
                return f"its {shown_cut(name)} is another file (sha256 {sha256[:12]}…)"
        proved = {name for name, _sha256 in self.files}
        missing = sorted(name for name in files if name not in proved)
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            return (f"it is not whole: it does not prove {len(missing)} of their "
                    f"{len(files)} files: {', '.join(shown_cut(n) for n in missing[:3])}{more}")
        return None


def _need(condition: bool, why: str) -> None:
    if not condition:
        raise NotAProof(why)


def _text(value: object, what: str, pattern: re.Pattern[str] | None = None) -> str:
    _need(isinstance(value, str) and len(value) <= MAX_TEXT, f"{what} is not a text")
    assert isinstance(value, str)
    _need(pattern is None or bool(pattern.match(value)),
          f"{what} {shown_cut(value)!r} is malformed")
    return value


def _made(value: object) -> str:
    """When the proof was made, as `prove` writes it (UTC), a date that exists."""
    made = _text(value, "made", _MADE)
    try:
        datetime.strptime(made, MADE_FORMAT)
    except ValueError:
        raise NotAProof(f"made {shown_cut(made)!r} is not a date") from None
    return made


def _name(value: object) -> str:
    """A file's name: a plain relative path, as `prove` writes it."""
    name = _text(value, "a file's name")
    _need(bool(name) and not name.startswith("/") and posixpath.normpath(name) == name
          and ".." not in name.split("/"), f"a file's name {shown_cut(name)!r} is not a plain "
          "relative path")
    return name


def _plain(data: object) -> None:
    """The document as JSON can carry it on: no NaN or Infinity, no lone surrogate (a
    statement of it is written as UTF-8: refused here, before anything is pushed)."""
    try:
        json.dumps(data, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (ValueError, RecursionError) as exc:  # UnicodeEncodeError is a ValueError
        why = "a lone surrogate in a text" if isinstance(exc, UnicodeError) else \
            "NaN or Infinity" if "Out of range float" in str(exc) else "too deep"
        raise NotAProof(f"it holds {why}: not JSON a proof is written in") from None


def _count(value: object, what: str) -> int:
    _need(type(value) is int and 0 <= value < 2**31, f"{what} is not a count")
    assert isinstance(value, int)
    return value


def _items(data: Mapping[str, Any], key: str) -> list[Any]:
    value = data.get(key)
    _need(isinstance(value, list) and len(value) <= MAX_ITEMS, f"{key} is not a bounded list")
    assert isinstance(value, list)
    _need(all(isinstance(item, dict) for item in value), f"an entry of {key} is not an object")
    return value


def summarise(data: object) -> ProofSummary:
    """The summary of a proof document (its JSON value), or NotAProof saying why not."""
    _plain(data)
    _need(isinstance(data, dict), "not a JSON object")
    assert isinstance(data, dict)
    form = data.get("format")
    _need(type(form) is int and form in (OLD_FORMAT, FORMAT), f"format {shown_cut(form)} is "
          f"not {FORMAT} (nor {OLD_FORMAT}, read as partial)")
    gpu = data.get("gpu")
    _need(isinstance(gpu, dict), "gpu is not an object")
    assert isinstance(gpu, dict)
    driver = gpu.get("driver_version")
    files, cubins, kernels = [], [0, 0], [0, 0]
    evidence: dict[str, int] = {}  # a file -> its cubins with kernels, loaded, all found
    harnessed = set()
    covers: list[tuple[int, int, int, int, bool]] = []
    tied: dict[str, _CubinCounts] = {}  # a file -> what its cubins say its coverage rests on
    for item in _items(data, "files"):
        name = _name(item.get("name"))
        _need(name not in evidence, f"{shown_cut(name)} is listed twice")
        files.append((name, _text(item.get("sha256"), "a file's sha256", _SHA256)))
        harness = item.get("harness")
        _need(harness is None or isinstance(harness, str), "a file's harness is not a text")
        if harness is not None:
            harnessed.add(name)
        evidence[name] = 0
        counts = tied.setdefault(name, _CubinCounts())
        for cubin in _items(item, "cubins"):
            loaded = cubin.get("loaded")
            _need(isinstance(loaded, bool), "a cubin's loaded is not true or false")
            found, wanted = _count(cubin.get("found"), "found"), _count(cubin.get("kernels"),
                                                                        "kernels")
            if form == FORMAT:
                ran = _count(cubin.get("launched"), "a cubin's launched")
                _need(ran <= wanted, "a cubin's launched is more than its kernels")
                counts.add(wanted, ran)
            cubins[0] += loaded
            cubins[1] += 1
            kernels[0] += min(found, wanted)
            kernels[1] += wanted
            evidence[name] += loaded and 0 < wanted == found
        if form == FORMAT:
            covers.append(_coverage(item.get("coverage"), name))
            counts.cover = covers[-1]
    raw_ops = _items(data, "ops")
    never = _never_launched(_items(data, "files"))
    for op in raw_ops:
        said = _launched(op.get("launched", []))  # absent in proofs made before it was said
        _need(not said & never.get(str(op.get("file")), set()), "an op case says it launched "
              "a kernel its file's coverage says was never launched")
    ops = [o.get("bitwise_equal") for o in raw_ops]
    _need(all(o is None or isinstance(o, bool) for o in ops), "an op's bitwise_equal is "
          "not true, false or null")
    op_files = Counter(_text(o.get("file"), "an op's file") for o in raw_ops)
    raw_stock = _items(data, "stock_without_jit")
    stock = [s.get("failed") for s in raw_stock]
    stock_files = Counter(_text(s.get("file"), "a stock run's file") for s in raw_stock)
    left_out = data.get("left_out", [])  # absent in proofs made before it was said
    _need(isinstance(left_out, list), "left_out is not a list")
    verdict = _text(data.get("verdict"), "verdict")
    _need(verdict in ("proven", "failed") or (verdict == "partial" and form == FORMAT),
          f"verdict {shown_cut(verdict)!r} is not proven, partial or failed")
    covered = None if form != FORMAT else _whole_coverage(data.get("coverage"), covers)
    equal_ops = Counter(str(o.get("file")) for o in raw_ops if o.get("bitwise_equal") is True)
    for name, counts in tied.items():
        if counts.cover is not None:
            _tied(name, counts, name in harnessed, equal_ops[name])
    summary = ProofSummary(
        _text(gpu.get("name"), "the GPU's name"), _text(gpu.get("target"), "target", _TARGET),
        None if driver is None else _text(driver, "the driver's version"),
        _text(gpu.get("driver_cuda"), "driver_cuda", _CUDA),
        _made(data.get("made")), verdict, tuple(files),
        Counted(*cubins), Counted(*kernels), Counted(sum(o is True for o in ops), len(ops)),
        covered)
    whole = all(cover[4] for cover in covers)
    _need(verdict != "proven" or whole, "it says proven, but not every added kernel was "
          "launched by a case compared equal (" + (str(covered) if covered else "") + ")")
    _need(verdict != "partial" or not whole, "it says partial, but every added kernel was "
          "launched by a case compared equal")
    if verdict in ("proven", "partial"):
        _need(not left_out, f"it says proven, but leaves out {len(left_out)} file(s) of its "
              "subject")
        _need(_unfounded(summary, evidence, harnessed, (op_files, stock_files)) is None
              and all(s is True for s in stock) and data.get("problems") == [],
              f"it says {verdict}, but " + (_unfounded(summary, evidence, harnessed,
                                                      (op_files, stock_files))
                                            or "a stock file ran with the JIT off or a "
                                            "problem is listed"))
    if form == OLD_FORMAT and verdict == "proven":  # which kernels ran is not known
        summary = replace(summary, verdict="partial")
    return summary


@dataclass
class _CubinCounts:
    """What a file's cubins say (their kernels, how many of each launched), which its
    coverage must agree with; and that coverage, once read."""

    kernels: list[int] = field(default_factory=list)
    launched: list[int] = field(default_factory=list)
    cover: tuple[int, int, int, int, bool] | None = None

    def add(self, kernels: int, launched: int) -> None:
        self.kernels.append(kernels)
        self.launched.append(launched)


def _tied(name: str, counts: _CubinCounts, harnessed: bool, equal_ops: int) -> None:
    """A file's coverage against what the rest of the document says: its added kernels are
    its cubins' (at least the largest cubin's, at most all of them: a kernel may be in two
    cubins), its launched ones their launched ones (the same bounds), and nothing launched
    or compared without a harness, nothing compared without an op case compared equal."""
    assert counts.cover is not None
    added, launched, compared, _unreachable, _whole = counts.cover
    where = f"{shown_cut(name)}'s coverage"
    _need(max(counts.kernels, default=0) <= added <= sum(counts.kernels),
          f"{where} says {added:,} added kernels; its cubins hold "
          f"{sum(counts.kernels):,}")
    _need(max(counts.launched, default=0) <= launched <= sum(counts.launched),
          f"{where} says {launched:,} launched; its cubins say {sum(counts.launched):,}")
    _need(harnessed or launched == 0, f"{where} says {launched:,} launched, but no harness "
          "ran the file's ops")
    _need(compared == 0 or equal_ops > 0, f"{where} says {compared:,} compared, but no op "
          "case of the file was compared equal")


def _kernel_names(value: object, what: str) -> list[str]:
    _need(isinstance(value, list) and len(value) <= MAX_KERNELS, f"{what} is not a bounded "
          "list")
    assert isinstance(value, list)
    _need(all(isinstance(n, str) and 0 < len(n) <= MAX_KERNEL_NAME for n in value),
          f"a name of {what} is not a kernel's name")
    _need(len(set(value)) == len(value), f"{what} names a kernel twice")
    return value


def _launched(value: object) -> set[str]:
    """An op case's launched kernels (each a name, and the cubin or cubins defining it)."""
    _need(isinstance(value, list) and len(value) <= MAX_KERNELS,
          "an op's launched is not a bounded list")
    assert isinstance(value, list)
    names = set()
    for item in value:
        _need(isinstance(item, dict) and set(item) in ({"name", "cubins"}, {"name", "cubin"}),
              "an op's launched kernel is not a name and its cubins")
        cubins = item.get("cubins", [item.get("cubin")])
        _need(isinstance(cubins, list) and 0 < len(cubins) <= MAX_KERNELS
              and all(type(n) is int and n >= 0 for n in cubins),
              "an op's launched kernel's cubins are not numbers")
        names.update(_kernel_names([item.get("name")], "an op's launched kernels"))
    return names


def _never_launched(files: list[Any]) -> dict[str, set[str]]:
    """Each file's kernels its coverage says were never launched (read as outside input:
    what is not a list of names is left to `_coverage` to refuse)."""
    found: dict[str, set[str]] = {}
    for item in files:
        cover = item.get("coverage")
        never = cover.get("never_launched") if isinstance(cover, dict) else None
        if isinstance(never, list):
            found[str(item.get("name"))] = {n for n in never if isinstance(n, str)}
    return found


def _coverage(value: object, name: str) -> tuple[int, int, int, int, bool]:
    """A file's coverage, checked: (added, launched, compared, unreachable, whole); its
    counts must hold (compared <= launched, every added kernel launched, never launched or
    unreachable, once)."""
    where = f"{shown_cut(name)}'s coverage"
    _need(isinstance(value, dict), f"{where} is not an object")
    assert isinstance(value, dict)
    added, launched, compared = (_count(value.get(k), f"{where} {k}")
                                 for k in ("added", "launched", "compared"))
    never = _kernel_names(value.get("never_launched"), f"{where} never_launched")
    raw = value.get("unreachable")
    _need(isinstance(raw, list) and all(isinstance(u, dict) for u in raw),
          f"{where} unreachable is not a list of objects")
    assert isinstance(raw, list)
    unreachable = _kernel_names([u.get("name") for u in raw], f"{where} unreachable")
    for item in raw:
        _text(item.get("why"), f"{where}: why a kernel is unreachable")
    _need(not set(never) & set(unreachable), f"{where} names a kernel both never launched "
          "and unreachable")
    recorder = value.get("recorder")
    _need(recorder is None or (isinstance(recorder, str) and len(recorder) <= MAX_TEXT),
          f"{where} recorder is not a text")
    _need(compared <= launched <= added and
          len(never) == added - launched - len(unreachable),
          f"{where} does not add up ({compared:,} compared, {launched:,} launched, "
          f"{len(never):,} never launched, {len(unreachable):,} unreachable of {added:,})")
    return added, launched, compared, len(unreachable), not never and compared == launched


def _whole_coverage(value: object, covers: list[tuple[int, int, int, int, bool]]
                    ) -> KernelCoverage:
    """The document's `coverage`: the sum of its files', each count as they say."""
    _need(isinstance(value, dict), "coverage is not an object")
    assert isinstance(value, dict)
    summed = {"added": sum(c[0] for c in covers), "launched": sum(c[1] for c in covers),
              "compared": sum(c[2] for c in covers),
              "never_launched": sum(c[0] - c[1] - c[3] for c in covers),
              "unreachable": sum(c[3] for c in covers)}
    for key, total in summed.items():
        _need(value.get(key) == total and type(value.get(key)) is int,
              f"coverage {key} is not the sum of its files' ({total:,})")
    return KernelCoverage(summed["added"], summed["compared"], summed["never_launched"],
                          summed["unreachable"])


def _unfounded(summary: ProofSummary, evidence: Mapping[str, int], harnessed: set[str],
               runs: tuple[Counter[str], Counter[str]]) -> str | None:
    """What a "proven" verdict does not rest on, or None: every file with a cubin of
    kernels that loaded and had each found, every op case equal, and each file with a
    harness its cases and its stock run without the JIT (and no run of a file not listed)."""
    ops, stock = runs
    if not evidence:
        return "it lists no file"
    if not (summary.cubins.whole and summary.kernels.whole and summary.ops.whole):
        return "its counts do not hold (a cubin that did not load, a kernel not found, an op " \
            "case not equal)"
    bare = next((name for name, count in evidence.items() if not count), None)
    if bare is not None:
        return f"{shown_cut(bare)} has no cubin with kernels that loaded: nothing of it proven"
    unrun = next((name for name in sorted(harnessed) if not ops[name] or not stock[name]), None)
    if unrun is not None:
        return f"{shown_cut(unrun)} has a harness, but no op case or no stock run without the " \
            "JIT"
    stray = next((name for name in (*ops, *stock) if name not in evidence), None)
    if stray is not None:
        return f"it runs {shown_cut(stray)}, which it does not list"
    return None


def read_proof(path: Path, trust: TrustKey | None) -> tuple[dict[str, Any], ProofSummary]:
    """A proof document from a file (regular, bounded) and its summary; with `trust`, it
    must carry that key's signature beside it (`PROOF.sig`, written by `prove --sign-key`).
    Refused in one line: not a proof (exit 2), not signed by the key (exit 3)."""
    try:
        body = read_input(path, MAX_PROOF, "--proof")
        data = strict_loads(body)
    except InputRefused:
        raise
    except UnicodeError:
        raise NotAProof(f"{path}: not a proof document (not UTF-8 JSON)") from None
    except ValueError as exc:
        raise NotAProof(f"{path}: not a proof document (not JSON: "
                        f"{shown_cut(str(exc), 120)})") from None
    except RecursionError:
        raise NotAProof(f"{path}: not a proof document (not JSON: too deep)") from None
    try:
        summary = summarise(data)
    except NotAProof as exc:
        raise NotAProof(f"{path}: not a proof document: {exc}") from None
    if trust is not None and not signed_beside(path, body, trust):
        raise Untrusted(f"{path} is not signed by {trust.path} (no "
                        f"{signature_beside(path).name}, changed since it was signed, or "
                        "signed by another key)")
    assert isinstance(data, dict)
    return data, summary


def require_verdict(summary: ProofSummary, where: str, partial: bool = False) -> None:
    """A verdict fit to be attached: proven, or partial when the user said so (`partial`);
    else VerificationError (exit 3) naming the coverage or the verdict."""
    if summary.verdict not in ("proven", "partial"):
        raise VerificationError(f"{where}: its verdict is {summary.verdict}: a failed proof is "
                                "not attached")
    if summary.verdict == "partial" and not partial:
        raise VerificationError(f"{where} is partial ({summary.how_much}): not attached as a "
                                "whole proof (give --partial-proof to attach it as partial)")


def require_proof_of(summary: ProofSummary, files: Mapping[str, str], serves: str,
                     where: str, partial: bool = False) -> None:
    """A proof fit to travel with kernels: proven (or partial, when `partial`: the user
    said so, `--partial-proof`), of these files byte for byte, on the GPU they serve; else
    VerificationError (exit 3) saying why.  A partial proof travels as it is: its statement
    carries its coverage, and every reader's line says "partial"."""
    if summary.verdict not in ("proven", "partial"):
        require_verdict(summary, where, partial)  # a failed proof: that first
    why = summary.mismatch(files)
    if why:
        raise VerificationError(f"{where} is not a proof of these kernels: {why}")
    require_verdict(summary, where, partial)  # of these files: then whether it is whole
    if summary.target != serves:
        raise VerificationError(f"{where} was proven on {summary.target}; these kernels serve "
                                f"{serves}")
