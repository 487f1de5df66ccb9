"""The in-container build script, run outside Docker on the vLLM-shaped fixture with real nvcc."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from devkit.helpers import DATA, cuda_home
from sm121_build.cuda.binary import Policy, audit_binary
from sm121_build.cuda.compat import ArchList, parse_target
from sm121_build.source.guard_rules import PatchFor, apply_all

pytestmark = pytest.mark.slow


def _build(source: Path, out: Path, arch: str) -> subprocess.CompletedProcess[str]:
    home = cuda_home()
    bindir = Path(sys.executable).parent
    env = {**os.environ, "TORCH_CUDA_ARCH_LIST": arch, "CUDA_HOME": str(home),
           "CMAKE_CUDA_COMPILER": str(home / "bin" / "nvcc"),
           "PATH": f"{home / 'bin'}:{bindir}:{os.environ['PATH']}", "MAX_JOBS": "2"}
    return subprocess.run(
        [sys.executable, "-m", "sm121_build.jobs.payload.build_extensions", "--source", str(source),
         "--out", str(out), "--target", "_C", "--target", "_moe_C",
         "--stand-in", "VLLM_FLASH_ATTN_SRC_DIR",  # not built here: nothing fetched
         "--cmake", str(bindir / "cmake") if (bindir / "cmake").exists() else "cmake"],
        capture_output=True, text=True, env=env, check=False)


@pytest.fixture()
def source(tmp_path: Path) -> Path:
    return Path(shutil.copytree(DATA / "vllm_like", tmp_path / "src"))


def _kernels(path: Path) -> dict[str, str]:
    report = audit_binary(path, path.name, Policy(parse_target("sm_121"), (13, 0)), True)
    return dict(report.kernels or {})


def test_unpatched_build_fails_with_ptxas_message(source: Path, tmp_path: Path) -> None:
    result = _build(source, tmp_path / "out", "12.1")
    assert result.returncode == 1
    assert "Instruction 'cvt with .e2m1x2' not supported on .target 'sm_121'" in result.stdout
    assert ("sm121-build: build failed: ptxas rejected an FP4 instruction for the plain target "
            "sm_121") in result.stderr
    assert not list((tmp_path / "out").glob("*.so"))


def test_patched_build_has_sm121_cubins(source: Path, tmp_path: Path) -> None:
    (result,) = apply_all(source, PatchFor("0.19.1", ArchList.parse("12.1")))
    # CUDA 13 takes the first FP4 branch; QUTLASS's guard is the other rewrite
    assert (result.outcome, result.replacements) == ("applied", 2)
    assert [r.new_list for r in result.rewrites] == ["12.1a", "10.0f;12.1a"]
    built = _build(source, tmp_path / "out", "12.1")
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr
    c = _kernels(tmp_path / "out" / "_C.abi3.so")
    assert c == {"_ZN4vllm15rms_norm_kernelEPfPKfi": "native",
                 "_ZN4vllm19silu_and_mul_kernelEPfPKfS2_i": "native",
                 "_Z8fp4_packPtPKfi": "native"}  # FP4 kept, as sm_121a
    moe = _kernels(tmp_path / "out" / "_moe_C.abi3.so")
    assert moe == {"_ZN4vllm3moe19topk_softmax_kernelEPfPKfi": "native"}


def test_arch_121a_keeps_fp4_without_patch(source: Path, tmp_path: Path) -> None:
    (result,) = apply_all(source, PatchFor("0.19.1", ArchList.parse("12.1a")))
    assert result.outcome == "not needed"
    built = _build(source, tmp_path / "out", "12.1a")
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr
    c = _kernels(tmp_path / "out" / "_C.abi3.so")
    assert c["_Z8fp4_packPtPKfi"] == "native"
    assert len(c) == 3


def test_cli_local_patches_a_copy_and_builds(source: Path, tmp_path: Path) -> None:
    """`sm121-build local`: the same script, driven by the CLI, no Docker."""
    home = cuda_home()
    env = {**os.environ, "CUDA_HOME": str(home), "MAX_JOBS": "2",
           "PATH": f"{home / 'bin'}:{Path(sys.executable).parent}:{os.environ['PATH']}"}
    before = (source / "CMakeLists.txt").read_text()
    result = subprocess.run(
        [sys.executable, "-m", "sm121_build", "local", "--source", str(source),
         "--out", str(tmp_path / "out")], capture_output=True, text=True, env=env, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    assert "fp4-sm12x-arch-specific: applied" in result.stderr
    assert (source / "CMakeLists.txt").read_text() == before  # the checkout is untouched
    assert sorted(line.rsplit("/", 1)[1] for line in result.stdout.splitlines()
                  if line.startswith("built ")) == ["_C.abi3.so", "_moe_C.abi3.so"]
    assert set(_kernels(tmp_path / "out" / "_C.abi3.so").values()) == {"native"}
    missing = subprocess.run(
        [sys.executable, "-m", "sm121_build", "local", "--source", str(source)],
        capture_output=True, text=True, env=env, check=False)
    assert missing.returncode == 2
    assert "Missing option '--out'" in missing.stderr


def test_cli_local_builds_flash_attention_from_the_pinned_commit(tmp_path: Path) -> None:
    """--ext _vllm_fa2_C: flash-attention fetched at the commit the checkout pins (a local
    repository stands in for GitHub), its guard given a native target, built next to _C."""
    from devkit.stockimage import fixture_checkout

    checkout, _ = fixture_checkout(tmp_path / "vllm")
    home = cuda_home()
    env = {**os.environ, "CUDA_HOME": str(home), "MAX_JOBS": "2",
           "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "PATH": f"{home / 'bin'}:{Path(sys.executable).parent}:{os.environ['PATH']}"}
    result = subprocess.run(
        [sys.executable, "-m", "sm121_build", "local", "--source", str(checkout),
         "--out", str(tmp_path / "out"), "--ext", "_vllm_fa2_C"],
        capture_output=True, text=True, env=env, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    assert "sass-from-ptx (vllm-flash-attn, CUDA_ARCHS 12.1): applied (set_gencode_flags_for_srcs" \
        " in cmake/utils.cmake:81 gives PTX-only sources sm_121 SASS from the same PTX)" \
        in result.stderr
    fa2 = tmp_path / "out" / "_vllm_fa2_C.abi3.so"
    assert set(_kernels(fa2).values()) == {"native"}
    fa3 = subprocess.run(
        [sys.executable, "-m", "sm121_build", "local", "--source", str(checkout),
         "--out", str(tmp_path / "out3"), "--ext", "_vllm_fa3_C"],
        capture_output=True, text=True, env=env, check=False)
    assert fa3.returncode == 2
    assert "_vllm_fa3_C (vllm-flash-attn) has no sm_12x implementation" in fa3.stderr
