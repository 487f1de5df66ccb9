"""`sm121-build prove`: what can be proven without a GPU.

- the added cubins of a real aot'd file (nvcc 13.0, the real ptxas) against its stock file:
  found by content, their kernels those of the PTX they came from, their bytes cubins;
- the whole command against a FAKE interpreter (`--python FAKE`): a script that prints what
  the real payloads (jobs/payload/load_cubins.py, harness_*.py, compare_outputs.py) print on
  the GPU, so the job's parsing, verdict, JSON document and refusals are exercised;
  THE FAKE IS NOT THE PROOF: the real payloads run only on a GPU (device_run.sh);
- what the children say parsed as outside input (garbage, wrong types, NaN, long lines);
- no GPU: the real loader on this machine (no libcuda.so.1) is one `error:` line.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from devkit.fake_gpu import fake_python
from devkit.helpers import aot_pair_of, cli, cuda_home, one_line_error
from sm121_build.core.errors import WrongGpu
from sm121_build.core.shipped import schema
from sm121_build.cuda.compat import Target
from sm121_build.cuda.dynsym import demangle
from sm121_build.cuda.fatbin import HostBinary, device_file_kind, ptx_kernels
from sm121_build.jobs.proofs.proof_reading import read_proof
from sm121_build.jobs.proofs.prove_child import Asked, Said
from sm121_build.jobs.proofs.prove_document import Subject
from sm121_build.jobs.proofs.proving import Pair, extract

ENV = {"CUDA_HOME": str(cuda_home())}

@pytest.fixture(scope="module")
def aot_pair(jit_only_so: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(--files, --stock): the aot'd file and its stock file, both named `_C.abi3.so` (so
    the Marlin harness is the one run)."""
    root = tmp_path_factory.mktemp("prove")
    stock, made = root / "stock", root / "aot"
    stock.mkdir()
    (stock / "_C.abi3.so").write_bytes(jit_only_so.read_bytes())
    done = cli("aot", str(stock / "_C.abi3.so"), "--out", str(made), "--target", "sm_121",
               env=ENV)
    assert done.returncode == 0, done.stderr
    return made, stock


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    return fake_python(tmp_path / "FAKE-python", sys.executable)


def _prove(pair: tuple[Path, Path], python: Path | str, out: Path, mode: str = "proven",
           launched: str = "all", differs: str = "awq") -> subprocess.CompletedProcess[str]:
    made, stock = pair
    return cli("prove", "--files", str(made), "--stock", str(stock), "--json", str(out),
               "--python", str(python), env={"FAKE_MODE": mode, "FAKE_LAUNCHED": launched,
                                             "FAKE_DIFFERS": differs})


def _check(data: object) -> None:
    jsonschema.Draft202012Validator(schema("proof")).validate(data)


@pytest.mark.slow
def test_the_added_cubins_of_a_real_aot_file(aot_pair: tuple[Path, Path],
                                             tmp_path: Path) -> None:
    made, stock = aot_pair
    pair = Pair("_C.abi3.so", made / "_C.abi3.so", stock / "_C.abi3.so",
                str(made / "_C.abi3.so"))
    subject = Subject(files=str(made), stock=str(stock))
    found = extract([pair], Target(121), tmp_path, subject)
    assert len(found) == 1
    cubins = found[0].cubins
    assert [c.sm for c in cubins] == ["sm_121", "sm_121"]  # one per translation unit
    with HostBinary.open(stock / "_C.abi3.so") as binary:
        ptx = {name for e in binary.entries if e.kind == "ptx"
               for name in ptx_kernels(binary.payload(e))}
    assert {k for c in cubins for k in c.kernels} == ptx  # every kernel of the PTX
    for path in found[0].paths.values():  # the bytes written are the cubins, decompressed
        assert device_file_kind(path.read_bytes()[:4096]) == "cubin"
    # a file against itself added nothing; on another GPU, nothing loads: refused
    with pytest.raises(Exception, match="nothing to prove"):
        extract([Pair("s", pair.stock, pair.stock, "s")], Target(121), tmp_path, subject)
    with pytest.raises(WrongGpu, match=r"sm_121; this GPU is sm_90"):
        extract([pair], Target(90), tmp_path, subject)


@pytest.mark.slow
def test_a_fake_gpu_that_proves_it(aot_pair: tuple[Path, Path], fake: Path,
                                   tmp_path: Path) -> None:
    done = _prove(aot_pair, fake, tmp_path / "proof.json")
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "proof.json").read_text())
    _check(data)
    assert data["verdict"] == "proven" and data["problems"] == []
    assert data["gpu"] == {"name": "FAKE GB10", "compute_capability": "12.1",
                           "target": "sm_121", "driver_cuda": "13.0",
                           "driver_version": "580.95.05"}
    [item] = data["files"]
    assert item["harness"] == "harness_marlin.py" and len(item["cubins"]) == 2
    assert all(c["loaded"] and c["found"] == c["kernels"] > 0 for c in item["cubins"])
    assert [o["first_call_s"] for o in data["ops"]] == [
        {"stock_jit": 2.5, "native": 0.001}] * 2
    assert data["stock_without_jit"][0]["failed"] is True
    assert "verdict: proven" in done.stdout
    assert read_proof(tmp_path / "proof.json", None)[1].verdict == "proven"  # read back


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "said"), [
    ("differs", "differs from the stock JIT's output (max abs diff 3, 12 ULP; vLLM's test "
                "allows exact)"),
    ("missing", "1 of"),
    ("unloadable", "does not load: CUDA_ERROR_INVALID_IMAGE"),
    ("stock-runs", "the stock file ran with the PTX JIT disabled"),
])
def test_a_fake_gpu_that_does_not(aot_pair: tuple[Path, Path], fake: Path, tmp_path: Path,
                                  mode: str, said: str) -> None:
    line = one_line_error(_prove(aot_pair, fake, tmp_path / "proof.json", mode), 3)
    assert said in line and "_C.abi3.so" in line
    data = json.loads((tmp_path / "proof.json").read_text())
    _check(data)
    assert data["verdict"] == "failed" and said in data["problems"][0]


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "said"), [
    ("no-gpu", "no GPU to prove on: cuInit: CUDA_ERROR_NO_DEVICE"),
    ("hopper", "added cubins are for sm_121; this GPU is sm_90 (compute capability 9.0)"),
    ("schema", "has no argument size_k; the harness_marlin.py harness does not fit"),
])
def test_refusals_are_one_line(aot_pair: tuple[Path, Path], fake: Path, tmp_path: Path,
                               mode: str, said: str) -> None:
    line = one_line_error(_prove(aot_pair, fake, tmp_path / "proof.json", mode))
    assert said in line
    assert not (tmp_path / "proof.json").exists()


def test_no_libcuda_is_no_gpu(tmp_path: Path) -> None:
    """The real loader, on a machine without the driver."""
    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("this machine has libcuda.so.1")
    except OSError:
        pass
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    done = cli("prove", "--files", str(tmp_path / "a"), "--stock", str(tmp_path / "b"),
               "--python", sys.executable)
    line = one_line_error(done)
    assert line.startswith("error: no GPU to prove on: libcuda.so.1")


