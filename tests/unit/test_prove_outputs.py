"""Every output an op writes is kept and compared (issue #63 part 2): harness_run.outputs
keeps each tensor an op returns and each input it writes in place, compare_outputs.compare
compares them all (it compared only the first before).  The FAKE torch here has tensors
of Python lists; it proves nothing of a GPU."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from devkit.fake_torch import H100_CUDA
from sm121_build.jobs.payload import compare_outputs, fa2_kernels, harness_run
from sm121_build.jobs.payload.fa2_kernels import Case

NAMES = Path(__file__).parents[1] / "data" / "kernel_names" / \
    "vllm-0.22.0-x86_64-fa2-sm90-added.txt.gz"


class FakeTensor:
    """FAKE: a tensor of Python floats; `.cpu()` a copy marked as on the host."""

    def __init__(self, values: list[float], on_host: bool = False) -> None:
        self.values, self.on_host = values, on_host

    def cpu(self) -> FakeTensor:
        return FakeTensor(list(self.values), on_host=True)


FAKE_TORCH = SimpleNamespace(Tensor=FakeTensor)


def test_outputs_keeps_every_tensor_returned_and_written() -> None:
    out, lse, kcache = FakeTensor([1.0]), FakeTensor([2.0]), FakeTensor([3.0])
    kept = harness_run.outputs(FAKE_TORCH, [out, None, lse], written=(kcache,))
    assert [t.values for t in kept] == [[1.0], [2.0], [3.0]]
    assert all(t.on_host for t in kept)
    assert [t.values for t in harness_run.outputs(FAKE_TORCH, out)] == [[1.0]]


def test_first_call_returns_every_output(capsys: pytest.CaptureFixture[str]) -> None:
    torch = SimpleNamespace(Tensor=FakeTensor, cuda=SimpleNamespace(synchronize=lambda: None))
    kept = harness_run.first_call(torch, lambda: (FakeTensor([1.0]), FakeTensor([5.0])), [],
                                  ("varlen_fwd", "c"))
    assert [t.values for t in kept] == [[1.0], [5.0]]
    assert '"case": "c"' in capsys.readouterr().out


@pytest.fixture
def list_math(monkeypatch: pytest.MonkeyPatch) -> None:
    """compare's per-tensor measures over FakeTensors (the real ones need torch)."""
    monkeypatch.setattr(compare_outputs, "same_bits",
                        lambda torch, a, b: a.values == b.values)

    def difference(torch: Any, a: FakeTensor, b: FakeTensor) -> float | None:
        if len(a.values) != len(b.values) or any(v != v for v in a.values + b.values):
            return None
        return max((abs(x - y) for x, y in zip(a.values, b.values, strict=True)),
                   default=0.0)

    monkeypatch.setattr(compare_outputs, "difference", difference)
    monkeypatch.setattr(compare_outputs, "ulps", lambda torch, a, b: None
                        if (d := difference(torch, a, b)) is None else int(d * 10))


@pytest.mark.usefixtures("list_math")
def test_a_difference_in_a_later_output_is_not_equal() -> None:
    """The bug: only result[0] was saved, so an op whose second output (FA2's softmax_lse,
    an appended KV cache) differed was proven equal."""
    same = (FakeTensor([1.0, 2.0]), FakeTensor([0.5]))
    later = (FakeTensor([1.0, 2.0]), FakeTensor([0.75]))
    assert compare_outputs.compare(None, same, same) == {
        "bitwise_equal": True, "max_abs_diff": 0.0, "max_ulp": 0, "outputs": 2,
        "differing": []}
    said = compare_outputs.compare(None, same, later)
    assert said["bitwise_equal"] is False and said["differing"] == [1]
    assert said["max_abs_diff"] == 0.25 and said["max_ulp"] == 2


@pytest.mark.usefixtures("list_math")
def test_a_missing_output_and_a_nan_are_said() -> None:
    one = (FakeTensor([1.0]),)
    two = (FakeTensor([1.0]), FakeTensor([2.0]))
    said = compare_outputs.compare(None, two, one)
    assert said["bitwise_equal"] is False and said["differing"] == [1]
    assert said["max_abs_diff"] is None and said["outputs"] == 2
    nan = (FakeTensor([1.0]), FakeTensor([float("nan")]))
    said = compare_outputs.compare(None, two, nan)
    assert said["max_abs_diff"] is None and said["max_ulp"] is None
    # a file of an older harness: one tensor per case, compared as one output
    assert compare_outputs.compare(None, FakeTensor([1.0]), FakeTensor([1.0]))["outputs"] == 1


