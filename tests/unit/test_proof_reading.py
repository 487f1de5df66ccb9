"""A proof read back (`kernels publish --proof`, `kernels verify`, `--kernels-from`): a file
through the door, every field checked, the verdict against its counts, its own signature
(`prove --sign-key`), and the one line a user is shown.  The document is the real one the
lent H200 made (docs/real-build/prove-sm90-h200/proof.json)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from devkit.fake_gpu import covered
from devkit.helpers import ROOT, cli, one_line_error
from devkit.keys import key_pair
from sm121_build.core.errors import Sm121Error, VerificationError
from sm121_build.image.cosign import SigningKey, TrustKey, Untrusted
from sm121_build.jobs.proofs.proof_reading import (
    NotAProof,
    read_proof,
    require_proof_of,
    signature_beside,
    summarise,
)

REAL = ROOT / "docs" / "real-build" / "prove-sm90-h200" / "proof.json"


def _real() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(REAL.read_text())
    return data


def test_the_real_proof_reads_as_one_line() -> None:
    """The real proof is of format 2 (before coverage was measured): read, as partial."""
    summary = summarise(_real())
    assert summary.line() == (
        "partial (coverage not measured: a format-2 proof) on NVIDIA H200 (sm_90), driver "
        f"580.159.04 (CUDA 13.0), {_real()['made'][:10]}: 64/64 added cubins load with the "
        "JIT off, 2,005/2,005 kernels found, 26/26 op cases bitwise equal to the stock JIT")
    files = {f["name"]: f["sha256"] for f in _real()["files"]}
    assert summary.mismatch(files) is None
    with pytest.raises(VerificationError, match=r"proof.json is partial \(coverage not "
                       r"measured: a format-2 proof\): not attached as a whole proof"):
        require_proof_of(summary, files, "sm_90", "proof.json")
    require_proof_of(summary, files, "sm_90", "proof.json", partial=True)
    summary = summarise(covered(_real()))  # FAKE: every kernel launched
    assert summary.verdict == "proven"
    assert summary.line().endswith("26/26 op cases bitwise equal to the stock JIT; proven "
                                   "for 2,005 of 2,005 added kernels; 0 never launched")
    require_proof_of(summary, files, "sm_90", "proof.json")
    with pytest.raises(VerificationError, match="proven on sm_90; these kernels serve sm_121"):
        require_proof_of(summary, files, "sm_121", "proof.json")
    with pytest.raises(VerificationError, match="which these kernels do not have"):
        require_proof_of(summary, {"_C.abi3.so": files["_C.abi3.so"]}, "sm_90", "p")


def _broken(change: str) -> object:
    data = _real()
    first = data["files"][0]
    if change == "unloaded":
        first["cubins"][0]["loaded"] = False
    elif change == "missing-kernel":
        first["cubins"][0]["found"] -= 1
    elif change == "op-differs":
        data["ops"][0]["bitwise_equal"] = False
    elif change == "problem":
        data["problems"] = ["something"]
    elif change == "stock-ran":
        data["stock_without_jit"][0]["failed"] = False
    elif change == "no-files":
        data["files"] = []
    elif change == "bool-count":
        first["cubins"][0]["found"] = True
    elif change == "huge-count":
        first["cubins"][0]["kernels"] = 2**40
    elif change == "sha":
        first["sha256"] = "Z" * 64
    elif change == "target":
        data["gpu"]["target"] = "sm_90\n"
    elif change == "name":
        data["gpu"]["name"] = "x" * 2000
    elif change == "format":
        data["format"] = 1
    elif change == "verdict":
        data["verdict"] = "maybe"
    elif change == "files-type":
        data["files"] = {"a": 1}
    elif change == "not-object":
        return [data]
    elif change == "nan":  # issue 62: each of these was read as proven
        data["ops"][0]["max_abs_diff"] = float("nan")
    elif change == "infinity":
        data["ops"][0]["first_call_s"]["native"] = float("inf")
    elif change == "surrogate":
        data["gpu"]["name"] = "\ud800"
    elif change == "surrogate-key":
        data["subject"]["\udcff"] = None
    elif change == "date":
        data["made"] = "2026-99-99T99:99:99Z"
    elif change == "listed-twice":
        data["files"].append(json.loads(json.dumps(first)))
    elif change == "same-file-other-spelling":
        data["files"].append({**json.loads(json.dumps(first)), "name": "./" + first["name"]})
    elif change == "harness-without-cases":
        data["ops"] = [o for o in data["ops"] if o["file"] != first["name"]]
        data["stock_without_jit"] = [r for r in data["stock_without_jit"]
                                     if r["file"] != first["name"]]
    elif change == "harness-without-stock-run":
        data["stock_without_jit"] = [r for r in data["stock_without_jit"]
                                     if r["file"] != first["name"]]
    elif change == "zero-kernel-cubin":
        first["cubins"] = [{**first["cubins"][0], "kernels": 0, "found": 0, "loaded": True}]
        first["harness"] = None
        data["ops"] = [o for o in data["ops"] if o["file"] != first["name"]]
        data["stock_without_jit"] = [r for r in data["stock_without_jit"]
                                     if r["file"] != first["name"]]
    elif change == "op-of-a-file-not-listed":
        data["ops"][0]["file"] = "_other.abi3.so"
    elif change == "left-out":
        data["left_out"] = [{"name": "_moe_C.abi3.so", "why": "no stock file"}]
    return data


@pytest.mark.parametrize("change", [
    "unloaded", "missing-kernel", "op-differs", "problem", "stock-ran", "no-files",
    "bool-count", "huge-count", "sha", "target", "name", "format", "verdict", "files-type",
    "not-object", "nan", "infinity", "surrogate", "surrogate-key", "date", "listed-twice",
    "same-file-other-spelling", "harness-without-cases", "harness-without-stock-run",
    "zero-kernel-cubin", "op-of-a-file-not-listed", "left-out"])
def test_a_document_that_is_no_proof_is_refused(change: str) -> None:
    """Each field is checked, and "proven" must rest on its counts: a cubin that did not
    load, a kernel not found, an op not equal, a problem listed or a stock file that ran
    with the JIT off make it no proof."""
    with pytest.raises(NotAProof):
        summarise(_broken(change))


def test_a_failed_proof_reads_but_does_not_travel() -> None:
    data = _real()
    data["ops"][0]["bitwise_equal"] = False
    data["verdict"], data["problems"] = "failed", ["x"]
    summary = summarise(data)
    assert summary.line().startswith("failed on NVIDIA H200 (sm_90)")
    assert "25/26 op cases" in summary.line()
    with pytest.raises(VerificationError, match="its verdict is failed"):
        require_proof_of(summary, {f["name"]: f["sha256"] for f in data["files"]}, "sm_90",
                         "p")


def test_its_signature_is_checked_when_a_key_is_trusted(tmp_path: Path) -> None:
    private, public = key_pair(tmp_path, "ours")
    _other, theirs = key_pair(tmp_path, "theirs")
    proof = tmp_path / "proof.json"
    proof.write_bytes(REAL.read_bytes())
    trust = TrustKey.load(public)
    with pytest.raises(Untrusted, match="is not signed by"):
        read_proof(proof, trust)  # no proof.json.sig
    body = proof.read_bytes()
    signature_beside(proof).write_text(SigningKey.load(private, None).sign(body) + "\n")
    assert read_proof(proof, trust)[1].verdict == "partial"  # format 2
    assert read_proof(proof, None)[0] == json.loads(body)
    with pytest.raises(Untrusted):
        read_proof(proof, TrustKey.load(theirs))
    proof.write_bytes(body.replace(b'"NVIDIA H200"', b'"NVIDIA GB10"'))  # changed after
    with pytest.raises(Untrusted):
        read_proof(proof, trust)


@pytest.mark.parametrize("content", [b"", b"not json", b"[" * 100_000, b"\xff\xfe",
                                     b'{"format": 2}'])
def test_what_is_not_json_or_not_a_proof_is_one_error(content: bytes, tmp_path: Path) -> None:
    proof = tmp_path / "p.json"
    proof.write_bytes(content)
    with pytest.raises(NotAProof, match="not a proof document"):
        read_proof(proof, None)


def test_the_proof_file_comes_through_the_door(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(Sm121Error, match="not a regular file"):
        read_proof(fifo, None)
    big = tmp_path / "big.json"
    with big.open("wb") as handle:
        handle.truncate(33 << 20)
    with pytest.raises(Sm121Error, match="more than"):
        read_proof(big, None)


def test_publish_proof_needs_a_key_and_prove_sign_key_needs_json(tmp_path: Path) -> None:
    line = one_line_error(cli("kernels", "publish", "--artifacts", str(tmp_path), "--to",
                              "127.0.0.1:1/k", "--proof", str(REAL)))
    assert "--proof is attached as a statement the key signs" in line
    private, _public = key_pair(tmp_path, "k")
    line = one_line_error(cli("prove", "--files", str(tmp_path), "--stock", str(tmp_path),
                              "--sign-key", str(private)))
    assert "--sign-key signs the proof --json writes" in line


@pytest.mark.parametrize(("old", "new", "said"), [
    ('"verdict": "proven"', '"verdict": "failed", "verdict": "proven"',
     "the key 'verdict' twice in one object"),
    ('"max_abs_diff": 0.0', '"max_abs_diff": NaN', "NaN is not a JSON number"),
    ('"max_abs_diff": 0.0', '"max_abs_diff": -Infinity', "-Infinity is not a JSON number"),
    ('"name": "NVIDIA H200"', '"name": "\\ud800"', "a lone surrogate"),
])
def test_json_a_proof_is_not_written_in_is_refused(old: str, new: str, said: str,
                                                   tmp_path: Path) -> None:
    """Issue 62: a key twice (the last one wins in Python), NaN, Infinity, a lone surrogate
    were read as they came."""
    proof = tmp_path / "p.json"
    proof.write_text(REAL.read_text().replace(old, new, 1))
    with pytest.raises(NotAProof, match=said):
        read_proof(proof, None)


def test_a_proof_of_some_of_the_files_is_not_whole() -> None:
    """Issue 62: a proof of one of an image's two files travelled as its proof."""
    summary = summarise(_real())
    files = {f["name"]: f["sha256"] for f in _real()["files"]}
    with pytest.raises(VerificationError, match=r"not whole: it does not prove 1 of their 3 "
                       r"files: _moe_C\.abi3\.so"):
        require_proof_of(summary, {**files, "_moe_C.abi3.so": "0" * 64}, "sm_90", "p",
                         partial=True)


