"""Run vLLM FA2's `varlen_fwd` and `fwd_kvcache` (and, for the cases derived from sparse
kernels, `fwd_sparse` and `varlen_fwd_sparse`) on fixed seeded inputs and save the outputs
(`sm121-build prove`; the method of benchmarks/device/fa2_outputs.py).

Standard library and torch only, run as a script by the interpreter `prove --python` names:

    python3 harness_fa2.py SO OUT.pt [KERNELS.json] [--kernels NAMES.txt | --cases CASES.json]
        [--slice I/N] [--derived-only | --fixed I,J]

The fixed cases first (`VARLEN`, `KVCACHE`), then those derived from the kernels
(fa2_kernels.py, its sibling): `--kernels`, the names of the kernels to launch (one a line:
the cases derived here, for this GPU's dispatch), or `--cases`, cases derived before
(`fa2_kernels.Derived.to_json`).  `--slice I/N`: only the cases whose position modulo N is
I (0 <= I < N), so that N processes share them.  `--derived-only`: the fixed cases left
out (a process given a part of the derived cases that is not the first: prove deals the
cases to its processes by module, one `--cases` file each).  `--fixed I,J`: the fixed cases
at those positions (`fa2_kernels.fixed_cases`' order) alone, their inputs the same as in a
run of all of them (every fixed input is drawn, in order, from the one seed; only the op
calls are left out): prove deals the fixed cases with their modules.  Every output tensor a case
writes is saved (what the op returns, and the KV cache it appends to).

Its lines on stdout, and the run around its cases, are harness_run.py's.
"""

from __future__ import annotations

import importlib
import math
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

# the sibling modules (found beside this script when it runs as one): the run both
# harnesses share, and the FA2 kernels' cases
sys.path.insert(0, str(Path(__file__).resolve().parent))
harness = importlib.import_module("harness_run")
fa2 = importlib.import_module("fa2_kernels")
case_files = importlib.import_module("case_files")