# FAKE: a stand-in `torch` for harness_fa2.py run as a script: its two ops take the
# arguments of vLLM 0.22.0's schemas, record the named ones they were given (CALLS), and
# return two tensors; `save` writes each key's count of outputs.  No GPU, no kernel.
FA2_TORCH = '''
import json, os
int32, float32, bfloat16, float16 = "int32", "float32", "bfloat16", "float16"
VARLEN = ("q:Tensor k:Tensor v:Tensor out:Optional[Tensor] cu_seqlens_q:Tensor "
          "cu_seqlens_k:Tensor seqused_k:Optional[Tensor] leftpad_k:Optional[Tensor] "
          "block_table:Optional[Tensor] alibi_slopes:Optional[Tensor] max_seqlen_q:int "
          "max_seqlen_k:int p_dropout:float softmax_scale:float zero_tensors:bool "
          "is_causal:bool window_size_left:int window_size_right:int softcap:float "
          "return_softmax:bool num_splits:int gen:Optional[Generator]")
KVCACHE = ("q:Tensor kcache:Tensor vcache:Tensor k:Optional[Tensor] v:Optional[Tensor] "
           "seqlens_k:Optional[Tensor] rotary_cos:Optional[Tensor] rotary_sin:Optional[Tensor] "
           "cache_batch_idx:Optional[Tensor] leftpad_k:Optional[Tensor] "
           "block_table:Optional[Tensor] alibi_slopes:Optional[Tensor] out:Optional[Tensor] "
           "softmax_scale:float is_causal:bool window_size_left:int window_size_right:int "
           "softcap:float is_rotary_interleaved:bool num_splits:int")
SPARSE = ("q:Tensor k:Tensor v:Tensor block_count:Tensor block_offset:Tensor "
          "column_count:Tensor column_index:Tensor out:Optional[Tensor] "
          "alibi_slopes:Optional[Tensor] p_dropout:float softmax_scale:float is_causal:bool "
          "softcap:float return_softmax:bool gen:Optional[Generator]")
VARLEN_SPARSE = ("q:Tensor k:Tensor v:Tensor block_count:Tensor block_offset:Tensor "
                 "column_count:Tensor column_index:Tensor out:Optional[Tensor] "
                 "cu_seqlens_q:Tensor cu_seqlens_k:Tensor seqused_k:Optional[Tensor] "
                 "alibi_slopes:Optional[Tensor] max_seqlen_q:int max_seqlen_k:int "
                 "p_dropout:float softmax_scale:float zero_tensors:bool is_causal:bool "
                 "softcap:float return_softmax:bool gen:Optional[Generator]")
class Tensor:
    def __init__(self, *shape, values=None):
        self.shape, self.values = shape, values
    def cpu(self): return self
    def to(self, *a): return self
    def reshape(self, *s): return Tensor(*s)
    def __mul__(self, other): return self
    def expand(self, *shape): return Tensor(*shape, values=self.values)
    def contiguous(self): return self
def _t(*shape, **kw): return Tensor(*shape)
randn = rand = randperm = empty_like = _t
def tensor(values, **kw):
    return Tensor(len(values), *([len(values[0])] if values and isinstance(values[0], list)
                                 else []), values=values)
def randint(low, high, shape, **kw): return Tensor(*shape)
def arange(*a, **kw): return Tensor(a[-1])
class _Arg:
    def __init__(self, spec):
        self.name, self.type = spec.split(":")
class _Op:
    def __init__(self, name, spec):
        self.name = name
        self.default = type("D", (), {"_schema": type("S", (), {
            "arguments": [_Arg(s) for s in spec.split()]})()})()
    def __call__(self, *args):
        named = {a.name: v for a, v in zip(self.default._schema.arguments, args)}
        call = {"op": self.name, "num_splits": named.get("num_splits"),
                "window": [named.get("window_size_left"), named.get("window_size_right")],
                "k": isinstance(named["k"], Tensor)}
        if "block_count" in named:  # a sparse op: its pattern, as given
            call.update({key: [named[key].shape, named[key].values] for key in (
                "block_count", "block_offset", "column_count", "column_index")})
        with open(os.environ["CALLS"], "a") as f:
            f.write(json.dumps(call) + "\\n")
        return [Tensor(1), Tensor(2)]
class _Ns:
    varlen_fwd = _Op("varlen_fwd", VARLEN)
    fwd_kvcache = _Op("fwd_kvcache", KVCACHE)
    fwd_sparse = _Op("fwd_sparse", SPARSE)
    varlen_fwd_sparse = _Op("varlen_fwd_sparse", VARLEN_SPARSE)
class ops:
    _vllm_fa2_C = _Ns()
    @staticmethod
    def load_library(path): pass
''' + H100_CUDA + '''
def save(saved, path):
    with open(path, "w") as f:
        json.dump({k: len(v) for k, v in saved.items()}, f)
'''


