"""Run vLLM `_C`'s Marlin GPTQ/AWQ repack ops on fixed seeded inputs and save the outputs
(`sm121-build prove`; the method of benchmarks/device/marlin_outputs.py).

Standard library and torch only, run as a script by the interpreter `prove --python` names:

    python3 harness_marlin.py SO OUT.pt

Its lines on stdout are those of harness_fa2.py: `schema_error` (exit 4), a line per case
(`op`, `case`, `first_s` or `error`; an error ends the run, exit 3), then `saved`.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from typing import Any

FAILED, SCHEMA = 3, 4
NAMESPACE = "_C"
NEEDED = {"gptq_marlin_repack": {"b_q_weight", "perm", "size_k", "size_n", "num_bits"},
          "awq_marlin_repack": {"b_q_weight", "size_k", "size_n", "num_bits"}}
SHAPES = [(256, 192), (4096, 4096), (7168, 2112)]  # (size_k, size_n)


class SchemaError(Exception):
    pass


def _say(data: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(data) + "\n")
    sys.stdout.flush()


def check(torch: Any, op: str) -> Any:
    """The op, when it is there with the arguments the harness gives (vLLM renames none of
    these across 0.2x; `is_a_8bit` came later and is given when asked for)."""
    try:
        found = getattr(getattr(torch.ops, NAMESPACE), op)
        names = {a.name for a in found.default._schema.arguments}
    except (AttributeError, RuntimeError):
        raise SchemaError(f"{NAMESPACE}.{op}: no such op in this library") from None
    lacking = sorted(NEEDED[op] - names)
    unknown = sorted(names - NEEDED[op] - {"is_a_8bit"})
    if lacking or unknown:
        raise SchemaError(f"{NAMESPACE}.{op}: lacks {lacking or 'nothing'}, has unknown "
                          f"{unknown or 'nothing'} (schema: {found.default._schema})")
    return found


def call(torch: Any, op: Any, values: dict[str, Any], label: tuple[str, str]) -> Any:
    """The op's first call, synchronized and timed, its output on the host.  Any error ends
    the run (a CUDA error is sticky: the next call would fail for this one's cause)."""
    args = [values[a.name] for a in op.default._schema.arguments]
    torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        result = op(*args)
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        out = result.cpu()
    except Exception as exc:  # RuntimeError, torch.AcceleratorError: any, said in one line
        _say({"op": label[0], "case": label[1],
              "error": (str(exc).splitlines() or [type(exc).__name__])[0][:300]})
        raise SystemExit(FAILED) from None
    _say({"op": label[0], "case": label[1], "first_s": round(first, 4)})
    return out


def repack(torch: Any, saved: dict[str, Any]) -> None:
    gen = torch.Generator(device="cuda").manual_seed(121)
    gptq, awq = check(torch, "gptq_marlin_repack"), check(torch, "awq_marlin_repack")
    for bits in (4, 8):
        pack = 32 // bits
        for k, n in SHAPES:
            cases = {"gptq": (gptq, "gptq_marlin_repack", (k // pack, n), False),
                     "gptq-act-order": (gptq, "gptq_marlin_repack", (k // pack, n), True),
                     "awq": (awq, "awq_marlin_repack", (k, n // pack), False)}
            for name, (op, op_name, shape, act_order) in cases.items():
                q = torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, device="cuda",
                                  generator=gen)
                perm = (torch.randperm(k, device="cuda", generator=gen).int() if act_order
                        else torch.empty(0, dtype=torch.int32, device="cuda"))
                values = {"b_q_weight": q, "perm": perm, "size_k": k, "size_n": n,
                          "num_bits": bits, "is_a_8bit": False}
                case = f"{name}-{bits}bit-{k}x{n}"
                saved[f"{op_name}/{case}"] = call(torch, op, values, (op_name, case))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.stderr.write("usage: harness_marlin.py SO OUT.pt\n")
        return 2
    torch = importlib.import_module("torch")
    torch.ops.load_library(argv[0])
    saved: dict[str, Any] = {}
    try:
        repack(torch, saved)
    except SchemaError as exc:
        _say({"schema_error": str(exc)[:500]})
        return SCHEMA
    except Exception as exc:  # between cases (making inputs): a sticky CUDA error shows here
        _say({"op": "(inputs)", "case": "(between cases)",
              "error": (str(exc).splitlines() or [type(exc).__name__])[0][:300]})
        return FAILED
    torch.save(saved, argv[1])
    _say({"saved": len(saved)})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