def test_nothing_to_prove_and_no_folder(tmp_path: Path, fake: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    done = cli("prove", "--files", str(tmp_path / "a"), "--stock", str(tmp_path / "b"),
               "--python", str(fake))
    assert "nothing to prove" in one_line_error(done)
    done = cli("prove", "--files", str(tmp_path / "none"), "--stock", str(tmp_path / "b"),
               "--python", str(fake))
    assert "--files" in one_line_error(done)


def test_what_a_child_says_is_parsed_as_outside_input() -> None:
    said = Said(Asked(cubins={"c": frozenset({"k" * 5000})}, cases=None))
    for line in [
        "not json", "{", "[1, 2]", '{"op": "x", "case": "y", "first_s": true}',
        '{"op": "x", "case": "y", "first_s": NaN}', '{"op": "x", "case": "y"}',
        '{"op": "x", "case": "y", "first_s": 1, "error": "both"}',
        '{"device": {"name": "g", "major": 900, "minor": 0, "driver": 1}}',
        '{"cubin": "c", "loaded": true, "found": -1, "missing": [], "missing_count": 0}',
        '{"cubin": "c", "loaded": "yes"}', '{"key": "k", "bitwise_equal": 1}',
        '{"key": "k", "bitwise_equal": true, "max_abs_diff": Infinity}',
        '{"key": "k", "bitwise_equal": false, "max_ulp": -1}',
        '{"key": "k", "bitwise_equal": false, "max_ulp": true}',
        '{"key": "k", "bitwise_equal": false, "max_ulp": 1.5}',
        '{"key": "k", "bitwise_equal": false, "max_ulp": 18446744073709551616}',
        '{"saved": 1e400}', "{" * 100_000, '{"other": 1}',
    ]:
        said.line(line)
    assert said.ignored == said.lines == 19
    assert (said.cases, said.loads, said.compared, said.device) == ([], [], [], None)
    said.line('{"cubin": "c", "loaded": true, "found": 2, "missing": ["' + "k" * 5000 +
              '", 7], "missing_count": 0}')
    said.line('{"op": "o", "case": "\x1b", "first_s": 0.5}')  # a raw control: not JSON
    said.line('{"op": "o", "case": "\\u001b]0;x\\u0007", "first_s": 0.5}')
    [load] = said.loads
    assert load.missing == ("k" * 300,) and load.missing_count == 1  # cut; 7 dropped
    assert [(c.case, c.first_s) for c in said.cases] == [("\x1b]0;x\x07", 0.5)]


def test_a_gpu_the_proof_reader_would_refuse_is_no_gpu() -> None:
    """Red team 11: a loader (an image's own python) that said driver 2147483647 or major 0
    was taken: `prove` said "verdict: proven" and wrote a proof whose `driver_cuda`
    ("2147483.64") or target ("sm_1") `kernels publish --proof` refuses as no proof.  The
    device is taken only as the reader reads it back: a driver of CUDA 1.0 to 999.99, a
    compute capability 1.0 to 99.9."""
    from sm121_build.jobs.proofs.proof_reading import _CUDA, _TARGET

    for major, driver in ((12, 2**31 - 1), (12, 1_000_000), (0, 13000), (12, 999)):
        said = Said(Asked())
        said.line(json.dumps({"device": {"name": "g", "major": major, "minor": 1,
                                         "driver": driver}}))
        assert said.device is None, (major, driver)
    for major, driver in ((12, 13000), (1, 1000), (99, 999_999)):
        said = Said(Asked())
        said.line(json.dumps({"device": {"name": "g", "major": major, "minor": 9,
                                         "driver": driver}}))
        assert said.device is not None
        assert _CUDA.match(said.device.driver_cuda) and _TARGET.match(str(said.device.target))


def test_the_proof_schema_is_closed() -> None:
    loaded = schema("proof")
    jsonschema.Draft202012Validator.check_schema(loaded)
    assert loaded["additionalProperties"] is False
    proven_with_a_problem = {
        "format": 3, "tool_version": "0", "made": "2026-11-28T04:10:00Z",
        "subject": {"image": None, "image_id": None, "base": None, "files": "f", "stock": "s"},
        "gpu": {
            "name": "g", "compute_capability": "9.0", "target": "sm_90", "driver_cuda": "13.0",
            "driver_version": None},
        "files": [], "ops": [], "stock_without_jit": [], "verdict": "proven",
        "coverage": {"added": 0, "launched": 0, "compared": 0, "never_launched": 0,
                     "unreachable": 0},
        "problems": ["x"]}
    with pytest.raises(jsonschema.ValidationError):
        _check(proven_with_a_problem)
    _check({**proven_with_a_problem, "problems": []})


def test_the_children_get_the_jit_they_are_meant_to(monkeypatch: pytest.MonkeyPatch) -> None:
    from sm121_build.jobs.proofs.prove_child import JIT_OFF, JIT_ON, Jit
    from sm121_build.jobs.proofs.proving import _env

    monkeypatch.setenv("CUDA_FORCE_PTX_JIT", "1")  # would make every cubin JIT from PTX
    monkeypatch.setenv("CUDA_DISABLE_PTX_JIT", "1")
    monkeypatch.setenv("CUDA_CACHE_PATH", "/home/user/.nv/ComputeCache")  # the user's
    on, off = _env(JIT_ON), _env(JIT_OFF)
    assert "CUDA_FORCE_PTX_JIT" not in on and "CUDA_FORCE_PTX_JIT" not in off
    assert "CUDA_DISABLE_PTX_JIT" not in on and off["CUDA_DISABLE_PTX_JIT"] == "1"
    assert on["CUDA_CACHE_DISABLE"] == off["CUDA_CACHE_DISABLE"] == "1"
    assert "CUDA_CACHE_PATH" not in on and "CUDA_CACHE_PATH" not in off
    # a JIT run given the run's own cache keeps its results there; a native run never
    cached, native = _env(Jit(True, "/run/jit-cache")), _env(Jit(False, "/run/jit-cache"))
    assert cached["CUDA_CACHE_PATH"] == "/run/jit-cache" and "CUDA_CACHE_DISABLE" not in cached
    assert native["CUDA_CACHE_DISABLE"] == "1" and "CUDA_CACHE_PATH" not in native
    assert os.environ["CUDA_FORCE_PTX_JIT"] == "1"  # ours untouched


@pytest.mark.parametrize("name", ["CUDA_FORCE_JIT", "CUDA_DISABLE_JIT"])
def test_cuda_12s_jit_switches_in_the_users_environment_reach_no_child(
        monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Red team: CUDA_FORCE_JIT=1 (CUDA 12: ignore every cubin, JIT the PTX or NVVM IR) in
    the user's environment reached the native runs, whose added cubins the driver would
    then pass over for the stock PTX; CUDA_DISABLE_JIT=1 reached the reference's."""
    from sm121_build.jobs.proofs.prove_child import JIT_OFF, JIT_ON, Jit
    from sm121_build.jobs.proofs.proving import _env

    monkeypatch.setenv(name, "1")
    for jit in (JIT_ON, JIT_OFF, Jit(True, "/run/jit-cache")):
        assert name not in _env(jit), jit


def test_an_images_own_jit_switches_are_said_outright_in_every_container() -> None:
    """Red team: an image's `ENV CUDA_FORCE_JIT=1` (or CUDA_DISABLE_JIT=1) stayed in its
    containers: only the PTX-only switches were given.  Every child's environment now sets
    each of them, to the driver's default."""
    from sm121_build.image.api import ConfinedResult, GpuJob
    from sm121_build.jobs.proofs.prove_child import JIT_OFF, JIT_ON, Jit
    from sm121_build.jobs.proofs.prove_image import ImageChildren

    jobs: list[GpuJob] = []

    class Engine:
        def run_with_gpu(self, image_id: str, job: GpuJob) -> ConfinedResult:
            jobs.append(job)
            return ConfinedResult(0, "", "")

    engine: Any = Engine()
    children = ImageChildren(engine, "sha256:" + "0" * 64, "python3", 60.0, ())
    for jit in (JIT_ON, JIT_OFF, Jit(True, "/work/jit-cache")):
        children.talk(("x.py",), "a child", jit, Asked())
    for job in jobs:
        env = dict(job.env)
        assert (env["CUDA_FORCE_JIT"], env["CUDA_DISABLE_JIT"], env["CUDA_FORCE_PTX_JIT"]) \
            == ("0", "0", "0"), env
    assert [dict(job.env)["CUDA_DISABLE_PTX_JIT"] for job in jobs] == ["0", "1", "0"]


def test_a_json_inside_an_input_is_refused_before_anything_is_made(
        aot_pair: tuple[Path, Path], fake: Path) -> None:
    """Red team round 6: `--json STOCK/made/by/prove/p.json` was refused only after the
    folders it names were made (and a probe file written) inside --stock."""
    made, stock = aot_pair
    before = sorted(p.relative_to(stock) for p in stock.rglob("*"))
    done = cli("prove", "--files", str(made), "--stock", str(stock), "--json",
               str(stock / "made" / "by" / "prove" / "p.json"), "--python", str(fake))
    assert "is inside the input" in one_line_error(done)
    assert sorted(p.relative_to(stock) for p in stock.rglob("*")) == before


def test_a_loader_that_counts_past_the_kernels_it_was_given_proves_nothing(
        aot_pair: tuple[Path, Path], fake: Path, tmp_path: Path) -> None:
    """Red team round 6: `found` 2**31-1 of 4 kernels was shown as "4294967294 of 4"; a
    count past what the loader was given is the loader's error, and the cubin unproven."""
    done = _prove(aot_pair, fake, tmp_path / "p.json", "hugecount")
    assert done.returncode == 3, done.stderr
    assert "the loader said it found 2147483647 of" in done.stderr
    _check(json.loads((tmp_path / "p.json").read_text()))


def test_cases_the_runs_did_not_say_prove_nothing(aot_pair: tuple[Path, Path], fake: Path,
                                                  tmp_path: Path) -> None:
    """Red team round 7: every case line behind a library's printf (none parses), the
    outputs saved and compared: "proven" with no op at all.  What the runs said must account
    for what they saved and what was compared."""
    done = _prove(aot_pair, fake, tmp_path / "p.json", "prefixed")
    assert done.returncode == 3, done.stderr
    assert "no op case was said by the stock JIT run" in done.stderr
    proof = json.loads((tmp_path / "p.json").read_text())
    assert proof["verdict"] == "failed"
    _check(proof)


# FAKE: a stand-in `torch` module for the op harnesses' shared run (harness_run.py) on a
# machine with no GPU; STORY picks how the library behaves.  It proves nothing of a GPU.
STUB_TORCH = '''
import os
STORY = os.environ["STORY"]
int32 = "int32"
class _Schema:
    def __init__(self, names):
        self.arguments = [type("A", (), {"name": n})() for n in names]
class _Op:
    def __init__(self, names):
        self.default = type("D", (), {"_schema": _Schema(names)})()
    def __call__(self, *args):
        raise RuntimeError("CUDA error: PTX JIT compilation was disabled\\nmore")
class _Namespace:
    def __getattr__(self, name):
        if not name.endswith("_repack"):  # (a library of the repack ops alone)
            raise AttributeError(name)
        if STORY == "schema":
            raise AttributeError(name)
        names = ["b_q_weight", "perm", "size_k", "size_n", "num_bits"]
        return _Op(names if name.startswith("gptq") else names[:1] + names[2:])
class _Ops:
    _C = _Namespace()
    def load_library(self, path):
        pass
ops = _Ops()
class cuda:
    @staticmethod
    def synchronize():
        pass
class Generator:
    def __init__(self, device):
        pass
    def manual_seed(self, seed):
        return self
def randint(*args, **kwargs):
    if STORY == "inputs":
        raise RuntimeError("CUDA error: an illegal instruction was encountered")
    return object()
def empty(*args, **kwargs):
    return object()
'''


@pytest.mark.parametrize(("story", "code", "said"), [
    ("schema", 4, {"schema_error": "_C.gptq_marlin_repack: no such op in this library"}),
    ("inputs", 3, {"op": "(inputs)", "case": "(between cases)",
                   "error": "CUDA error: an illegal instruction was encountered"}),
    ("call", 3, {"op": "gptq_marlin_repack", "case": "gptq-4bit-256x192",
                 "error": "CUDA error: PTX JIT compilation was disabled"}),
])
def test_the_harnesses_shared_run_says_each_ending_in_one_line(
        tmp_path: Path, story: str, code: int, said: dict[str, object]) -> None:
    """harness_marlin.py run as `prove` runs it (a script, its sibling harness_run.py
    beside it) against the FAKE torch: a schema that does not fit (exit 4), an error
    between cases and one in an op's first call (exit 3), each its one JSON line."""
    import sm121_build.jobs.payload as payload

    (tmp_path / "torch.py").write_text(STUB_TORCH)
    done = subprocess.run(
        [sys.executable, str(Path(payload.__file__).parent / "harness_marlin.py"),
         str(tmp_path / "lib.so"), str(tmp_path / "out.pt")],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "PYTHONPATH": str(tmp_path), "STORY": story})
    assert done.returncode == code, done.stderr
    assert [json.loads(line) for line in done.stdout.splitlines()] == [said]
    assert not (tmp_path / "out.pt").exists()


def test_a_folder_not_named_in_utf8_makes_a_proof_that_reads_back(
        aot_pair: tuple[Path, Path], fake: Path, tmp_path: Path) -> None:
    """Issue 62: `--files` in a folder whose name is not UTF-8 (`mkdir $'\\xff'`) was written
    into the proof as a lone surrogate, which `kernels attest` died on; it is written as
    text (`\\xff`), and the proof reads back."""
    import shutil

    made, stock = aot_pair
    odd = tmp_path / os.fsdecode(b"\xff")
    shutil.copytree(made, odd)
    done = _prove((odd, stock), fake, tmp_path / "p.json")
    assert done.returncode == 0, done.stderr
    data, summary = read_proof(tmp_path / "p.json", None)
    assert summary.verdict == "proven" and data["subject"]["files"].endswith("/\\xff")


def test_a_file_with_no_stock_file_is_said_and_not_proven(
        aot_pair: tuple[Path, Path], fake: Path, tmp_path: Path) -> None:
    """Issue 62: a `.so` under --files with no stock file was left out without a word, and
    the folder was "proven"."""
    import shutil

    made, stock = aot_pair
    files = tmp_path / "files"
    shutil.copytree(made, files)
    (files / "sub").mkdir()
    (files / "sub" / "_extra.abi3.so").write_bytes((made / "_C.abi3.so").read_bytes())
    done = _prove((files, stock), fake, tmp_path / "p.json")
    line = one_line_error(done, 3)
    assert "sub/_extra.abi3.so: not proven: no stock file to compare it with" in line
    data = json.loads((tmp_path / "p.json").read_text())
    _check(data)
    assert data["verdict"] == "failed"
    assert data["left_out"] == [{"name": "sub/_extra.abi3.so",
                                 "why": "no stock file to compare it with"}]
    assert [f["name"] for f in data["files"]] == ["_C.abi3.so"]
    assert read_proof(tmp_path / "p.json", None)[1].verdict == "failed"


def test_a_fifo_under_files_is_named_and_not_proven(
        aot_pair: tuple[Path, Path], fake: Path, tmp_path: Path) -> None:
    """Red team 2, case 07: a FIFO named like a `.so` under --files was passed over without
    a word, and the folder "proven"; alone, only "nothing to prove" was said."""
    import os
    import shutil

    made, stock = aot_pair
    files = tmp_path / "files"
    shutil.copytree(made, files)
    (files / "sub").mkdir()
    os.mkfifo(files / "sub" / "_fifo.abi3.so")
    done = _prove((files, stock), fake, tmp_path / "p.json")
    one_line_error(done, 3)
    assert f"--files {files}/sub/_fifo.abi3.so: not a regular file: not proven" in done.stderr
    data = json.loads((tmp_path / "p.json").read_text())
    _check(data)
    assert data["verdict"] == "failed"
    assert data["left_out"] == [{"name": "sub/_fifo.abi3.so", "why": "not a regular file"}]
    alone = tmp_path / "alone"
    alone.mkdir()
    os.mkfifo(alone / "_C.abi3.so")
    done = _prove((alone, stock), fake, tmp_path / "q.json")
    assert "nothing to prove" in one_line_error(done)
    assert f"--files {alone}/_C.abi3.so: not a regular file: not proven" in done.stderr


def test_a_link_out_of_files_is_named_and_not_proven(
        aot_pair: tuple[Path, Path], fake: Path, tmp_path: Path) -> None:
    """Red team 2, case 07: a `.so` under --files that is a link to a file outside it was
    followed and proven; a link inside --files still is."""
    import shutil

    made, stock = aot_pair
    files, stocks = tmp_path / "files", tmp_path / "stock"
    shutil.copytree(made, files)
    shutil.copytree(stock, stocks)
    for sub in ("out", "in"):
        (files / sub).mkdir()
        (stocks / sub).mkdir()
        shutil.copy(stock / "_C.abi3.so", stocks / sub / "_C.abi3.so")
    (files / "out" / "_C.abi3.so").symlink_to(made / "_C.abi3.so")
    (files / "in" / "_C.abi3.so").symlink_to(Path("..") / "_C.abi3.so")
    done = _prove((files, stocks), fake, tmp_path / "p.json")
    one_line_error(done, 3)
    assert f"--files {files}/out/_C.abi3.so: a link out of --files: not proven" in done.stderr
    data = json.loads((tmp_path / "p.json").read_text())
    _check(data)
    assert data["verdict"] == "failed"
    assert data["left_out"] == [{"name": "out/_C.abi3.so", "why": "a link out of --files"}]
    assert [f["name"] for f in data["files"]] == ["_C.abi3.so", "in/_C.abi3.so"]


def _added(aot_pair: tuple[Path, Path], tmp_path: Path) -> list[str]:
    """The added kernels of the aot'd file for sm_121, sorted (what the harness is given)."""
    made, stock = aot_pair
    pair = Pair("_C.abi3.so", made / "_C.abi3.so", stock / "_C.abi3.so",
                str(made / "_C.abi3.so"))
    [found] = extract([pair], Target(121), tmp_path, Subject(files="f", stock="s"))
    return sorted({k for c in found.cubins for k in c.kernels})


def test_every_added_kernel_launched_is_proven_with_its_coverage(
        aot_pair: tuple[Path, Path], fake: Path, tmp_path: Path) -> None:
    """Issue 63: the native run's recorder says every added kernel launched in a case
    compared equal: proven, and the proof says how many of how many."""
    added = _added(aot_pair, tmp_path)
    done = _prove(aot_pair, fake, tmp_path / "p.json")
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "p.json").read_text())
    _check(data)
    assert data["format"] == 3 and data["verdict"] == "proven"
    assert data["files"][0]["coverage"] == {
        "added": len(added), "launched": len(added), "compared": len(added),
        "never_launched": [], "unreachable": [], "recorder": None}
    assert data["coverage"]["never_launched"] == 0 and "warning" not in done.stderr
    assert [c["launched"] for c in data["files"][0]["cubins"]] == [
        c["kernels"] for c in data["files"][0]["cubins"]]  # each cubin's, by name
    summary = read_proof(tmp_path / "p.json", None)[1]
    assert summary.line().endswith(f"proven for {len(added)} of {len(added)} added kernels; "
                                   "0 never launched")


