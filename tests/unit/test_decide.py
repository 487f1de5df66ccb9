"""The no-rebuild decision: shown with the source's own CMake (real `cmake -P` on the
fixture's utils.cmake), against stock reports whose cubins say which 12.x archs were built.

Reports are made from fatbin entries directly (the audit of real files is tested elsewhere);
the guards are evaluated for real.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from devkit.helpers import DATA
from sm121_build.cuda.binary import BinaryReport
from sm121_build.cuda.compat import loads_natively, parse_target
from sm121_build.cuda.fatbin import Entry
from sm121_build.rebuild.decide import decide, stock_family_archs
from sm121_build.source.guards import evaluate

GPU = parse_target("sm_121")


def _report(name: str, cubins: list[str], native: int, total: int) -> BinaryReport:
    entries = []
    for index, sm in enumerate(cubins):
        digits = "".join(c for c in sm if c.isdigit())
        variant = sm[-1] if sm[-1] in "af" else ""
        entries.append(Entry(0, index, "elf", int(digits), variant, 0, (8, 8), 0, 1, 1, None))
    kernels = {f"k{i}": "native" if i < native else "jit" for i in range(total)}
    return BinaryReport(name, 1, entries, [], {"native": 0, "jit": 0, "none": 0},
                        kernels)  # type: ignore[arg-type]


@pytest.fixture
def source(tmp_path: Path) -> Path:
    return Path(shutil.copytree(DATA / "vllm_like", tmp_path / "src"))


def test_loading_of_cmake_targets() -> None:
    assert loads_natively("12.0", GPU) and loads_natively("12.0f", GPU)
    assert loads_natively("12.1a", GPU) and not loads_natively("12.0a", GPU)
    assert not loads_natively("9.0", GPU) and not loads_natively("8.0+PTX", GPU)


def test_stock_built_for_the_same_targets_needs_no_rebuild(source: Path) -> None:
    stock = {"_C.abi3.so": _report("_C.abi3.so", ["sm_90", "sm_121"], 5, 5),
             "_moe_C.abi3.so": _report("_moe_C.abi3.so", ["sm_121"], 3, 4)}
    decision = decide(stock, source, "12.1", "13.0", GPU)
    assert not decision.rebuild, decision.reason
    assert decision.stock_archs == ("12.1",)
    assert "12.1" in decision.build_targets
    assert decision.lines() == ["_C.abi3.so: 5/5 kernels already native on sm_121",
                                "_moe_C.abi3.so: 3/4 kernels already native on sm_121"]


@pytest.mark.parametrize(("stock_cubins", "arch", "why"), [
    (["sm_90"], "12.1", "carry no sm_12x cubins"),
    (["sm_120"], "12.1", "CUDA_ARCHS would give 12.1, which the stock build (12.0) did not"),
    (["sm_121"], "12.1;12.0", "CUDA_ARCHS would give 12.0"),
])
def test_a_build_that_could_add_native_code_goes_ahead(source: Path, stock_cubins: list[str],
                                                       arch: str, why: str) -> None:
    stock = {"_C.abi3.so": _report("_C.abi3.so", stock_cubins, 1, 1),
             "_moe_C.abi3.so": _report("_moe_C.abi3.so", stock_cubins, 1, 1)}
    decision = decide(stock, source, arch, "13.0", GPU)
    assert decision.rebuild
    assert why in decision.reason


def test_missing_extension_or_no_native_kernel_rebuilds(source: Path) -> None:
    good = _report("_C.abi3.so", ["sm_121"], 2, 2)
    assert "has no _moe_C.abi3.so" in decide(
        {"_C.abi3.so": good, "_moe_C.abi3.so": None}, source, "12.1", "13.0",
        GPU).reason
    dead = _report("_moe_C.abi3.so", ["sm_121"], 0, 2)
    assert "_moe_C.abi3.so: no kernel native" in decide(
        {"_C.abi3.so": good, "_moe_C.abi3.so": dead}, source, "12.1", "13.0",
        GPU).reason


def test_a_guard_the_evaluation_cannot_read_means_rebuild(source: Path) -> None:
    cmake = source / "CMakeLists.txt"
    cmake.write_text(cmake.read_text() + '\ncuda_archs_loose_intersection(NEW_FP4_ARCHS '
                     '"12.0f" ${CUDA_ARCHS})\n')  # unquoted third argument
    stock = {n: _report(n, ["sm_121"], 1, 1) for n in ("_C.abi3.so", "_moe_C.abi3.so")}
    decision = decide(stock, source, "12.1", "13.0", GPU)
    assert decision.rebuild
    found = re.search(r"cannot all be evaluated \((\d+) guard calls, (\d+) read\)",
                      decision.reason)
    assert found and int(found.group(1)) == int(found.group(2)) + 1


def test_a_guard_split_over_lines_is_read(source: Path) -> None:
    cmake = source / "CMakeLists.txt"
    cmake.write_text(cmake.read_text() + '\ncuda_archs_loose_intersection(MXFP4_ARCHS\n'
                     '  "12.1a" # family-specific\n  "${CUDA_ARCHS}")\n')
    lines = cmake.read_text().splitlines()
    guards = {g.variable: g for g in evaluate(source, "12.1", "13.0")}
    assert guards["MXFP4_ARCHS"].line == len(lines) - 2
    assert guards["MXFP4_ARCHS"].arch_list == "12.1a"
    stock = {n: _report(n, ["sm_121"], 1, 1) for n in ("_C.abi3.so", "_moe_C.abi3.so")}
    decision = decide(stock, source, "12.1", "13.0", GPU)
    assert not decision.rebuild, decision.reason


def test_family_archs_from_cubins() -> None:
    report = _report("_C.abi3.so", ["sm_80", "sm_120", "sm_120a", "sm_120f", "sm_121a"], 1, 1)
    assert stock_family_archs({"x": report}, GPU) == ("12.0", "12.1")
