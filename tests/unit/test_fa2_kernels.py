"""prove's FA2 cases from the kernels (jobs/payload/fa2_kernels.py, issue #63 part 2): the
names of the kernels aot adds to vLLM 0.22.0's `_vllm_fa2_C` (tests/data/kernel_names),
read; the cases derived from them; what is left unreachable, and why."""

from __future__ import annotations

import collections
import gzip
import json
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from sm121_build.jobs.payload import fa2_kernels as fa2
from sm121_build.jobs.payload.fa2_kernels import A100, GB10, H100, Case, Kernel, Traits

NAMES = Path(__file__).parents[1] / "data" / "kernel_names" / \
    "vllm-0.22.0-x86_64-fa2-sm90-added.txt.gz"


@pytest.fixture(scope="module")
def names() -> list[str]:
    return gzip.decompress(NAMES.read_bytes()).decode().split()


def _demangled_fields(text: str) -> tuple[list[int], list[object]]:
    m = re.search(r"<Flash_fwd_kernel_traits<(\d+), (\d+), (\d+), (\d+), \w+, \w+, "
                  r"cutlass::\w+, .*?> >, (.*)>\(", text)
    assert m, text
    rest = [v.strip() for v in m.group(5).split(",")]
    return [int(m.group(i)) for i in range(1, 5)], \
        [v == "true" if v in ("true", "false") else int(v) for v in rest]


@pytest.mark.skipif(shutil.which("c++filt") is None, reason="no c++filt")
def test_every_name_reads_as_cxxfilt_demangles_it(names: list[str]) -> None:
    demangled = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True,
                               text=True, check=True).stdout.splitlines()
    for name, text in zip(names, demangled, strict=True):
        k = fa2.parse(name)
        assert k is not None, name
        dims, args = _demangled_fields(text)
        t = k.traits
        assert [t.head_dim, t.block_m, t.block_n, t.warps] == dims, text
        assert list(k.args) == args, text
        assert t.dtype == ("bfloat16" if "bfloat16_t" in text else "float16")
        assert k.kind in text


def test_a_name_read_by_hand() -> None:
    name = ("_ZN5flash32flash_fwd_splitkv_combine_kernelI23Flash_fwd_kernel_traitsILi96ELi64"
            "ELi128ELi4ELb0ELb0EN7cutlass6half_tE19Flash_kernel_traitsILi96ELi64ELi128ELi4E"
            "S3_EELi16ELi6ELb1EEEvNS_16Flash_fwd_paramsE")
    assert fa2.parse(name) == Kernel("flash_fwd_splitkv_combine_kernel",
                                     Traits(96, 64, 128, 4, False, False, "float16"),
                                     (16, 6, True))
    assert fa2.parse("_ZN6marlin6MarlinILi1EEEvv") is None  # not FA2's: not read
    with pytest.raises(fa2.NameError_):
        fa2.parse("_ZN5flash16flash_fwd_kernelI23Flash_fwd_kernel_traitsILi128EEEEvv")


def _one(case: Case, gpu: fa2.Gpu = H100) -> Kernel:
    found = fa2.launched(case, gpu)
    assert len(found) == 1, found
    return found[0]


def test_the_dispatch_of_varlen_fwd() -> None:
    base = Case("varlen_fwd", head_size=128, seqlen_q=128, seqlen_k=256)
    k = _one(base)
    assert k.kind == "flash_fwd_kernel" and k.traits.block_n == 64  # sm_90: 128 x 64
    assert not k.flag("Is_even_MN")  # cu_seqlens: never even for varlen_fwd
    assert _one(base, A100).traits == k.traits  # cc 8.0 is not sm8x
    assert _one(replace(base, head_size=120)).flag("Is_even_K") is False
    assert _one(replace(base, causal=True)).flag("Is_causal")
    assert not _one(replace(base, causal=True, seqlen_q=1)).flag("Is_causal")
    assert _one(replace(base, window=(16, 16))).flag("Is_local")
    assert _one(replace(base, window=(-1, 0))).flag("Is_causal")  # causal by its window
    assert not _one(replace(base, window=(300, 300))).flag("Is_local")  # past seqlen_k
    paged = _one(replace(base, paged=16))
    assert paged.kind == "flash_fwd_splitkv_kernel" and not paged.flag("Split")
    swapped = fa2.launched(replace(base, seqlen_q=1, heads=8, heads_k=2, num_splits=5), H100)
    assert [k.kind for k in swapped] == ["flash_fwd_splitkv_kernel",
                                         "flash_fwd_splitkv_combine_kernel"]
    assert swapped[1].args == (4, 3, True)
    assert fa2.launched(replace(base, head_size=36), H100) == ()  # refused: not 8k
    assert _one(replace(base, head_size=256), A100).traits.block_m == 128
    assert _one(replace(base, head_size=256), GB10).traits.block_m == 64


