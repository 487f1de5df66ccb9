"""The end of every main-job and inject run: how it ended, each step's time, what is native
now and what stays non-native and why; `--json` puts the record on stdout however it ends."""

from __future__ import annotations

import json

import pytest

from sm121_build.core.console import Steps
from sm121_build.core.errors import Sm121Error
from sm121_build.cuda.compat import ArchList
from sm121_build.jobs.framework.run_record import (
    ExtensionCounts,
    KernelsFrom,
    RunDecision,
    markdown,
    new_record,
    recorded,
    summary_lines,
)

ARCHS_121 = ArchList.parse("12.1")  # a Spark's arch list


def _record() -> object:
    record = new_record("build", "vllm/vllm-openai:nightly", "x:sm121", ARCHS_121)
    record.status = "built"
    record.steps = [{"name": "pull", "seconds": 12.0, "ok": True},
                    {"name": "build", "seconds": 1104.9, "ok": True}]
    record.before = {"_C.abi3.so": ExtensionCounts({}, {}, {"native": 4149, "jit": 281,
                                                            "none": 239})}
    record.after = {"_C.abi3.so": ExtensionCounts({}, {}, {"native": 4352, "jit": 0, "none": 0})}
    record.decision = RunDecision(True, "", (), {"_C.abi3.so": {"remains": [
        "239 kernel(s) have no code sm_121 loads: only sm_90a"]}, "_moe_C.abi3.so": {
        "remains": ["1 kernel(s) stay JIT-only (PTX compiled by the driver at first use)"]}})
    return record


def test_the_summary_says_steps_counts_and_what_stays() -> None:
    assert summary_lines(_record()) == [  # type: ignore[arg-type]
        "summary: built",
        "  steps: pull 12.0s, build 1104.9s",
        "  _C.abi3.so: 4149 → 4352 of 4352 kernels native on sm_121",
        "  stays non-native:",
        "    _C.abi3.so: 239 kernel(s) have no code sm_121 loads: only sm_90a",
        "    _moe_C.abi3.so: 1 kernel(s) stay JIT-only (PTX compiled by the driver at first "
        "use)"]


def test_the_summary_and_markdown_say_which_kernels_image_was_used_and_pushed() -> None:
    record = _record()
    digest = "sha256:" + "d" * 64
    record.kernels_from = KernelsFrom("r/k:0.33.0-aaaaaaaaaaaa-cu130-sm121", "hit",  # type: ignore[attr-defined]
                                      digest, "k" * 24)
    record.kernels_to = ["mirror/k:k-" + "k" * 24, "mirror/k:nightly"]  # type: ignore[attr-defined]
    lines = summary_lines(record)  # type: ignore[arg-type]
    assert lines[2:5] == [
        f"  kernels from r/k:0.33.0-aaaaaaaaaaaa-cu130-sm121: hit ({digest}, reuse key "
        f"{'k' * 24})", f"  kernels pushed: mirror/k:k-{'k' * 24}",
        "  kernels pushed: mirror/k:nightly"]
    record.decision = None  # type: ignore[attr-defined]
    text = markdown(record)  # type: ignore[arg-type]
    assert "- kernels pushed: `mirror/k:nightly`" in text
    record.kernels_from = KernelsFrom("r/k:t", "unreachable",  # type: ignore[attr-defined]
                                      why="cannot resolve r/k:t: connection refused")
    assert "- kernels from `r/k:t`: unreachable (cannot resolve r/k:t: connection refused)" \
        in markdown(record)  # type: ignore[arg-type]


def test_a_failed_run_says_so_and_json_still_comes(capsys: pytest.CaptureFixture[str]) -> None:
    steps = Steps()
    record = new_record("build", "b:1", "b:1-sm121", ARCHS_121)
    with pytest.raises(Sm121Error), recorded(record, None, None, steps, as_json=True):
        with steps.step("inspect b:1"):
            pass
        with steps.step("build"):
            raise Sm121Error("docker build failed: ptxas said: error")
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert data["status"] == "failed" and data["error"].startswith("docker build failed")
    assert [(s["name"], s["ok"]) for s in data["steps"]] == [("inspect b:1", True),
                                                            ("build", False)]
    assert "summary:" not in err  # a failed run ends with its error line (printed by the CLI)
    assert summary_lines(record)[:2] == ["summary: failed",
                                         "  steps: inspect b:1 0.0s, build 0.0s (failed)"]


def _report(name: str, kernels: dict[str, str]) -> object:
    from sm121_build.cuda.binary import BinaryReport

    return BinaryReport(name, 1, [], [], {"native": 0, "jit": 0, "none": 0},
                        kernels)  # type: ignore[arg-type]


def test_a_run_without_the_source_says_what_aot_leaves_non_native() -> None:
    """aot alone (the source not read: --only, `aot IMAGE`, or none to be had): every
    extension with kernels aot cannot make native is kept with the reason, so the summary
    never says "nothing" stays while it does; what aot covers whole stays out."""
    from sm121_build.cuda.binary import DEFAULT_POLICY, AotAble
    from sm121_build.jobs.aot_work.aot_step import AotAction
    from sm121_build.jobs.main_run.main_plan import aot_decision, native_by_aot
    from sm121_build.rebuild.decide import left_by_aot
    from tests.unit.test_decide_step import nothing_outside

    fa2, c, moe = "vllm_flash_attn/_vllm_fa2_C.abi3.so", "_C.abi3.so", "_moe_C.abi3.so"
    stock = {fa2: _report(fa2, {"k1": "jit", "k2": "jit"}),
             c: _report(c, {"a": "native", "b": "none", "c": "none", "d": "jit"}),
             moe: _report(moe, {"m": "native"}), "gone.abi3.so": None}
    aot = (AotAction(fa2, AotAble(2, 2, 100)), AotAction(c, AotAble(1, 1, 10)))
    assert left_by_aot(native_by_aot(aot), stock) == {c: (0, 2)}
    assert left_by_aot(native_by_aot(aot[:1]), stock) == {c: (1, 2)}
    record = new_record("build", "base", "tag", ARCHS_121)
    with nothing_outside():  # #61: made of what was gathered alone, no I/O
        decision = aot_decision(DEFAULT_POLICY, aot[:1], stock)
    record.decided(decision)
    assert record.decision is not None
    assert record.decision.chosen == (fa2,)
    kept = record.decision.extensions[c]
    assert (kept["action"], kept["build"], kept["after"]) == ("keep", False, kept["before"])
    assert summary_lines(record)[-2:] == [
        "  stays non-native:",
        "    _C.abi3.so: 2 kernel(s) load nothing on sm_121 and 1 stay JIT-only: aot cannot "
        "change them; whether a source build can was not decided (the source was not read: "
        "`sm121-build --base IMAGE --source DIR` reads it)"]
    covered = new_record("build", "base", "tag", ARCHS_121)
    covered.decided(aot_decision(DEFAULT_POLICY, aot, {fa2: stock[fa2]}))
    assert summary_lines(covered)[-1] == "  stays non-native: nothing the plan knows of"
