"""What a rebuild adds to aot: `aot_does_as_well` and `left_by_aot` (rebuild/decide.py),
on stock reports made from fatbin entries and kernel verdicts directly (the audit of real
files, and `judge_extensions` on real guards, are tested elsewhere); CUDA's loading rule for
CMake targets."""

from __future__ import annotations

from sm121_build.cuda.binary import BinaryReport
from sm121_build.cuda.compat import loads_natively, parse_target
from sm121_build.rebuild.decide import ExtensionVerdict, aot_does_as_well, left_by_aot

GPU = parse_target("sm_121")


def _report(name: str, native: int, jit: int, none: int) -> BinaryReport:
    kernels = {f"n{i}": "native" for i in range(native)} | {f"j{i}": "jit" for i in range(jit)}
    kernels |= {f"x{i}": "none" for i in range(none)}
    return BinaryReport(name, 1, [], [], {"native": 0, "jit": 0, "none": 0},
                        kernels)  # type: ignore[arg-type]


def _plan(name: str, before: int, after: int) -> ExtensionVerdict:
    counts = {"native": before, "jit": 0, "none": 0}
    return ExtensionVerdict(name=name, target=name.split(".")[0], build=True, reason="",
                         before=counts, after={**counts, "native": after})


def test_loading_of_cmake_targets() -> None:
    assert loads_natively("12.0", GPU) and loads_natively("12.0f", GPU)
    assert loads_natively("12.1a", GPU) and not loads_natively("12.0a", GPU)
    assert not loads_natively("9.0", GPU) and not loads_natively("8.0+PTX", GPU)


def test_a_build_that_gains_no_more_than_aot_is_left_to_aot() -> None:
    plan = _plan("_C.abi3.so", before=4149, after=4352)
    assert aot_does_as_well(plan, {"_C.abi3.so": 281})  # aot: 4430 >= 4352
    assert not aot_does_as_well(plan, {"_C.abi3.so": 100})  # aot: 4249 < 4352
    assert not aot_does_as_well(plan, {"_moe_C.abi3.so": 9999})  # aot takes another file


def test_what_aot_leaves_is_the_jit_it_does_not_cover_and_every_none() -> None:
    stock: dict[str, BinaryReport | None] = {
        "_C.abi3.so": _report("_C.abi3.so", 4149, 281, 239),
        "_moe_C.abi3.so": _report("_moe_C.abi3.so", 2455, 1, 0),
        "_fa.abi3.so": _report("_fa.abi3.so", 10, 0, 0), "gone.so": None}
    assert left_by_aot({"_C.abi3.so": 281, "_moe_C.abi3.so": 1}, stock) == \
        {"_C.abi3.so": (0, 239)}
    assert left_by_aot({}, stock) == {"_C.abi3.so": (281, 239), "_moe_C.abi3.so": (1, 0)}
