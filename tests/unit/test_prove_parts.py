"""Issue 63: `prove` derives FA2's cases from the kernels a file added, deals them to parts by
module, runs each side's parts at once, gives the stock side's JIT a fresh cache folder of
the run's own (never the native side), compares every part, and names the kernels no op can
launch on this GPU with the dispatch rule as evidence.

The kernels are the 1,472 vLLM 0.22.0's FA2 gained for sm_90 (tests/data/kernel_names, read
off the aot'd file on a lent H200); the modules they sit in are made up here.  FAKE: the
children (`Answering`) answer in this process as the payloads would on a GPU, launching
what fa2_kernels' dispatch model says each case launches; they run nothing.  The real run
is docs/real-build.md's (benchmarks/device/fa2_prove.sh).
"""

from __future__ import annotations

import gzip
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from sm121_build.core.children import Ended
from sm121_build.cuda.added import AddedCubin
from sm121_build.jobs.payload import fa2_kernels
from sm121_build.jobs.proofs import prove_cases
from sm121_build.jobs.proofs.prove_cases import (
    FAMILIES,
    Dealing,
    Modules,
    Part,
    _dealt,
    deal_cases,
)
from sm121_build.jobs.proofs.prove_child import Asked, Device, GpuSizes, Jit, Said, heard
from sm121_build.jobs.proofs.proving import (
    HARNESSES,
    Extracted,
    Folders,
    OpsProven,
    Pair,
    coverage,
    prove_ops,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "kernel_names"
NAMES = gzip.decompress((DATA / "vllm-0.22.0-x86_64-fa2-sm90-added.txt.gz").read_bytes()
                        ).decode().split()
H200 = Device("FAKE H200", 9, 0, 13000, None, GpuSizes(232448, 233472, 132))
GPU = fa2_kernels.Gpu(9, 0, 232448, 233472, 132)


def _module(name: str) -> int:
    """A made-up module per kind, head dim and dtype (FA2 has a .cu file of each)."""
    kernel = fa2_kernels.parse(name)
    assert kernel is not None
    t = kernel.traits
    return 1 + hash((kernel.kind, t.head_dim, t.dtype)) % 40


class _Cubin(AddedCubin):
    def __init__(self, number: int, kernels: tuple[str, ...]) -> None:
        object.__setattr__(self, "number", number)
        object.__setattr__(self, "kernels", kernels)
        object.__setattr__(self, "entry", SimpleNamespace(size=40_000 * len(kernels)))


def _extracted(tmp_path: Path) -> Extracted:
    modules: dict[int, list[str]] = {}
    for name in NAMES:
        modules.setdefault(_module(name), []).append(name)
    cubins = tuple(_Cubin(n, tuple(k)) for n, k in sorted(modules.items()))
    return Extracted(Pair("vllm_flash_attn/_vllm_fa2_C.abi3.so", tmp_path / "new.so",
                          tmp_path / "stock.so", str(tmp_path / "new.so")),
                     cubins, {c.number: tmp_path / f"{c.number}.cubin" for c in cubins})


@dataclass
class Answering:
    """FAKE children: each call recorded; a harness says its cases (the fixed ones unless
    --derived-only, then those of --cases), a native run the kernels fa2_kernels' model
    says each launches, the comparison every case of its pairs equal."""

    jobs: int = 4
    python: str = "FAKE"
    calls: list[tuple[tuple[str, ...], Jit]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def at(self, path: Path) -> str:
        return str(path)

    def talk(self, args: tuple[str, ...], what: str, jit: Jit, asked: Asked,
             seconds: float | None = None) -> tuple[Ended, Said]:
        with self.lock:
            self.calls.append((args, jit))
        script, rest = Path(args[0]).name, list(args[1:])
        lines: list[dict[str, object]] = []
        if script == "compare_outputs.py":
            keys = [k for path in rest[0::2] for k in json.loads(Path(path).read_text())]
            lines = [{"key": k, "bitwise_equal": True, "max_abs_diff": 0.0, "max_ulp": 0}
                     for k in keys]
        else:
            so, out, rest = rest[0], rest[1], rest[2:]
            listing = json.loads(Path(rest.pop(0)).read_text()) if rest[:1] and \
                not rest[0].startswith("--") else None
            if "stock" in so and not jit.on:
                lines = [{"op": "varlen_fwd", "case": "bfloat16-d128-causal",
                          "error": "CUDA error: PTX JIT compilation was disabled"}]
                return Ended(3, b"", b"", 0, False, 0.0, 0), heard(
                    b"".join(json.dumps(x).encode() + b"\n" for x in lines), asked, what)
            cases = fa2_kernels.cases_from_json(json.loads(Path(rest[1]).read_text())) \
                if rest[:1] == ["--cases"] else []
            fixed = [] if "--derived-only" in rest else fa2_kernels.fixed_cases()
            names = {fa2_kernels.parse(n): n for n in listing or []}
            keys = []
            for case in [*fixed, *cases]:
                key = f"{case.op}/{case.key}"
                keys.append(key)
                lines.append({"op": case.op, "case": case.key,
                              "first_s": 9.0 if jit.on else 0.01})
                lines += [{"launched": names[k], "case": key}
                          for k in fa2_kernels.launched(case, GPU) if k in names]
            Path(out).write_text(json.dumps(keys))
            lines.append({"saved": len(keys)})
        text = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
        return Ended(0, text, b"", 0, False, 0.0, 0), heard(text, asked, what)


def _proven(tmp_path: Path, jobs: int) -> tuple[Answering, Extracted, OpsProven]:
    item = _extracted(tmp_path)
    children = Answering(jobs=jobs)
    (tmp_path / "run").mkdir()
    (tmp_path / "ours").mkdir()
    proven = prove_ops(children, item, HARNESSES["_vllm_fa2_C"],
                       Folders(tmp_path / "run", tmp_path / "ours"), H200)
    return children, item, proven


@pytest.mark.parametrize("jobs", [1, 4])
def test_fa2s_derived_cases_launch_every_kernel_the_dispatch_can_reach(tmp_path: Path,
                                                                      jobs: int) -> None:
    _children, item, proven = _proven(tmp_path, jobs)
    results = proven.results
    assert results and all(r.error is None and r.bitwise_equal for r in results), \
        [r for r in results if r.error][:3]
    cover = coverage(item, proven.launched, results, proven.recorder, proven.dead)
    derived = fa2_kernels.derive(NAMES, GPU, first=fa2_kernels.fixed_cases())
    assert cover.added == len(NAMES) == 1472
    assert cover.launched == cover.compared == derived.covered == 1360
    # the 96 blocks the dispatch picks only on other GPUs, and the 16 sparse kernels of an
    # uneven head dim (the sparse ops take head dim 128 only): unreachable, with the rule
    assert len(cover.unreachable) == 96 + 16
    assert all("never selects it on compute capability 9.0" in u.why
               for u in cover.unreachable)
    assert sum("flash_fwd_sparse_kernel" in u.name and "Is_even_K false" in u.why
               for u in cover.unreachable) == 16
    # the 16 others: launched by fwd_sparse / varlen_fwd_sparse cases; none left
    assert cover.never_launched == ()
    assert cover.whole


def test_the_parts_hold_whole_modules_and_only_the_stock_jit_gets_the_cache(
        tmp_path: Path) -> None:
    children, item, _proven_ops = _proven(tmp_path, 4)
    harness = [(args, jit) for args, jit in children.calls
               if Path(args[0]).name == "harness_fa2.py"]
    jit_runs = [(a, j) for a, j in harness if j.on]
    native = [(a, j) for a, j in harness if not j.on and "new.so" in a[1]]
    stock_off = [(a, j) for a, j in harness if not j.on and "stock.so" in a[1]]
    assert len(jit_runs) == len(native) == 4 and len(stock_off) == 1
    caches = {j.cache for _a, j in jit_runs}
    assert len(caches) == 1 and None not in caches
    assert Path(str(next(iter(caches)))).is_dir()
    assert all(j.cache is None for _a, j in native + stock_off)
    # each part runs its fixed cases (`--fixed`, dealt with their modules) or none
    assert all(("--derived-only" in a) != ("--fixed" in a) for a, _j in jit_runs)
    positions = [int(at) for a, _j in jit_runs if "--fixed" in a
                 for at in a[a.index("--fixed") + 1].split(",")]
    assert sorted(positions) == list(range(len(fa2_kernels.fixed_cases())))
    # the first part's cases (a harness may have none fixed); it fails at its first anyway
    assert "--cases" in stock_off[0][0] and "--derived-only" not in stock_off[0][0]
    module_of = {k: c.number for c in item.cubins for k in c.kernels}
    derived = fa2_kernels.derive(NAMES, GPU, first=fa2_kernels.fixed_cases())
    owner: dict[int, int] = {}
    for part, (args, _jit) in enumerate(jit_runs):
        data = json.loads(Path(args[args.index("--cases") + 1]).read_text())
        for case in data["cases"]:
            first = min(module_of[k] for k in derived.expects[f'{case["op"]}/{case["key"]}'])
            assert owner.setdefault(first, part) == part  # a module's cases in one part
    [compare] = [a for a, _j in children.calls if Path(a[0]).name == "compare_outputs.py"]
    assert len(compare) == 1 + 2 * 4  # a pair of files per part


def test_a_gpu_the_loader_did_not_describe_gets_the_fixed_cases_only(tmp_path: Path) -> None:
    dealt = deal_cases(FAMILIES["fa2"], NAMES, Modules({}), Device("g", 9, 0, 13000, None),
                       Dealing(8, tmp_path))
    assert dealt.parts == (Part(None, True),) and dealt.dead == {}
    assert dealt.said is not None and "fixed cases only" in dealt.said


def test_cases_are_dealt_by_module_to_at_most_jobs_parts(tmp_path: Path) -> None:
    modules = Modules({name: _module(name) for name in NAMES})
    dealt = deal_cases(FAMILIES["fa2"], NAMES, modules, H200, Dealing(16, tmp_path))
    assert 1 < len(dealt.parts) <= 16
    assert all(part.fixed == bool(part.only) for part in dealt.parts)
    assert sorted(at for part in dealt.parts for at in part.only or ()) == \
        list(range(len(fa2_kernels.fixed_cases())))
    assert dealt.derived == sum(p.derived for p in dealt.parts) > 1000
    (tmp_path / "one").mkdir()
    one = deal_cases(FAMILIES["fa2"], NAMES, modules, H200, Dealing(1, tmp_path / "one"))
    assert len(one.parts) == 1 and one.derived == dealt.derived


def test_the_largest_modules_are_dealt_first_to_the_lightest_part() -> None:
    """The stock side's wall is its slowest part's: modules go by size, the largest first,
    each to the part with the fewest bytes so far (not by their count)."""
    case = fa2_kernels.Case("varlen_fwd")
    groups = {1: [case], 2: [case] * 5, 3: [case] * 2, 4: [case], 5: [case] * 9}
    size = {1: 100, 2: 60, 3: 50, 4: 40, 5: 10}
    parts = _dealt(groups, size, 2)
    assert [len(p) for p in parts] == [1 + 1, 5 + 2 + 9]  # 100+40 | 60+50+10
    assert len(_dealt(groups, size, 16)) == 5  # never more parts than modules


def test_each_fixed_case_is_dealt_with_its_module(tmp_path: Path) -> None:
    """FA2's fixed cases are dealt as its derived ones are, each with the module of its
    first kernel (`--fixed`): together in the first part, they made it the stock side's
    long pole (~290 s of JIT, against at most 167 s for each of the other 15 parts)."""
    modules = Modules({name: _module(name) for name in NAMES})
    dealt = deal_cases(FAMILIES["fa2"], NAMES, modules, H200, Dealing(16, tmp_path))
    fixed = fa2_kernels.fixed_cases()
    derived = fa2_kernels.derive(NAMES, GPU, first=fixed)
    owner: dict[int, int] = {}
    for number, part in enumerate(dealt.parts):
        assert part.cases is not None and part.only is not None
        assert part.fixed == bool(part.only)
        for case in json.loads(part.cases.read_text())["cases"]:
            first = min(modules.of[k] for k in derived.expects[f'{case["op"]}/{case["key"]}'])
            assert owner.setdefault(first, number) == number
    placed = [(at, number) for number, part in enumerate(dealt.parts)
              for at in part.only or ()]
    assert sorted(at for at, _n in placed) == list(range(len(fixed)))  # each once
    for at, number in placed:
        first = min(modules.of[k] for k in derived.expects[fixed[at].name])
        assert owner.setdefault(first, number) == number  # with its module's cases
    assert len({number for _at, number in placed}) > 1  # not all in one part
    with_fixed = next(p for p in dealt.parts if p.only)
    assert with_fixed.options("C")[:3] == ("--cases", "C", "--fixed")
    assert next(p for p in dealt.parts if not p.only).options("C")[-1] == "--derived-only"


def test_a_harness_whose_fixed_cases_launch_no_added_kernel_runs_them_first(
        tmp_path: Path) -> None:
    """Marlin's fixed cases (the repack ops) are not dealt: the first part runs them all."""
    derivation = prove_cases.Derivation([], {}, {})
    family = prove_cases.Family("X", "model", lambda *_a: derivation)
    dealt = deal_cases(family, [], Modules({}), H200, Dealing(4, tmp_path))
    assert [(p.fixed, p.only) for p in dealt.parts] == [(True, None)]
    assert dealt.parts[0].options("C") == ("--cases", "C")


def test_the_dispatchs_unreachable_kernels_rest_on_the_gpu_tables_memory(
        tmp_path: Path) -> None:
    """Red team: a loader that lies about the shared memory could make reachable kernels
    "unreachable" (and a proof whole). The table's sizes for the compute capability are
    used; a GPU the table gives none for gets no kernel called unreachable by the dispatch."""
    modules = Modules({name: _module(name) for name in NAMES})
    lying = Device("FAKE H200", 9, 0, 13000, None, GpuSizes(1024, 1024, 132))
    (tmp_path / "a").mkdir()
    dealt = deal_cases(FAMILIES["fa2"], NAMES, modules, lying, Dealing(4, tmp_path / "a"))
    assert len(dealt.dead) == 96 + 16 and dealt.said is not None and "GPU table's" in dealt.said
    unknown = Device("FAKE", 9, 9, 13000, None, GpuSizes(232448, 233472, 132))
    (tmp_path / "b").mkdir()
    dealt = deal_cases(FAMILIES["fa2"], NAMES, modules, unknown, Dealing(4, tmp_path / "b"))
    assert dealt.dead == {} and dealt.said is not None and "no shared memory" in dealt.said
    assert dealt.derived > 1000


@pytest.mark.parametrize("jobs", [1, 2, 3, 16, 1000])
@pytest.mark.parametrize("where", ["modules", "none", "sizes"])
def test_every_fixed_case_is_dealt_once_whatever_the_jobs_and_modules(
        tmp_path: Path, jobs: int, where: str) -> None:
    """Each of FA2's fixed cases goes to exactly one part (`--fixed`), whatever the jobs,
    also when none of its kernels is in a module the GPU loads (`none`), or when the
    modules have sizes (`sizes`); a part that runs none is `--derived-only`, and both
    sides get the same options for the same part."""
    of = {name: _module(name) for name in NAMES} if where != "none" else {}
    size = {n: 1000 * n for n in set(of.values())} if where == "sizes" else {}
    dealt = deal_cases(FAMILIES["fa2"], NAMES, Modules(of, size), H200,
                       Dealing(jobs, tmp_path))
    assert 1 <= len(dealt.parts) <= jobs
    positions = []
    for part in dealt.parts:
        args = part.options("C")
        assert args[:2] == ("--cases", "C")
        assert ("--fixed" in args) == part.fixed == bool(part.only) != \
            ("--derived-only" in args)
        if "--fixed" in args:
            positions += [int(at) for at in args[args.index("--fixed") + 1].split(",")]
    assert sorted(positions) == list(range(len(fa2_kernels.fixed_cases())))
