"""What `prove`'s children say (jobs/payload/load_cubins.py, harness_*.py, compare_outputs.py):
JSON lines on stdout, read as they come and parsed as outside input.

A line is cut at `LINE_BYTES` (`core.children.Lines`), at most `MAX_LINES` are read, each
must be one JSON object whose fields have the types the protocol names; anything else (a
torch warning on stdout, a line cut short, a field of the wrong type) is counted as
ignored, never trusted.  Texts are cut to `TEXT` characters and lists to `NAMES` items.

What is kept is what the child was asked (`Asked`): an answer about a cubin it was not
given, a kernel not in that cubin, a case or output it was not asked about, or one it
already answered is counted and dropped, never stored; and what one child's answers keep is
bounded (`MAX_KEPT` answers, `KEPT_BYTES` of their lines): past that the child is refused
in one line (`SaidTooMuch`), however many valid lines it prints.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sm121_build.core.children import Ended, Lines, Program, run
from sm121_build.core.errors import Sm121Error
from sm121_build.cuda.compat import Target

LINE_BYTES = 64 * 1024
MAX_LINES = 100_000
TEXT = 300
NAMES = 20
MAX_KEPT = 20_000  # answers one child's Said keeps: a cubin each, a case, an output
KEPT_BYTES = 8 << 20  # of the lines those answers came in
MAX_DRIVER = 1_000_000  # cuDriverGetVersion's past CUDA 999.99: a proof's driver_cuda has
#                         at most three digits a side (`proof_reading`)


class SaidTooMuch(Sm121Error):
    """A child answered more than one child's answers may keep (`MAX_KEPT`, `KEPT_BYTES`)."""


@dataclass(frozen=True)
class Jit:
    """The driver's PTX JIT for a child: on or off, and for a run with it on, the run's own
    fresh cache folder as the child sees it (None: the cache off)."""

    on: bool
    cache: str | None = None


JIT_ON, JIT_OFF = Jit(True), Jit(False)


@dataclass(frozen=True)
class Asked:
    """What a child was asked about: answers about anything else are counted, not kept.
    `cubins`: the loader's cubins (id -> the kernels it was given); `cases`: the `OP/CASE`
    keys a run or a comparison may answer (None: any, within the budget: the stock JIT run,
    which says what the cases are); `kernels`: the file's added kernels (mangled names) a
    native run's recorder may say a case launched."""

    cubins: Mapping[str, frozenset[str]] = field(default_factory=dict)
    cases: frozenset[str] | None = frozenset()
    kernels: frozenset[str] = frozenset()  # the added kernels a native run may say it launched


def _text(value: object) -> str | None:
    """A text the child said, a lone surrogate (`"\\ud800"`, which no UTF-8 document can
    carry) written as its escape, then cut to `TEXT` (cut after: six characters an escape,
    300 surrogates were 1,800 characters, more than the proof's reader takes)."""
    if not isinstance(value, str):
        return None
    return value[:TEXT].encode("utf-8", "backslashreplace").decode("utf-8")[:TEXT]


def _count(value: object) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 31
    return value if ok else None  # type: ignore[return-value]


def _seconds(value: object) -> float | None:
    if not _finite(value):
        return None
    number = float(value)  # type: ignore[arg-type]
    return number if 0 <= number < 1e7 else None


@dataclass(frozen=True)
class GpuSizes:
    """Shared memory per block (opt-in) and per SM in bytes, and the SM count."""

    smem_block: int
    smem_sm: int
    sms: int


@dataclass(frozen=True)
class Device:
    """The GPU the loader found (device 0): its name, compute capability, the CUDA version
    its driver runs (`cuDriverGetVersion`: 13000) and the kernel module's version; and what
    a harness's dispatch reads of it, where the loader said it (`sizes`)."""

    name: str
    major: int
    minor: int
    driver: int
    version: str | None
    sizes: GpuSizes | None = None

    @property
    def capability(self) -> str:
        return f"{self.major}.{self.minor}"

    @property
    def target(self) -> Target:
        return Target(self.major * 10 + self.minor)

    @property
    def driver_cuda(self) -> str:
        return f"{self.driver // 1000}.{self.driver % 1000 // 10}"


@dataclass(frozen=True)
class CubinLoad:
    """One cubin as the driver took it: loaded or not (the driver's error name), and how
    many of its kernels `cuModuleGetFunction` found (the first missing ones by name)."""

    cubin: str
    loaded: bool
    found: int = 0
    missing: tuple[str, ...] = ()
    missing_count: int = 0
    error: str | None = None