@pytest.mark.parametrize(("launched", "ran"), [("half", 0.5), ("none", 0.0)])
def test_added_kernels_never_launched_make_it_partial_and_are_named(
        aot_pair: tuple[Path, Path], fake: Path, tmp_path: Path, launched: str,
        ran: float) -> None:
    """Issue 63: nothing differs, but the cases launched some (or none) of the added
    kernels: partial, exit 0 with a warning naming the coverage, every kernel never launched
    named in the proof (and shown demangled)."""
    added = _added(aot_pair, tmp_path)
    done = _prove(aot_pair, fake, tmp_path / "p.json", launched=launched)
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "p.json").read_text())
    _check(data)
    ran_count = int(len(added) * ran)
    never = added[ran_count:]
    assert data["verdict"] == "partial" and data["problems"] == []
    assert data["files"][0]["coverage"]["never_launched"] == never
    assert data["files"][0]["coverage"]["launched"] == ran_count
    assert sum(c["launched"] for c in data["files"][0]["cubins"]) >= ran_count
    line = f"proven for {ran_count} of {len(added)} added kernels; {len(never)} never launched"
    assert f"warning: partial: {line}" in done.stderr
    assert f"verdict: partial: {line}" in done.stdout
    assert read_proof(tmp_path / "p.json", None)[1].line().startswith(f"partial ({line}) on")