def test_the_dispatch_of_fwd_kvcache() -> None:
    base = Case("fwd_kvcache", head_size=64, seqlen_q=128, seqlen_k=512)
    k = _one(base)
    assert k.kind == "flash_fwd_kernel" and k.flag("Is_even_MN")
    assert not _one(replace(base, seqlens_k=True)).flag("Is_even_MN")
    append = _one(replace(base, seqlens_k=True, append=3))
    assert append.kind == "flash_fwd_splitkv_kernel" and append.flag("Append_KV")
    split = fa2.launched(replace(base, num_splits=65), H100)
    assert split[0].flag("Split") and split[1].args == (8, 7, True)
    assert fa2.launched(replace(base, append=3), H100) == ()  # appending needs seqlens_k


def test_derived_cases_launch_every_reachable_kernel(names: list[str]) -> None:
    """On H100 (sm_90, the GPU the names were added for): every kernel is launched by a
    derived case or said unreachable; the unreachable ones are the sparse ops' and the
    blocks the dispatch picks only on other GPUs; the report is printed."""
    derived = fa2.derive(names, H100)
    by_name: dict[str, Kernel] = {}
    for n in names:
        parsed = fa2.parse(n)
        assert parsed is not None
        by_name[n] = parsed
    kernels = {k: n for n, k in by_name.items()}
    launched_by = collections.defaultdict(list)
    for case in derived.cases:
        assert fa2.invalid(case) is None
        for k in fa2.launched(case, H100):
            launched_by[k].append(case.key)
        assert {by_name[n] for n in derived.expects[case.name]} == \
            set(fa2.launched(case, H100)) & set(kernels)
    assert len({c.key for c in derived.cases}) == len(derived.cases)
    assert derived.covered + len(derived.unreachable) == len(names)
    for name, why in derived.unreachable.items():
        k = by_name[name]
        assert k not in launched_by and why
        assert k.kind == "flash_fwd_sparse_kernel" or k.traits != fa2._fwd_traits(
            k.traits.head_dim, bool(k.flag("Is_causal")), False, H100, k.traits.dtype), name
    print(f"\nFA2 vLLM 0.22.0 on sm_90: {derived.covered} of {len(names)} kernels launched "
          f"by {len(derived.cases)} cases; left:")
    for why, count in collections.Counter(derived.unreachable.values()).most_common():
        print(f"  {count:4d}  {why}")
    assert derived.covered >= len(names) - 128