def _fa2_harness(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str],
                                                        list[dict[str, Any]]]:
    import sm121_build.jobs.payload as payload

    (tmp_path / "torch.py").write_text(FA2_TORCH)
    calls = tmp_path / "calls.jsonl"
    calls.write_text("")
    done = subprocess.run(
        [sys.executable, str(Path(payload.__file__).parent / "harness_fa2.py"),
         str(tmp_path / "lib.so"), str(tmp_path / "out.pt"), *args],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "PYTHONPATH": str(tmp_path), "CALLS": str(calls)})
    return done, [json.loads(line) for line in calls.read_text().splitlines()]


def test_the_fa2_harness_runs_the_cases_it_is_given_in_slices(tmp_path: Path) -> None:
    """harness_fa2.py as `prove` would run it: the 8 fixed cases, then those of --cases;
    --slice 1/2 runs every other derived case and no fixed one; every output is saved."""
    cases = [Case("fwd_kvcache", seqlens_k=True, append=3, num_splits=2),
             Case("varlen_fwd", window=(16, 8)), Case("fwd_kvcache", seqlen_q=1, num_splits=9)]
    file = tmp_path / "cases.json"
    file.write_text(json.dumps({"cases": [{**asdict(c), "window": list(c.window)}
                                          for c in cases]}))
    done, calls = _fa2_harness(tmp_path, "--cases", str(file))
    assert done.returncode == 0, done.stderr
    saved = json.loads((tmp_path / "out.pt").read_text())
    assert len(saved) == 11 and set(saved.values()) == {2, 4}  # append: + the KV cache
    assert saved[f"fwd_kvcache/{cases[0].key}"] == 4
    assert calls[8:] == [{"op": "fwd_kvcache", "num_splits": 2, "window": [-1, -1], "k": True},
                         {"op": "varlen_fwd", "num_splits": 1, "window": [16, 8], "k": True},
                         {"op": "fwd_kvcache", "num_splits": 9, "window": [-1, -1],
                          "k": False}]
    done, calls = _fa2_harness(tmp_path, "--cases", str(file), "--slice", "1/2")
    assert done.returncode == 0, done.stderr
    assert [c["num_splits"] for c in calls] == [2, 9]  # derived cases 1 and 3
    # a part of prove's that is not the first: its derived cases alone, all of them
    done, calls = _fa2_harness(tmp_path, "--cases", str(file), "--derived-only")
    assert done.returncode == 0, done.stderr
    assert [c["num_splits"] for c in calls] == [2, 1, 9]
    assert len(json.loads((tmp_path / "out.pt").read_text())) == 3


def test_the_fa2_harness_runs_the_fixed_cases_it_is_dealt_on_the_same_inputs(
        tmp_path: Path) -> None:
    """`--fixed I,J`: the fixed cases at those positions alone (prove deals them with their
    modules), then the derived ones; the same calls, by position, as a run of all of
    them (every fixed input is drawn from the one seed, in order)."""
    file = tmp_path / "cases.json"
    file.write_text(json.dumps({"cases": [asdict(Case("varlen_fwd", window=(16, 8)))]}))
    done, every = _fa2_harness(tmp_path, "--cases", str(file))
    assert done.returncode == 0, done.stderr
    done, calls = _fa2_harness(tmp_path, "--cases", str(file), "--fixed", "1,5,7")
    assert done.returncode == 0, done.stderr
    assert calls == [every[1], every[5], every[7], every[8]]
    saved = json.loads((tmp_path / "out.pt").read_text())
    fixed = fa2_kernels.fixed_cases()
    assert sorted(saved) == sorted(
        [f"varlen_fwd/{fixed[1].dtype}-d{fixed[1].head_size}-full",
         f"fwd_kvcache/{fixed[5].dtype}-d{fixed[5].head_size}-contiguous",
         f"fwd_kvcache/{fixed[7].dtype}-d{fixed[7].head_size}-contiguous",
         f"varlen_fwd/{Case('varlen_fwd', window=(16, 8)).key}"])