def test_a_difference_still_fails_whatever_the_coverage(
        aot_pair: tuple[Path, Path], fake: Path, tmp_path: Path) -> None:
    line = one_line_error(_prove(aot_pair, fake, tmp_path / "p.json", "differs", "half"), 3)
    assert "differs from the stock JIT's output" in line
    data = json.loads((tmp_path / "p.json").read_text())
    _check(data)
    assert data["verdict"] == "failed"


def test_a_differing_case_names_the_kernels_it_launched_and_their_modules(
        aot_pair: tuple[Path, Path], fake: Path, tmp_path: Path) -> None:
    """Issue 63: a defect confined to some modules shows as a differing case, and the line
    names the added kernels that case launched and the cubins (modules) they came from; the
    JSON lists them all."""
    added = _added(aot_pair, tmp_path)
    ran = added[:len(added) // 2]
    line = one_line_error(_prove(aot_pair, fake, tmp_path / "p.json", "differs", "half",
                                 differs="gptq"), 3)
    data = json.loads((tmp_path / "p.json").read_text())
    _check(data)
    [bad] = [o for o in data["ops"] if o["bitwise_equal"] is False]
    assert sorted(k["name"] for k in bad["launched"]) == sorted(ran)
    cubins = {c["number"] for c in data["files"][0]["cubins"] if c["launched"]}
    assert {n for k in bad["launched"] for n in k["cubins"]} == cubins
    numbers = ", ".join(str(n) for n in sorted(cubins))
    assert f"it launched {len(ran)} added kernel(s) of cubin(s) {numbers}: " in line
    assert demangle(bad["launched"][0]["name"]) in line
    # the case that launched nothing is named without kernels
    line = one_line_error(_prove(aot_pair, fake, tmp_path / "q.json", "differs", "half"), 3)
    assert "differs from the stock JIT's output" in line and "it launched" not in line


def test_a_recorder_that_cannot_record_leaves_every_kernel_never_launched(
        aot_pair: tuple[Path, Path], fake: Path, tmp_path: Path) -> None:
    added = _added(aot_pair, tmp_path)
    done = _prove(aot_pair, fake, tmp_path / "p.json", launched="broken")
    assert done.returncode == 0, done.stderr
    cover = json.loads((tmp_path / "p.json").read_text())["files"][0]["coverage"]
    assert cover["never_launched"] == added
    assert cover["recorder"] == "the profiler could not start: CUPTI_ERROR_NOT_INITIALIZED"
    assert "launches not recorded: the profiler could not start" in done.stderr


def test_a_hostile_recorder_is_bounded_and_its_strangers_ignored(
        aot_pair: tuple[Path, Path], fake: Path, tmp_path: Path) -> None:
    """Issue 63: the recorder's lines are outside input: 30,000 names of no added kernel,
    an escape sequence, a case not asked, a list for a name, a 5,000-fold name, one name
    100 times: one kernel launched, the rest counted and dropped."""
    added = _added(aot_pair, tmp_path)
    done = _prove(aot_pair, fake, tmp_path / "p.json", launched="hostile")
    assert done.returncode == 0, done.stderr
    cover = json.loads((tmp_path / "p.json").read_text())["files"][0]["coverage"]
    assert (cover["launched"], cover["compared"]) == (1, 1)
    assert cover["never_launched"] == added[1:]
    assert "\x1b" not in done.stdout + done.stderr


TRAP_STUB = """
extern "C" __global__ void stub(int *x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
  x[threadIdx.x] = 1;
#else
  __trap();  // compiled for any other GPU: a kernel that can only trap
#endif
}
extern "C" __global__ void real(float *x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = x[i] * 2.f + 1.f;
}
template <typename T> __global__ void asserts(T *x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
  x[0] = 1;
#else
  assert(false);  // calls __assertfail, then exits: not a trap stub
#endif
}
template __global__ void asserts<float>(float *);
"""


@pytest.mark.slow
def test_a_trap_stub_never_launched_is_unreachable_with_the_evidence(tmp_path: Path) -> None:
    """Issue 63: a kernel compiled for a GPU its source was not written for (`__trap()`
    alone: nvcc 13.0's real SASS for sm_121) is named unreachable, with the evidence; a
    real kernel and an `assert` stub (which exits) are not; so a file whose only kernel
    never launched is a trap stub is proven."""
    from sm121_build.cuda.added import AddedCubin, trap_stubs
    from sm121_build.jobs.proofs.proving import Extracted, coverage

    (tmp_path / "k.cu").write_text(TRAP_STUB)
    subprocess.run([str(cuda_home() / "bin" / "nvcc"), "-cubin", "-arch=sm_121", "-o",
                    str(tmp_path / "k.cubin"), str(tmp_path / "k.cu")], check=True,
                   capture_output=True, timeout=300)
    cubin = (tmp_path / "k.cubin").read_bytes()
    stubs = trap_stubs(cubin, 121)
    assert list(stubs) == ["stub"]
    assert "a trap (BPT) and no EXIT: any launch of it traps" in stubs["stub"]
    assert trap_stubs(cubin, 61) == {} and trap_stubs(b"not an ELF", 121) == {}
    kernels = ("stub", "real", "_Z7assertsIfEvPT_")

    class Cubin(AddedCubin):
        def __init__(self) -> None:
            object.__setattr__(self, "number", 1)
            object.__setattr__(self, "kernels", kernels)

    item = Extracted(Pair("k.so", tmp_path, tmp_path, "k.so"), (Cubin(),),
                     {1: tmp_path / "k.cubin"}, stubs)
    cover = coverage(item, [], [], None)
    assert (cover.added, cover.launched, cover.never_launched) == (
        3, 0, ("_Z7assertsIfEvPT_", "real"))
    assert [(u.name, u.why) for u in cover.unreachable] == [("stub", stubs["stub"])]
    assert not cover.whole
    from sm121_build.jobs.proofs.prove_child import Compared, Launched
    from sm121_build.jobs.proofs.prove_document import OpResult

    equal = OpResult("k.so", "op", "case", Compared("op/case", True, 0.0), (1.0, 0.1))
    cover = coverage(item, [Launched("real", "op/case"),
                            Launched("_Z7assertsIfEvPT_", "op/case")], [equal], None)
    assert cover.whole and (cover.compared, len(cover.unreachable)) == (2, 1)


def test_prove_files_loads_neither_the_signing_nor_the_engine_code() -> None:
    """`prove --files` runs on a GPU host that may lack what signing and the engine need (a
    lent H200 had no `cryptography`): its modules import neither (until --sign-key)."""
    script = ("import sys\n"
              "import sm121_build.cli.prove, sm121_build.jobs.proofs.proving\n"
              "import sm121_build.jobs.proofs.prove_document\n"
              "print([m for m in sys.modules if m.split('.')[0] in ('cryptography', 'docker')"
              " or m == 'sm121_build.image.cosign'])\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.strip() == "[]"


def test_an_fa2_file_runs_the_harness_with_the_derived_cases_and_the_jit_cache(
        aot_pair: tuple[Path, Path], fake: Path, tmp_path: Path) -> None:
    """The whole command on a file named as FA2's: the cases derived from its added kernels
    (none of them FA2's here: the fixed cases alone, in one part) given as --cases, the
    stock JIT run given the run's own cache folder (the FAKE checks it is a fresh folder and
    that no other run gets one)."""
    made, stock = aot_pair
    for folder in (made, stock):
        (tmp_path / folder.name).mkdir()
        (tmp_path / folder.name / "_vllm_fa2_C.abi3.so").write_bytes(
            (folder / "_C.abi3.so").read_bytes())
    done = cli("prove", "--files", str(tmp_path / made.name), "--stock",
               str(tmp_path / stock.name), "--json", str(tmp_path / "p.json"), "--python",
               str(fake), "--jobs", "4", env={"FAKE_MODE": "proven", "FAKE_LAUNCHED": "all"})
    assert done.returncode == 0, done.stderr
    assert "0 case(s) derived from its added kernels, in 1 part(s)" in done.stderr
    data = json.loads((tmp_path / "p.json").read_text())
    _check(data)
    assert data["verdict"] == "proven" and data["files"][0]["harness"] == "harness_fa2.py"
    done = cli("prove", "--files", str(tmp_path / made.name), "--stock",
               str(tmp_path / stock.name), "--python", str(fake), "--jobs", "0")
    assert done.returncode == 2 and "--jobs" in done.stderr


def test_a_marlin_named_c_file_gets_marlin_gemm_cases_from_its_kernels(
        marlin_names_so: Path, fake: Path, tmp_path: Path) -> None:
    """Issue 63: a `_C` whose added kernels are named as vLLM's Marlin GEMM kernels (two
    modules): five marlin_gemm cases derived from the six names on the GB10's sizes, dealt
    to two parts (one module each); the sixth, which marlin_mm never selects there, named
    unreachable with the rule; the rest never launched (the FAKE recorder says no launch),
    so partial."""
    pair = aot_pair_of(marlin_names_so, "_C.abi3.so", tmp_path)
    done = _prove(pair, fake, tmp_path / "p.json", launched="none")
    assert done.returncode == 0, done.stderr
    assert "5 case(s) derived from its added kernels, in 2 part(s); 1 kernel(s) no op " \
        "launches on this GPU" in done.stderr
    data = json.loads((tmp_path / "p.json").read_text())
    _check(data)
    assert data["verdict"] == "partial"
    cover = data["files"][0]["coverage"]
    assert cover["added"] == 6 and len(cover["unreachable"]) == 1
    assert len(cover["never_launched"]) == 5
    [dead] = cover["unreachable"]
    assert "ELi128ELi1ELi8ELi4ELb0ELi4ELi8E" in dead["name"]
    assert dead["why"].startswith("the Marlin dispatch (vLLM 0.22.0 marlin.cu) never "
                                  "selects it on compute capability 12.1: with 101376 bytes")
    derived = {o["case"] for o in data["ops"]} - {"gptq-4bit-256x192", "awq-8bit-7168x2112"}
    assert derived == {"float16-u4b8-float16-float16-m8n64k128-g-1",
                       "float16-u4b8-float16-float16-m16n1664k128-g-1",
                       "float16-u4b8-float16-float16-m64n3328k256-g128",
                       "s8-u4-float16-float16-m16n1664k128-g-1-zp",
                       "s8-u4-float16-float16-m32n256k192-g64-zp"}


def test_the_proof_prove_made_on_a_lent_h200_reads_back_with_its_coverage(
        tmp_path: Path) -> None:
    """docs/real-build.md's run of `prove` on vLLM 0.22.0's FA2 aot'd for sm_90 (a lent H200,
    2026-11-28): the document it wrote passes the schema and the reader, and says what it
    measured: 1,321 cases bitwise equal; 1,344 of 1,472 added kernels launched; the 32
    sparse kernels (an op the harness does not call) never launched; 96 unreachable."""
    import gzip

    real = Path(__file__).resolve().parents[2] / "docs" / "real-build" / \
        "prove-sm90-h200-fa2" / "proof.json.gz"
    (tmp_path / "proof.json").write_bytes(gzip.decompress(real.read_bytes()))
    data, summary = read_proof(tmp_path / "proof.json", None)
    _check(data)
    assert summary.verdict == "partial"
    assert "proven for 1,344 of 1,472 added kernels; 32 never launched, 96 unreachable" \
        in summary.line()
    assert len(data["ops"]) == 1321 and all(op["bitwise_equal"] for op in data["ops"])
    cover = data["files"][0]["coverage"]
    assert all("sparse" in name for name in cover["never_launched"])
    assert all("never selects it on compute capability 9.0" in u["why"]
               for u in cover["unreachable"])


def test_the_whole_fa2_proof_of_the_lent_h200_reads_back(tmp_path: Path) -> None:
    """docs/real-build.md's FA2 run with the sparse ops' cases (a lent H200, 2026-11-29,
    c_prove.sh): proven, every one of the 1,472 added kernels launched by a case compared
    bitwise equal (1,360) or unreachable by the dispatch's rule (112: 96 blocks of other
    GPUs, 16 sparse kernels of an uneven K), 1,337 of 1,337 cases equal, among them the
    sparse ones."""
    import gzip

    real = Path(__file__).resolve().parents[2] / "docs" / "real-build" / \
        "prove-sm90-h200-fa2" / "_vllm_fa2_C.1-honest.proof.json.gz"
    (tmp_path / "proof.json").write_bytes(gzip.decompress(real.read_bytes()))
    data, summary = read_proof(tmp_path / "proof.json", None)
    _check(data)
    assert summary.verdict == "proven" and data["problems"] == []
    cover = data["files"][0]["coverage"]
    assert (cover["added"], cover["launched"], cover["compared"]) == (1472, 1360, 1360)
    assert cover["never_launched"] == [] and len(cover["unreachable"]) == 112
    assert sum("Is_even_K false" in u["why"] for u in cover["unreachable"]) == 16
    assert len(data["ops"]) == 1337 and all(op["bitwise_equal"] for op in data["ops"])
    sparse = [op for op in data["ops"] if op["op"].endswith("_sparse")]
    assert len(sparse) == 16 and {op["op"] for op in sparse} == {"fwd_sparse",
                                                                  "varlen_fwd_sparse"}


@pytest.mark.parametrize(("planted", "differ"), [("all", 1337), ("192", 204)])
def test_the_planted_fa2_proofs_of_the_lent_h200_name_the_planted_modules(
        tmp_path: Path, planted: str, differ: int) -> None:
    """docs/real-build.md's FA2 runs with a ptxas that rounds every f32 fma toward zero in
    every module, or in the 8 modules of head dim 192 alone (the file #57 called proven;
    both variants aot'd on the CPU machine, proven on a lent H200 on 2026-11-29 by
    c_prove.sh): failed; the differing cases are exactly those that launched a kernel of a
    planted module, each naming its cubins."""
    import gzip

    real = Path(__file__).resolve().parents[2] / "docs" / "real-build" / \
        "prove-sm90-h200-fa2-planted" / f"planted-{planted}.proof.json.gz"
    (tmp_path / "proof.json").write_bytes(gzip.decompress(real.read_bytes()))
    data = json.loads((tmp_path / "proof.json").read_text())
    _check(data)
    assert data["verdict"] == "failed" and len(data["ops"]) == 1337
    assert data["made"].startswith("2026-11-29") and data["gpu"]["name"] == "NVIDIA H200"
    bad = [op for op in data["ops"] if op["bitwise_equal"] is False]
    assert len(bad) == differ == len(data["problems"])
    cubins = {c for op in bad for k in op["launched"] for c in k["cubins"]}
    if planted == "192":
        assert cubins == {5, 6, 7, 8, 33, 34, 35, 36}
        assert all(op["case"].split("-")[1] in ("d184", "d192") for op in bad)
        hit = [op for op in data["ops"] if any(c in cubins for k in op["launched"]
                                                 for c in k["cubins"])]
        assert hit == bad  # every case of a planted module differs, no other one
    assert "it launched 1 added kernel(s) of cubin(s)" in data["problems"][0]


def test_the_c_proofs_prove_made_on_a_lent_h200_read_back(tmp_path: Path) -> None:
    """docs/real-build.md's runs of `prove` on vLLM 0.22.0's `_C` aot'd for sm_90 (a lent
    H200, 2026-11-29, benchmarks/device/c_prove.sh): honest, proven (354 of 365 added
    kernels launched by a case compared bitwise equal, the 11 left unreachable, each with
    its rule); with the GPTQ 4-bit half module planted (c_plant_ptxas.sh), failed: 37
    cases differ, each naming the Marlin kernel of cubin 4 it launched."""
    import gzip

    real = Path(__file__).resolve().parents[2] / "docs" / "real-build" / "prove-sm90-h200-c"
    for variant, verdict in (("_C.1-honest", "proven"), ("_C.2-planted", "failed")):
        (tmp_path / "proof.json").write_bytes(
            gzip.decompress((real / f"{variant}.proof.json.gz").read_bytes()))
        data = json.loads((tmp_path / "proof.json").read_text())
        _check(data)
        cover = data["files"][0]["coverage"]
        assert (cover["added"], cover["launched"], len(cover["unreachable"])) == (365, 354, 11)
        assert cover["never_launched"] == [] and len(data["ops"]) == 365
        if verdict == "proven":
            assert read_proof(tmp_path / "proof.json", None)[1].verdict == "proven"
            assert all(op["bitwise_equal"] for op in data["ops"])
            continue
        assert data["verdict"] == "failed"
        bad = [op for op in data["ops"] if op["bitwise_equal"] is False]
        assert len(bad) == 37 and all(op["case"].startswith("float16-u4b8-") for op in bad)
        assert all(any(k["cubins"] == [4] and k["name"].startswith(
            "_ZN6marlin6MarlinILl1125899906910725ELl1125899907892224E") for k in op["launched"])
            for op in bad)
        assert "it launched 1 added kernel(s) of cubin(s) 4: void marlin::Marlin<" in \
            data["problems"][0]


def test_the_moe_proof_of_the_lent_h200_reads_back(tmp_path: Path) -> None:
    """docs/real-build.md's `_moe_C` run (a lent H200, 2026-11-29): proven, 732 of 732
    cases bitwise equal, 737 of 738 added kernels launched, the placeholder unreachable by
    its rule; the stock file without the JIT failed, as it must."""
    import gzip

    real = Path(__file__).resolve().parents[2] / "docs" / "real-build" / "prove-sm90-h200-c"
    (tmp_path / "proof.json").write_bytes(
        gzip.decompress((real / "_moe_C.3-honest.proof.json.gz").read_bytes()))
    data = json.loads((tmp_path / "proof.json").read_text())
    _check(data)
    cover = data["files"][0]["coverage"]
    assert (cover["added"], cover["launched"], cover["compared"]) == (738, 737, 737)
    assert cover["never_launched"] == []
    [dead] = cover["unreachable"]
    assert "MarlinDefault" in dead["name"] and "never selects it" in dead["why"]
    assert len(data["ops"]) == 732 and all(op["bitwise_equal"] for op in data["ops"])
    assert data["problems"] == [] and data["verdict"] == "proven"
    assert "PTX JIT compilation was disabled" in data["stock_without_jit"][0]["said"]
    assert read_proof(tmp_path / "proof.json", None)[1].verdict == "proven"


def test_two_files_whose_paths_flatten_alike_are_both_proven(
        aot_pair: tuple[Path, Path], fake: Path, tmp_path: Path) -> None:
    """Red team: `x/y/_vllm_fa2_C.abi3.so` and `x_y/_vllm_fa2_C.abi3.so` both named their
    runs' files `x_y__vllm_fa2_C.abi3.so…` (a path's `/` made `_`): the second's cases
    folder was there already, `error: …cases: File exists`, and nothing was proven (a
    name of 300 characters made a file name too long the same way)."""
    made, stock = aot_pair
    names = ["x/y/_vllm_fa2_C.abi3.so", "x_y/_vllm_fa2_C.abi3.so",
             "d" * 120 + "/" + "e" * 120 + "/_vllm_fa2_C.abi3.so"]
    for side, folder in (("files", made), ("stock", stock)):
        for name in names:
            (tmp_path / side / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / side / name).write_bytes((folder / "_C.abi3.so").read_bytes())
    done = cli("prove", "--files", str(tmp_path / "files"), "--stock", str(tmp_path / "stock"),
               "--json", str(tmp_path / "p.json"), "--python", str(fake),
               env={"FAKE_MODE": "proven", "FAKE_LAUNCHED": "all"})
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "p.json").read_text())
    assert sorted(item["name"] for item in data["files"]) == sorted(names)
    assert data["verdict"] == "proven"


