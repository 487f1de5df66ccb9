"""Run vLLM FA2's `varlen_fwd` and `fwd_kvcache` on fixed seeded inputs and save the outputs
(`sm121-build prove`; the method of benchmarks/device/fa2_outputs.py).

Standard library and torch only, run as a script by the interpreter `prove --python` names:

    python3 harness_fa2.py SO OUT.pt

Its lines on stdout, and the run around its cases, are harness_run.py's.
"""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path
from typing import Any

# the sibling module both harnesses share (found beside this script when it runs as one)
sys.path.insert(0, str(Path(__file__).resolve().parent))
harness = importlib.import_module("harness_run")

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


def schema_of(torch: Any, op: str) -> Any:
    try:
        return getattr(getattr(torch.ops, NAMESPACE), op).default._schema
    except (AttributeError, RuntimeError):
        raise harness.SchemaError(f"{NAMESPACE}.{op}: no such op in this library") from None


def check(torch: Any, op: str) -> Any:
    schema = schema_of(torch, op)
    names = {a.name for a in schema.arguments}
    lacking = sorted(NEEDED[op] - names)
    if lacking:
        raise harness.SchemaError(f"{NAMESPACE}.{op} has no argument {', '.join(lacking)} "
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
            raise harness.SchemaError(f"{NAMESPACE}: argument {n} of type {ty} is not one the "
                              "harness knows")
    return values


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
        saved[f"varlen_fwd/{case}"] = harness.first_call(torch, op, values,
                                                         ("varlen_fwd", case))


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
        saved[f"fwd_kvcache/{case}"] = harness.first_call(torch, op, values,
                                                          ("fwd_kvcache", case))


def cases(torch: Any, saved: dict[str, Any]) -> None:
    gen = torch.Generator(device="cuda").manual_seed(121)
    check(torch, "varlen_fwd")
    check(torch, "fwd_kvcache")
    varlen(torch, saved, gen)
    kvcache(torch, saved, gen)


if __name__ == "__main__":
    sys.exit(harness.run(sys.argv[1:], "harness_fa2.py", cases))
