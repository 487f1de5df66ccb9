"""Issue 62: `prove` and proof documents at the doors.

- every path option a command READS is an input of the outputs door (`cli.params.InputPath`,
  `--python`): no `--json`, `--out`, `--report` is written over, into or through it;
- a child's answers are kept only for what it was asked, once, within a budget.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from devkit.fake_gpu import fake_python
from devkit.helpers import ROOT, cli, one_line_error
from devkit.keys import key_pair
from sm121_build.cli import cli as root
from sm121_build.cli.params import InputPath, interpreter_value
from sm121_build.core.console import CUT, shown_cut
from sm121_build.jobs.proofs.proof_reading import read_proof
from sm121_build.jobs.proofs.prove_child import (
    KEPT_BYTES,
    MAX_KEPT,
    Asked,
    Compared,
    Device,
    Said,
    SaidTooMuch,
    heard,
)
from sm121_build.jobs.proofs.prove_document import (
    Coverage,
    CubinResult,
    FileProof,
    OpResult,
    Proof,
    StockWithoutJit,
    Subject,
    document,
)

PROOF = ROOT / "docs" / "real-build" / "prove-sm90-h200" / "proof.json"
# the path options that name what a command WRITES: every other path option is read
OUTPUTS = {"out", "report", "summary_md", "json_out"}


def _commands(group: click.Command, prefix: str = "") -> list[tuple[str, click.Command]]:
    found = [(prefix or "sm121-build", group)]
    if isinstance(group, click.Group):
        ctx = click.Context(group)
        for name in group.list_commands(ctx):
            command = group.get_command(ctx, name)
            assert command is not None
            found += _commands(command, f"{prefix} {name}".strip())
    return found


def test_every_path_option_that_is_read_is_an_input() -> None:
    """A scan of the CLI: a path option is an output (`OUTPUTS`) or an `InputPath`, which
    declares it an input of the outputs door; `--python` (a name or a path) is declared by
    its callback."""
    paths, pythons = [], []
    for where, command in _commands(root):
        for param in command.params:
            if param.name == "python":
                pythons.append(where)
                assert param.callback is interpreter_value, where
            if isinstance(param.type, click.Path) and param.name not in OUTPUTS:
                paths.append(f"{where} {param.name}")
                assert isinstance(param.type, InputPath), f"{where} {param.name} is read " \
                    "but not declared an input (cli.params.InputPath)"
    assert pythons == ["prove"]
    assert {"prove files", "prove stock", "prove sign_key", "kernels publish trust_key",
            "kernels attest proof", "aot cuda_home"} <= set(paths)


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    return tmp_path / "a", tmp_path / "b"


def test_prove_json_onto_its_own_key_is_refused(folders: tuple[Path, Path],
                                                tmp_path: Path) -> None:
    """Red team (issue 62): `prove --json K.pem --sign-key K.pem` replaced the private key
    with the proof, exit 0."""
    private, _public = key_pair(tmp_path, "k")
    fake = fake_python(tmp_path / "FAKE-python", sys.executable)
    before = private.read_bytes()
    for out in (private, tmp_path / "." / private.name):
        line = one_line_error(cli("prove", "--files", str(folders[0]), "--stock",
                                  str(folders[1]), "--python", str(fake), "--json", str(out),
                                  "--sign-key", str(private)))
        assert "is the same file as the input" in line and "nothing to prove" not in line
    assert private.read_bytes() == before


def test_prove_json_onto_its_interpreter_is_refused(folders: tuple[Path, Path],
                                                    tmp_path: Path) -> None:
    fake = fake_python(tmp_path / "FAKE-python", sys.executable)
    before = fake.read_bytes()
    line = one_line_error(cli("prove", "--files", str(folders[0]), "--stock", str(folders[1]),
                              "--python", str(fake), "--json", str(fake)))
    assert "is the same file as the input" in line
    assert fake.read_bytes() == before


def test_aot_out_inside_its_cuda_home_is_refused(tmp_path: Path) -> None:
    home, so = tmp_path / "cuda", tmp_path / "x.so"
    (home / "bin").mkdir(parents=True)
    so.write_bytes(b"\x7fELF")
    line = one_line_error(cli("aot", str(so), "--out", str(home / "out"), "--cuda-home",
                              str(home)))
    assert "is inside the input" in line
    assert not (home / "out").exists()


# a child that answers, validly, about what it was not asked: 100,000 lines of 20 missing
# kernel names of 300 characters each (before issue 62: 777 MB kept from the probe alone)
FLOOD = '''
import json, sys
print(json.dumps({"device": {"name": "FLOOD", "major": 12, "minor": 1, "driver": 13000,
                             "version": "1"}}))
names = ["k%03d" % i + "x" * 296 for i in range(20)]
line = json.dumps({"cubin": "c", "loaded": True, "found": 1, "missing": names,
                   "missing_count": 20}) + "\\n"
for _ in range(100_000):
    sys.stdout.write(line)
'''


def _lines(*items: dict[str, object]) -> bytes:
    return b"".join(json.dumps(item).encode() + b"\n" for item in items)


def test_a_child_keeps_only_answers_to_what_it_was_asked() -> None:
    asked = Asked(cubins={"0000-00001": frozenset({"kern_a", "kern_b"})})
    said = heard(_lines(
        *({"cubin": f"other-{n}", "loaded": False, "error": "x" * 300} for n in range(500)),
        {"cubin": "0000-00001", "loaded": True, "found": 1, "missing_count": 1,
         "missing": ["kern_b", "not_its_kernel", "y" * 5000]},
        *({"cubin": "0000-00001", "loaded": True, "found": 2, "missing": [],
           "missing_count": 0} for _ in range(500)),
        *({"op": "o", "case": f"c{n}", "first_s": 1.0} for n in range(500)),
        *({"key": f"o/c{n}", "bitwise_equal": True} for n in range(500))), asked, "loader")
    [load] = said.loads
    assert (load.found, load.missing) == (1, ("kern_b",))  # the first answer, its kernel
    assert (said.cases, said.compared) == ([], [])
    assert said.unasked == 500 + 500 + 500 and said.repeated == 500 and said.kept == 1
    runs = heard(_lines(*({"op": "o", "case": f"c{n % 3}", "first_s": 1.0}
                          for n in range(300))), Asked(cases=frozenset({"o/c1"})), "run")
    assert [c.case for c in runs.cases] == ["c1"] and runs.repeated == 99


@pytest.mark.parametrize(("count", "pad"), [(MAX_KEPT + 1, 0), (200, 60_000)])
def test_a_child_that_answers_past_its_budget_is_refused(count: int, pad: int) -> None:
    output = _lines(*({"op": "o", "case": f"c{n}", "first_s": 1.0, "pad": "p" * pad}
                      for n in range(count)))
    with pytest.raises(SaidTooMuch, match=r"^the stock run said more than .*: refused"):
        heard(output, Asked(cases=None), "the stock run")
    said = Said(Asked(cases=None))
    for line in output.decode().splitlines():
        said.line(line)
    assert said.over is not None and said.cases == []  # nothing kept past the budget
    assert said.kept <= MAX_KEPT + 1 and said.kept_bytes <= KEPT_BYTES + 65_536


def test_a_flooding_child_does_not_fill_the_memory(folders: tuple[Path, Path],
                                                   tmp_path: Path) -> None:
    """Red team (issue 62): the probe's well-formed lines drove the tool to 777 MB."""
    flood = tmp_path / "flood"
    flood.write_text(f"#!{sys.executable}\n{FLOOD}")
    flood.chmod(0o755)
    measure = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:], "
               "capture_output=True, text=True); print(done.returncode, "
               "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
               "print(done.stderr, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", measure, sys.executable, "-m", "sm121_build",
                           "prove", "--files", str(folders[0]), "--stock", str(folders[1]),
                           "--python", str(flood)], capture_output=True, text=True,
                          cwd=ROOT, check=True)
    code, kib = map(int, done.stdout.split())
    assert code == 2 and "nothing to prove" in done.stderr
    assert kib < 400 * 1024  # the bound: well under its 831 MB


