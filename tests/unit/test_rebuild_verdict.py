"""The audit's rebuild verdict per .so, on real ELF files built by nvcc for the shapes real
wheels have: FA2 (sm_80 cubins + PTX), FA3/FlashMLA (sm_90a / sm_100f only), _C partly
native, a native build, and an unknown extension."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from devkit.helpers import DATA, compile_cached, gencode
from sm121_build.cuda.binary import DEFAULT_POLICY, BinaryReport, audit_binary
from sm121_build.cuda.compat import DEFAULT_TARGET
from sm121_build.rebuild.decide import rebuild_verdict

KERNELS = DATA / "kernels.cu"


@pytest.mark.parametrize("name, pairs, verdict, says", [
    ("vllm_flash_attn/_vllm_fa2_C.abi3.so", ("compute_80:sm_80", "compute_80:compute_80"),
     "fixable", "rule sass-from-ptx builds _vllm_fa2_C natively (sm121-build --base IMAGE)"),
    ("vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so", ("compute_90a:sm_90a",),
     "other GPUs only", "its code is only for sm_90a (arch/family-specific instructions of "
     "other GPUs); whether its source can build sm_12x code the binary cannot tell: "
     "`audit --source DIR` or sm121-build --base IMAGE decides with the source's guards"),
    ("vllm/_flashmla_C.abi3.so", ("compute_90a:sm_90a", "compute_100f:sm_100f"),
     "other GPUs only", "its code is only for sm_100f, sm_90a (arch/family-specific "
     "instructions of other GPUs); whether its source can build sm_12x code the binary "
     "cannot tell: `audit --source DIR` or sm121-build --base IMAGE decides with the "
     "source's guards"),
    # outside vLLM (FlashInfer's AOT modules): --source, a vLLM tree, would not decide it
    ("flashinfer_jit_cache/jit_cache/fmha_sm100.so", ("compute_100f:sm_100f",),
     "other GPUs only", "its code is only for sm_100f (arch/family-specific instructions of "
     "other GPUs); whether its source can build sm_12x code the binary cannot tell"),
    ("_C.abi3.so", ("compute_90:sm_90",), "fixable",
     "the main job rebuilds _C (sm121-build --base IMAGE)"),
    ("_custom_C.abi3.so", ("compute_80:sm_80", "compute_80:compute_80"), "no rule",
     "no rule here rebuilds _custom_C"),
    # arch-specific code of another GPU beside portable code: a rebuild might help
    ("_custom_C.abi3.so", ("compute_90a:sm_90a", "compute_80:sm_80"), "no rule",
     "no rule here rebuilds _custom_C"),
    # arch-specific code of the GPU's own major (sm_120a does not load on sm_121)
    ("_custom_C.abi3.so", ("compute_120a:sm_120a",), "no rule",
     "no rule here rebuilds _custom_C"),
    # the GPU's own `a` PTX JIT-compiles; it is not another GPU's code
    ("_custom_C.abi3.so", ("compute_121a:compute_121a",), "no rule",
     "no rule here rebuilds _custom_C"),
    # a default extension's name decides by its file name, wherever it lies
    ("lib/sub/_C.abi3.so", ("compute_90:sm_90",), "fixable",
     "the main job rebuilds _C (sm121-build --base IMAGE)"),
    ("vllm_flash_attn/_vllm_fa2_C.abi3.so", ("compute_120:sm_120",), "native", ""),
])
@pytest.mark.parametrize("kernels", [True, False])
def test_rebuild_verdicts(tmp_path: Path, name: str, pairs: tuple[str, ...], verdict: str,
                          says: str, kernels: bool) -> None:
    built = compile_cached(f"fixable-{'-'.join(p.split(':')[1] for p in pairs)}", KERNELS,
                           gencode(*pairs))
    path = tmp_path / name.rsplit("/", 1)[-1]
    shutil.copy(built, path)
    report = audit_binary(path, name, DEFAULT_POLICY, with_kernels=kernels)
    found = rebuild_verdict(report, DEFAULT_TARGET)
    assert found is not None and found.verdict == verdict
    if verdict == "native":
        assert found.reason == "every kernel is native on sm_121"
        return
    # nothing here is native: every kernel (or every fatbin, without kernel names) lacks
    total, what = (len(report.kernels), "kernels") if report.kernels is not None else (
        len({e.container for e in report.entries}), "fatbins")
    assert found.reason == f"{total} of {total} {what} not native on sm_121; {says}"


def test_partly_native_c_is_left_to_the_main_jobs_decision(tmp_path: Path) -> None:
    a = compile_cached("tu_a", DATA / "two_tus" / "a.cu", gencode("compute_121:sm_121"),
                       shared=False)
    b = compile_cached("tu_b", DATA / "two_tus" / "b.cu", gencode("compute_90:sm_90"),
                       shared=False)
    import subprocess

    from devkit.helpers import nvcc

    so = tmp_path / "_C.abi3.so"
    subprocess.run([nvcc(), "-shared", "-o", str(so), str(a), str(b)], check=True)
    report = audit_binary(so, "_C.abi3.so", DEFAULT_POLICY, with_kernels=True)
    found = rebuild_verdict(report, DEFAULT_TARGET)
    assert found is not None and found.verdict == "partly native"
    lacking = sum(1 for v in (report.kernels or {}).values() if v != "native")
    assert 0 < lacking < len(report.kernels or {})
    assert found.reason == (
        f"{lacking} of {len(report.kernels or {})} kernels not native on sm_121; whether a "
        "rebuild gains anything the binary cannot tell: `audit --source DIR` or sm121-build "
        "--base IMAGE decides with the source's guards")


def test_no_device_code_has_no_verdict(tmp_path: Path) -> None:
    report = BinaryReport("x.so", 1, [], [], {"native": 0, "jit": 0, "none": 0}, {})
    assert rebuild_verdict(report, DEFAULT_TARGET) is None
