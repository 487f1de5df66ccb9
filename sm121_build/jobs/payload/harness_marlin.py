"""Run vLLM `_C`'s Marlin GPTQ/AWQ repack ops on fixed seeded inputs and save the outputs
(`sm121-build prove`; the method of benchmarks/device/marlin_outputs.py).

Standard library and torch only, run as a script by the interpreter `prove --python` names:

    python3 harness_marlin.py SO OUT.pt

Its lines on stdout, and the run around its cases, are harness_run.py's.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

# the sibling module both harnesses share (found beside this script when it runs as one)
sys.path.insert(0, str(Path(__file__).resolve().parent))
harness = importlib.import_module("harness_run")

NAMESPACE = "_C"
NEEDED = {"gptq_marlin_repack": {"b_q_weight", "perm", "size_k", "size_n", "num_bits"},
          "awq_marlin_repack": {"b_q_weight", "size_k", "size_n", "num_bits"}}
SHAPES = [(256, 192), (4096, 4096), (7168, 2112)]  # (size_k, size_n)


def check(torch: Any, op: str) -> Any:
    """The op, when it is there with the arguments the harness gives (vLLM renames none of
    these across 0.2x; `is_a_8bit` came later and is given when asked for)."""
    try:
        found = getattr(getattr(torch.ops, NAMESPACE), op)
        names = {a.name for a in found.default._schema.arguments}
    except (AttributeError, RuntimeError):
        raise harness.SchemaError(f"{NAMESPACE}.{op}: no such op in this library") from None
    lacking = sorted(NEEDED[op] - names)
    unknown = sorted(names - NEEDED[op] - {"is_a_8bit"})
    if lacking or unknown:
        raise harness.SchemaError(f"{NAMESPACE}.{op}: lacks {lacking or 'nothing'}, has unknown "
                          f"{unknown or 'nothing'} (schema: {found.default._schema})")
    return found


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
                args = [values[a.name] for a in op.default._schema.arguments]
                saved[f"{op_name}/{case}"] = harness.first_call(torch, op, args,
                                                                (op_name, case))


if __name__ == "__main__":
    sys.exit(harness.run(sys.argv[1:], "harness_marlin.py", repack))
