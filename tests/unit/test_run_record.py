"""The run report's Markdown (the nightly's job summary) on crafted records."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from devkit import summary_worlds
from sm121_build.core.console import md
from sm121_build.core.errors import VerificationError
from sm121_build.cuda.compat import ArchList
from sm121_build.jobs.framework import run_record


def _record(**extra: Any) -> run_record.RunRecord:
    record = run_record.new_record("build", "vllm/vllm-openai:nightly",
                                   "vllm/vllm-openai:nightly-sm121", ArchList.parse("12.1"))
    return replace(record, **extra)


def test_built_run_has_the_before_after_table() -> None:
    entry = run_record.ExtensionCounts({"sm_90": 2}, {}, {"native": 0, "jit": 0, "none": 9})
    after = run_record.ExtensionCounts({"sm_121": 3}, {}, {"native": 9, "jit": 0, "none": 0})
    text = run_record.markdown(_record(status="built", vllm_version="0.19.1",
                                       before={"_C.abi3.so": entry},
                                       after={"_C.abi3.so": after, "_moe_C.abi3.so": after},
                                       fp4_excluded={"_C.abi3.so": 4}))
    assert "**built and verified**" in text
    assert "- vLLM: `0.19.1`" in text
    assert ("| `_C.abi3.so` | sm\\_90 ×2 | 0 native, 0 JIT, 9 none | sm\\_121 ×3 | "
            "9 native, 0 JIT, 0 none |") in text  # (`\_`: Markdown-escaped, shown `_`)
    assert "| `_moe_C.abi3.so` | — | — | sm\\_121 ×3 | 9 native, 0 JIT, 0 none |" in text
    assert "`_C.abi3.so`: 4 FP4 kernel(s) left out on purpose." in text


def test_skipped_run_without_a_kept_audit_says_so() -> None:
    text = run_record.markdown(_record(status="up-to-date"))
    assert "**up to date \\(build skipped\\)**" in text
    assert "No audit kept for the existing image" in text
    assert "|" not in text


def test_failure_is_recorded_and_reraised(tmp_path: Path) -> None:
    report, summary = tmp_path / "r.json", tmp_path / "s.md"
    summary.write_text("earlier step\n")
    with pytest.raises(VerificationError), run_record.recorded(_record(), report, summary):
        raise VerificationError("verification failed: x; not tagged")
    assert '"error": "verification failed: x; not tagged"' in report.read_text()
    assert summary.read_text().startswith("earlier step\n## sm121-build:")  # appended
    assert "**FAILED**: verification failed: x; not tagged" in summary.read_text()


# what a registry's refusal, a base image's file name or a cached record may hold: a
# heading, a link, HTML, a table cell, a code span, an escape of the escaper, controls
HOSTILE = "\n# h\n[x](http://e)<img src=x>|`a`\\|\x1b[2J\r\u202e"


@pytest.mark.parametrize("outcome", ["hit", "refused"])
def test_the_main_jobs_summary_passes_every_value_through_the_escaper(outcome: str) -> None:
    """The nightly's $GITHUB_STEP_SUMMARY from a record whose every value is hostile (a
    kernels image's refusal, the rebuild decision naming a base image's file; issue #62):
    each value is there, escaped; no heading, link, HTML, code span or control character
    arrives, and no table gains a cell (devkit/summary_worlds.py's invariants, which the
    whole-run fuzzer checks on generated records too)."""
    values = {field: f"{field}{HOSTILE}" for field in summary_worlds.FIELDS}
    assert summary_worlds.broken_run_summary(values, outcome) == []
    text = run_record.markdown(summary_worlds.hostile_record(values.__getitem__, outcome))
    assert text.splitlines()[0].startswith("## sm121-build: base")
    for field in summary_worlds.SHOWN:  # each value arrived whole (escaped), none dropped
        assert md(values[field]) in text, field