def test_a_value_of_the_document_in_a_message_is_cut() -> None:
    """Issue 62: an 8 MB `format` became an 8 MB error line."""
    data = _real()
    data["format"] = "x" * (8 << 20)
    with pytest.raises(NotAProof) as refused:
        summarise(data)
    assert len(str(refused.value)) < 500 and "(8388408 more bytes)" in str(refused.value)


def test_the_line_of_a_proof_shows_its_names_cut() -> None:
    data = _real()
    data["gpu"]["name"] = "G" * 1000
    data["gpu"]["driver_version"] = "\x1b" * 1000
    line = summarise(data).line()
    assert "G" * 200 + "…(800 more bytes)" in line and "\x1b" not in line
    assert len(line) < 900


def _partial() -> dict[str, Any]:
    """FAKE coverage on the real proof: two of `_C.abi3.so`'s kernels never launched."""
    return covered(_real(), {"_C.abi3.so": ["_Z6never1v", "_Z6never2v"]})


def test_a_partial_proof_says_how_much_and_travels_only_when_asked() -> None:
    """Issue 63: a proof whose cases did not launch every added kernel is `partial`, its
    line names the coverage, and it is attached only with --partial-proof."""
    data = _partial()
    summary = summarise(data)
    assert summary.verdict == "partial"
    assert summary.line().startswith("partial (proven for 2,003 of 2,005 added kernels; 2 "
                                     "never launched) on NVIDIA H200 (sm_90)")
    files = {f["name"]: f["sha256"] for f in data["files"]}
    with pytest.raises(VerificationError, match=r"p is partial \(proven for 2,003 of 2,005 "
                       r"added kernels; 2 never launched\): not attached as a whole proof"):
        require_proof_of(summary, files, "sm_90", "p")
    require_proof_of(summary, files, "sm_90", "p", partial=True)
    data["verdict"] = "failed"
    data["problems"] = ["x"]
    failed = summarise(data)
    assert failed.line().endswith("op cases bitwise equal to the stock JIT")  # no "proven for"
    with pytest.raises(VerificationError, match="its verdict is failed"):
        require_proof_of(failed, files, "sm_90", "p", partial=True)