def test_the_first_cases_stay_first_and_the_search_finds_what_proposals_miss(
        names: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    first = [Case("varlen_fwd"), Case("fwd_kvcache", paged=256, seqlen_k=512, seqlens_k=True)]
    derived = fa2.derive(names, H100, first=first)
    assert derived.cases[:2] == first
    full = derived.covered
    monkeypatch.setattr(fa2, "_proposals", lambda k: [])
    searched = fa2.derive(names, H100, budget=3000)
    assert 0 < searched.covered <= full
    assert fa2.derive(names, H100, budget=3000).to_json() == searched.to_json()  # seeded


def test_cases_read_back_from_json_and_bad_ones_refused(names: list[str]) -> None:
    derived = fa2.derive(names, H100, budget=0)
    data = json.loads(json.dumps(derived.to_json()))
    assert fa2.cases_from_json(data) == derived.cases
    bad: object
    for bad in ({"cases": [{"op": "varlen_fwd", "head_size": "128"}]},
                {"cases": [{"op": "varlen_fwd", "head_size": 36}]},
                {"cases": [{"op": "rm -rf"}]},
                {"cases": [{"op": "varlen_fwd", "window": [1]}]},
                {"cases": [{"op": "varlen_fwd", "causal": 1}]},
                {"cases": [{"op": "fwd_sparse", "seqlen_q": 1 << 40}]},  # sizes bounded
                {"cases": [{"op": "varlen_fwd", "tile": [64, 256]}]},  # a Marlin case's field
                {"cases": [{"op": "varlen_fwd", "batch": 10**6}]},
                {"cases": [{"op": "fwd_sparse", "head_size": 64}]},
                {"cases": "all"}, []):
        with pytest.raises(ValueError):
            fa2.cases_from_json(bad)


# hostile names (red team 2, case 01): a name of FA2's that parse cannot read is refused
# with its own NameError_, never another exception; one it returns is one derive can use
_P = "_ZN5flash16flash_fwd_kernelI"
_FLAGS = "Lb0ELb1ELb0ELb0ELb0ELb1ELb0ELb0E"


def _traits(head: str = "Li128E") -> str:
    return f"23Flash_fwd_kernel_traitsI{head}Li128ELi32ELi4ELb0ELb0EN7cutlass10bfloat16_tEE"


HOSTILE = {
    "nested 2,000 deep": _P + "1aI" * 2000 + "E" * 2000 + "E",
    "traits nested 2,000 deep": _P + _traits("1aI" * 2000 + "E" * 2000) + _FLAGS + "E",
    "a template as the head dim": _P + _traits("1aI1bE") + _FLAGS + "E",
    "head dim 100": _P + _traits("Li100E") + _FLAGS + "E",
    "a negative head dim": _P + _traits("Lin5E") + _FLAGS + "E",
    "a name among the bool flags": _P + _traits() + "1a" + _FLAGS[4:] + "E",
    "an int among the bool flags": _P + _traits() + "Li1E" + _FLAGS[4:] + "E",
    "a bool as the block": _P + "23Flash_fwd_kernel_traitsILi128ELb1ELi32ELi4ELb0ELb0EN7cutlass"
                            "10bfloat16_tEE" + _FLAGS + "E",
    "a huge Log_max_splits": "_ZN5flash32flash_fwd_splitkv_combine_kernelI" + _traits()
                             + "Li16ELi99999999ELb1EE",
}


@pytest.mark.parametrize("name", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_name_is_refused_with_name_error(name: str) -> None:
    with pytest.raises(fa2.NameError_):
        fa2.parse(name)


def test_derive_lists_the_names_parse_refuses_as_unreachable() -> None:
    """The names the red team gave derive (head dim 100; a bool flag beside one that is a
    name, which sorting could not compare): no crash, each refused name unreachable with
    why, the good one covered."""
    good = _P + _traits().replace("Li32E", "Li64E") + _FLAGS + "E"  # H100's causal d128
    bad = [HOSTILE["head dim 100"], HOSTILE["a name among the bool flags"]]
    derived = fa2.derive([good, *bad], H100, budget=200)
    assert set(derived.unreachable) == set(bad)
    assert all("not read as FA2's" in why for why in derived.unreachable.values())
    assert derived.covered == 1 and derived.foreign == []


class _Counting(str):
    """A name that counts what is read of it: each character indexed, each one `index`
    scans."""

    reads = 0

    def __getitem__(self, key: Any) -> str:
        _Counting.reads += key.stop - (key.start or 0) if isinstance(key, slice) and \
            key.stop is not None else 1
        return str.__getitem__(self, key)

    def index(self, sub: Any, start: Any = None, end: Any = None) -> int:
        found = str.index(self, sub, start, end)
        _Counting.reads += found - (start or 0) + 1
        return found


@pytest.mark.parametrize("shape", ["deep", "traits deep", "literals"])
def test_a_4_mb_name_is_refused_reading_each_character_a_few_times(shape: str) -> None:
    n = 1_000_000
    name = {"deep": _P + "1aI" * n + "E" * n,
            "traits deep": _P + _traits("1aI" * n + "E" * n) + _FLAGS + "E",
            "literals": _P + _traits("Li1E" * n) + _FLAGS + "E"}[shape]
    assert len(name) >= 4_000_000
    _Counting.reads = 0
    with pytest.raises(fa2.NameError_):
        fa2.parse(_Counting(name))
    assert _Counting.reads <= 4 * len(name)


def _substituted(levels: int, width: int = 8) -> str:
    """A name whose head dim is a template of `levels` templates, each of `width`
    substitutions (`S<n>_`) of the one before: a few hundred bytes that, written out,
    are `width ** levels` names."""
    def ref(index: int) -> str:  # the substitution of `subs[index]`: S_, S0_, S1_, ...
        if index == 0:
            return "S_"
        digits, n, text = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ", index - 1, ""
        while True:
            text, n = digits[n % 36] + text, n // 36
            if not n:
                return f"S{text}_"

    chain, subs, last = "", 3, 0  # flash, Flash_fwd_kernel_traits, z
    for level in range(levels):
        chain += f"1{chr(97 + level)}I" + ref(last) * width + "E"
        last, subs = subs + 1, subs + 2  # its name, then the template
    return _P + _traits(f"1zI{chain}E") + _FLAGS + "E"


def test_a_name_that_substitutes_templates_into_templates_is_refused_at_once() -> None:
    """Red team: a name of under 500 bytes whose head dim is a template of templates by
    substitution: its refusal wrote the template out (`str(value)[:40]` cuts only after
    the whole is made), 8 ** 12 names, here a MemoryError under 1 GiB (before: 8 ** 8
    took 3.6 s in `prove`'s own process).  Run under that limit, derive names it
    unreachable."""
    name = _substituted(12)
    assert len(name) < 500
    script = ("import resource, sys\n"
              "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
              "from sm121_build.jobs.payload import fa2_kernels as fa2\n"
              "derived = fa2.derive([sys.argv[1]], fa2.GB10, budget=10)\n"
              "print(derived.unreachable[sys.argv[1]])\n")
    done = subprocess.run([sys.executable, "-c", script, name], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-300:]
    assert "not read as FA2's" in done.stdout and "head dim z<...>" in done.stdout
    assert len(done.stdout) < 300


@pytest.mark.parametrize("name", HOSTILE.values(), ids=HOSTILE.keys())
def test_the_harness_refuses_a_hostile_name_in_its_usage_line(tmp_path: Path,
                                                               name: str) -> None:
    """harness_fa2.py as the image runs it: one `usage:` line, exit 2, no traceback."""
    import sm121_build.jobs.payload as payload

    file = tmp_path / "names.txt"
    file.write_text(name + "\n")
    done = subprocess.run(
        [sys.executable, str(Path(payload.__file__).parent / "harness_fa2.py"),
         str(tmp_path / "x.so"), str(tmp_path / "out.pt"), "--kernels", str(file)],
        capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr[-300:]
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("usage:")


@pytest.mark.parametrize("args", [[], ["a", "b"], ["/nonexistent"], ["NAMES", "x.y", "1", "2"],
                                  ["NAMES", "9.0", "１２", "3"]])
def test_its_own_command_line_refuses_in_one_usage_line(tmp_path: Path, args: list[str]
                                                         ) -> None:
    names = tmp_path / "NAMES"
    names.write_text("")
    done = subprocess.run([sys.executable, fa2.__file__,
                           *[str(names) if a == "NAMES" else a for a in args]],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1
    assert done.stderr.startswith("usage: fa2_kernels.py")


def test_the_sparse_ops_dispatch_one_kernel_of_head_dim_128() -> None:
    """run_mha_fwd_sparse: head dim 128 only (121..128 padded to it, so Is_even_K is always
    true), one 64x64 block, Is_local and Is_even_MN fixed false; no window, paged cache or
    split; one query without ALiBi is not causal."""
    base = Case("fwd_sparse", seqlen_q=131, seqlen_k=197, causal=True, softcap=30.0)
    [k] = fa2.launched(base, H100)
    assert k.kind == "flash_fwd_sparse_kernel"
    assert (k.traits.head_dim, k.traits.block_m, k.traits.block_n, k.traits.warps) == \
        (128, 64, 64, 4)
    assert k.args == (False, True, False, False, False, True, True, False)
    assert fa2.launched(replace(base, head_size=124), H100) == (k,)
    assert fa2.launched(replace(base, op="varlen_fwd_sparse"), H100) == (k,)
    for refused in (replace(base, head_size=64), replace(base, head_size=120),
                    replace(base, window=(16, 0)), replace(base, paged=16, seqlen_k=208),
                    replace(base, num_splits=2)):
        assert fa2.launched(refused, H100) == () and fa2.invalid(refused), refused
    assert not fa2.launched(replace(base, seqlen_q=1), H100)[0].flag("Is_causal")
    assert fa2.launched(replace(base, seqlen_q=1, alibi=True), H100)[0].flag("Is_causal")


def test_every_sparse_kernel_is_launched_or_shown_dead(names: list[str]) -> None:
    """vLLM 0.22.0's 32 sparse kernels on sm_90: the 16 of an even head dim each launched
    by a derived case of `fwd_sparse` or `varlen_fwd_sparse`; the 16 others dead, by the
    rule that the sparse ops take head dim 128 only."""
    derived = fa2.derive(names, H100)
    sparse = [n for n in names if "flash_fwd_sparse_kernel" in n]
    assert len(sparse) == 32
    launched = {n for c in derived.cases for n in derived.expects[c.name]}
    dead = derived.dead()
    assert sum(n in launched for n in sparse) == 16
    assert all(n in launched or "Is_even_K false" in dead[n] for n in sparse)
    ops = {c.op for c in derived.cases if c.op in fa2.SPARSE_OPS}
    assert ops == set(fa2.SPARSE_OPS)


@pytest.mark.parametrize("text", [
    '{"op": "varlen_fwd", "softcap": 1e309}',  # inf, as json reads it
    '{"op": "varlen_fwd", "softcap": NaN}',
    '{"op": "varlen_fwd", "softcap": -30.0}',
    '{"op": "fwd_kvcache", "append": -5, "seqlens_k": true}',
    '{"op": "varlen_fwd", "window": [1000000000000000000000000000000, 0]}',
    '{"op": "varlen_fwd", "window": [-7, 0]}',
    # each size within its bound, their product 550 GB of bfloat16 for q alone
    '{"op": "varlen_fwd", "batch": 64, "heads": 256, "heads_k": 256, "seqlen_q": 65536,'
    ' "seqlen_k": 65536, "head_size": 256}'])
def test_a_case_files_value_past_what_the_op_takes_is_refused(text: str) -> None:
    """A case file is outside input (red team 5): a softcap of inf, NaN or below 0, a
    negative count of appended keys, a window no int64 holds, and sizes whose product is
    hundreds of gigabytes are refused before any tensor is made."""
    with pytest.raises(ValueError):
        fa2.cases_from_json(json.loads(f'{{"cases": [{text}]}}'))


@pytest.mark.parametrize("content", [b"[" * 100_000 + b"]" * 100_000, b" " * 4097])
def test_a_case_file_nested_deep_or_past_its_bound_is_a_value_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: bytes) -> None:
    """`--cases` nested past the JSON reader's recursion, or longer than the bound: the
    harness's one `usage:` line (a ValueError), never a traceback or the file held whole."""
    from types import SimpleNamespace

    from sm121_build.jobs.payload import case_files

    monkeypatch.setattr(case_files, "MAX_FILE_BYTES", 4096)
    file = tmp_path / "cases.json"
    file.write_bytes(content)
    for opts in (SimpleNamespace(cases=str(file), kernels=None),
                 SimpleNamespace(cases=None, kernels=str(file))):
        if opts.kernels and content.startswith(b"["):
            continue  # a names file is not JSON
        with pytest.raises(ValueError):
            case_files.read_cases(opts, fa2.cases_from_json, fa2.parse)


def test_a_case_file_that_is_a_fifo_is_refused_never_waited_on(tmp_path: Path) -> None:
    """The harness's input files through its own door: a FIFO named as `--cases` or
    `--kernels` is one ValueError at once (the read would wait for a writer for ever)."""
    import os
    from types import SimpleNamespace

    from sm121_build.jobs.payload import case_files

    fifo = tmp_path / "cases.json"
    os.mkfifo(fifo)
    for opts in (SimpleNamespace(cases=str(fifo), kernels=None),
                 SimpleNamespace(cases=None, kernels=str(fifo))):
        with pytest.raises(ValueError, match="not a regular file"):
            case_files.read_cases(opts, fa2.cases_from_json, fa2.parse)
