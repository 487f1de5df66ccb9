"""Device code that is a file of its own: raw cubins (FlashInfer's cubin packages ship
thousands), fatbins and PTX text, audited alone, in a folder and in a wheel, against the real
cuobjdump (`-lelf -lptx`, `-symbols`) on real nvcc 13 output."""

from __future__ import annotations

import json
import re
import shutil
import zipfile
from pathlib import Path

import pytest

from devkit.helpers import DATA, cli, compile_device_file, gencode, run_cuobjdump
from sm121_build.verify.audit import audit_binary
from sm121_build.verify.checks import SM121
from sm121_build.verify.fatbin import HostBinary, cuobjdump_listing

CUBINS = ["sm_80", "sm_90", "sm_90a", "sm_100f", "sm_120", "sm_120f", "sm_121", "sm_121a"]
NATIVE_ON_SM121 = {"sm_120", "sm_120f", "sm_121", "sm_121a"}


def _cubin(arch: str) -> Path:
    return compile_device_file(f"k_{arch}", DATA / "kernels.cu", "cubin", [f"-arch={arch}"])


def _symbols(path: Path) -> list[str]:
    out = run_cuobjdump("-symbols", str(path)).stdout
    return sorted(re.findall(r"^FUNC\s+\S+\s+\S+\s+ENTRY\s+(\S+)$", out, re.M))


@pytest.mark.parametrize("arch", CUBINS)
def test_a_raw_cubin_equals_cuobjdump(arch: str) -> None:
    path = _cubin(arch)
    oracle = run_cuobjdump("-lelf", str(path))
    assert oracle.returncode == 0, oracle.stderr
    with HostBinary.open(path) as binary:
        assert binary.raw == "cubin" and [e.sm for e in binary.entries] == [arch]
        assert cuobjdump_listing(path, binary.entries, binary.raw) == oracle.stdout.splitlines()
        assert sorted(binary.kernels(binary.entries[0])) == _symbols(path)
    report = audit_binary(path, path.name, SM121, with_kernels=True)
    verdict = "native" if arch in NATIVE_ON_SM121 else "none"
    assert report.kernels and set(report.kernels.values()) == {verdict}


def test_a_raw_fatbin_equals_cuobjdump() -> None:
    path = compile_device_file("k", DATA / "kernels.cu", "fatbin", [
        *gencode("compute_90:sm_90", "compute_100f:sm_100f", "compute_120f:compute_120f")])
    oracle = run_cuobjdump("-lelf", "-lptx", str(path))
    assert oracle.returncode == 0, oracle.stderr
    with HostBinary.open(path) as binary:
        assert binary.raw == "fatbin"
        assert cuobjdump_listing(path, binary.entries, binary.raw) == oracle.stdout.splitlines()
    report = audit_binary(path, path.name, SM121, with_kernels=True)
    assert report.kernels and set(report.kernels.values()) == {"jit"}  # compute_120f PTX


@pytest.mark.parametrize(("target", "driver", "verdict"), [
    ("compute_120", "13.0", "jit"), ("compute_120a", "13.0", "none"),
    ("compute_121a", "13.0", "jit"), ("compute_90", "12.8", "none")])
def test_ptx_text_is_judged_by_its_target_and_version(target: str, driver: str,
                                                      verdict: str) -> None:
    """PTX 9.0 (nvcc 13.0): a 12.8 driver cannot JIT it; `a` PTX only for its own GPU."""
    path = compile_device_file(f"k_{target}", DATA / "kernels.cu", "ptx", [f"-arch={target}"])
    assert run_cuobjdump("-lptx", str(path)).stdout == ""  # cuobjdump lists no raw PTX
    result = cli("audit", "--json", "--driver", driver, str(path))
    assert result.returncode == 0, result.stderr
    (binary,) = json.loads(result.stdout)["binaries"]
    assert set(binary["kernels"].values()) == {verdict} and len(binary["kernels"]) == 4
    assert list(binary["ptx"]) == [target.replace("compute_", "sm_")]


def test_a_wheel_of_raw_cubins_says_how_many_load(tmp_path: Path) -> None:
    """The shape of PyPI's flashinfer-cubin: raw cubins for other GPUs only."""
    wheel = tmp_path / "cubins-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for i, arch in enumerate(["sm_90a", "sm_100f", "sm_100f", "sm_120f"]):
            archive.write(_cubin(arch), f"pkg/cubins/kernel_{i}_{arch}.cubin")
        archive.writestr("pkg/cubins/readme.txt", "not device code")
    result = cli("audit", "--json", str(wheel))
    assert result.returncode == 0, result.stderr
    verdicts = {b["name"]: b["verdict"] for b in json.loads(result.stdout)["binaries"]}
    assert verdicts == {"pkg/cubins/kernel_0_sm_90a.cubin": "none",
                        "pkg/cubins/kernel_1_sm_100f.cubin": "none",
                        "pkg/cubins/kernel_2_sm_100f.cubin": "none",
                        "pkg/cubins/kernel_3_sm_120f.cubin": "native"}
    assert cli("audit", "--require", "native", str(wheel)).returncode == 1


def test_a_folder_mixing_libraries_and_device_files(tmp_path: Path,
                                                    matrix: dict[str, Path]) -> None:
    shutil.copy(matrix["sm121"], tmp_path / "_C.so")
    shutil.copy(_cubin("sm_100f"), tmp_path / "gemm.cubin")
    ptx = compile_device_file("k_compute_120", DATA / "kernels.cu", "ptx",
                              ["-arch=compute_120"])
    shutil.copy(ptx, tmp_path / "attn.ptx")
    (tmp_path / "notes.ptx").write_text("not PTX at all\n")
    result = cli("audit", "--json", str(tmp_path))
    assert result.returncode == 0, result.stderr
    verdicts = {b["name"]: b["verdict"] for b in json.loads(result.stdout)["binaries"]}
    assert verdicts == {"_C.so": "native", "attn.ptx": "jit", "gemm.cubin": "none"}