def test_a_file_changed_while_it_is_proven_gets_no_proof(aot_pair: tuple[Path, Path],
                                                         tmp_path: Path) -> None:
    """Red team: the native run (the file's own code, on this host under --files) wrote
    other bytes over the file; the proof named it by the sha256 read after the runs, so
    it vouched for bytes no child ran (`kernels publish --proof` takes a proof by sha256).
    Now the sha256 is read with the cubins, before any child, and must hold to the end."""
    from devkit.fake_gpu import FAKE_PYTHON

    made, stock = aot_pair
    files = tmp_path / "files"
    files.mkdir()
    (files / "_C.abi3.so").write_bytes((made / "_C.abi3.so").read_bytes())
    rewrite = ("import os, sys\n"
               "if sys.argv[1].endswith('harness_marlin.py') and '/stock/' not in sys.argv[2]"
               " and os.environ.get('CUDA_DISABLE_PTX_JIT') == '1':\n"
               "    open(sys.argv[2], 'ab').write(b'other bytes')\n")
    python = tmp_path / "FAKE-rewriting"
    python.write_text(f"#!{sys.executable}\n{rewrite}{FAKE_PYTHON}")
    python.chmod(0o755)
    out = tmp_path / "p.json"
    done = cli("prove", "--files", str(files), "--stock", str(stock), "--json", str(out),
               "--python", str(python), env={"FAKE_MODE": "proven", "FAKE_LAUNCHED": "all"})
    line = one_line_error(done, 3)
    assert "_C.abi3.so: changed while it was proven" in line
    assert not out.exists()


