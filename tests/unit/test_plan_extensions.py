"""The per-extension decision (decide.judge_extensions) on real nvcc output and a vLLM-shaped
CMake tree evaluated with real cmake -P: what is built, why, and what stays non-native."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from devkit.helpers import DATA, compile_cached, gencode
from devkit.helpers import vllm_like_tree as _tree
from sm121_build.cuda.binary import DEFAULT_POLICY, BinaryReport, audit_binary
from sm121_build.cuda.compat import DEFAULT_TARGET, ArchList
from sm121_build.rebuild.decide import MIN_JIT_SHARE, Inputs, judge_extensions
from sm121_build.source.external import source_targets
from sm121_build.source.guard_targets import guard_owners
from sm121_build.source.guards import find_calls

KERNELS = DATA / "kernels.cu"
CMAKELISTS = """
cuda_archs_loose_intersection(REPACK_ARCHS "7.5;8.0+PTX" "${CUDA_ARCHS}")
define_extension_target(_C SOURCES a.cu)
if(${CMAKE_CUDA_COMPILER_VERSION} VERSION_GREATER_EQUAL 13.0)
  set(MOE_LIST "12.0f")
else()
  set(MOE_LIST "12.0a")
endif()
cuda_archs_loose_intersection(MOE_ARCHS "${MOE_LIST}" "${CUDA_ARCHS}")
define_extension_target(_moe_C SOURCES b.cu)
"""
QUTLASS = """
set(Q_LIST)
if(${CMAKE_CUDA_COMPILER_VERSION} VERSION_GREATER_EQUAL 13.0)
  list(APPEND Q_LIST "12.0f")
