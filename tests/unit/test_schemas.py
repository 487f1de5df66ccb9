"""The JSON outputs against the schemas shipped in the package (sm121_build/data/schemas):
`audit --json` of real nvcc output, the manifest `--out` writes and `inject` reads, and the
run report.  A field added without its schema (or a schema loosened to anything) fails here."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from devkit.helpers import DATA, compile_cached, gencode
from sm121_build.core.shipped import schema
from sm121_build.cuda.binary import DEFAULT_POLICY, audit_binary
from sm121_build.cuda.compat import ArchList
from sm121_build.jobs.formats import artifacts
from sm121_build.jobs.framework import run_record


def _check(name: str, data: Any) -> None:
    jsonschema.Draft202012Validator(schema(name)).validate(data)


@pytest.mark.parametrize("name", ["audit", "report", "manifest", "proof"])
def test_each_schema_is_a_valid_schema_and_closed(name: str) -> None:
    loaded = schema(name)
    jsonschema.Draft202012Validator.check_schema(loaded)
    assert loaded["additionalProperties"] is False  # an unknown top-level field fails


def test_audit_json_of_real_files(tmp_path: Path) -> None:
    folder = tmp_path / "vllm"
    (folder / "vllm_flash_attn").mkdir(parents=True)
    shutil.copy(compile_cached("schema-fa2", DATA / "kernels.cu",
                               gencode("compute_80:sm_80", "compute_80:compute_80")),
                folder / "vllm_flash_attn" / "_vllm_fa2_C.abi3.so")
    shutil.copy(compile_cached("schema-121", DATA / "kernels.cu",
                               gencode("compute_121:sm_121", "compute_120f:sm_120f")),
                folder / "_C.abi3.so")
    shutil.copy(compile_cached("schema-90a", DATA / "kernels.cu", gencode("compute_90a:sm_90a")),
                folder / "vllm_flash_attn" / "_vllm_fa3_C.abi3.so")  # "other GPUs only"
    subprocess.run(["cc", "-shared", "-o", str(folder / "host_only.so"), "-x", "c", "/dev/null"],
                   check=True)
    for extra in ([], ["--kernels"]):
        result = subprocess.run([sys.executable, "-m", "sm121_build", "audit", "--json",
                                 str(folder), *extra], capture_output=True, text=True,
                                check=False)
        assert result.returncode == 0, result.stderr
        data = json.loads(result.stdout)
        _check("audit", data)
        assert {Path(b["name"]).name for b in data["binaries"]} >= {"_C.abi3.so",
                                                                    "_vllm_fa2_C.abi3.so"}
        assert {b["rebuild"]["verdict"] for b in data["binaries"] if b.get("rebuild")} >= {
            "other GPUs only", "fixable"}
    broken = dict(data, binaries=[{**data["binaries"][0], "rebuild": {"verdict": "maybe"}}])
    with pytest.raises(jsonschema.ValidationError):
        _check("audit", broken)


def test_the_manifest_export_writes_and_inject_reads(tmp_path: Path) -> None:
    so = compile_cached("schema-121", DATA / "kernels.cu",
                        gencode("compute_121:sm_121", "compute_120f:sm_120f"))
    report = audit_binary(so, "_C.abi3.so", DEFAULT_POLICY, with_kernels=True)
    provenance = artifacts.Provenance(
        base="vllm/vllm-openai:nightly", base_digest="sha256:" + "a" * 64,
        vllm_version="0.26.0", vllm_commit="c" * 40, vllm_commit_id=None, arch_list="12.1",
        patches="0123456789abcdef", package_dir="/usr/local/lib/python3.12/dist-packages/vllm",
        tool_version="0.1.0", external={"vllm-flash-attn": "f" * 40})
    files = {"_C.abi3.so": so, "vllm_flash_attn/_vllm_fa2_C.abi3.so": so}
    counts = {name: (report.arch_counts("elf"), report.kernel_counts()["native"])
              for name in files}
    path = artifacts.export(tmp_path / "out", files, provenance, counts)
    data = json.loads(path.read_text())
    assert artifacts.load(tmp_path / "out").provenance == provenance  # read back as written
    _check("manifest", data)
    assert artifacts.load(tmp_path / "out").files.keys() == files.keys()
    with pytest.raises(jsonschema.ValidationError):
        _check("manifest", {**data, "files": {"../x.so": data["files"]["_C.abi3.so"]}})
    native = report.kernel_counts()["native"]
    assert data["files"]["_C.abi3.so"]["kernels_native"] == native > 0
    assert artifacts.Manifest.from_json(data).files["_C.abi3.so"].kernels_native == native
    both = {**data["files"]["_C.abi3.so"], "kernels_native_sm121": native}
    with pytest.raises(jsonschema.ValidationError):  # one name or the other, never both
        _check("manifest", {**data, "files": {"_C.abi3.so": both}})


def test_a_manifest_of_an_earlier_release_reads_with_its_counts() -> None:
    """The manifest a real run wrote before `kernels_native` had its name (docs/real-build,
    `--gpu sm_90`: the field said sm121 and counted sm_90's kernels) passes the schema and
    reads with its counts."""
    old = json.loads((Path(__file__).resolve().parents[2] / "docs" / "real-build" /
                      "main-job-gpu-sm90" / "manifest.json").read_text())
    _check("manifest", old)
    files = artifacts.Manifest.from_json(old).files
    assert {name: record.kernels_native for name, record in files.items()} == \
        {name: entry["kernels_native_sm121"] for name, entry in old["files"].items()}
    assert 2405 in {record.kernels_native for record in files.values()}


def test_run_reports_of_each_outcome() -> None:
    base = run_record.new_record("build", "vllm/vllm-openai:nightly",
                                 "vllm/vllm-openai:nightly-sm121", ArchList.parse("12.1"))
    _check("report", base.as_json())  # a run that failed before anything was known
    assert set(base.as_json()) == {"format", *run_record.RunRecord.REQUIRED}
    counts = run_record.ExtensionCounts({"sm_121": 2}, {}, {"native": 4, "jit": 0, "none": 0})
    record = replace(
        base, status="built", vllm_version="0.26.0", vllm_commit="c" * 40,
        base_digest="vllm/vllm-openai@sha256:" + "a" * 64, content_key="0" * 24,
        extensions=["_C.abi3.so"], before={"_C.abi3.so": counts},
        after={"_C.abi3.so": counts}, fp4_excluded={"_C.abi3.so": 0},
        abi_symbols_checked=88, artifacts="/out", log="/log",
        image_id="sha256:" + "b" * 64, tags=["x:y"],
        external={"vllm-flash-attn": run_record.ExternalSource("f" * 40, "/repo")},
        decision={"rebuild": True, "reason": "r", "chosen": ["_C.abi3.so"], "extensions": {
            "_C.abi3.so": {"name": "_C.abi3.so", "target": "_C",
                           "before": {"native": 0, "jit": 4, "none": 0},
                           "after": {"native": 4, "jit": 0, "none": 0}, "build": True,
                           "reason": "r", "remains": []}}},
        pulled=run_record.Pulled(None, "sha256:" + "a" * 64))
    built = record.as_json()
    _check("report", built)
    assert built["external"] == {"vllm-flash-attn": {"commit": "f" * 40, "repository": "/repo"}}
    assert built["after"]["_C.abi3.so"]["cubins"] == {"sm_121": 2}
    # the audit kept under the content key is read back as it was written
    skipped = replace(base, status="up-to-date")
    skipped.keep_audit_of(built)
    assert (skipped.before, skipped.after, skipped.fp4_excluded, skipped.log) == (
        record.before, record.after, record.fp4_excluded, record.log)
    _check("report", skipped.as_json())
    with pytest.raises(jsonschema.ValidationError):
        _check("report", {**built, "unexpected": 1})
    with pytest.raises(jsonschema.ValidationError):
        _check("report", {**built, "status": "done"})