def test_the_fa2_harness_derives_cases_from_kernel_names(tmp_path: Path) -> None:
    """--kernels: the cases derived for the GPU torch reports (the FAKE's: an H100), after
    the fixed cases, whose kernels are not derived again."""
    names = gzip.decompress(NAMES.read_bytes()).decode().split()[::20]
    file = tmp_path / "names.txt"
    file.write_text("\n".join(names) + "\n")
    done, calls = _fa2_harness(tmp_path, "--kernels", str(file))
    assert done.returncode == 0, done.stderr
    fixed = fa2_kernels.fixed_cases()
    derived = fa2_kernels.derive(names, fa2_kernels.H100, first=fixed).cases[len(fixed):]
    assert len(derived) > 10
    assert [c["op"] for c in calls[8:]] == [c.op for c in derived]
    assert [c["num_splits"] for c in calls[8:]] == [c.num_splits for c in derived]


@pytest.mark.parametrize(("args", "said"), [
    (["--slice", "2/2"], "is not I/N"),
    (["--slice", "x"], "is not I/N"),
    (["--cases"], "valueless option"),
    (["--kernels", "a", "--cases", "b"], "give one"),
    (["--frobnicate", "1"], "unknown"),
    (["--derived-only", "--derived-only"], "unknown, repeated"),
    (["--cases", "/nonexistent/cases.json"], "No such file"),
    (["--fixed", "8"], "the harness has 8 fixed cases"),
    (["--fixed", "3,1"], "ascending, each once"),
    (["--fixed", "1,1"], "ascending, each once"),
    (["--fixed", "1,-2"], "is not I,J"),
    (["--fixed", ""], "is not I,J"),
    (["--fixed", "1", "--derived-only"], "give one"),
    (["--fixed", "\u0661"], "is not I,J"),  # ARABIC-INDIC DIGIT ONE: int() takes it as 1
    (["--fixed", "0,\U0001d7cf"], "is not I,J"),  # MATHEMATICAL BOLD DIGIT ONE
    (["--fixed", "\u00b2"], "is not I,J"),  # SUPERSCRIPT TWO: isdigit(), which int() refuses
    (["--fixed", "0,"], "is not I,J"),
    (["--fixed", " 1"], "is not I,J"),
    (["--fixed", ",".join(map(str, range(1000)))], "is not I,J"),
    (["--fixed", "0,0"], "ascending, each once"),
    (["--fixed", "999"], "the harness has 8 fixed cases"),
    (["--slice", "\u0660/\u0662"], "is not I/N"),
])
def test_the_fa2_harness_refuses_bad_options_in_one_line(
        tmp_path: Path, args: list[str], said: str) -> None:
    done, calls = _fa2_harness(tmp_path, *args)
    assert done.returncode == 2 and not calls
    assert len(done.stderr.splitlines()) == 1 and said in done.stderr


def test_the_native_runs_listing_reaches_the_recorder_before_the_options(
        tmp_path: Path) -> None:
    """`prove` gives the native run its added kernels as harness_run's third argument
    (`SO OUT.pt KERNELS.json`), and harness_fa2's own options after it: both are taken (the
    FAKE torch has no profiler, so the recorder says once why it records nothing)."""
    listing = tmp_path / "kernels.json"
    listing.write_text(json.dumps(["_ZN5flash16flash_fwd_kernelIv"]))
    file = tmp_path / "cases.json"
    file.write_text(json.dumps({"cases": [{**asdict(Case("varlen_fwd", window=(16, 8))),
                                           "window": [16, 8]}]}))
    done, calls = _fa2_harness(tmp_path, str(listing), "--cases", str(file))
    assert done.returncode == 0, done.stderr
    assert len(calls) == 9
    said = [json.loads(line) for line in done.stdout.splitlines()]
    assert sum("recorder" in line for line in said) == 1, said