# -- red team, issue 63's Marlin surfaces (2026-11-28) -------------------------------------

def test_a_loader_lying_about_the_sm_count_makes_no_kernel_unreachable(
        marlin_names_so: Path, fake: Path, tmp_path: Path) -> None:
    """Red team: the shared memory comes from the GPU table, but the SM count is what the
    loader says; 100,000 SMs put the override's threshold past every N a case has, and
    three reachable Marlin kernels were called unreachable "by the dispatch".  Past what
    the cases can test, no kernel is called unreachable."""
    pair = aot_pair_of(marlin_names_so, "_C.abi3.so", tmp_path)
    unreachable = {}
    for sms in (48, 100_000):
        done = cli("prove", "--files", str(pair[0]), "--stock", str(pair[1]), "--json",
                   str(tmp_path / f"p{sms}.json"), "--python", str(fake),
                   env={"FAKE_MODE": "proven", "FAKE_LAUNCHED": "none",
                        "FAKE_SIZES": json.dumps({"smem_block": 101376, "smem_sm": 102400,
                                                  "sms": sms})})
        assert done.returncode == 0, done.stderr
        cover = json.loads((tmp_path / f"p{sms}.json").read_text())["files"][0]["coverage"]
        unreachable[sms] = {u["name"] for u in cover["unreachable"]}
    assert len(unreachable[48]) == 1 and unreachable[100_000] == set()


