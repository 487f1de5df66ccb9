"""What `prove`'s op harnesses (harness_fa2.py, harness_marlin.py) share: their lines on
stdout, the timed first call of an op, and the run around a harness's cases.  Standard
library only; a harness, run as a script, imports it as its sibling (`import_module`).

    {"schema_error": "..."}                        an op or argument it does not know (exit 4)
    {"op": OP, "case": CASE, "first_s": S}         a case ran; S: its first call, synchronized
    {"op": OP, "case": CASE, "error": "..."}       a case failed: nothing follows (exit 3)
    {"saved": N}                                   N outputs saved to OUT.pt

Run as `script SO OUT.pt KERNELS.json` (the native run), each case's first call is recorded
by torch's profiler (CUPTI's activity API) and every kernel it launched that is one of
KERNELS.json's (a JSON list of the file's added kernels, mangled) is said once per case:

    {"launched": MANGLED, "case": "OP/CASE"}      the case launched that added kernel
    {"recorder": "..."}                            why launches were not recorded (once)

The profiler names a kernel demangled (kineto and torch demangle with `__cxa_demangle`);
each name given is demangled with `torch._C._demangle` (the same function) to match, and
said mangled, as the file defines it.  A kernel of torch's own (a copy, a random fill) is
no name given: never said.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

FAILED, SCHEMA = 3, 4


_BACK_REFERENCE = re.compile(r"S[0-9A-Z]*_|T[0-9]*_")


class Recorder:
    """The kernels each first call launched, of those given (`names`: reported name ->
    mangled name; a reported name two given kernels answer to, as their mangled or their
    demangled name, is none of them: which of them ran is not known); `broken`: why
    nothing is recorded, said once."""

    def __init__(self, torch: Any, kernels: list[str]) -> None:
        self.torch = torch
        claims: dict[str, set[str]] = {}
        demangle = getattr(getattr(torch, "_C", None), "_demangle", None)
        for kernel in kernels:
            claims.setdefault(kernel, set()).add(kernel)
            # (cuda/dynsym.demangle's bound, this payload importing nothing of the package: a
            # name with many back-references could demangle to gigabytes; never demangled)
            if demangle is not None and len(kernel) <= 4096 and \
                    len(_BACK_REFERENCE.findall(kernel)) <= 24:
                try:
                    claims.setdefault(str(demangle(kernel)), set()).add(kernel)
                except Exception:  # a name the demangler refuses: kept mangled
                    continue
        self.names: dict[str, str] = {name: next(iter(owners))
                                      for name, owners in claims.items() if len(owners) == 1}
        self.broken: str | None = None
        self.events = 0  # GPU events the profiler reported, of any name

    def fail(self, why: str) -> None:
        if self.broken is None:
            self.broken = why[:300]
            say({"recorder": self.broken})

    def start(self) -> Any:
        """A profiler of the GPU's activity, started; None when it cannot be (said)."""
        if self.broken is not None:
            return None
        try:
            profiler = self.torch.profiler
            session = profiler.profile(activities=[profiler.ProfilerActivity.CUDA])
            session.__enter__()
        except Exception as exc:  # no kineto, no CUPTI: said once, the run goes on
            self.fail(f"the profiler could not start: {_first_line(exc)}")
            return None
        return session

    def stop(self, session: Any, label: tuple[str, str]) -> None:
        """The session stopped; each given kernel it saw launched said once for `label`."""
        if session is None:
            return
        try:
            session.__exit__(None, None, None)
            names = [str(event.name) for event in session.events()]
        except Exception as exc:
            self.fail(f"the profiler's events could not be read: {_first_line(exc)}")
            return
        self.events += len(names)
        case = f"{label[0]}/{label[1]}"
        for kernel in sorted({self.names[n] for n in names if n in self.names}):
            say({"launched": kernel, "case": case})


_recorder: Recorder | None = None  # set by `run` for a native run (KERNELS.json given)


class SchemaError(Exception):
    """The library's ops are not those the harness calls."""


def say(data: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(data) + "\n")
    sys.stdout.flush()


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:300]


def outputs(torch: Any, result: Any, written: tuple[Any, ...] = ()) -> tuple[Any, ...]:
    """Every tensor an op gave back (a tensor, or each tensor of a list or tuple), then
    those of its inputs it wrote in place (`written`), on the host in that order."""
    given = result if isinstance(result, (list, tuple)) else (result,)
    return tuple(t.cpu() for t in (*given, *written) if isinstance(t, torch.Tensor))