def test_the_comparison_joins_the_parts_and_refuses_a_case_saved_twice(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """compare_outputs.py REF OTHER [REF OTHER ...]: prove's parts compared as one; a case
    two parts of one side saved is no account of the cases (exit 2)."""
    files = {"r0": {"a/1": 1}, "n0": {"a/1": 1}, "r1": {"a/2": 2}, "n1": {"a/2": 3},
             "r2": {"a/1": 1}}
    fake = SimpleNamespace(load=files.__getitem__)
    monkeypatch.setattr(compare_outputs.importlib, "import_module", lambda name: fake)
    monkeypatch.setattr(compare_outputs, "compare",
                        lambda torch, a, b: {"bitwise_equal": a == b})
    assert compare_outputs.main(["r0", "n0", "r1", "n1"]) == 0
    said = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert said == [{"key": "a/1", "bitwise_equal": True},
                    {"key": "a/2", "bitwise_equal": False}]
    assert compare_outputs.main(["r0", "n0", "r2", "n1"]) == 2
    assert "saved by two parts" in capsys.readouterr().err
    assert compare_outputs.main(["r0"]) == 2


def test_the_fa2_harness_gives_the_sparse_ops_a_vertical_slash_pattern(
        tmp_path: Path) -> None:
    """The sparse ops' cases: `block_count`/`block_offset`/`column_count`/`column_index`
    shaped (batch, heads, query blocks of 64[, entries]) with the pattern `sparse_pattern`
    gives (causal: no key past a block's last query, bottom-right aligned); the outputs
    saved under `OP/KEY`, the two ops' cases apart."""
    cases = [Case("fwd_sparse", batch=2, heads=4, heads_k=2, seqlen_q=131, seqlen_k=197,
                  alibi=True),
             Case("varlen_fwd_sparse", batch=2, heads=4, heads_k=2, seqlen_q=131,
                  seqlen_k=197, causal=True)]
    file = tmp_path / "cases.json"
    file.write_text(json.dumps({"cases": [{**asdict(c), "window": list(c.window)}
                                          for c in cases]}))
    done, calls = _fa2_harness(tmp_path, "--cases", str(file), "--derived-only")
    assert done.returncode == 0, done.stderr
    assert set(json.loads((tmp_path / "out.pt").read_text())) == {c.name for c in cases}
    full, causal = calls
    assert full["op"] == "fwd_sparse" and causal["op"] == "varlen_fwd_sparse"
    assert full["block_count"] == [[2, 4, 3], [3, 3, 3]]
    assert full["block_offset"] == [[2, 4, 3, 3], [[0, 128, 192]] * 3]
    assert full["column_index"][1] == [[71], [78], [85]]  # one key of block 64..127
    # causal: the first 64 queries see keys up to 63 + 197 - 131 = 129
    assert causal["block_offset"][1] == [[0, 128, 0], [0, 128, 192], [0, 128, 192]]
    assert causal["block_count"][1] == [2, 3, 3]
    for offsets, count, limit in zip(causal["block_offset"][1], causal["block_count"][1],
                                     (130, 194, 197), strict=True):
        assert all(start < limit for start in offsets[:count])
        assert offsets[:count] == sorted(offsets[:count])


def test_a_sparse_pattern_costs_the_entries_it_gives(tmp_path: Path) -> None:
    """`sparse_pattern` of a row of 1,024 key blocks costs about 4 times that of 256 (each
    block judged by its place, not searched for in the row: red team 5 measured minutes for
    a case of 65,536 queries and keys)."""
    import time

    from sm121_build.jobs.payload import harness_fa2

    def cost(seqlen_k: int) -> float:
        case = Case("fwd_sparse", heads=1, heads_k=1, batch=1, seqlen_q=64 * 64,
                    seqlen_k=seqlen_k)
        start = time.process_time()
        harness_fa2.sparse_pattern(case)
        return max(time.process_time() - start, 0.05)

    small, large = min(cost(16384) for _ in range(3)), min(cost(65536) for _ in range(3))
    assert large / small < 8.0, (small, large)
