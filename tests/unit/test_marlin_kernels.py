"""Issue 63: the Marlin GEMM cases of `_C` come from the kernels a file added.

`marlin_kernels` reads `marlin::Marlin<...>` names, models vLLM 0.22.0's dispatch
(marlin.cu's marlin_gemm / marlin_mm / determine_exec_config) and derives one
`marlin_gemm` case per kernel; the kernels it never selects on the GPU are named with the
rule.  The names are the 365 kernels aot added to vLLM 0.22.0's x86_64 `_C` for sm_90
(tests/data/kernel_names); the dispatch examples are worked by hand from marlin.cu.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest

from devkit.fake_torch import H100_CUDA
from sm121_build.jobs.payload import marlin_kernels as mk
from sm121_build.jobs.payload.marlin_kernels import Case, Kernel, Sizes
from sm121_build.jobs.proofs.prove_cases import FAMILIES, Dealing, Modules, deal_cases
from sm121_build.jobs.proofs.prove_child import Device, GpuSizes

DATA = Path(__file__).resolve().parents[1] / "data" / "kernel_names"
H100 = mk.H100_SIZES
F16, BF16, S8 = mk.ID["kFloat16"], mk.ID["kBFloat16"], mk.ID["kS8"]
U4, U4B8 = mk.ID["kU4"], mk.ID["kU4B8"]


def _names(which: str = "C") -> list[str]:
    with gzip.open(DATA / f"vllm-0.22.0-x86_64-{which}-sm90-added.txt.gz", "rt") as f:
        return [line.strip() for line in f if line.strip()]


def test_the_scalar_type_ids_are_vllms() -> None:
    """The ids the 0.22.0 names carry (read off its kernel names, csrc/core/scalar_type.hpp's
    packing): half, int8, uint4, uint4b8, uint8b128, float8_e4m3fn, float4_e2m1f."""
    assert mk.ID["kFloat16"] == 1125899906910725
    assert mk.ID["kS8"] == 1125899906909952
    assert mk.ID["kU4"] == 1125899906843648
    assert mk.ID["kU4B8"] == 1125899907892224
    assert mk.ID["kU8B128"] == 1125899923621888
    assert mk.ID["kFE4M3fn"] == 2814749767172868
    assert mk.ID["kFE2M1f"] == 562949953487106


def test_every_marlin_name_of_the_file_parses() -> None:
    names = _names()
    parsed = {n: mk.parse(n) for n in names}
    marlin = [n for n, k in parsed.items() if k is not None]
    assert len(marlin) == 351
    assert all(n.startswith("_ZN6marlin6MarlinI") for n in marlin)
    k = parsed[marlin[0]]
    assert k is not None and k.stages == 4 and k.threads in (128, 256)
    negative = next(k for k in parsed.values() if k is not None and k.group_blocks == -1)
    assert "group -1" in negative.describe()
    # other kernels and hostile names are not Marlin GEMM kernels
    for name in ("_ZN6marlin13MarlinDefaultEPK4int4", "_ZN6marlin6MarlinILl1E" * 100,
                 "_ZN6marlin6MarlinILl" + "9" * 5000, "\x1b]0;x\x07"):
        assert mk.parse(name) is None


@pytest.mark.parametrize(("case", "kernels"), [
    # M 8: one 8-row block; few blocks (256/128 * 1 * 4 <= 132): (128, 64, 128)
    (Case(m=8, n=256, k=256), [Kernel(F16, U4B8, F16, F16, 128, 1, 4, 8, True, 4, -1, False)]),
    # M 64, N 34 tiles of 256 (34 * 4 > 132 SMs): no override, (64, 256, 256); groups of 128
    (Case(m=64, n=8704, k=4096, group=128),
     [Kernel(F16, U4B8, F16, F16, 256, 4, 16, 4, False, 4, 8, False)]),
    # M 100: 64 rows, then 36 (3 blocks); N 128 * 35 not a multiple of 256: (64, 128, 128)
    (Case(m=100, n=4480, k=512),
     [Kernel(F16, U4B8, F16, F16, 128, 4, 8, 4, False, 4, -1, False),
      Kernel(F16, U4B8, F16, F16, 128, 3, 8, 4, False, 4, -1, False)]),
    # act order, K not full: group_blocks 0; K 192 (an odd count of 64): (64, 128, 128)
    (Case(m=16, n=8704, k=192, group=64, act_order=True, k_full=False),
     [Kernel(F16, U4B8, F16, F16, 128, 1, 8, 4, False, 4, 0, False)]),
    # AWQ with an int8 activation: the output is the scales' type, no 8-row block at M 8
    (Case(a="kS8", c="kBFloat16", b="kU4", s="kBFloat16", m=8, n=8704, k=1024, zero=True),
     [Kernel(S8, U4, BF16, BF16, 256, 1, 8, 8, False, 4, -1, False)]),
])
def test_the_dispatch_as_marlin_cu_picks(case: Case, kernels: list[Kernel]) -> None:
    assert list(mk.launched(case, H100)) == kernels


@pytest.mark.parametrize("case", [
    Case(a="kFE4M3fn", c="kFloat16", m=16, n=256, k=256),  # FP8 activation on SM90
    Case(m=16, n=200, k=256),  # N not a multiple of 64
    Case(m=16, n=256, k=250),  # K not a multiple of 16
    Case(b="kU4", m=16, n=256, k=256),  # uint4 without its zero point
    Case(a="kBFloat16", c="kFloat16"),  # a 16-bit activation's output is its own type
    Case(m=16, n=256, k=256, act_order=True, k_full=True),  # act order, one group
])
def test_what_marlin_gemm_refuses_launches_nothing(case: Case) -> None:
    assert mk.launched(case, H100) == ()


def test_every_added_gemm_kernel_gets_a_case_or_a_rule() -> None:
    """On an H100's sizes: one case per GEMM kernel, each launching the kernel it was made
    for (the model's own check); the rest each named with a rule; the other kernels of the
    file (repack, permute, preprocess) left to the harness's fixed cases."""
    names = _names()
    derived = mk.derive(names, H100)
    launched = {n for names_ in derived.expects.values() for n in names_}
    gemm = {n for n in names if mk.parse(n) is not None}
    assert len(derived.cases) == 341 and launched <= gemm
    assert gemm - launched == {n for n in derived.dead() if mk.parse(n) is not None}
    dead = derived.dead()
    assert len(dead) == 11
    assert sum("placeholder" in why for why in dead.values()) == 1
    assert all(mk.parse(n) is not None or n.startswith(mk.DEFAULTS) for n in dead)
    for case in derived.cases:
        assert mk.invalid(case) is None
        by_name = {mk.parse(n): n for n in names if mk.parse(n) is not None}
        assert [by_name[k] for k in mk.launched(case, H100)] == derived.expects[case.key]
    assert len({c.key for c in derived.cases}) == len(derived.cases)
    assert len(derived.foreign) == 13  # repack, permute, preprocess: not GEMM kernels
    # on a GB10 (less shared memory, 48 SMs) the same names derive other shapes
    gb10 = mk.derive(names, Sizes(12, 1, 101376, 48))
    assert {c.key for c in gb10.cases} != {c.key for c in derived.cases}


def test_every_added_moe_kernel_gets_a_case_with_its_tile() -> None:
    """`_moe_C`'s Marlin kernels (marlin_moe_wna16, the same template): the op is given its
    tile (thread_k, thread_n) and its block size, so each of the 732 kernels gets its own
    case; the placeholder is named unreachable; the five permute kernels (an act-order
    case's, one per block size) are not GEMM kernels."""
    names = _names("moe_C")
    derived = mk.derive(names, H100)
    assert len(derived.cases) == 732 and set(derived.dead()) == {
        n for n in names if n.startswith(mk.DEFAULTS)}
    assert sum(1 for n in derived.foreign if "permute_cols_kernel" in n) == 5
    assert {c.moe_block for c in derived.cases} == {8, 16, 32, 48, 64}
    assert all(c.moe_block and c.tile in mk.MOE_TILES for c in derived.cases)
    k = mk.parse(derived.expects[derived.cases[0].key][0])
    assert k is not None and k.moe and k.describe().startswith("MoE Marlin<")


def test_the_moe_dispatch_takes_the_tile_it_is_given() -> None:
    """moe_wna16_marlin_gemm: the tile given, threads = thread_k * thread_n / 64, M blocks
    from the block size; a tile whose pipeline does not fit the GPU's shared memory, or
    that does not divide N and K, launches nothing."""
    case = Case(m=48, n=256, k=256, moe_block=32, tile=(64, 256))
    assert mk.launched(case, H100) == (
        Kernel(F16, U4B8, F16, F16, 256, 2, 16, 4, False, 4, -1, False, moe=True),)
    # generate_kernels.py builds the 256-thread (64, 256) tile for more than one M block
    assert mk.launched(replace(case, moe_block=16), H100) == ()
    eight = Case(m=24, n=256, k=256, moe_block=8, tile=(128, 64))
    assert mk.launched(eight, H100)[0].m8
    assert mk.launched(replace(case, n=192), H100) == ()
    tiny = Sizes(9, 0, 40000, 132)
    assert mk.launched(replace(case, moe_block=64), tiny) == ()
    assert mk.invalid(replace(case, moe_block=24)) is not None
    assert mk.invalid(Case(tile=(64, 256))) is not None


def test_many_made_up_names_cost_the_budget_not_more(monkeypatch: pytest.MonkeyPatch) -> None:
    """Red team: 12,480 distinct made-up Marlin names of known types took 1.7 million
    dispatch evaluations (33 s); the derivation spends at most its budget, and the kernels
    it did not get to are said so, never called unreachable by a rule."""
    count = [0]
    real = mk.launched

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(mk, "launched", counted)
    names = [f"_ZN6marlin6MarlinILl{F16}ELl{U4B8}ELl{F16}ELl{F16}ELi{t}ELi{m}ELi{n}ELi{k}ELb0E"
             "Li4ELi8ELb0EEEv" for t in range(100, 140) for m in (1, 2, 3, 4)
             for n in range(1, 40) for k in (4, 8)]
    derived = mk.derive(names, H100, budget=20_000)
    assert count[0] <= 20_000
    assert sum(why == mk.NOT_TRIED for why in derived.unreachable.values()) > 10_000
    assert not any(why == mk.NOT_TRIED for why in derived.dead().values())
    count[0] = 0
    mk.derive(_names(), H100)
    assert count[0] <= mk.BUDGET  # the real file's derivation is within the default


def test_a_derivation_reads_back_and_refuses_a_bad_case() -> None:
    derived = mk.derive(_names(), H100)
    data = json.loads(json.dumps(derived.to_json()))
    assert mk.cases_from_json(data) == derived.cases
    for bad in ({"cases": [{"m": "16"}]}, {"cases": [{"m": True}]}, {"cases": [1]},
                {"cases": [{"b": "kU4"}]}, {"cases": [{"n": 100}]}, [], {"cases": {}},
                {"cases": [{"op": "varlen_fwd", "head_size": 128}]}):  # FA2's, not Marlin's
        with pytest.raises(ValueError):
            mk.cases_from_json(bad)


def test_marlin_cases_are_dealt_by_module_and_the_dead_named(tmp_path: Path) -> None:
    names = _names()
    modules = Modules({n: 1 + i % 3 for i, n in enumerate(names)}, {1: 10, 2: 20, 3: 30})
    h200 = Device("NVIDIA H200", 9, 0, 13000, "580", GpuSizes(232448, 233472, 132))
    dealt = deal_cases(FAMILIES["marlin"], names, modules, h200, Dealing(4, tmp_path))
    assert dealt.derives and dealt.derived == 341 and len(dealt.parts) == 3
    assert dealt.parts[0].fixed and not dealt.parts[1].fixed
    assert len(dealt.dead) == 11
    assert all(why.startswith("the Marlin dispatch (vLLM 0.22.0 marlin.cu) never selects "
                              "it on compute capability 9.0: ") for why in dealt.dead.values())
    read = [mk.cases_from_json(json.loads(p.cases.read_text())) for p in dealt.parts
             if p.cases is not None]
    assert sum(len(d) for d in read) == 341


# FAKE: a stand-in `torch` for harness_marlin.py run as a script: the repack ops and
# marlin_gemm take vLLM 0.22.0's arguments and record what they were given (CALLS); tensors
# carry a shape and a dtype.  No GPU, no kernel.
MARLIN_TORCH = '''
import json, os
int8, int32, float32, uint8 = "int8", "int32", "float32", "uint8"
float16, bfloat16 = "float16", "bfloat16"
float8_e4m3fn, float8_e8m0fnu = "float8_e4m3fn", "float8_e8m0fnu"
class Tensor:
    def __init__(self, shape, dtype="float32"):
        self.shape, self.dtype = tuple(shape), dtype
    def cpu(self): return self
    def int(self): return Tensor(self.shape, "int32")
    def to(self, dtype): return Tensor(self.shape, dtype)
    def view(self, dtype): return Tensor(self.shape, dtype)
    def contiguous(self): return self
    def __getitem__(self, index): return self
    def roll(self, shift, dim):  # (as torch 2.11: roll_cuda not implemented for Float8)
        if self.dtype.startswith("float8"):
            raise RuntimeError(f'"roll_cuda" not implemented for {self.dtype!r}')
        return self
    def element_size(self):
        return 1 if self.dtype in ("int8", "uint8") or "float8" in self.dtype else 4
    def repeat(self, n): return Tensor((n,), self.dtype)
    def long(self): return self
    def __mul__(self, other): return self
    __add__ = __mul__
def _shape(shape): return shape if isinstance(shape, tuple) else (shape,)
def randint(low, high, shape, dtype="int64", **kw): return Tensor(_shape(shape), dtype)
def rand(shape, dtype="float32", **kw): return Tensor(_shape(shape), dtype)
randn = rand
def randperm(n, **kw): return Tensor((n,), "int64")
def empty(*shape, dtype="float32", **kw): return Tensor(shape, dtype)
def zeros(n, dtype="float32", **kw): return Tensor((n,), dtype)
def tensor(values, dtype="float32", **kw): return Tensor((len(values),), dtype)
def argsort(t): return Tensor(t.shape, "int64")
def bitwise_and(t, mask): return t
def stack(ts): return Tensor((len(ts),) + ts[0].shape, ts[0].dtype)
SPECS = {
    "gptq_marlin_repack": "b_q_weight perm size_k size_n num_bits is_a_8bit",
    "awq_marlin_repack": "b_q_weight size_k size_n num_bits is_a_8bit",
    "marlin_int4_fp8_preprocess": "qweight qzeros_or_none inplace",
    "marlin_gemm": "a c_or_none b_q_weight b_bias_or_none b_scales a_scales global_scale "
                   "b_zeros_or_none g_idx_or_none perm_or_none workspace b_type_id size_m "
                   "size_n size_k is_k_full use_atomic_add use_fp32_reduce is_zp_float",
    "moe_wna16_marlin_gemm": "a c_or_none b_q_weight b_bias_or_none b_scales a_scales "
                   "global_scale b_zeros_or_none g_idx_or_none perm_or_none workspace "
                   "sorted_token_ids expert_ids num_tokens_past_padded topk_weights "
                   "moe_block_size top_k mul_topk_weights b_type_id size_m size_n size_k "
                   "is_full_k use_atomic_add use_fp32_reduce is_zp_float thread_k thread_n "
                   "blocks_per_sm",
}
class _Arg:
    def __init__(self, name): self.name = name
class _Op:
    def __init__(self, name):
        self.name = name
        self.default = type("D", (), {"_schema": type("S", (), {
            "arguments": [_Arg(s) for s in SPECS[name].split()]})()})()
    def __call__(self, *args):
        named = {a.name: v for a, v in zip(self.default._schema.arguments, args)}
        shown = {k: ([v.dtype, *v.shape] if isinstance(v, Tensor) else v)
                 for k, v in named.items()}
        with open(os.environ["CALLS"], "a") as f:
            f.write(json.dumps({"op": self.name, **shown}) + "\\n")
        return Tensor((1,))
class _Ns:
    def __getattr__(self, name):
        if name not in SPECS:
            raise AttributeError(name)
        return _Op(name)
class ops:
    _C = _moe_C = _Ns()
    @staticmethod
    def load_library(path): pass
''' + H100_CUDA + '''
def save(saved, path):
    with open(path, "w") as f:
        json.dump(sorted(saved), f)
'''


def _harness(tmp_path: Path, *args: str, lib: str = "lib.so"
             ) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    import sm121_build.jobs.payload as payload

    (tmp_path / "torch.py").write_text(MARLIN_TORCH)
    calls = tmp_path / "calls.jsonl"
    calls.write_text("")
    done = subprocess.run(
        [sys.executable, str(Path(payload.__file__).parent / "harness_marlin.py"),
         str(tmp_path / lib), str(tmp_path / "out.pt"), *args],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "PYTHONPATH": str(tmp_path), "CALLS": str(calls)})
    return done, [json.loads(line) for line in calls.read_text().splitlines()]


