"""The proof `sm121-build prove` makes: per file, per added cubin, whether the driver loaded
it and found its kernels; per op case, whether the native file computed what the stock file
computes through the driver's JIT, bit for bit, and how long each first call took; whether
the stock file failed with the JIT disabled; per file, how many of its added kernels some
case launched (the coverage) and which never were; and the verdict: `proven` only when
every added kernel launched in some case whose output was bitwise equal, `partial` when
nothing differs but some were never launched (`proven for X of Y added kernels; Z never
launched`), `failed` on any problem.  Its JSON form is `data/schemas/proof.schema.json`
(`--json`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import yaml

from sm121_build.core.console import note, result, shown
from sm121_build.core.shipped import package_data
from sm121_build.cuda.dynsym import demangle
from sm121_build.jobs.proofs.prove_child import Compared, Device

FORMAT = 3  # 2: `subject`, each file's sha256, each op's ULPs and vLLM's tolerance;
#            3: each file's `coverage` (kernels launched), the whole's, verdict `partial`
Verdict = Literal["proven", "partial", "failed"]
SAID_KERNELS = 3  # a differing case's launched kernels named on its line (all in the JSON)
SAID_CUBINS = 8  # and the cubins they came from


@dataclass(frozen=True)
class Unreachable:
    """An added kernel no op of its file can reach (dead code, a trap stub compiled for
    another GPU family), and the evidence for it."""

    name: str
    why: str

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "why": self.why}


@dataclass(frozen=True)
class Coverage:
    """A file's added kernels for this GPU (distinct mangled names of the cubins it loads):
    how many, how many some case of the native run launched (`launched`), how many a case
    launched whose output was bitwise equal to the stock JIT's (`compared`), those never
    launched (sorted, mangled as the cubin names them), those shown unreachable, and why
    launches were not recorded where they were not (`recorder`)."""

    added: int
    launched: int
    compared: int
    never_launched: tuple[str, ...]
    unreachable: tuple[Unreachable, ...] = ()
    recorder: str | None = None

    @property
    def whole(self) -> bool:
        """Every added kernel launched (or shown unreachable) by a case compared equal."""
        return not self.never_launched and self.compared == self.launched

    def as_json(self) -> dict[str, Any]:
        return {"added": self.added, "launched": self.launched, "compared": self.compared,
                "never_launched": list(self.never_launched),
                "unreachable": [u.as_json() for u in self.unreachable],
                "recorder": self.recorder}


def coverage_line(added: int, compared: int, never: int, unreachable: int) -> str:
    """`proven for 1,402 of 1,640 added kernels; 238 never launched` (and the unreachable)."""
    shown_unreachable = f", {unreachable:,} unreachable" if unreachable else ""
    return (f"proven for {compared:,} of {added:,} added kernels; {never:,} never "
            f"launched{shown_unreachable}")


@dataclass(frozen=True)
class CubinResult:
    """One added cubin the GPU loads: where it sits, what it defines, what the driver did,
    and how many of its kernels a case launched."""

    number: int
    sm: str
    container: int
    kernels: int
    loaded: bool
    found: int
    missing: tuple[str, ...]
    missing_count: int
    error: str | None
    launched: int = 0  # its kernels some case launched (by name)

    def as_json(self) -> dict[str, Any]:
        return {"number": self.number, "sm": self.sm, "container": self.container,
                "kernels": self.kernels, "loaded": self.loaded, "found": self.found,
                "missing": list(self.missing), "missing_count": self.missing_count,
                "error": self.error, "launched": self.launched}


@dataclass(frozen=True)
class FileProof:
    """One file of --files with its stock file: its added cubins this GPU loads, how many
    it added for other GPUs (not proven here), and the harness its ops ran under."""

    name: str
    cubins: tuple[CubinResult, ...]
    other_gpus: int
    harness: str | None
    sha256: str  # of the file proven: what ties the proof to a kernels image's manifest
    coverage: Coverage

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "sha256": self.sha256,
                "cubins": [c.as_json() for c in self.cubins],
                "added_for_other_gpus": self.other_gpus, "harness": self.harness,
                "coverage": self.coverage.as_json()}


@dataclass(frozen=True)
class Tolerance:
    """What vLLM's own test of an op accepts (`torch.testing.assert_close`'s atol, rtol),
    and which test says so (`data/op_tolerances.yaml`)."""

    atol: float
    rtol: float
    test: str

    def __str__(self) -> str:
        return "exact" if self.atol == self.rtol == 0 else f"atol {self.atol:g}, rtol " \
            f"{self.rtol:g}"


def _tolerances() -> dict[str, Tolerance]:
    raw = yaml.safe_load(package_data("op_tolerances.yaml"))
    return {str(op): Tolerance(float(v["atol"]), float(v["rtol"]), str(v["test"]))
            for op, v in raw.items()}


OP_TOLERANCES = _tolerances()


@dataclass(frozen=True)
class KernelLaunched:
    """An added kernel a case launched (mangled, as its cubins define it), and the added
    cubins (modules) that define it (a name may be in two): what a differing case names."""

    name: str
    cubins: tuple[int, ...]

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "cubins": list(self.cubins)}


@dataclass(frozen=True)
class OpResult:
    """One case of an op: how its native output compared with the stock JIT's (None: not
    compared, `error` says why: bit for bit, the largest difference absolute and in units
    in the last place), each first call's seconds (stock JIT, native), and the added
    kernels the native run launched in it (`launched`)."""

    file: str
    op: str
    case: str
    compared: Compared | None
    first_s: tuple[float | None, float | None]
    error: str | None = None
    launched: tuple[KernelLaunched, ...] = ()

    def kernels_said(self) -> str:
        """`; it launched 2 added kernel(s) of cubin(s) 7, 9: NAME, NAME`, or nothing."""
        if not self.launched:
            return ""
        numbers = sorted({n for k in self.launched for n in k.cubins})
        cubins = ", ".join(str(n) for n in numbers[:SAID_CUBINS]) + (
            f" and {len(numbers) - SAID_CUBINS:,} more" if len(numbers) > SAID_CUBINS else "")
        names = [shown(demangle(k.name)) for k in self.launched[:SAID_KERNELS]]
        more = len(self.launched) - len(names)
        return (f"; it launched {len(self.launched):,} added kernel(s) of cubin(s) {cubins}: "
                + "; ".join(names) + (f"; and {more:,} more" if more else ""))

    @property
    def bitwise_equal(self) -> bool | None:
        return None if self.compared is None else self.compared.bitwise_equal

    @property
    def tolerance(self) -> Tolerance | None:
        """What vLLM's own test of the op accepts, where the table knows the op."""
        return OP_TOLERANCES.get(self.op)

    def difference(self) -> str:
        """How far off a differing output is, beside what vLLM's test accepts."""
        item = self.compared
        diff = "not comparable" if item is None or item.max_abs_diff is None else \
            f"max abs diff {item.max_abs_diff:g}"
        ulp = f", {item.max_ulp:,} ULP" if item is not None and item.max_ulp is not None \
            else ""
        allowed = f"; vLLM's test allows {self.tolerance}" if self.tolerance else ""
        return diff + ulp + allowed

    def as_json(self) -> dict[str, Any]:
        item, tolerance = self.compared, self.tolerance
        return {"file": self.file, "op": self.op, "case": self.case,
                "bitwise_equal": self.bitwise_equal,
                "max_abs_diff": None if item is None else item.max_abs_diff,
                "max_ulp": None if item is None else item.max_ulp,
                "vllm_tolerance": None if tolerance is None else {
                    "atol": tolerance.atol, "rtol": tolerance.rtol, "test": tolerance.test},
                "first_call_s": {"stock_jit": self.first_s[0], "native": self.first_s[1]},
                "error": self.error, "launched": [k.as_json() for k in self.launched]}