def test_a_moe_c_no_case_serves_is_partial_not_failed(aot_pair: tuple[Path, Path],
                                                      fake: Path, tmp_path: Path) -> None:
    """Red team: a `_moe_C` none of whose added kernels is a Marlin MoE kernel (the harness
    has no fixed case for `_moe_C`) was "failed: no op case was said"; no case runs, the
    file's loading is proven, its kernels never launched: partial, exit 0."""
    made, stock = aot_pair
    for folder, side in ((made, "files"), (stock, "stock")):
        (tmp_path / side).mkdir()
        (tmp_path / side / "_moe_C.abi3.so").write_bytes((folder / "_C.abi3.so").read_bytes())
    done = cli("prove", "--files", str(tmp_path / "files"), "--stock", str(tmp_path / "stock"),
               "--json", str(tmp_path / "p.json"), "--python", str(fake),
               env={"FAKE_MODE": "proven"})
    assert done.returncode == 0, done.stderr
    assert "no case of the harness_marlin.py harness serves its added kernels" in done.stderr
    data = json.loads((tmp_path / "p.json").read_text())
    _check(data)
    assert data["verdict"] == "partial" and data["ops"] == [] and \
        data["stock_without_jit"] == [] and data["files"][0]["harness"] is None
    assert read_proof(tmp_path / "p.json", None)[1].verdict == "partial"