NAMESPACE = "_vllm_fa2_C"
# the arguments each op must have by these names (the rest are filled by their type)
NEEDED = {
    "varlen_fwd": {"q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                   "max_seqlen_k", "softmax_scale", "is_causal"},
    "fwd_kvcache": {"q", "kcache", "vcache", "seqlens_k", "block_table", "softmax_scale",
                    "is_causal"},
    "fwd_sparse": {"q", "k", "v", "block_count", "block_offset", "column_count",
                   "column_index", "softmax_scale", "is_causal", "softcap"},
    "varlen_fwd_sparse": {"q", "k", "v", "block_count", "block_offset", "column_count",
                          "column_index", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                          "max_seqlen_k", "softmax_scale", "is_causal", "softcap"},
}
SPARSE_BLOCK = 64  # the rows of one block_count entry (mha_*_sparse's BLOCK_M)


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


def varlen(torch: Any, saved: dict[str, Any], gen: Any, wanted: Callable[[int], bool]
           ) -> None:
    """Prefill: one sequence of 1,024 tokens; the cases `wanted` says (by position) are
    called, every input drawn."""
    schema = check(torch, "varlen_fwd")
    op = torch.ops._vllm_fa2_C.varlen_fwd
    for at, (dtype_name, d, causal) in enumerate(fa2.VARLEN):
        dtype = getattr(torch, dtype_name)
        length, heads = 1024, 16
        q, k, v = (torch.randn(length, heads, d, device="cuda", dtype=dtype, generator=gen)
                   for _ in range(3))
        cu = torch.tensor([0, length], device="cuda", dtype=torch.int32)
        if not wanted(at):
            continue
        values = arguments(torch, schema, {
            "q": q, "k": k, "v": v, "cu_seqlens_q": cu, "cu_seqlens_k": cu,
            "max_seqlen_q": length, "max_seqlen_k": length,
            "softmax_scale": 1.0 / math.sqrt(d), "is_causal": causal})
        case = f"{dtype_name}-d{d}-{'causal' if causal else 'full'}"
        saved[f"varlen_fwd/{case}"] = harness.first_call(torch, op, values,
                                                         ("varlen_fwd", case))


def kvcache(torch: Any, saved: dict[str, Any], gen: Any, wanted: Callable[[int], bool]
            ) -> None:
    """Decode against a KV cache: contiguous, and paged (blocks of 256, a table of them);
    the cases `wanted` says (by position among all fixed cases) are called, every input
    drawn."""
    schema = check(torch, "fwd_kvcache")
    op = torch.ops._vllm_fa2_C.fwd_kvcache
    batch, heads, cache_len, block = 2, 16, 512, 256
    for at, (dtype_name, d, paged) in enumerate(fa2.KVCACHE, start=len(fa2.VARLEN)):
        dtype = getattr(torch, dtype_name)
        q = torch.randn(batch, 1, heads, d, device="cuda", dtype=dtype, generator=gen)
        shape = (batch * cache_len // block, block, heads, d) if paged else \
            (batch, cache_len, heads, d)
        kc, vc = (torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)
                  for _ in range(2))
        table = torch.arange(batch * cache_len // block, device="cuda",
                             dtype=torch.int32).reshape(batch, -1) if paged else None
        lengths = torch.tensor([300, cache_len], device="cuda", dtype=torch.int32)
        if not wanted(at):
            continue
        values = arguments(torch, schema, {
            "q": q, "kcache": kc, "vcache": vc, "seqlens_k": lengths, "block_table": table,
            "softmax_scale": 1.0 / math.sqrt(d), "is_causal": True})
        case = f"{dtype_name}-d{d}-{'paged' if paged else 'contiguous'}"
        saved[f"fwd_kvcache/{case}"] = harness.first_call(torch, op, values,
                                                          ("fwd_kvcache", case))


def _table(torch: Any, gen: Any, batch: int, blocks: int) -> Any:
    """A block table: each sequence's blocks, in a seeded shuffled order of the cache."""
    order = torch.randperm(batch * blocks, device="cuda", generator=gen)
    return order.to(torch.int32).reshape(batch, blocks)


def sparse_pattern(case: Any) -> tuple[list[list[int]], list[list[int]]]:
    """A vertical-slash pattern for every block of 64 queries (the same for each sequence and
    head): the key blocks it attends (every other block of 64 keys it may see, and the last
    one), and one key of each block left out (vertical lines), both ascending, as
    vLLM's `convert_vertical_slash_indexes` gives them.  Causal: a query block sees the keys
    up to its last query's (bottom-right aligned, as FA2 masks)."""
    blocks, columns = [], []
    rows = -(-case.seqlen_q // SPARSE_BLOCK)
    for m in range(rows):
        seen = case.seqlen_k
        if case.causal:
            last_q = min((m + 1) * SPARSE_BLOCK, case.seqlen_q) - 1
            seen = max(0, min(case.seqlen_k, last_q + case.seqlen_k - case.seqlen_q + 1))
        starts = list(range(0, seen, SPARSE_BLOCK))
        last = len(starts) - 1  # (each start judged by its place: linear in the row)
        kept = [s for at, s in enumerate(starts) if at % 2 == 0 or at == last]
        left = [s for at, s in enumerate(starts) if at % 2 == 1 and at != last]
        blocks.append(kept)
        columns.append([s + (7 * (m + 1) + 13 * j) % SPARSE_BLOCK
                        for j, s in enumerate(left)])
    return blocks, columns


def sparse_inputs(torch: Any, case: Any) -> dict[str, Any]:
    """`block_count`, `block_offset`, `column_count`, `column_index` of `sparse_pattern`,
    shaped (batch, heads, query blocks[, most entries]) as int32 on the GPU."""
    blocks, columns = sparse_pattern(case)
    b, h = case.batch, case.heads

    def padded(rows: list[list[int]]) -> list[list[int]]:
        width = max(1, max(len(r) for r in rows))
        return [r + [0] * (width - len(r)) for r in rows]

    def on_gpu(values: list[Any]) -> Any:
        one = torch.tensor(values, device="cuda", dtype=torch.int32)
        return one.expand(b, h, *one.shape).contiguous()

    return {"block_count": on_gpu([len(r) for r in blocks]),
            "block_offset": on_gpu(padded(blocks)),
            "column_count": on_gpu([len(r) for r in columns]),
            "column_index": on_gpu(padded(columns))}


def derived_inputs(torch: Any, case: Any, gen: Any) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """The named arguments of one derived case (fa2_kernels.Case), and the inputs the op
    writes in place (the KV cache it appends to)."""
    dtype, d = getattr(torch, case.dtype), case.head_size
    b, hq, hk, sq, sk = case.batch, case.heads, case.heads_k, case.seqlen_q, case.seqlen_k

    def rand(*shape: int) -> Any:
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)

    named: dict[str, Any] = {
        "softmax_scale": 1.0 / math.sqrt(d), "is_causal": case.causal,
        "window_size_left": case.window[0], "window_size_right": case.window[1],
        "softcap": case.softcap, "num_splits": case.num_splits,
        "alibi_slopes": (torch.rand(hq, device="cuda", dtype=torch.float32, generator=gen)
                         if case.alibi else None),
        # (the ops with dropout take these: fwd_kvcache has none, and no argument of them)
        "p_dropout": case.p_dropout, "return_softmax": case.return_softmax,
        "gen": (torch.Generator(device="cuda").manual_seed(121) if case.p_dropout > 0
                else None)}
    if case.op in fa2.SPARSE_OPS:
        named.update(sparse_inputs(torch, case))
        if case.op == "fwd_sparse":
            named.update({"q": rand(b, sq, hq, d), "k": rand(b, sk, hk, d),
                          "v": rand(b, sk, hk, d)})
            return named, ()
    cache_shape = (b * sk // case.paged, case.paged, hk, d) if case.paged else (b, sk, hk, d)
    table = _table(torch, gen, b, sk // case.paged) if case.paged else None
    if case.op in ("varlen_fwd", "varlen_fwd_sparse"):
        q = rand(b * sq, hq, d)
        k, v = (rand(*cache_shape) if case.paged else rand(b * sk, hk, d) for _ in range(2))
        named.update({
            "q": q, "k": k, "v": v, "block_table": table,
            "cu_seqlens_q": torch.arange(0, b + 1, device="cuda", dtype=torch.int32) * sq,
            "cu_seqlens_k": torch.arange(0, b + 1, device="cuda", dtype=torch.int32) * sk,
            "max_seqlen_q": sq, "max_seqlen_k": sk})
        return named, ()
    kcache, vcache = rand(*cache_shape), rand(*cache_shape)
    named.update({"q": rand(b, sq, hq, d), "kcache": kcache, "vcache": vcache,
                  "block_table": table})
    if case.seqlens_k:  # each sequence's cache in use: room left for what is appended
        top = sk - case.append
        named["seqlens_k"] = torch.randint(max(1, top // 2), top + 1, (b,), device="cuda",
                                           dtype=torch.int32, generator=gen)
    if case.append:
        named["k"], named["v"] = rand(b, case.append, hk, d), rand(b, case.append, hk, d)
        return named, (kcache, vcache)
    return named, ()


def gpu_of(torch: Any) -> Any:
    """What fa2_kernels' dispatch reads of this GPU (device 0)."""
    p = torch.cuda.get_device_properties(0)
    return fa2.Gpu(p.major, p.minor, int(p.shared_memory_per_block_optin),
                   int(p.shared_memory_per_multiprocessor), int(p.multi_processor_count))


def read_cases(opts: Any) -> tuple[list[str] | None, list[Any]]:
    """The files the options name (`case_files.read_cases`), before any GPU work."""
    found: tuple[list[str] | None, list[Any]] = case_files.read_cases(
        opts, fa2.cases_from_json, fa2.parse)
    return found


def derived_cases(torch: Any, names: list[str] | None, given: list[Any]) -> list[Any]:
    """The derived cases: those given, or those derived for this GPU from the names (the
    fixed cases kept ahead, so that what they launch is not derived again)."""
    if names is None:
        return given
    fixed = fa2.fixed_cases()
    return list(fa2.derive(names, gpu_of(torch), first=fixed).cases[len(fixed):])


def cases_with(opts: Any, names: list[str] | None, given: list[Any]
               ) -> Callable[[Any, dict[str, Any]], None]:
    """The harness's cases: the fixed ones, then the derived ones, those of its slice."""

    def cases(torch: Any, saved: dict[str, Any]) -> None:
        gen = torch.Generator(device="cuda").manual_seed(121)
        derived = derived_cases(torch, names, given)
        # the ops the cases call (a library without the sparse ops runs the others)
        schemas = {op: check(torch, op) for op in
                   ("varlen_fwd", "fwd_kvcache", *sorted({c.op for c in derived}))}
        first, count = opts.part
        if first == 0 and opts.fixed:  # the fixed cases: their inputs as before, one seed
            only = opts.only
            wanted: Callable[[int], bool] = (lambda _at: True) if only is None \
                else only.__contains__
            varlen(torch, saved, gen, wanted)
            kvcache(torch, saved, gen, wanted)
        for at, case in enumerate(derived, start=1):
            if at % count == first:
                one(torch, saved, schemas, case)

    return cases


def one(torch: Any, saved: dict[str, Any], schemas: dict[str, Any], case: Any) -> None:
    """A derived case run, its outputs saved under `OP/KEY`; its inputs from a seed of its
    own (the key's CRC-32), the same whichever slice runs it."""
    gen = torch.Generator(device="cuda").manual_seed(121 + zlib.crc32(case.key.encode()))
    named, written = derived_inputs(torch, case, gen)
    op = getattr(torch.ops._vllm_fa2_C, case.op)
    values = arguments(torch, schemas[case.op], named)
    saved[case.name] = harness.first_call(torch, op, values, (case.op, case.key), written)


def main(argv: list[str]) -> int:
    # `SO OUT.pt [KERNELS.json]` is harness_run's (the recorder's listing, the native run's);
    # this harness's own options follow
    plain = 3 if len(argv) > 2 and not argv[2].startswith("--") else 2
    try:
        opts = harness.options(argv[plain:])
        if opts.only and opts.only[-1] >= len(fa2.fixed_cases()):
            raise ValueError(f"--fixed {opts.only[-1]}: the harness has "
                             f"{len(fa2.fixed_cases())} fixed cases")
        names, given = read_cases(opts)
    except (OSError, ValueError) as exc:  # fa2.NameError_ is a ValueError
        text = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
        sys.stderr.write(f"usage: harness_fa2.py SO OUT.pt [--kernels F | --cases F] "
                         f"[--slice I/N] [--derived-only | --fixed I,J]: {text}\n")
        return 2
    return int(harness.run(argv[:plain], "harness_fa2.py", cases_with(opts, names, given)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
