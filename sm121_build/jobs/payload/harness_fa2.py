"""Run vLLM FA2's `varlen_fwd` and `fwd_kvcache` on fixed seeded inputs and save the outputs
(`sm121-build prove`; the method of benchmarks/device/fa2_outputs.py).

Standard library and torch only, run as a script by the interpreter `prove --python` names:

    python3 harness_fa2.py SO OUT.pt

Each line on stdout is one JSON object:

    {"schema_error": "..."}                        an op or argument it does not know (exit 4)
    {"op": OP, "case": CASE, "first_s": S}         a case ran; S: its first call, synchronized
    {"op": OP, "case": CASE, "error": "..."}       a case failed: nothing follows (exit 3)
    {"saved": N}                                   N outputs saved to OUT.pt
"""

from __future__ import annotations

import importlib
import json
import math
import sys
import time
from typing import Any

FAILED, SCHEMA = 3, 4
NAMESPACE = "_vllm_fa2_C"
# the arguments each op must have by these names (the rest are filled by their type)
NEEDED = {
    "varlen_fwd": {"q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                   "max_seqlen_k", "softmax_scale", "is_causal"},
    "fwd_kvcache": {"q", "kcache", "vcache", "seqlens_k", "block_table", "softmax_scale",
                    "is_causal"},
}
VARLEN = [("bfloat16", 128, True), ("bfloat16", 128, False), ("float16", 64, True),
          ("bfloat16", 256, True), ("bfloat16", 96, True)]
KVCACHE = [("bfloat16", 128, False), ("bfloat16", 128, True), ("float16", 64, False)]


class SchemaError(Exception):
    pass


def _say(data: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(data) + "\n")
    sys.stdout.flush()


def schema_of(torch: Any, op: str) -> Any:
    try:
        return getattr(getattr(torch.ops, NAMESPACE), op).default._schema
    except (AttributeError, RuntimeError):
        raise SchemaError(f"{NAMESPACE}.{op}: no such op in this library") from None


def check(torch: Any, op: str) -> Any:
    schema = schema_of(torch, op)
    names = {a.name for a in schema.arguments}
    lacking = sorted(NEEDED[op] - names)
    if lacking:
        raise SchemaError(f"{NAMESPACE}.{op} has no argument {', '.join(lacking)} "
                          f"(schema: {schema})")
    return schema


def arguments(torch: Any, schema: Any, named: dict[str, Any]) -> list[Any]:
    """The op's arguments in schema order: those `named`, the rest by type (None for an
    optional, 0 / 0.0 / False, -1 for a window)."""
    values = []
    for a in schema.arguments:
        n, ty = a.name, str(a.type)
        if n in named:
            values.append(named[n])
        elif "window" in n:
            values.append(-1)
        elif ty.startswith("Optional[") or ty.endswith("?"):
            values.append(None)
        elif ty in ("float", "bool", "int", "SymInt"):
            values.append({"float": 0.0, "bool": False}.get(ty, 0))
        elif ty == "Tensor" and n == "out":
            values.append(torch.empty_like(named["q"]))
        else:
            raise SchemaError(f"{NAMESPACE}: argument {n} of type {ty} is not one the "
                              "harness knows")
    return values


def timed(torch: Any, op: Any, values: list[Any], label: tuple[str, str]) -> tuple[Any, float]:
    """The op's first call, synchronized and timed, its output on the host.  Any error ends
    the run (a CUDA error is sticky: the next call would fail for this one's cause)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        result = op(*values)
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        out = (result[0] if isinstance(result, (list, tuple)) else result).cpu()
    except Exception as exc:  # RuntimeError, torch.AcceleratorError: any, said in one line
        _say({"op": label[0], "case": label[1],
              "error": (str(exc).splitlines() or [type(exc).__name__])[0][:300]})
        raise SystemExit(FAILED) from None
    _say({"op": label[0], "case": label[1], "first_s": round(first, 4)})
    return out, first


def varlen(torch: Any, saved: dict[str, Any], gen: Any) -> None:
    schema = check(torch, "varlen_fwd")
    op = torch.ops._vllm_fa2_C.varlen_fwd
    for dtype_name, d, causal in VARLEN:
        dtype = getattr(torch, dtype_name)
        length, heads = 1024, 16
        q, k, v = (torch.randn(length, heads, d, device="cuda", dtype=dtype, generator=gen)
                   for _ in range(3))
        cu = torch.tensor([0, length], device="cuda", dtype=torch.int32)
        values = arguments(torch, schema, {
            "q": q, "k": k, "v": v, "cu_seqlens_q": cu, "cu_seqlens_k": cu,
            "max_seqlen_q": length, "max_seqlen_k": length,
            "softmax_scale": 1.0 / math.sqrt(d), "is_causal": causal})
        case = f"{dtype_name}-d{d}-{'causal' if causal else 'full'}"
        saved[f"varlen_fwd/{case}"] = timed(torch, op, values, ("varlen_fwd", case))[0]


def kvcache(torch: Any, saved: dict[str, Any], gen: Any) -> None:
    """Decode against a KV cache: contiguous, and paged (blocks of 256, a table of them)."""
    schema = check(torch, "fwd_kvcache")
    op = torch.ops._vllm_fa2_C.fwd_kvcache
    batch, heads, cache_len, block = 2, 16, 512, 256
    for dtype_name, d, paged in KVCACHE:
        dtype = getattr(torch, dtype_name)
        q = torch.randn(batch, 1, heads, d, device="cuda", dtype=dtype, generator=gen)
        shape = (batch * cache_len // block, block, heads, d) if paged else \
            (batch, cache_len, heads, d)
        kc, vc = (torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)
                  for _ in range(2))
        table = torch.arange(batch * cache_len // block, device="cuda",
                             dtype=torch.int32).reshape(batch, -1) if paged else None
        lengths = torch.tensor([300, cache_len], device="cuda", dtype=torch.int32)
        values = arguments(torch, schema, {
            "q": q, "kcache": kc, "vcache": vc, "seqlens_k": lengths, "block_table": table,
            "softmax_scale": 1.0 / math.sqrt(d), "is_causal": True})
        case = f"{dtype_name}-d{d}-{'paged' if paged else 'contiguous'}"
        saved[f"fwd_kvcache/{case}"] = timed(torch, op, values, ("fwd_kvcache", case))[0]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.stderr.write("usage: harness_fa2.py SO OUT.pt\n")
        return 2
    torch = importlib.import_module("torch")
    torch.ops.load_library(argv[0])
    gen = torch.Generator(device="cuda").manual_seed(121)
    saved: dict[str, Any] = {}
    try:
        check(torch, "varlen_fwd")
        check(torch, "fwd_kvcache")
        varlen(torch, saved, gen)
        kvcache(torch, saved, gen)
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
