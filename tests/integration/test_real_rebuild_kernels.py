"""Verification's kernel checks on a real rebuild: vLLM 0.33.0's `_C_stable_libtorch` built for
12.1 on the lent GPU machine (docs/real-build.md; its per-kernel audit is committed as
docs/real-build/vllm-0.33.0-c-stable/kernels-built.json.xz) against PyPI's aarch64 wheel.

nvcc 13 varies the anonymous-namespace hashes and the source-path hash from build to build,
CUB names its namespace after the arch list, CUTLASS and Machete compile sm_90a kernels as
trap-only stubs for sm_120, and Machete is built only with a 9.0a target: the rebuild must
pass with each of those counted, and fail if any kernel it really loses is hidden."""

from __future__ import annotations

import json
import lzma
import zipfile
from pathlib import Path

import pytest

from devkit.helpers import CACHE, ROOT, pypi_download
from sm121_build.cuda.binary import DEFAULT_POLICY, BinaryReport, audit_binary
from sm121_build.verify.checks import check_still_loadable, compare_kernels

pytestmark = [pytest.mark.vllm]

NAME = "_C_stable_libtorch.abi3.so"
BUILT = ROOT / "docs/real-build/vllm-0.33.0-c-stable/kernels-built.json.xz"


def _built(kernels: dict[str, str] | None = None) -> BinaryReport:
    data = json.loads(lzma.decompress(BUILT.read_bytes()))
    return BinaryReport(NAME, int(data["size"]), [], [], {}, kernels or data["kernels"])


def test_the_real_0_33_0_rebuild_passes_the_kernel_checks(tmp_path: Path) -> None:
    wheel = pypi_download("vllm==0.33.0", CACHE / "wheels",
                          platform="manylinux_2_28_aarch64")
    with zipfile.ZipFile(wheel) as archive:
        stock_path = Path(archive.extract(f"vllm/{NAME}", tmp_path))
    stock = audit_binary(stock_path, NAME, DEFAULT_POLICY, with_kernels=True)
    built = _built()
    comparison = compare_kernels(NAME, stock_path, built)
    assert (comparison.stock_arch, len(comparison.stock_kernels)) == ("sm_120", 4149)
    assert len(comparison.built_native) == 4352
    assert comparison.missing == ()
    assert len(comparison.stubs_left_out) == 72  # Machete's sm_90a GEMMs: trap-only on sm_120
    assert len(comparison.fp4_excluded) == 6  # 4 Machete prepack, 2 MXFP4 grouped GEMM
    assert check_still_loadable(stock, built, comparison.stubs) == []
    assert stock.kernels is not None
    jit_now_native = [k for k, v in stock.kernels.items() if v == "jit"]
    assert len(jit_now_native) == 281
    # a kernel the build really lost is still caught, by name
    kernels = dict(built.kernels or {})
    lost = next(k for k in kernels if "qknorm_rope_cache_kernel" in k)
    del kernels[lost]
    comparison = compare_kernels(NAME, stock_path, _built(kernels))
    assert len(comparison.missing) == 1 and "qknorm_rope_cache_kernel" in comparison.missing[0]
    assert len(check_still_loadable(stock, _built(kernels), comparison.stubs)) == 1