@dataclass(frozen=True)
class StockWithoutJit:
    """The stock file run with the PTX JIT disabled: it must fail (the GPU cannot run it
    natively), else the harness did not reach a kernel that needed the added cubins."""

    file: str
    failed: bool
    said: str

    def as_json(self) -> dict[str, Any]:
        return {"file": self.file, "failed": self.failed, "said": self.said}


@dataclass(frozen=True)
class LeftOut:
    """A file of the subject that was not proven, and why (no stock file to compare it
    with, no cubin its stock file lacks): the proof is not of it, so nothing is "proven"."""

    name: str
    why: str

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "why": self.why}


@dataclass(frozen=True)
class Subject:
    """What a proof is of: an image (its reference, ID and the base its stock files came
    from), or files on this host (`--files`, `--stock`)."""

    image: str | None = None
    image_id: str | None = None
    base: str | None = None
    files: str | None = None
    stock: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {"image": self.image, "image_id": self.image_id, "base": self.base,
                "files": self.files, "stock": self.stock}

    def __str__(self) -> str:
        return f"image {self.image}" if self.image else f"--files {self.files}"


@dataclass(frozen=True)
class Proof:
    tool_version: str
    device: Device
    files: tuple[FileProof, ...]
    ops: tuple[OpResult, ...]
    stock_without_jit: tuple[StockWithoutJit, ...]
    made: str  # when, UTC (`2026-11-28T04:10:00Z`): the proof's date
    subject: Subject
    left_out: tuple[LeftOut, ...] = ()  # files of the subject not proven, said

    def problems(self) -> list[str]:
        """Each thing that keeps the files from being proven, one line each."""
        lines = [f"{shown(item.name)}: not proven: {item.why}" for item in self.left_out]
        for item in self.files:
            if not any(cubin.kernels for cubin in item.cubins):
                lines.append(f"{shown(item.name)}: no added cubin with a kernel for this GPU: "
                             "nothing of it is proven here")
            for cubin in item.cubins:
                where = f"{shown(item.name)}: added cubin {cubin.number} ({cubin.sm}, " \
                        f"container {cubin.container})"
                if not cubin.loaded:
                    lines.append(f"{where} does not load: {shown(cubin.error or '?')}")
                elif cubin.missing_count or cubin.found != cubin.kernels:
                    first = f" (first: {shown(cubin.missing[0])})" if cubin.missing else ""
                    lines.append(f"{where}: {cubin.kernels - cubin.found} of {cubin.kernels} "
                                 f"kernel(s) not found{first}")
        for op in self.ops:
            where = f"{shown(op.file)}: {shown(op.op)} {shown(op.case)}"
            if op.error is not None:
                lines.append(f"{where}: {shown(op.error)}")
            elif not op.bitwise_equal:
                lines.append(f"{where}: differs from the stock JIT's output "
                             f"({op.difference()}){op.kernels_said()}")
        for stock in self.stock_without_jit:
            if not stock.failed:
                lines.append(f"{shown(stock.file)}: the stock file ran with the PTX JIT "
                             "disabled: its ops did not need the added cubins")
        return lines

    def coverage(self) -> dict[str, int]:
        """The files' coverage added up: kernels added, launched, compared, never launched,
        unreachable."""
        covers = [item.coverage for item in self.files]
        return {"added": sum(c.added for c in covers),
                "launched": sum(c.launched for c in covers),
                "compared": sum(c.compared for c in covers),
                "never_launched": sum(len(c.never_launched) for c in covers),
                "unreachable": sum(len(c.unreachable) for c in covers)}

    def coverage_line(self) -> str:
        """`proven for X of Y added kernels; Z never launched`."""
        total = self.coverage()
        return coverage_line(total["added"], total["compared"], total["never_launched"],
                             total["unreachable"])

    @property
    def verdict(self) -> Verdict:
        """`failed` on any problem; else `partial` when a file's added kernels were not all
        launched by a case compared equal; else `proven`."""
        if self.problems():
            return "failed"
        return "proven" if all(item.coverage.whole for item in self.files) else "partial"

    def as_json(self) -> dict[str, Any]:
        d = self.device
        return {"format": FORMAT, "tool_version": self.tool_version, "made": self.made,
                "subject": self.subject.as_json(),
                "gpu": {"name": d.name, "compute_capability": d.capability,
                        "target": str(d.target), "driver_cuda": d.driver_cuda,
                        "driver_version": d.version},
                "files": [f.as_json() for f in self.files],
                "ops": [o.as_json() for o in self.ops],
                "stock_without_jit": [s.as_json() for s in self.stock_without_jit],
                "left_out": [item.as_json() for item in self.left_out],
                "coverage": self.coverage(),
                "verdict": self.verdict, "problems": self.problems()}


