"""The default run's plan on REAL vLLM 0.33.0: PyPI's aarch64 wheel (the DGX Spark one) as the
stock extensions, its sdist as the pinned source, the shipped rules applied, CUDA 13.0."""

from __future__ import annotations

import shutil
import tarfile
import zipfile
from pathlib import Path

import pytest

from devkit.helpers import CACHE, pypi_download
from sm121_build.core.vllm import projects
from sm121_build.cuda.binary import DEFAULT_POLICY, audit_binary
from sm121_build.cuda.compat import DEFAULT_TARGET, ArchList
from sm121_build.jobs.aot_work.aot_step import aot_actions
from sm121_build.rebuild.decide import aot_does_as_well, decide_inputs, judge_extensions
from sm121_build.source.guard_rules import PatchFor, apply_for_build

ARCHS_121 = ArchList.parse("12.1")  # a Spark's arch list

pytestmark = [pytest.mark.vllm]
VERSION = "0.33.0"


def test_the_default_run_plans_fa2_qutlass_and_c_on_0_33_0(tmp_path: Path) -> None:
    wheel = pypi_download(f"vllm=={VERSION}", CACHE / "wheels",
                          platform="manylinux_2_28_aarch64")
    sdist = pypi_download(f"vllm=={VERSION}", CACHE / "sdists", sdist=True)
    stock = {}
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.namelist():
            if member.startswith("vllm/") and member.endswith(".abi3.so") and \
                    "third_party" not in member:
                name = member.removeprefix("vllm/")
                path = tmp_path / "so" / name
                path.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(member) as src, path.open("wb") as out:
                    shutil.copyfileobj(src, out)
                stock[name] = audit_binary(path, name, DEFAULT_POLICY, with_kernels=True)
    prefix = f"vllm-{VERSION}/"
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "sdist", filter="data", members=[
            m for m in tar.getmembers() if m.name == prefix + "CMakeLists.txt"
            or m.name.startswith(prefix + "cmake/")])
    source = tmp_path / "sdist" / prefix
    lines = apply_for_build(source, {}, PatchFor(VERSION, ARCHS_121, "13.0", DEFAULT_TARGET))
    assert lines[-1].startswith("sass-from-ptx: applied (set_gencode_flags_for_srcs in "
                                "cmake/utils.cmake:")
    plans = {p.name: p for p in judge_extensions(
        stock, decide_inputs(source, ARCHS_121, "13.0", DEFAULT_TARGET),
        {t: p.name for p in projects() for t in p.targets})}
    built = {name for name, p in plans.items() if p.build}
    assert built == {"_C_stable_libtorch.abi3.so", "_qutlass_C.abi3.so",
                     "vllm_flash_attn/_vllm_fa2_C.abi3.so"}
    c = plans["_C_stable_libtorch.abi3.so"]
    assert (c.before, c.after) == ({"native": 4149, "jit": 281, "none": 239},
                                   {"native": 4430, "jit": 0, "none": 239})
    assert c.remains == ("239 kernel(s) have no code sm_121 loads: only sm_90a, sm_100f, "
                         "sm_110f (arch/family-specific instructions of other GPUs: no sm_12x "
                         "implementation)",)
    fa2 = plans["vllm_flash_attn/_vllm_fa2_C.abi3.so"]
    assert (fa2.before, fa2.after) == ({"native": 0, "jit": 2224, "none": 0},
                                       {"native": 2224, "jit": 0, "none": 0})
    qutlass = plans["_qutlass_C.abi3.so"]
    assert qutlass.reason == ("QUTLASS_SM120_ARCHS (cmake/external_projects/qutlass.cmake:57) "
                              "gives 12.0f, which the stock file has no cubins for")
    moe = plans["_moe_C_stable_libtorch.abi3.so"]
    assert not moe.build and moe.reason.startswith("only 1 of 2456 kernels are JIT-only")
    for name in ("_flashmla_C.abi3.so", "_deepselect_C.abi3.so",
                 "vllm_flash_attn/_vllm_fa3_C.abi3.so"):
        assert not plans[name].build
        assert plans[name].remains[0].endswith("(arch/family-specific instructions of other "
                                               "GPUs: no sm_12x implementation)")
    assert plans["_flashkda_C.abi3.so"].reason == "every kernel is already native on sm_121"
    # the plan actions: every extension with JIT-only kernels that carry PTX is aot'd (FA2's
    # 2224, `_C`'s 281, `_moe_C`'s one Marlin kernel); a source build would make no more of
    # them native, so only `_qutlass_C` (no PTX, 12.0f from its guard) is built
    aot = {a.name: a.able.kernels for a in aot_actions(stock)}
    assert aot == {"_C_stable_libtorch.abi3.so": 281, "_moe_C_stable_libtorch.abi3.so": 1,
                   "vllm_flash_attn/_vllm_fa2_C.abi3.so": 2224}
    native = {a.name: a.able.kernels or 0 for a in aot_actions(stock)}
    assert {n for n, p in plans.items() if p.build and not aot_does_as_well(p, native)} == {
        "_qutlass_C.abi3.so"}