def test_a_value_in_a_message_is_cut_to_a_bound() -> None:
    """`core.console.shown_cut`: a value from outside is shown escaped and cut, whatever
    its size or type."""
    assert shown_cut("x" * 8_000_000) == "x" * CUT + f"…({8_000_000 - CUT} more bytes)"
    assert shown_cut("\x1b]0;title\x07") == "\\e]0;title\\x07"
    assert shown_cut([[1]] * 1_000_000) == "(a list of 1000000 items)"
    assert (shown_cut(None), shown_cut(2.5), shown_cut(True)) == ("None", "2.5", "True")
    assert len(shown_cut("\x1b" * 10_000, 10)) < 100


def test_a_number_too_large_for_a_float_is_ignored_not_a_traceback() -> None:
    """Red team (issue 62): `"first_s": 1` and 400 zeros raised OverflowError in the parser."""
    huge = "1" + "0" * 400
    said = heard(f'{{"op": "o", "case": "c", "first_s": {huge}}}\n'
                 f'{{"key": "o/c", "bitwise_equal": false, "max_abs_diff": {huge}}}\n'
                 .encode(), Asked(cases=None), "run")
    assert (said.cases, said.compared, said.ignored) == ([], [], 2)


def _proof(kernels: int, diff: float) -> Proof:
    cubin = CubinResult(1, "sm_121", 0, kernels, True, kernels, (), 0, None, kernels)
    op = OpResult("_C.abi3.so", "op", "case", Compared("op/case", True, diff), (1.0, 0.1))
    return Proof("0", Device("g", 12, 1, 13000, None),
                 (FileProof("_C.abi3.so", (cubin,), 0, "harness_marlin.py", "0" * 64,
                             Coverage(kernels, kernels, kernels, ())),),
                 (op,), (StockWithoutJit("_C.abi3.so", True, "JIT disabled"),),
                 "2026-11-28T04:10:00Z", Subject(files="f", stock="s"))