def _coverage_broken(change: str) -> object:
    data = _partial()
    first = data["files"][0]
    cover = first["coverage"]
    if change == "proven-but-partial":
        data["verdict"] = "proven"
    elif change == "partial-but-whole":
        data = covered(_real())
        data["verdict"] = "partial"
    elif change == "partial-with-a-problem":
        data["problems"] = ["x"]
    elif change == "partial-left-out":
        data["left_out"] = [{"name": "_moe_C.abi3.so", "why": "no stock file"}]
    elif change == "partial-op-differs":
        data["ops"][0]["bitwise_equal"] = False
    elif change == "launched-past-added":
        cover["launched"] = cover["added"] + 1
    elif change == "compared-past-launched":
        cover["compared"] = cover["launched"] + 1
    elif change == "never-does-not-add-up":
        cover["never_launched"] = cover["never_launched"][:1]
    elif change == "never-twice":
        cover["never_launched"] = ["_Z6never1v", "_Z6never1v"]
    elif change == "never-not-names":
        cover["never_launched"] = [1, 2]
    elif change == "never-empty-name":
        cover["never_launched"] = ["", "_Z6never2v"]
    elif change == "never-huge-list":
        cover["never_launched"] = [f"k{n}" for n in range(1_000_001)]
    elif change == "unreachable-and-never":
        cover["unreachable"] = [{"name": "_Z6never1v", "why": "a trap stub"}]
        cover["launched"] -= 1
        cover["compared"] -= 1
    elif change == "unreachable-no-why":
        cover["unreachable"] = [{"name": "_Z1xv"}]
        cover["launched"] -= 1
        cover["compared"] -= 1
    elif change == "bool-count":
        cover["added"] = True
    elif change == "huge-count":
        cover["added"] = 2**40
    elif change == "no-coverage":
        del first["coverage"]
    elif change == "recorder-type":
        cover["recorder"] = ["x"]
    elif change == "sum-wrong":
        data["coverage"]["never_launched"] = 0
    elif change == "sum-bool":
        data["coverage"]["unreachable"] = False
    elif change == "no-sum":
        del data["coverage"]
    elif change == "partial-format-2":
        data["format"] = 2
    elif change == "cubin-launched-past-kernels":
        first["cubins"][0]["launched"] = first["cubins"][0]["kernels"] + 1
    elif change == "cubin-launched-absent":
        del first["cubins"][0]["launched"]
    return data