def test_a_kernel_in_two_cubins_is_said_of_both(aot_pair: tuple[Path, Path], fake: Path,
                                                tmp_path: Path) -> None:
    """Red team: `shared_kernel<1>` is in both added cubins; a differing case named it of
    one (the last), though which copy ran is not known."""
    _prove(aot_pair, fake, tmp_path / "p.json", "differs", differs="gptq")
    data = json.loads((tmp_path / "p.json").read_text())
    _check(data)
    op = next(o for o in data["ops"] if o["bitwise_equal"] is False)
    [shared] = [k for k in op["launched"] if "shared_kernel" in k["name"]]
    assert len(shared["cubins"]) == 2


@pytest.mark.parametrize("bad", ["not a list", [{"name": 5, "cubins": [1]}],
                                 [{"name": "x", "cubins": [-1]}], [[[[[]]]]],
                                 [{"name": "x", "cubins": [1], "extra": True}], None,
                                 [{"name": "x", "cubins": []}], [{"name": "x"}]])
def test_the_reader_refuses_what_the_schema_refuses_of_launched(
        aot_pair: tuple[Path, Path], fake: Path, tmp_path: Path, bad: object) -> None:
    """Red team: the proof reader (kernels publish / attest / verify) read nothing of
    `ops[].launched`: each malformed value the schema refuses passed as proven."""
    done = _prove(aot_pair, fake, tmp_path / "proof.json")
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "proof.json").read_text())
    data["ops"][0]["launched"] = bad
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(jsonschema.ValidationError):
        _check(data)
    with pytest.raises(Exception, match="launched"):
        read_proof(tmp_path / "bad.json", None)


def test_the_reader_refuses_a_case_launching_a_kernel_never_launched(
        aot_pair: tuple[Path, Path], fake: Path, tmp_path: Path) -> None:
    done = _prove(aot_pair, fake, tmp_path / "proof.json", launched="half")
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "proof.json").read_text())
    never = data["files"][0]["coverage"]["never_launched"][0]
    data["ops"][0]["launched"] = [{"name": never, "cubins": [1]}]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(Exception, match="never launched"):
        read_proof(tmp_path / "bad.json", None)


def test_a_differing_line_is_bounded_whatever_the_cubin_count() -> None:
    """Red team: the line named 3 kernels but every cubin: 20,000 launched kernels (what a
    child may keep) made a line of 128,970 characters."""
    from sm121_build.jobs.proofs.prove_child import Compared
    from sm121_build.jobs.proofs.prove_document import KernelLaunched, OpResult

    launched = tuple(KernelLaunched(f"_Z{n}kv", (n,)) for n in range(20_000))
    op = OpResult("_C.abi3.so", "marlin_gemm", "c", Compared("marlin_gemm/c", False, 3.0),
                  (1.0, 1.0), None, launched)
    line = op.kernels_said()
    assert len(line) < 300 and "and 19,992 more" in line and "and 19,997 more" in line


def test_the_recorder_says_no_kernel_for_a_name_two_answer_to() -> None:
    """Red team: `_Z1fPiS_` and `_Z1fPiPi` both demangle to `f(int*, int*)`; the profiler's
    one name was said as the first in sorted order, which may not be the kernel that ran.
    A name two given kernels answer to is none of them."""
    import types

    from sm121_build.jobs.payload import harness_run

    real, other = "_Z1fPiS_", "_Z1fPiPi"
    assert demangle(real) == demangle(other) == "f(int*, int*)"
    torch = types.SimpleNamespace(_C=types.SimpleNamespace(_demangle=demangle))
    recorder = harness_run.Recorder(torch, sorted([real, other]))
    assert "f(int*, int*)" not in recorder.names
    assert recorder.names[real] == real and recorder.names[other] == other
    # a given kernel named as another's demangled text is not taken for it either
    named = harness_run.Recorder(torch, [real, "f(int*, int*)"])
    assert "f(int*, int*)" not in named.names


def test_a_refused_part_ends_its_siblings_at_once(tmp_path: Path,
                                                  marlin_names_so: Path) -> None:
    """Red team: one part's stock JIT run said its schema does not fit (exit 4) while its
    sibling ran on for 40 s: the one-line error came when the sibling ended (up to
    --timeout, the GPU busy).  The siblings are ended with the refusal: the sleeping one
    never gets to write its mark."""
    from devkit.fake_gpu import FAKE_PYTHON

    pair = aot_pair_of(marlin_names_so, "_C.abi3.so", tmp_path / "pair")
    mark = tmp_path / "the-sibling-ran-on"
    python = tmp_path / "FAKE-refusing"
    python.write_text(
        f"#!{sys.executable}\nimport json, os, sys, time\n"
        "if sys.argv[1].endswith('harness_marlin.py') and "
        "os.environ.get('CUDA_DISABLE_PTX_JIT') != '1':\n"
        "    if '--derived-only' in sys.argv:\n"
        f"        time.sleep(40); open({str(mark)!r}, 'w').close()\n"
        "    else:\n"
        "        print(json.dumps({'schema_error': 'no such op'}), flush=True); sys.exit(4)\n"
        + FAKE_PYTHON)
    python.chmod(0o755)
    done = cli("prove", "--files", str(pair[0]), "--stock", str(pair[1]), "--python",
               str(python), "--jobs", "2", "--timeout", "60", env={"FAKE_MODE": "proven"})
    assert "no such op; the harness_marlin.py harness does not fit" in one_line_error(done)
    time.sleep(0.5)
    assert not mark.exists()