def test_what_prove_writes_is_what_the_reader_takes(tmp_path: Path) -> None:
    """Issue 62: the writer never writes NaN (`allow_nan=False`), and a file whose added
    cubins hold no kernel is not proven by it: the reader refuses both."""
    good = tmp_path / "good.json"
    good.write_bytes(document(_proof(3, 0.0)))
    assert read_proof(good, None)[1].verdict == "proven"
    with pytest.raises(ValueError, match="Out of range float"):
        document(_proof(3, float("nan")))
    empty = _proof(0, 0.0)
    assert empty.verdict == "failed"
    assert "_C.abi3.so: no added cubin with a kernel for this GPU" in empty.problems()[0]
    (tmp_path / "empty.json").write_bytes(document(empty))
    assert read_proof(tmp_path / "empty.json", None)[1].verdict == "failed"


def test_a_name_that_is_not_utf8_is_refused_before_any_gpu_work(tmp_path: Path) -> None:
    """Issue 62: `prove --files DIR` wrote a name that is not UTF-8 into the proof as a lone
    surrogate, and `kernels attest` (`publish --proof`, after it pushed) died on it."""
    files, stock = tmp_path / "files", tmp_path / "stock"
    for folder in (files, stock):
        (folder / os.fsdecode(b"\xff")).mkdir(parents=True)
        (folder / os.fsdecode(b"\xff") / "_C.abi3.so").write_bytes(b"\x7fELF")
    line = one_line_error(cli("prove", "--files", str(files), "--stock", str(stock),
                              "--python", str(tmp_path / "never-run")))
    assert "\\xff/_C.abi3.so is not a UTF-8 name" in line


def test_a_childs_lone_surrogate_is_written_as_its_escape() -> None:
    said = heard(b'{"device": {"name": "\\ud800GB10", "major": 12, "minor": 1, '
                 b'"driver": 13000, "version": "\\udcff"}}\n', Asked(), "probe")
    assert said.device is not None
    assert (said.device.name, said.device.version) == ("\\ud800GB10", "\\udcff")


def test_attest_refuses_a_proof_with_a_lone_surrogate_before_the_registry(
        tmp_path: Path) -> None:
    private, _public = key_pair(tmp_path, "k")
    data = json.loads(PROOF.read_text())
    data["files"][0]["name"] = "\udcff/_C.abi3.so"
    data["subject"]["files"] = "/tmp/\udcff"
    proof = tmp_path / "p.json"
    proof.write_text(json.dumps(data))
    line = one_line_error(cli("kernels", "attest", "127.0.0.1:1/k", "--proof", str(proof),
                              "--sign-key", str(private)))
    assert "not a proof document: it holds a lone surrogate" in line


