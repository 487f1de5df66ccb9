"""What one audit of a real nvcc-built .so counts: per arch, per translation unit, per
kernel; and the one entry field (the `a` variant) that turns PTX from JIT into nothing."""

from __future__ import annotations

from pathlib import Path

from devkit.helpers import DATA, compile_cached, gencode
from sm121_build.cuda.binary import DEFAULT_POLICY, audit_binary
from sm121_build.cuda.fatbin import HostBinary, cuobjdump_listing


def test_counts_of_a_fatbin_with_every_kind_of_entry(matrix: dict[str, Path]) -> None:
    path = matrix["plain"]
    report = audit_binary(path, "plain.so", DEFAULT_POLICY, with_kernels=True)
    with HostBinary.open(path) as binary:
        entries = binary.entries
    assert report.size == path.stat().st_size and report.entries == entries
    assert report.cuobjdump == cuobjdump_listing(path, entries)
    # arches in numeric order (sm_100a after sm_90a), plain before its `a` form
    assert list(report.arch_counts("elf")) == ["sm_80", "sm_90a", "sm_100a", "sm_120",
                                               "sm_120a", "sm_121", "sm_121a"]
    assert report.arch_counts("ptx") == {"sm_90": 1, "sm_120": 1}
    # two translation units (one without kernels), each with an sm_121 cubin
    assert report.containers == {"native": 2, "jit": 0, "none": 0}
    # the last entry of the kernels' unit is compute_90 PTX: the best entry counts, not the last
    assert entries[-1].kind == "ptx" and report.kernels is not None
    assert report.kernel_counts() == {"native": 4, "jit": 0, "none": 0}
    assert report.verdict == "native"


def test_counts_when_nothing_or_only_ptx_loads(matrix: dict[str, Path]) -> None:
    sm90 = audit_binary(matrix["sm90"], "sm90.so", DEFAULT_POLICY, with_kernels=True)
    assert sm90.containers == {"native": 0, "jit": 0, "none": 2}
    assert sm90.kernel_counts() == {"native": 0, "jit": 0, "none": 4}
    ptx = audit_binary(matrix["ptx_only"], "ptx.so", DEFAULT_POLICY, with_kernels=True)
    assert ptx.kernel_counts() == {"native": 0, "jit": 4, "none": 0} and ptx.verdict == "jit"


def test_arch_specific_ptx_of_another_gpu_does_not_jit(tmp_path: Path) -> None:
    a = compile_cached("ptx-90a", DATA / "kernels.cu", gencode("compute_90a:compute_90a"))
    plain = compile_cached("ptx-90", DATA / "kernels.cu", gencode("compute_90:compute_90"))
    assert audit_binary(a, "a.so", DEFAULT_POLICY, with_kernels=True).kernel_counts()["none"] == 4
    counts = audit_binary(plain, "p.so", DEFAULT_POLICY, with_kernels=True).kernel_counts()
    assert counts["jit"] == 4


def test_an_arch_of_any_text_sorts_without_an_error() -> None:
    """The audit's summary fuzzer: `sm_90³` (a digit to str.isdigit) and 5,000 digits (past
    int()'s 4,300) raised ValueError in the sort key."""
    from sm121_build.cuda.binary import _arch_key

    assert _arch_key("sm_90³")[0] == 90
    assert _arch_key("sm_" + "9" * 5000)[0] == 999_999_999
    assert _arch_key("sm_")[0] == 0
