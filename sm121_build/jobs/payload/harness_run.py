"""What `prove`'s op harnesses (harness_fa2.py, harness_marlin.py) share: their lines on
stdout, the timed first call of an op, and the run around a harness's cases.  Standard
library only; a harness, run as a script, imports it as its sibling (`import_module`).

    {"schema_error": "..."}                        an op or argument it does not know (exit 4)
    {"op": OP, "case": CASE, "first_s": S}         a case ran; S: its first call, synchronized
    {"op": OP, "case": CASE, "error": "..."}       a case failed: nothing follows (exit 3)
    {"saved": N}                                   N outputs saved to OUT.pt
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from collections.abc import Callable
from typing import Any

FAILED, SCHEMA = 3, 4


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
    return out


def run(argv: list[str], script: str, cases: Callable[[Any, dict[str, Any]], None]) -> int:
    """`script SO OUT.pt`: the library loaded, `cases` filling the outputs by name, the
    outputs saved; a schema that does not fit, or an error between cases, in one line."""
    if len(argv) != 2:
        sys.stderr.write(f"usage: {script} SO OUT.pt\n")
        return 2
    torch = importlib.import_module("torch")
    torch.ops.load_library(argv[0])
    saved: dict[str, Any] = {}
    try:
        cases(torch, saved)
    except SchemaError as exc:
        say({"schema_error": str(exc)[:500]})
        return SCHEMA
    except Exception as exc:  # between cases (making inputs): a sticky CUDA error shows here
        say({"op": "(inputs)", "case": "(between cases)", "error": _first_line(exc)})
        return FAILED
    torch.save(saved, argv[1])
    say({"saved": len(saved)})
    return 0