@pytest.mark.parametrize("change", [
    "proven-but-partial", "partial-but-whole", "partial-with-a-problem", "partial-left-out",
    "partial-op-differs", "launched-past-added", "compared-past-launched",
    "never-does-not-add-up", "never-twice", "never-not-names", "never-empty-name",
    "never-huge-list", "unreachable-and-never", "unreachable-no-why", "bool-count",
    "huge-count", "no-coverage", "recorder-type", "sum-wrong", "sum-bool", "no-sum",
    "partial-format-2", "cubin-launched-past-kernels", "cubin-launched-absent"])
def test_coverage_that_does_not_hold_is_no_proof(change: str) -> None:
    """Issue 63: the coverage is checked as every field is (types, bounds, the counts add
    up, no name twice, the file's and the whole's agree), and the verdict against it:
    "proven" over a kernel never launched, "partial" over nothing missing or over a
    problem, is no proof."""
    with pytest.raises(NotAProof):
        summarise(_coverage_broken(change))


def test_a_partial_proof_with_unreachable_kernels_reads() -> None:
    data = _partial()
    cover = data["files"][0]["coverage"]
    cover["unreachable"] = [{"name": "_Z4trapv", "why": "SASS: BPT.TRAP only"}]
    cover["launched"] -= 1
    cover["compared"] -= 1
    data["coverage"].update(unreachable=1, launched=data["coverage"]["launched"] - 1,
                            compared=data["coverage"]["compared"] - 1)
    assert str(summarise(data).coverage) == ("proven for 2,002 of 2,005 added kernels; 2 "
                                             "never launched, 1 unreachable")


