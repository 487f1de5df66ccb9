"""Every rebuild verdict the audit prints on PyPI's vLLM 0.33.0 and 0.28.0 aarch64 wheels,
from the binaries alone and with their sdists (`audit --source`), as README lists them; the
per-kernel JSON pinned to what the pyelftools-based reader gave before the struct reader
replaced it (sha256 of every file's kernels and entries)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from devkit.helpers import CACHE, ROOT, pypi_download

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCHEMA = json.loads((ROOT / "sm121_build/data/schemas/audit.schema.json").read_text())

# file: (verdict, native kernels, kernels, rebuild without source, rebuild with the sdist)
VERDICTS: dict[str, dict[str, tuple[str, int, int, str, str]]] = {
    "0.33.0": {
        "_C_stable_libtorch.abi3.so": ("partial", 4149, 4669, "partly native", "fixable"),
        "_deepselect_C.abi3.so": ("none", 0, 79, "other GPUs only",
                                  "no sm_12x implementation"),
        "_flashkda_C.abi3.so": ("native", 132, 132, "native", "native"),
        "_flashmla_C.abi3.so": ("none", 0, 111, "other GPUs only", "no sm_12x implementation"),
        "_flashmla_extension_C.abi3.so": ("none", 0, 8, "other GPUs only",
                                          "no sm_12x implementation"),
        "_moe_C_stable_libtorch.abi3.so": ("jit", 2455, 2456, "partly native", "optional"),
        "_qutlass_C.abi3.so": ("none", 0, 26, "other GPUs only", "fixable"),
        "vllm_flash_attn/_vllm_fa2_C.abi3.so": ("jit", 0, 2224, "fixable", "fixable"),
        "vllm_flash_attn/_vllm_fa3_C.abi3.so": ("none", 0, 1333, "other GPUs only", "no rule"),
    },
    "0.28.0": {
        "_C_stable_libtorch.abi3.so": ("partial", 2768, 3315, "partly native", "fixable"),
        "_flashkda_C.abi3.so": ("native", 60, 60, "native", "native"),
        "_flashmla_C.abi3.so": ("none", 0, 45, "other GPUs only", "no sm_12x implementation"),
        "_flashmla_extension_C.abi3.so": ("none", 0, 8, "other GPUs only",
                                          "no sm_12x implementation"),
        "_moe_C_stable_libtorch.abi3.so": ("jit", 2599, 2605, "partly native", "optional"),
        "_qutlass_C.abi3.so": ("none", 0, 26, "other GPUs only", "fixable"),
        "vllm_flash_attn/_vllm_fa2_C.abi3.so": ("jit", 0, 2224, "fixable", "fixable"),
        "vllm_flash_attn/_vllm_fa3_C.abi3.so": ("none", 0, 1213, "other GPUs only", "no rule"),
    },
}
# sha256 of {name: {"kernels", "entries"}} (sorted keys), measured with the pyelftools
# reader at commit 56f2ea8 and unchanged by the struct reader
KERNEL_DIGESTS = {
    "0.33.0": ("7eb07f87ba72b0b1288d24b272d49b8b55dcc99d035c3a34e957f6e13e39d374", 11038),
    "0.28.0": ("d9faa03a09689a0a040b068f1043902450801d6e3a50d5752bd2e4809763bf33", 9496),
}


def _audit(*args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "sm121_build", "audit", "--json", *args],
                          capture_output=True, text=True, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    data: dict[str, Any] = json.loads(done.stdout)
    jsonschema.validate(data, SCHEMA)
    return data


def _sdist_tree(version: str, dest: Path) -> Path:
    sdist = pypi_download(f"vllm=={version}", CACHE / "sdists", sdist=True)
    prefix = f"vllm-{version}/"
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data", members=[
            m for m in tar.getmembers()
            if m.name in (prefix + "CMakeLists.txt", prefix + "PKG-INFO",
                          prefix + "vllm/_version.py") or m.name.startswith(prefix + "cmake/")])
    return dest / prefix.rstrip("/")


@pytest.mark.parametrize("version", sorted(VERDICTS))
def test_every_verdict_on_the_real_wheel_with_and_without_its_source(
        version: str, tmp_path: Path) -> None:
    wheel = pypi_download(f"vllm=={version}", CACHE / "wheels",
                          platform="manylinux_2_28_aarch64")
    alone = _audit(str(wheel))
    with_source = _audit(str(wheel), "--source", str(_sdist_tree(version, tmp_path)))
    assert with_source["source"]["version"] == version
    assert with_source["source"]["arch"] == "12.1"
    found = {}
    for plain, sourced in zip(alone["binaries"], with_source["binaries"], strict=True):
        assert plain["name"] == sourced["name"] and plain["kernels"] == sourced["kernels"]
        if plain["rebuild"] is None:
            assert plain["verdict"] is None  # no device code
            continue
        name = plain["name"].removeprefix("vllm/")
        found[name] = (plain["verdict"], plain["kernel_counts"]["native"],
                       len(plain["kernels"]), plain["rebuild"]["verdict"],
                       sourced["rebuild"]["verdict"])
        if sourced["rebuild"]["verdict"] == "no sm_12x implementation":
            assert "no guard of the source gives" in sourced["rebuild"]["reason"]
        if plain["rebuild"]["verdict"] == "other GPUs only":  # says what it sees, no more
            assert "the binary cannot tell" in plain["rebuild"]["reason"]
            assert "no sm_12x implementation" not in plain["rebuild"]["reason"]
    assert found == VERDICTS[version]
    qutlass = next(b for b in with_source["binaries"] if b["name"].endswith("_qutlass_C.abi3.so"))
    assert qutlass["rebuild"]["reason"].startswith(
        "QUTLASS_SM120_ARCHS (cmake/external_projects/qutlass.cmake:")
    assert "gives 12.0f" in qutlass["rebuild"]["reason"]
    assert [p["name"] for p in alone["packages"]] == ["vllm"]
    digest, total = KERNEL_DIGESTS[version]
    # every entry of vLLM's files lies in .nv_fatbin; the digest predates the field
    assert {e.pop("section") for b in alone["binaries"] for e in b["entries"]} <= {".nv_fatbin"}
    pinned = {b["name"]: {"kernels": b["kernels"], "entries": b["entries"]}
              for b in alone["binaries"]}
    assert sum(len(b["kernels"]) for b in alone["binaries"]) == total
    assert hashlib.sha256(json.dumps(pinned, sort_keys=True).encode()).hexdigest() == digest


def test_a_source_of_another_version_is_refused_before_any_work(tmp_path: Path) -> None:
    wheel = pypi_download("vllm==0.33.0", CACHE / "wheels", platform="manylinux_2_28_aarch64")
    source = _sdist_tree("0.28.0", tmp_path)
    done = subprocess.run([sys.executable, "-m", "sm121_build", "audit", str(wheel),
                           "--source", str(source)], capture_output=True, text=True,
                          check=False, cwd=ROOT)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"error: --source {source} is vLLM 0.28.0, {wheel.name} is 0.33.0: the verdicts need "
        "the source the files were built from"]