# FAKE: a stand-in `torch` whose ops succeed and whose profiler reports the kernel names of
# $EVENTS (a JSON list) for every session; STORY "no-profiler" has none, "silent" reports
# nothing.  It proves nothing of a GPU: it runs harness_run.py's recorder on a CPU.
RECORDING_TORCH = '''
import json, os
from pathlib import Path
STORY = os.environ["STORY"]
int32 = "int32"
class _Out:
    def cpu(self):
        return self
    def int(self):
        return self
Tensor = _Out
class _Schema:
    def __init__(self, names):
        self.arguments = [type("A", (), {"name": n})() for n in names]
class _Op:
    def __init__(self, names):
        self.default = type("D", (), {"_schema": _Schema(names)})()
    def __call__(self, *args):
        return _Out()
class _Namespace:
    def __getattr__(self, name):
        if not name.endswith("_repack"):  # (a library of the repack ops alone)
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
    return _Out()
randperm = empty = randint
def save(saved, path):
    Path(path).write_text(json.dumps(sorted(saved)))
class _C:
    @staticmethod
    def _demangle(name):
        return {"_Z6repackIiEvv": "void repack<int>()"}.get(name, name)
class _Event:
    def __init__(self, name):
        self.name = name
class _Session:
    def __init__(self, activities):
        assert activities == ["CUDA"]
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        return False
    def events(self):
        if STORY == "silent":
            return []
        return [_Event(n) for n in json.loads(os.environ["EVENTS"])]
class _Profiler:
    class ProfilerActivity:
        CUDA = "CUDA"
    profile = _Session
if STORY != "no-profiler":
    profiler = _Profiler()
'''


def _record(tmp_path: Path, story: str, events: list[str], kernels: list[str]
            ) -> tuple[int, list[dict[str, object]]]:
    import sm121_build.jobs.payload as payload

    (tmp_path / "torch.py").write_text(RECORDING_TORCH)
    (tmp_path / "kernels.json").write_text(json.dumps(kernels))
    done = subprocess.run(
        [sys.executable, str(Path(payload.__file__).parent / "harness_marlin.py"),
         str(tmp_path / "lib.so"), str(tmp_path / "out.pt"), str(tmp_path / "kernels.json")],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "PYTHONPATH": str(tmp_path), "STORY": story,
             "EVENTS": json.dumps(events)})
    return done.returncode, [json.loads(line) for line in done.stdout.splitlines()]


def test_the_recorder_says_each_added_kernel_a_case_launched(tmp_path: Path) -> None:
    """Issue 63: harness_run.py's recorder (torch's profiler around each first call, FAKE
    here) says, per case, each of the given kernels the profiler named, mangled as given:
    one the profiler names demangled (as kineto does), one it names mangled; torch's own
    kernels, a copy and a name given to no one are never said."""
    given = ["_Z6repackIiEvv", "_Z5otherv", "_Z5neverv"]
    events = ["void repack<int>()", "_Z5otherv", "void repack<int>()",
              "Memcpy DtoH (Device -> Pageable)", "void at::native::fill<float>()", "\x1b]0;x"]
    code, lines = _record(tmp_path, "record", events, given)
    assert code == 0
    cases = [f"{d['op']}/{d['case']}" for d in lines if "first_s" in d]
    assert len(cases) == 18
    launched = [(d["launched"], d["case"]) for d in lines if "launched" in d]
    assert launched == [(k, c) for c in cases for k in ("_Z5otherv", "_Z6repackIiEvv")]
    assert lines[-1] == {"saved": 18} and not any("recorder" in d for d in lines)


@pytest.mark.parametrize(("story", "said"), [
    ("no-profiler", "the profiler could not start: "),
    ("silent", "the profiler reported no GPU activity at all (no CUPTI?)")])
def test_a_recorder_that_cannot_record_says_so_once_and_the_run_goes_on(
        tmp_path: Path, story: str, said: str) -> None:
    code, lines = _record(tmp_path, story, ["_Z5otherv"], ["_Z5otherv"])
    assert code == 0
    recorder = [str(d["recorder"]) for d in lines if "recorder" in d]
    assert len(recorder) == 1 and recorder[0].startswith(said)
    assert lines[-1] == {"saved": 18} and not any("launched" in d for d in lines)


def test_without_a_listing_nothing_is_recorded(tmp_path: Path) -> None:
    """The stock runs are given no listing: no profiler, no recorder line."""
    import sm121_build.jobs.payload as payload

    (tmp_path / "torch.py").write_text(RECORDING_TORCH)
    done = subprocess.run(
        [sys.executable, str(Path(payload.__file__).parent / "harness_marlin.py"),
         str(tmp_path / "lib.so"), str(tmp_path / "out.pt")],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "PYTHONPATH": str(tmp_path), "STORY": "no-profiler"})
    assert done.returncode == 0, done.stderr
    assert all(set(json.loads(line)) & {"first_s", "saved"} for line in done.stdout.splitlines())


