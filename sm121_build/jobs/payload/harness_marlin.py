"""Run vLLM `_C`'s Marlin ops on seeded inputs and save the outputs (`sm121-build prove`;
the method of benchmarks/device/marlin_outputs.py).

Standard library and torch only, run as a script by the interpreter `prove --python` names:

    python3 harness_marlin.py SO OUT.pt [KERNELS.json] [--kernels NAMES.txt | --cases CASES.json]
        [--slice I/N] [--derived-only]

The fixed cases first: the GPTQ and AWQ repack ops (for 16-bit activations, and for 8-bit
ones where the op takes `is_a_8bit`), and `marlin_int4_fp8_preprocess` where the library
has it.  Then the `marlin_gemm` cases derived from the kernels (marlin_kernels.py, its
sibling): `--kernels`, the names (the cases derived here, for this GPU), or `--cases`,
cases derived before (`marlin_kernels.Derived.to_json`).  `--slice` and `--derived-only`
as in harness_fa2.py.  Every output an op gives back is saved.

Its lines on stdout, and the run around its cases, are harness_run.py's.
"""

from __future__ import annotations

import importlib
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

# the sibling modules (found beside this script when it runs as one)
sys.path.insert(0, str(Path(__file__).resolve().parent))
harness = importlib.import_module("harness_run")
marlin = importlib.import_module("marlin_kernels")
case_files = importlib.import_module("case_files")

MOE = "_moe_C"  # the library of the MoE GEMM (the repack ops and marlin_gemm are `_C`'s)
NEEDED = {"gptq_marlin_repack": {"b_q_weight", "perm", "size_k", "size_n", "num_bits"},
          "awq_marlin_repack": {"b_q_weight", "size_k", "size_n", "num_bits"},
          "marlin_int4_fp8_preprocess": {"qweight", "qzeros_or_none", "inplace"},
          "marlin_gemm": {"a", "c_or_none", "b_q_weight", "b_bias_or_none", "b_scales",
                          "b_zeros_or_none", "workspace", "b_type_id", "size_m", "size_n",
                          "size_k", "use_atomic_add", "use_fp32_reduce", "is_zp_float"},
          "moe_wna16_marlin_gemm": {
              "a", "c_or_none", "b_q_weight", "b_bias_or_none", "b_scales", "a_scales",
              "global_scale", "b_zeros_or_none", "g_idx_or_none", "perm_or_none", "workspace",
              "sorted_token_ids", "expert_ids", "num_tokens_past_padded", "topk_weights",
              "moe_block_size", "top_k", "mul_topk_weights", "b_type_id", "size_m",
              "size_n", "size_k", "is_full_k", "use_atomic_add", "use_fp32_reduce",
              "is_zp_float", "thread_k", "thread_n", "blocks_per_sm"}}
# arguments given where the op has them: `is_a_8bit` came to the repack ops later; vLLM
# 0.33's marlin_gemm has no act order (g_idx, perm, is_k_full): its act-order cases are left
OPTIONAL = {"gptq_marlin_repack": {"is_a_8bit"}, "awq_marlin_repack": {"is_a_8bit"},
            "marlin_gemm": {"a_scales", "global_scale", "g_idx_or_none", "perm_or_none",
                            "is_k_full"}}
SHAPES = [(256, 192), (4096, 4096), (7168, 2112)]  # (size_k, size_n)
FP8_NO_NAN = -0x08080809  # 0xF7F7F7F7: each byte's lowest exponent bit off (no e4m3fn NaN)


def namespace_of(path: str) -> str:
    """The library's ops: `_moe_C`'s for a file of that name, else `_C`'s."""
    return MOE if Path(path).name.startswith(MOE + ".") else "_C"


def found_op(torch: Any, namespace: str, op: str) -> Any | None:
    """The op, or None where the library has none of that name."""
    try:
        return getattr(getattr(torch.ops, namespace), op)
    except (AttributeError, RuntimeError):
        return None


def check(torch: Any, namespace: str, op: str) -> Any:
    """The op, when it is there with the arguments the harness gives (vLLM renames none of
    the repack ops' across 0.2x; `is_a_8bit` came later and is given when asked for)."""
    found = found_op(torch, namespace, op)
    if found is None:
        raise harness.SchemaError(f"{namespace}.{op}: no such op in this library")
    names = {a.name for a in found.default._schema.arguments}
    lacking = sorted(NEEDED[op] - names)
    unknown = sorted(names - NEEDED[op] - OPTIONAL.get(op, set()))
    if lacking or unknown:
        raise harness.SchemaError(f"{namespace}.{op}: lacks {lacking or 'nothing'}, has unknown "
                                  f"{unknown or 'nothing'} (schema: {found.default._schema})")
    return found


def _call(torch: Any, op: Any, values: dict[str, Any], label: tuple[str, str]) -> Any:
    args = [values[a.name] for a in op.default._schema.arguments]
    return harness.first_call(torch, op, args, label)