@dataclass(frozen=True)
class CaseRun:
    """One case of a harness: the seconds of its first call, or the error it ended with."""

    op: str
    case: str
    first_s: float | None
    error: str | None


@dataclass(frozen=True)
class Compared:
    """One output compared with the reference's: `OP/CASE`, equal bit for bit, the largest
    absolute difference (None: shapes differ, or a NaN), or the side it is missing from."""

    key: str
    bitwise_equal: bool
    max_abs_diff: float | None
    missing_in: str | None = None
    max_ulp: int | None = None  # units in the last place, for floats (None: not said)


@dataclass(frozen=True)
class Launched:
    """An added kernel (its mangled name, as the file's cubin defines it) that the native
    run's recorder saw launched during a case (`OP/CASE`)."""

    kernel: str
    case: str


@dataclass
class Said:
    """Everything one child said that parsed and was asked (`asked`), in order, once each;
    how many lines did not parse (`ignored`), answered what was not asked (`unasked`) or
    again (`repeated`); `over` when its answers passed the budget."""

    asked: Asked = field(default_factory=Asked)
    device: Device | None = None
    error: str | None = None
    schema_error: str | None = None
    loads: list[CubinLoad] = field(default_factory=list)
    cases: list[CaseRun] = field(default_factory=list)
    compared: list[Compared] = field(default_factory=list)
    launched: list[Launched] = field(default_factory=list)
    recorder: str | None = None  # why the launch recorder did not record (said by the run)
    saved: int | None = None
    done: int | None = None
    lines: int = 0
    ignored: int = 0
    unasked: int = 0
    repeated: int = 0
    kept: int = 0
    kept_bytes: int = 0
    over: str | None = None
    _seen: set[str] = field(default_factory=set, repr=False)

    def cut(self) -> None:
        """A line longer than `LINE_BYTES`: counted and ignored whole, never read in part."""
        self.lines += 1
        self.ignored += 1

    def line(self, text: str) -> None:
        """One line of the child's stdout."""
        self.lines += 1
        if self.lines > MAX_LINES:
            self.ignored += 1
            return
        try:
            data = json.loads(text) if text.lstrip().startswith("{") else None
        except (ValueError, RecursionError):
            data = None
        kept = self.kept
        if not isinstance(data, dict) or not self._take(data):
            self.ignored += 1
        elif self.kept > kept:
            self.kept_bytes += len(text)
            if self.kept > MAX_KEPT or self.kept_bytes > KEPT_BYTES:
                self.over = f"more than {MAX_KEPT:,} answers or {KEPT_BYTES:,} bytes of them"
                self._drop()

    def _drop(self) -> None:
        """Past the budget: nothing more is kept (the child is refused when it ends)."""
        self.loads.clear()
        self.cases.clear()
        self.compared.clear()
        self.launched.clear()
        self._seen.clear()

    def _new(self, kind: str, key: str, asked: bool) -> bool:
        """Whether an answer of `kind` about `key` is to be kept: asked, and the first."""
        if self.over is not None:
            return False
        if not asked:
            self.unasked += 1
            return False
        if f"{kind}\0{key}" in self._seen:
            self.repeated += 1
            return False
        self._seen.add(f"{kind}\0{key}")
        self.kept += 1
        return True

    def refuse_if_over(self, what: str) -> None:
        """SaidTooMuch in one line when the child's answers passed the budget."""
        if self.over is not None:
            raise SaidTooMuch(f"{what} said {self.over}: refused (its answers are not "
                              "kept)")

    def _take(self, data: Mapping[str, Any]) -> bool:
        if "device" in data:
            return self._device(data["device"])
        if "cubin" in data:
            return self._cubin(data)
        if "op" in data:
            return self._case(data)
        if "key" in data:
            return self._compared(data)
        if "launched" in data:
            return self._launched(data)
        for name in ("error", "schema_error", "recorder"):
            if name in data and _text(data[name]) is not None:
                setattr(self, name, _text(data[name]))
                return True
        for name in ("saved", "done"):
            if name in data and _count(data[name]) is not None:
                setattr(self, name, _count(data[name]))
                return True
        return False

    def _device(self, value: object) -> bool:
        if not isinstance(value, dict):
            return False
        name, version = _text(value.get("name")), value.get("version")
        major, minor = _count(value.get("major")), _count(value.get("minor"))
        driver = _count(value.get("driver"))
        if name is None or major is None or minor is None or driver is None \
                or not 1 <= major < 100 or not minor < 10 or not 1000 <= driver < MAX_DRIVER:
            return False  # (a GPU, or a driver's CUDA, a proof could not be read back with)
        block, per_sm, sms = (_count(value.get(key)) for key in ("smem_block", "smem_sm",
                                                                   "sms"))
        sizes = GpuSizes(block, per_sm, sms) if block and per_sm and sms else None
        self.device = Device(name, major, minor, driver, _text(version), sizes)
        return True

    def _cubin(self, data: Mapping[str, Any]) -> bool:
        cubin, loaded = _text(data["cubin"]), data.get("loaded")
        if cubin is None or not isinstance(loaded, bool):
            return False
        found, count = _count(data.get("found")), _count(data.get("missing_count"))
        missing = data.get("missing")
        if loaded and (found is None or count is None or not isinstance(missing, list)):
            return False
        kernels = self.asked.cubins.get(cubin)
        if not self._new("cubin", cubin, kernels is not None):
            return True  # parsed, and counted: not kept
        assert kernels is not None
        if not loaded:
            self.loads.append(CubinLoad(cubin, False, error=_text(data.get("error"))
                                        or "no reason given"))
            return True
        assert found is not None and count is not None and isinstance(missing, list)
        names = tuple(m[:TEXT] for m in missing[:NAMES]  # only kernels it was given
                      if isinstance(m, str) and m in kernels)
        self.loads.append(CubinLoad(cubin, True, found, names, max(count, len(names))))
        return True

    def _case(self, data: Mapping[str, Any]) -> bool:
        op, case = _text(data["op"]), _text(data.get("case"))
        first, error = _seconds(data.get("first_s")), _text(data.get("error"))
        if op is None or case is None or (first is None) == (error is None):
            return False
        key = f"{op}/{case}"
        if not self._new("case", key, self.asked.cases is None or key in self.asked.cases):
            return True
        self.cases.append(CaseRun(op, case, first, error))
        return True

    def _compared(self, data: Mapping[str, Any]) -> bool:
        key = _text(data["key"])
        if key is None:
            return False
        side = data.get("missing_in")
        asked = self.asked.cases is None or key in self.asked.cases
        if side in ("reference", "other"):
            if self._new("key", key, asked):
                self.compared.append(Compared(key, False, None, str(side)))
            return True
        equal, diff, ulp = data.get("bitwise_equal"), data.get("max_abs_diff"), \
            data.get("max_ulp")
        if not isinstance(equal, bool) or (diff is not None and not _finite(diff)) or (
                ulp is not None and (type(ulp) is not int or not 0 <= ulp < 2**64)):
            return False
        if not self._new("key", key, asked):
            return True
        self.compared.append(Compared(key, equal, None if diff is None else float(diff),
                                      max_ulp=ulp))
        return True


    def _launched(self, data: Mapping[str, Any]) -> bool:
        """`{"launched": KERNEL, "case": "OP/CASE"}`: kept when the kernel is one of the
        file's added kernels and the case one asked, once per pair (a name of torch's own
        kernels, or of another file's, is counted as unasked)."""
        kernel, said = data["launched"], data.get("case")
        if not isinstance(kernel, str) or not isinstance(said, str):
            return False
        op, _slash, rest = said.partition("/")  # each part cut as a case line's are
        case = f"{_text(op)}/{_text(rest)}"
        asked = kernel in self.asked.kernels and (self.asked.cases is None
                                                  or case in self.asked.cases)
        if self._new("launched", f"{kernel}\0{case}", asked):
            self.launched.append(Launched(kernel, case))
        return True


def _finite(value: object) -> bool:
    """A difference may be any finite number (`_seconds` bounds a time, not this); an
    integer too large for a float (`1` and 400 zeros) is none."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def heard(output: bytes, asked: Asked, what: str) -> Said:
    """What a child (`what`) said, from its whole output at once (a container's log), parsed
    as `talk` parses it while it comes; SaidTooMuch past the budget."""
    said = Said(asked)
    lines = Lines(said.line, LINE_BYTES, on_cut=said.cut)
    lines(output)
    lines.close()
    said.refuse_if_over(what)
    return said


def talk(program: Program, asked: Asked) -> tuple[Ended, Said]:
    """Run a child to its end or deadline; what it said of what it was `asked`, parsed line
    by line as it came; SaidTooMuch past the budget."""
    said = Said(asked)
    lines = Lines(said.line, LINE_BYTES, on_cut=said.cut)
    ended = run(program, lines)
    lines.close()
    said.refuse_if_over(program.what)
    return ended, said