def first_call(torch: Any, op: Any, args: list[Any], label: tuple[str, str],
               written: tuple[Any, ...] = ()) -> tuple[Any, ...]:
    """The op's first call, synchronized and timed (said), and every output it wrote on
    the host (`outputs`: what it returned, then `written`, the inputs it writes in place).
    Any error ends the run (a CUDA error is sticky: the next call would fail for this
    one's cause)."""
    session = _recorder.start() if _recorder is not None else None
    torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        result = op(*args)
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        out = outputs(torch, result, written)
    except Exception as exc:  # RuntimeError, torch.AcceleratorError: any, said in one line
        say({"op": label[0], "case": label[1], "error": _first_line(exc)})
        raise SystemExit(FAILED) from None
    say({"op": label[0], "case": label[1], "first_s": round(first, 4)})
    if _recorder is not None:
        _recorder.stop(session, label)
    return out


@dataclass(frozen=True)
class HarnessOptions:
    """The harness's options after SO OUT.pt."""

    kernels: str | None = None
    cases: str | None = None
    part: tuple[int, int] = (0, 1)
    fixed: bool = True  # the fixed cases run (in the first slice); not with --derived-only
    only: tuple[int, ...] | None = None  # --fixed I,J: those fixed cases alone (None: all)


def _digits(text: str) -> bool:
    """Whether `text` is ASCII digits alone (`str.isdigit` also takes '\u0661', which
    int() reads as 1, and '\u00b2', which int() refuses)."""
    return text.isascii() and text.isdigit()


def _fixed_only(value: str) -> tuple[int, ...]:
    """`--fixed I,J,...`: positions among the harness's fixed cases, ascending, each once."""
    items = value.split(",")
    if len(value) > 200 or not all(_digits(item) and len(item) <= 3 for item in items):
        raise ValueError(f"--fixed {value[:40]!r} is not I,J,... (positions of fixed cases)")
    only = tuple(int(item) for item in items)
    if list(only) != sorted(set(only)):
        raise ValueError(f"--fixed {value[:40]!r}: positions ascending, each once")
    return only


def options(argv: list[str]) -> HarnessOptions:
    """`--kernels FILE`, `--cases FILE`, `--slice I/N`, `--derived-only`, `--fixed I,J`
    (the fixed cases at those positions alone: a harness refuses one it does not have);
    ValueError in one line."""
    found: dict[str, str] = {}
    rest = list(argv)
    fixed = "--derived-only" not in rest
    if not fixed:
        rest.remove("--derived-only")
    while rest:
        flag = rest.pop(0)
        if flag not in ("--kernels", "--cases", "--slice", "--fixed") or not rest \
                or flag in found:
            raise ValueError(f"unknown, repeated or valueless option {flag[:40]!r}")
        found[flag] = rest.pop(0)
    if "--kernels" in found and "--cases" in found:
        raise ValueError("--kernels and --cases: give one")
    part = (0, 1)
    if "--slice" in found:
        i, _, n = found["--slice"].partition("/")
        if not (_digits(i) and _digits(n) and 0 <= int(i) < int(n) <= 1024):
            raise ValueError(f"--slice {found['--slice'][:40]!r} is not I/N, 0 <= I < N")
        part = (int(i), int(n))
    only = _fixed_only(found["--fixed"]) if "--fixed" in found else None
    if only is not None and not fixed:
        raise ValueError("--fixed and --derived-only: give one")
    return HarnessOptions(found.get("--kernels"), found.get("--cases"), part, fixed, only)


def run(argv: list[str], script: str, cases: Callable[[Any, dict[str, Any]], None]) -> int:
    """`script SO OUT.pt [KERNELS.json]`: the library loaded, `cases` filling the outputs by
    name (each first call's added kernels recorded, with KERNELS.json), the outputs saved; a
    schema that does not fit, or an error between cases, in one line."""
    global _recorder
    if len(argv) not in (2, 3):
        sys.stderr.write(f"usage: {script} SO OUT.pt [KERNELS.json]\n")
        return 2
    torch = importlib.import_module("torch")
    torch.ops.load_library(argv[0])
    if len(argv) == 3:
        with open(argv[2], encoding="utf-8") as listing:
            kernels = json.load(listing)
        _recorder = Recorder(torch, [k for k in kernels if isinstance(k, str)])
    saved: dict[str, Any] = {}
    try:
        cases(torch, saved)
    except SchemaError as exc:
        say({"schema_error": str(exc)[:500]})
        return SCHEMA
    except Exception as exc:  # between cases (making inputs): a sticky CUDA error shows here
        say({"op": "(inputs)", "case": "(between cases)", "error": _first_line(exc)})
        return FAILED
    if _recorder is not None and saved and not _recorder.events:
        _recorder.fail("the profiler reported no GPU activity at all (no CUPTI?)")
    torch.save(saved, argv[1])
    say({"saved": len(saved)})
    return 0