def test_the_harness_runs_the_gemm_cases_it_is_given(tmp_path: Path) -> None:
    """harness_marlin.py as `prove` runs it: the fixed repack cases (and their 8-bit
    activation variants), then one marlin_gemm call per case of --cases, each with the
    inputs its kernel needs: the weight type's id, A of M x K, packed weights, scales of
    the case's groups, zero points for uint4, g_idx and perm for act order."""
    cases = [Case(m=8, n=256, k=256),
             Case(a="kS8", c="kFloat16", b="kU4", s="kFloat16", m=32, n=512, k=1024,
                  group=128, zero=True),
             Case(m=16, n=8704, k=192, group=64, act_order=True, k_full=False)]
    file = tmp_path / "cases.json"
    file.write_text(json.dumps({"cases": [{**asdict(c), "key": c.key} for c in cases]}))
    done, calls = _harness(tmp_path, "--cases", str(file))
    assert done.returncode == 0, done.stderr
    repacks = [c for c in calls if c["op"].endswith("_repack")]
    assert len(repacks) == 18 + 4 and sum(c["is_a_8bit"] for c in repacks) == 4
    pre = [c for c in calls if c["op"] == "marlin_int4_fp8_preprocess"]
    assert [c["qzeros_or_none"] for c in pre] == [None, ["int32", 2, 32]]
    gemm = [c for c in calls if c["op"] == "marlin_gemm"]
    assert len(gemm) == 3
    first, awq, act = gemm
    assert first["a"] == ["float16", 8, 256] and first["b_type_id"] == mk.ID["kU4B8"]
    assert first["b_q_weight"] == ["int32", 16, 256 * 16 * 4 // 32]
    assert first["b_scales"] == ["float16", 1, 256] and first["g_idx_or_none"] is None
    assert awq["a"] == ["int8", 32, 1024] and awq["a_scales"] == ["float32", 32]
    assert awq["b_zeros_or_none"] == ["int32", 8, 512 * 4 // 32]
    assert awq["b_scales"] == ["float16", 8, 512]
    assert act["g_idx_or_none"] == ["int32", 192] and act["perm_or_none"] == ["int32", 192]
    assert act["is_k_full"] is False and act["b_scales"] == ["float16", 3, 8704]
    assert all(c["use_fp32_reduce"] and not c["use_atomic_add"] for c in gemm)
    saved = json.loads((tmp_path / "out.pt").read_text())
    assert {f"marlin_gemm/{c.key}" for c in cases} <= set(saved)
    # --derived-only: no fixed case
    done, calls = _harness(tmp_path, "--cases", str(file), "--derived-only")
    assert done.returncode == 0 and [c["op"] for c in calls] == ["marlin_gemm"] * 3


def test_the_harness_refuses_a_bad_cases_file_in_one_line(tmp_path: Path) -> None:
    file = tmp_path / "cases.json"
    file.write_text(json.dumps({"cases": [{"m": "x"}]}))
    done, calls = _harness(tmp_path, "--cases", str(file))
    assert done.returncode == 2 and calls == []
    assert done.stderr.startswith("usage: harness_marlin.py") and "Traceback" not in done.stderr
    assert len(done.stderr.splitlines()) == 1


def test_the_harness_runs_moe_cases_on_a_moe_library(tmp_path: Path) -> None:
    """`_moe_C.abi3.so`: no fixed case (its library has no repack op); each MoE case one
    moe_wna16_marlin_gemm call, its weights one per expert, its tokens routed and padded
    to the block size, the tile and the block size given."""
    case = Case(m=24, n=256, k=256, group=64, moe_block=16, tile=(128, 128))
    file = tmp_path / "cases.json"
    file.write_text(json.dumps({"cases": [{**asdict(case), "key": case.key}]}))
    done, calls = _harness(tmp_path, "--cases", str(file), lib="_moe_C.abi3.so")
    assert done.returncode == 0, done.stderr
    [call] = calls
    assert call["op"] == "moe_wna16_marlin_gemm"
    assert call["b_q_weight"] == ["int32", mk.MOE_EXPERTS, 16, 256 * 16 // 8]
    assert call["b_scales"] == ["float16", mk.MOE_EXPERTS, 4, 256]
    assert (call["moe_block_size"], call["top_k"]) == (16, mk.MOE_TOP_K)
    assert (call["thread_k"], call["thread_n"], call["blocks_per_sm"]) == (128, 128, -1)
    # 24 tokens x 2 routes over 4 experts: 12 each, padded to 16: 4 blocks
    assert call["sorted_token_ids"] == ["int32", 64] and call["expert_ids"] == ["int32", 4]


def test_moe_cases_with_float8_scales_build_their_inputs(tmp_path: Path) -> None:
    """Device run, 2026-11-28: torch rolls no float8 tensor ("roll_cuda" not implemented
    for 'Float8_e8m0fnu'), and the MoE cases of NVFP4 / MXFP4 / MXFP8 weights ended their
    part between cases; each expert's scales are now rolled as bytes."""
    cases = [Case(a="kBFloat16", c="kBFloat16", b="kFE2M1f", s="kFE8M0fnu", m=48, n=256,
                  k=256, group=32, moe_block=16, tile=(128, 64)),
             Case(b="kFE2M1f", s="kFE4M3fn", m=48, n=256, k=256, group=16, moe_block=16,
                  tile=(128, 128))]
    file = tmp_path / "cases.json"
    file.write_text(json.dumps({"cases": [{**asdict(c), "key": c.key} for c in cases]}))
    done, calls = _harness(tmp_path, "--cases", str(file), lib="_moe_C.abi3.so")
    assert done.returncode == 0, done.stdout + done.stderr
    assert [c["b_scales"][0] for c in calls] == ["float8_e8m0fnu", "float8_e4m3fn"]
    assert calls[1]["global_scale"] == ["float32", mk.MOE_EXPERTS]


@pytest.mark.parametrize("value", ["0", "0,1", "\u0661", ""])
def test_the_harness_refuses_fixed_in_one_line(tmp_path: Path, value: str) -> None:
    """Marlin's fixed cases run together in the first part: `--fixed` (any value) is
    refused, in one line, before any op is called."""
    done, calls = _harness(tmp_path, "--fixed", value)
    assert done.returncode == 2 and calls == []
    assert done.stderr.startswith("usage: harness_marlin.py") and "Traceback" not in done.stderr
    assert len(done.stderr.splitlines()) == 1 and "--fixed" in done.stderr