def test_a_childs_launched_lines_are_kept_only_for_kernels_and_cases_asked() -> None:
    """Issue 63: `{"launched": K, "case": C}` is kept when K is an added kernel of the file
    and C a case asked, once per pair; anything else is counted, never kept."""
    said = Said(Asked(cases=frozenset({"o/c", "o/d"}), kernels=frozenset({"_Z1kv", "_Z1jv"})))
    for line in [
        '{"launched": "_Z1kv", "case": "o/c"}', '{"launched": "_Z1kv", "case": "o/c"}',
        '{"launched": "_Z1kv", "case": "o/d"}', '{"launched": "_Z1jv", "case": "o/x"}',
        '{"launched": "_Z5torchv", "case": "o/c"}', '{"launched": "\\u001b]0;x", "case": "o/c"}',
        '{"launched": ["_Z1kv"], "case": "o/c"}', '{"launched": "_Z1kv", "case": 3}',
        '{"launched": "_Z1kv"}', '{"recorder": "' + "r" * 5000 + '"}',
    ]:
        said.line(line)
    assert [(item.kernel, item.case) for item in said.launched] == [
        ("_Z1kv", "o/c"), ("_Z1kv", "o/d")]
    assert (said.repeated, said.unasked, said.ignored) == (1, 3, 3)
    assert said.recorder == "r" * 300


def test_a_child_launching_past_the_budget_is_refused() -> None:
    kernels = frozenset(f"_Z{n}kv" for n in range(MAX_KEPT + 1))
    output = b"".join(b'{"launched": "%s", "case": "o/c"}\n' % k.encode() for k in kernels)
    with pytest.raises(SaidTooMuch, match="native run said more than"):
        heard(output, Asked(cases=frozenset({"o/c"}), kernels=kernels), "native run")


def test_a_launch_in_a_case_with_a_long_name_is_the_cases() -> None:
    """A case line's op and case are each cut to 300 characters; a launch's `OP/CASE` is
    cut alike, so a case named past that still owns its launches."""
    said = Said(Asked(cases=None, kernels=frozenset({"_Z1kv"})))
    said.line(json.dumps({"op": "o", "case": "c" * 400, "first_s": 0.5}))
    said.line(json.dumps({"launched": "_Z1kv", "case": "o/" + "c" * 400}))
    [case] = said.cases
    assert [item.case for item in said.launched] == [f"{case.op}/{case.case}"]


def _demangle_bomb(levels: int) -> str:
    """A name of ~11 bytes a level whose every template argument is `X<prev, prev>`: its
    demangled form doubles a level (red team 2: 278 bytes, 285 MB, 1.7 GB, 8 s)."""
    digits = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"

    def ref(k: int) -> str:
        return "S_" if k == 0 else f"S{digits[(k - 1) % 36]}_" if k <= 36 else \
            f"S{digits[(k - 1) // 36]}{digits[(k - 1) % 36]}_"
    body = "1XIiiE" + "".join(f"S0_I{ref(i + 1)}{ref(i + 1)}E" for i in range(1, levels))
    return f"_Z1fI{body}Evv"


def test_a_name_whose_demangled_form_is_unbounded_is_never_demangled() -> None:
    """cuda/dynsym.demangle and the recorder leave such a name mangled (shown escaped and
    cut); a real kernel name is still demangled."""
    from sm121_build.cuda.dynsym import demangle
    from sm121_build.jobs.payload import harness_run
    from sm121_build.verify.checks import _shown

    bomb = _demangle_bomb(25)
    assert len(bomb) < 300
    assert demangle(bomb) == bomb
    assert len(_shown(bomb)) < 400
    real = "_ZN3c104cuda12device_countEv"
    assert demangle(real) == "c10::cuda::device_count()"
    small = _demangle_bomb(4)  # a few back-references: demangled as before
    assert demangle(small) != small

    class _Torch:
        class _C:
            @staticmethod
            def _demangle(name: str) -> str:
                assert name != bomb, "the bomb was handed to the demangler"
                return name.upper()
    recorder = harness_run.Recorder(_Torch(), [bomb, real])
    assert recorder.names == {bomb: bomb, real: real, real.upper(): real}


def test_a_childs_text_of_lone_surrogates_stays_within_what_the_reader_takes() -> None:
    """Red team 2: 300 lone surrogates became 1,800 characters of escapes: prove wrote and
    signed a proof its own reader refuses ("the GPU's name is not a text")."""
    from sm121_build.jobs.proofs.prove_child import TEXT, _text

    said = _text("\ud800" * 300)
    assert said is not None and len(said) <= TEXT and "\ud800" not in said