def document(proof: Proof) -> bytes:
    """The proof's JSON document as `--json` writes (and `--sign-key` signs) it: strict
    JSON, never NaN or Infinity (ValueError), as `proof_reading` reads it back."""
    return (json.dumps(proof.as_json(), indent=2, allow_nan=False) + "\n").encode()


NEVER_SHOWN = 20  # names never launched shown per file (the proof lists every one)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def say_proof(proof: Proof) -> None:
    """The human summary: a line per file and per op, then the verdict."""
    d = proof.device
    result(f"GPU: {shown(d.name)}, compute capability {d.capability} ({d.target}), driver "
           f"{shown(d.version or '?')} (CUDA {d.driver_cuda})")
    for item in proof.files:
        loaded = sum(c.loaded for c in item.cubins)
        kernels = sum(c.found for c in item.cubins)
        wanted = sum(c.kernels for c in item.cubins)
        result(f"{shown(item.name)}: {loaded} of {len(item.cubins)} added cubin(s) loaded "
               f"with the JIT disabled, {kernels} of {wanted} kernel(s) found")
        if item.other_gpus:
            note(f"{shown(item.name)}: {item.other_gpus} added cubin(s) for other GPUs, not "
                 "proven here")
        cover = item.coverage
        result(f"{shown(item.name)}: {cover.launched:,} of {cover.added:,} added kernel(s) "
               f"launched by a case, {cover.compared:,} by a case compared bitwise equal"
               + (f", {len(cover.unreachable):,} unreachable" if cover.unreachable else ""))
        if cover.recorder:
            note(f"{shown(item.name)}: launches not recorded: {shown(cover.recorder)}")
        for stub in cover.unreachable[:NEVER_SHOWN]:
            note(f"{shown(item.name)}: unreachable: {shown(demangle(stub.name))}: "
                 f"{shown(stub.why)}")
        for name in cover.never_launched[:NEVER_SHOWN]:
            note(f"{shown(item.name)}: never launched: {shown(demangle(name))}")
        if len(cover.never_launched) > NEVER_SHOWN:
            note(f"{shown(item.name)}: and {len(cover.never_launched) - NEVER_SHOWN:,} more "
                 "never launched (every one in the --json proof)")
    for op in proof.ops:
        same = "error" if op.error else "bitwise equal" if op.bitwise_equal else \
            f"DIFFERS ({op.difference()})"
        result(f"{shown(op.file)}: {shown(op.op)} {shown(op.case)}: {same}; first call "
               f"{_seconds(op.first_s[0])} stock JIT, {_seconds(op.first_s[1])} native")
    for stock in proof.stock_without_jit:
        note(f"{shown(stock.file)}: stock with the JIT disabled "
             f"{'failed, as it must' if stock.failed else 'ran'}: {shown(stock.said)}")
    for left in proof.left_out:
        note(f"{shown(left.name)}: not proven: {left.why}")
    verdict = proof.verdict
    result(f"verdict: {verdict}" + (f": {proof.coverage_line()}" if verdict == "partial"
                                    else ""))