def test_kernels_publish_and_attest_refuse_a_partial_proof_offered_whole(
        tmp_path: Path) -> None:
    """Issue 63: `kernels publish --proof` and `kernels attest` refuse a partial proof in
    one line (exit 3) naming its coverage, before any registry or engine is asked; with
    --partial-proof it goes on (here to the registry nobody listens on)."""
    proof = tmp_path / "partial.json"
    proof.write_text(json.dumps(_partial()))
    private, _public = key_pair(tmp_path, "k")
    line = one_line_error(cli("kernels", "attest", "127.0.0.1:9/k:t", "--proof", str(proof),
                              "--sign-key", str(private)), 3)
    assert "is partial (proven for 2,003 of 2,005 added kernels; 2 never launched)" in line
    assert "--partial-proof" in line
    done = cli("kernels", "attest", "127.0.0.1:9/k:t", "--proof", str(proof), "--sign-key",
               str(private), "--partial-proof", env={"SM121_REGISTRY_TIMEOUT": "2"})
    assert done.returncode == 7, done.stderr  # past the verdict: the registry is asked
    artifacts = _artifacts(tmp_path / "artifacts")
    publish = ("kernels", "publish", "--artifacts", str(artifacts), "--to", "127.0.0.1:9/k",
               "--sign-key", str(private), "--proof", str(proof))
    env = {"DOCKER_HOST": "unix:///nonexistent.sock"}  # exit 4 if the engine were asked
    for flag in ((), ("--partial-proof",)):  # of other files: that is said first
        line = one_line_error(cli(*publish, *flag, env=env), 3)
        assert "is not a proof of these kernels" in line
    line = one_line_error(cli("kernels", "publish", "--artifacts", str(artifacts), "--to",
                              "127.0.0.1:9/k", "--proof", str(REAL), "--partial-proof"))
    assert "--proof is attached as a statement the key signs" in line
    line = one_line_error(cli("kernels", "publish", "--artifacts", str(artifacts), "--to",
                              "127.0.0.1:9/k", "--partial-proof", "--sign-key",
                              str(private)))
    assert "--partial-proof says how --proof is attached: give --proof" in line


def _artifacts(folder: Path) -> Path:
    """An artifacts folder `kernels publish` loads: one ELF file, its manifest."""
    import shutil
    import sys

    from sm121_build.core.inputs import sha256_of

    folder.mkdir()
    shutil.copy(Path(sys.executable).resolve(), folder / "_C.abi3.so")
    (folder / "manifest.json").write_text(json.dumps({
        "format": 1, "base": "vllm/vllm-openai:x", "base_digest": "sha256:" + "a" * 64,
        "vllm_version": "0.33.0", "vllm_commit": "b" * 40, "arch_list": "9.0",
        "patches": "none", "package_dir": "/usr/local/lib/python3.12/dist-packages/vllm",
        "tool_version": "0", "files": {"_C.abi3.so": {
            "sha256": sha256_of(folder / "_C.abi3.so"), "mode": "755"}}}))
    return folder


@pytest.mark.parametrize("change", ["zero-added", "all-unreachable", "no-harness-launched",
                                    "compared-without-equal-case"])
def test_coverage_rests_on_the_rest_of_the_document(change: str) -> None:
    """Red team 2: "proven" over coverage not tied to the cubins or the op cases (0 of 0
    added while the cubins hold kernels; every kernel made "unreachable" while the cubins
    say it launched; kernels launched and compared in a file no harness ran)."""
    from devkit.fake_gpu import covered

    data = covered(json.loads(REAL.read_text()), {})
    summarise(json.loads(json.dumps(data)))  # as made: it holds
    item = next(f for f in data["files"] if f["harness"])
    cover = item["coverage"]
    if change == "zero-added":
        for key in ("added", "launched", "compared"):
            data["coverage"][key] -= cover[key]
            cover[key] = 0
    elif change == "all-unreachable":
        data["coverage"]["launched"] -= cover["launched"]
        data["coverage"]["compared"] -= cover["compared"]
        data["coverage"]["unreachable"] += cover["launched"]
        cover["unreachable"] = [{"name": f"_Z{i}madeupv", "why": "said so"}
                                for i in range(cover["launched"])]
        cover["launched"] = cover["compared"] = 0
    elif change == "no-harness-launched":
        item["harness"] = None
        data["ops"] = [o for o in data["ops"] if o["file"] != item["name"]]
        data["stock_without_jit"] = [r for r in data["stock_without_jit"]
                                     if r["file"] != item["name"]]
    else:
        for op in data["ops"]:
            if op["file"] == item["name"]:
                op["bitwise_equal"] = None
                op["error"] = "not compared"
    with pytest.raises(NotAProof):
        summarise(data)