endif()
cuda_archs_loose_intersection(Q_ARCHS "${Q_LIST}" "${CUDA_ARCHS}")
define_extension_target(_q_C SOURCES q.cu)
"""
UNREADABLE = """
cuda_archs_loose_intersection(U_ARCHS "${NOT_SET_HERE}" "${CUDA_ARCHS}")
define_extension_target(_u_C SOURCES u.cu)
"""


def _report(tmp_path: Path, name: str, *pairs: str) -> BinaryReport:
    built = compile_cached(f"plan-{'-'.join(p.split(':')[1] for p in pairs)}", KERNELS,
                           gencode(*pairs))
    path = tmp_path / name.replace("/", "_")
    shutil.copy(built, path)
    return audit_binary(path, name, DEFAULT_POLICY, with_kernels=True)


def _inputs(source: Path, cuda: str = "13.0") -> Inputs:
    return Inputs(source, ArchList.parse("12.1"), cuda, DEFAULT_TARGET,
                  frozenset(source_targets(source)),
                  frozenset({"vllm", "vllm-flash-attn"}), frozenset({"_vllm_fa2_C"}))


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    source = _tree(tmp_path, CMAKELISTS)
    (source / "cmake" / "external_projects").mkdir()
    (source / "cmake" / "external_projects" / "q.cmake").write_text(QUTLASS)
    (source / "cmake" / "external_projects" / "u.cmake").write_text(UNREADABLE)
    return source


def test_guards_feed_the_target_defined_after_them_or_their_project_file(tree: Path) -> None:
    owners = guard_owners(tree, find_calls(tree))
    assert owners == {"CMakeLists.txt:2": ("_C",), "CMakeLists.txt:9": ("_moe_C",),
                      "cmake/external_projects/q.cmake:6": ("_q_C",),
                      "cmake/external_projects/u.cmake:2": ("_u_C",)}


def test_each_extension_is_planned_on_its_own_evidence(tmp_path: Path, tree: Path) -> None:
    stock = {
        # PTX only for sm_12x (sm_80 cubins + compute_80): the same-PTX rule makes it native
        "_C.abi3.so": _report(tmp_path, "_C.abi3.so", "compute_80:sm_80",
                              "compute_80:compute_80"),
        # already native (sm_120f loads on sm_121)
        "_moe_C.abi3.so": _report(tmp_path, "_moe_C.abi3.so", "compute_120f:sm_120f"),
        # sm_100f only, but its guard gives 12.0f: the binary alone would say "other GPUs"
        "_q_C.abi3.so": _report(tmp_path, "_q_C.abi3.so", "compute_100f:sm_100f"),
        # sm_90a only and its guard cannot be read: rebuilt to be safe, this one only
        "_u_C.abi3.so": _report(tmp_path, "_u_C.abi3.so", "compute_90a:sm_90a"),
        # flash-attention 3: sm_90a only, no rule builds it
        "vllm_flash_attn/_vllm_fa3_C.abi3.so": _report(
            tmp_path, "vllm_flash_attn/_vllm_fa3_C.abi3.so", "compute_90a:sm_90a"),
        "missing.abi3.so": None,
    }
    (tree / "CMakeLists.txt").write_text(CMAKELISTS + "define_extension_target(_vllm_fa3_C)\n")
    plans = {p.target: p for p in judge_extensions(stock, _inputs(tree),
                                                   {"_vllm_fa3_C": "vllm-flash-attn"})}
    assert {t: p.build for t, p in plans.items()} == {
        "_C": True, "_moe_C": False, "_q_C": True, "_u_C": True, "_vllm_fa3_C": False}
    c = plans["_C"]
    # a stock build without sm_12x: vLLM's own arch list gives the GPU native code too
    assert c.reason == "4 JIT-only kernel(s) get sm_12x SASS from the same PTX (rule " \
        "sass-from-ptx); the main arch list (CUDA_ARCHS) gives 12.1, which the stock file " \
        "has no cubins for"
    assert (c.before, c.after) == ({"native": 0, "jit": 4, "none": 0},
                                   {"native": 4, "jit": 0, "none": 0})
    assert plans["_moe_C"].reason == "every kernel is already native on sm_121"
    assert plans["_q_C"].reason == ("Q_ARCHS (cmake/external_projects/q.cmake:6) gives 12.1, "
                                    "which the stock file has no cubins for")
    assert plans["_q_C"].after == {"native": 4, "jit": 0, "none": 0}
    assert plans["_u_C"].reason.startswith("the guard U_ARCHS (cmake/external_projects/"
                                           "u.cmake:2) cannot be read")
    fa3 = plans["_vllm_fa3_C"]
    assert fa3.reason == "no rule here builds _vllm_fa3_C (vllm-flash-attn) for sm_121"
    assert fa3.remains == ("4 kernel(s) have no code sm_121 loads: only sm_90a "
                           "(arch/family-specific instructions of other GPUs: no sm_12x "
                           "implementation)",)
    lines = [p.line() for p in plans.values()]
    assert "_C.abi3.so: build (native 0→4, JIT 4→0, none 0→0 of 4): 4 JIT-only" in lines[0]


def test_under_cuda_12_9_the_family_guard_is_not_taken(tmp_path: Path, tree: Path) -> None:
    stock = {"_q_C.abi3.so": _report(tmp_path, "_q_C.abi3.so", "compute_100f:sm_100f")}
    (plan,) = judge_extensions(stock, _inputs(tree, "12.9"), {})
    assert not plan.build
    assert plan.reason == "no guard of the pinned source gives it code that loads on sm_121"
    assert plan.remains == ("4 kernel(s) have no code sm_121 loads: only sm_100f "
                            "(arch/family-specific instructions of other GPUs: no sm_12x "
                            "implementation)",)


def test_a_few_jit_kernels_are_offered_not_built(tmp_path: Path, tree: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from sm121_build.rebuild import decide

    (tree / "cmake" / "external_projects" / "j.cmake").write_text(
        "define_extension_target(_j_C SOURCES j.cu)\n")  # no guard: only the JIT gain
    stock = {"_j_C.abi3.so": _report(tmp_path, "_j_C.abi3.so", "compute_80:sm_80",
                                     "compute_80:compute_80")}
    (plan,) = judge_extensions(stock, _inputs(tree), {})
    assert plan.build
    monkeypatch.setattr(decide, "MIN_JIT_SHARE", 2.0)  # 4 of 4 is under 200 %
    (plan,) = judge_extensions(stock, _inputs(tree), {})
    assert not plan.build and plan.before == plan.after
    assert plan.reason.startswith("only 4 of 4 kernels are JIT-only (")
    assert plan.reason.endswith("under 200%: not worth a full compile by default; --ext _j_C "
                                "builds it")
    assert MIN_JIT_SHARE == 0.01