def repack(torch: Any, saved: dict[str, Any]) -> None:
    """The repack ops' fixed cases (and the 8-bit activations' where the op takes them)."""
    gen = torch.Generator(device="cuda").manual_seed(121)
    gptq, awq = check(torch, "_C", "gptq_marlin_repack"), check(torch, "_C", "awq_marlin_repack")
    a8 = {a.name for a in gptq.default._schema.arguments} >= {"is_a_8bit"}
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
                saved[f"{op_name}/{case}"] = _call(torch, op, values, (op_name, case))
                if a8 and not act_order and (k, n) == SHAPES[0]:  # (no act order with it)
                    values["is_a_8bit"] = True
                    case = f"{name}-{bits}bit-a8-{k}x{n}"
                    saved[f"{op_name}/{case}"] = _call(torch, op, values, (op_name, case))


def preprocess(torch: Any, saved: dict[str, Any]) -> None:
    """`marlin_int4_fp8_preprocess` without and with AWQ zero points, where the library
    has the op."""
    if found_op(torch, "_C", "marlin_int4_fp8_preprocess") is None:
        return
    op = check(torch, "_C", "marlin_int4_fp8_preprocess")
    gen = torch.Generator(device="cuda").manual_seed(122)
    k, n = 256, 256
    q = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, device="cuda",
                      generator=gen)
    zeros = torch.randint(-2**31, 2**31 - 1, (k // 128, n // 8), dtype=torch.int32,
                          device="cuda", generator=gen)
    for case, z in (("without-zp-256x256", None), ("awq-g128-256x256", zeros)):
        values = {"qweight": q, "qzeros_or_none": z, "inplace": False}
        saved[f"marlin_int4_fp8_preprocess/{case}"] = _call(
            torch, op, values, ("marlin_int4_fp8_preprocess", case))


def gemm_inputs(torch: Any, case: Any, gen: Any) -> dict[str, Any]:
    """`marlin_gemm`'s arguments for a case (marlin_kernels.Case), drawn from `gen`."""
    dev = "cuda"
    dtype = {name: getattr(torch, held, None) for name, _, held in marlin.TYPES.values()}
    m, n, k = case.m, case.n, case.k
    bits = marlin.TYPES[marlin.ID[case.b]][1]
    out_dtype = dtype[case.c]

    def words(*shape: int) -> Any:
        return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, device=dev,
                             generator=gen)

    a_scales = None
    if case.a == "kS8":
        a = torch.randint(-128, 128, (m, k), dtype=torch.int8, device=dev, generator=gen)
        a_scales = torch.rand((m,), dtype=torch.float32, device=dev, generator=gen) * 0.01
    else:
        a = torch.randn((m, k), dtype=dtype[case.a], device=dev, generator=gen)
    b = words(k // 16, n * 16 * bits // 32)
    if case.b == "kFE4M3fn":
        b = torch.bitwise_and(b, FP8_NO_NAN)
    groups = 1 if case.group == -1 else k // case.group
    global_scale = None
    if case.s == "kFE4M3fn":  # NVFP4's block scales and its global scale
        scales = (torch.rand((groups, n), device=dev, generator=gen) + 0.5).to(
            torch.float8_e4m3fn)
        global_scale = torch.tensor([0.25], dtype=torch.float32, device=dev)
    elif case.s == "kFE8M0fnu":  # MX scales: exponents near 1.0
        scales = torch.randint(124, 131, (groups, n), dtype=torch.uint8, device=dev,
                               generator=gen).view(torch.float8_e8m0fnu)
    else:
        scales = torch.rand((groups, n), dtype=out_dtype, device=dev, generator=gen) * 0.02
    zeros = words(groups, n * bits // 32) if case.zero else None
    g_idx = perm = None
    if case.act_order:  # as vLLM's marlin_sort_g_idx gives them: g_idx sorted, its order
        raw = torch.randint(0, groups, (k,), dtype=torch.int32, device=dev, generator=gen)
        perm = torch.argsort(raw).int()
        g_idx = raw[perm.long()].contiguous()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return {"a": a, "c_or_none": None, "b_q_weight": b, "b_bias_or_none": None,
            "b_scales": scales, "a_scales": a_scales, "global_scale": global_scale,
            "b_zeros_or_none": zeros, "g_idx_or_none": g_idx, "perm_or_none": perm,
            "workspace": torch.zeros(sms * 4, dtype=torch.int32, device=dev),
            "b_type_id": marlin.ID[case.b], "size_m": m, "size_n": n, "size_k": k,
            "is_k_full": case.k_full, "use_atomic_add": False, "use_fp32_reduce": True,
            "is_zp_float": False}


def moe_inputs(torch: Any, case: Any, gen: Any) -> dict[str, Any]:
    """`moe_wna16_marlin_gemm`'s arguments for a MoE case: marlin_gemm's, each weight
    tensor one per expert; each token routed to MOE_TOP_K experts in turn, the routes
    sorted by expert and padded to the block size as moe_align_block_size gives them."""
    dense = gemm_inputs(torch, case, gen)
    dev, experts, top_k, block = "cuda", marlin.MOE_EXPERTS, marlin.MOE_TOP_K, case.moe_block

    def rolled(t: Any, by: int) -> Any:  # (torch rolls no float8 tensor: their bytes)
        if t.element_size() != 1:
            return t.roll(by, 0)
        return t.view(torch.uint8).roll(by, 0).view(t.dtype)

    def per_expert(t: Any, vary: bool = True) -> Any:  # each expert's own rows (vary)
        return None if t is None else torch.stack(
            [t] + [rolled(t, e) if vary else t for e in range(1, experts)]).contiguous()

    routes: dict[int, list[int]] = {e: [] for e in range(experts)}
    for token in range(case.m):
        for j in range(top_k):
            routes[(token + j) % experts].append(token * top_k + j)
    sorted_ids: list[int] = []
    expert_ids: list[int] = []
    for expert, ids in routes.items():
        padded = -(-len(ids) // block) * block
        sorted_ids += ids + [case.m * top_k] * (padded - len(ids))
        expert_ids += [expert] * (padded // block)
    named = {**dense,
             "b_q_weight": per_expert(dense["b_q_weight"]),
             "b_scales": per_expert(dense["b_scales"]),
             "b_zeros_or_none": per_expert(dense["b_zeros_or_none"]),
             "g_idx_or_none": per_expert(dense["g_idx_or_none"], vary=False),
             "perm_or_none": per_expert(dense["perm_or_none"], vary=False),
             "global_scale": None if dense["global_scale"] is None else
             dense["global_scale"].repeat(experts),
             "sorted_token_ids": torch.tensor(sorted_ids, dtype=torch.int32, device=dev),
             "expert_ids": torch.tensor(expert_ids, dtype=torch.int32, device=dev),
             "num_tokens_past_padded": torch.tensor([len(sorted_ids)], dtype=torch.int32,
                                                    device=dev),
             "topk_weights": torch.rand((case.m, top_k), dtype=torch.float32, device=dev,
                                        generator=gen),
             "moe_block_size": block, "top_k": top_k, "mul_topk_weights": False,
             "is_full_k": case.k_full, "thread_k": case.tile[0], "thread_n": case.tile[1],
             "blocks_per_sm": -1}
    return named


def gpu_sizes(torch: Any) -> Any:
    """What marlin_kernels' dispatch reads of this GPU (device 0)."""
    p = torch.cuda.get_device_properties(0)
    return marlin.Sizes(p.major, p.minor, int(p.shared_memory_per_block_optin),
                        int(p.multi_processor_count))


def read_cases(opts: Any) -> tuple[list[str] | None, list[Any]]:
    """The files the options name (`case_files.read_cases`), before any GPU work."""
    found: tuple[list[str] | None, list[Any]] = case_files.read_cases(opts, marlin.cases_from_json)
    return found


def cases_with(opts: Any, names: list[str] | None, given: list[Any], namespace: str
               ) -> Callable[[Any, dict[str, Any]], None]:
    """The harness's cases for the library of `namespace`: the fixed ones (`_C`'s), then
    the derived ones of its op, those of its slice."""

    def cases(torch: Any, saved: dict[str, Any]) -> None:
        derived = given if names is None else marlin.derive(names, gpu_sizes(torch)).cases
        name = "moe_wna16_marlin_gemm" if namespace == MOE else "marlin_gemm"
        op = check(torch, namespace, name) if derived else None
        first, count = opts.part
        if first == 0 and opts.fixed and namespace != MOE:
            repack(torch, saved)
            preprocess(torch, saved)
        takes = {a.name for a in op.default._schema.arguments} if op is not None else set()
        for at, case in enumerate(derived, start=1):
            if bool(case.moe_block) != (name != "marlin_gemm") or \
                    (case.act_order and "g_idx_or_none" not in takes):
                continue  # another library's case, or an op without act order
            if at % count == first:
                gen = torch.Generator(device="cuda").manual_seed(
                    121 + zlib.crc32(case.key.encode()))
                values = (moe_inputs if case.moe_block else gemm_inputs)(torch, case, gen)
                saved[f"{name}/{case.key}"] = _call(torch, op, values, (name, case.key))

    return cases


def main(argv: list[str]) -> int:
    # `SO OUT.pt [KERNELS.json]` is harness_run's (the recorder's listing, the native run's);
    # this harness's own options follow
    plain = 3 if len(argv) > 2 and not argv[2].startswith("--") else 2
    try:
        opts = harness.options(argv[plain:])
        if opts.only is not None:
            raise ValueError("--fixed: its fixed cases run together, in the first part")
        names, given = read_cases(opts)
    except (OSError, ValueError) as exc:
        text = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
        sys.stderr.write(f"usage: harness_marlin.py SO OUT.pt [--kernels F | --cases F] "
                         f"[--slice I/N] [--derived-only]: {text}\n")
        return 2
    return int(harness.run(argv[:plain], "harness_marlin.py",
                           cases_with(opts, names, given, namespace_of(argv[0]))))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
