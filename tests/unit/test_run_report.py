"""The run report's Markdown (the nightly's job summary) on crafted records."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from sm121_build.core.console import md
from sm121_build.core.errors import VerificationError
from sm121_build.cuda.compat import ArchList
from sm121_build.verify import run_report


def _record(**extra: Any) -> run_report.RunRecord:
    record = run_report.new_record("build", "vllm/vllm-openai:nightly",
                                   "vllm/vllm-openai:nightly-sm121", ArchList.parse("12.1"))
    return replace(record, **extra)


def test_built_run_has_the_before_after_table() -> None:
    entry = run_report.ExtensionCounts({"sm_90": 2}, {}, {"native": 0, "jit": 0, "none": 9})
    after = run_report.ExtensionCounts({"sm_121": 3}, {}, {"native": 9, "jit": 0, "none": 0})
    text = run_report.markdown(_record(status="built", vllm_version="0.19.1",
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
    text = run_report.markdown(_record(status="up-to-date"))
    assert "**up to date \\(build skipped\\)**" in text
    assert "No audit kept for the existing image" in text
    assert "|" not in text


def test_failure_is_recorded_and_reraised(tmp_path: Path) -> None:
    report, summary = tmp_path / "r.json", tmp_path / "s.md"
    summary.write_text("earlier step\n")
    with pytest.raises(VerificationError), run_report.recorded(_record(), report, summary):
        raise VerificationError("verification failed: x; not tagged")
    assert '"error": "verification failed: x; not tagged"' in report.read_text()
    assert summary.read_text().startswith("earlier step\n## sm121-build:")  # appended
    assert "**FAILED**: verification failed: x; not tagged" in summary.read_text()


# what a registry's refusal, a base image's file name or a cached record may hold: a
# heading, a link, HTML, a table cell, a code span, an escape of the escaper, controls
HOSTILE = "\n# h\n[x](http://e)<img src=x>|`a`\\|\x1b[2J\r\u202e"


def _hostile(field: str) -> str:
    return f"{field}{HOSTILE}"


def _hostile_counts(field: str) -> run_report.ExtensionCounts:
    return run_report.ExtensionCounts(
        {_hostile(f"{field}-cubins"): _hostile("n")}, {_hostile("ptx"): 1},  # type: ignore[dict-item]
        {"native": _hostile("native"), "jit": _hostile("jit"), "none": _hostile("none")})  # type: ignore[dict-item]


def _hostile_record() -> run_report.RunRecord:
    """A main job's record whose every string (a count too: a cached record is read from
    the untrusted cache) is hostile."""
    extension = {"build": True, "action": _hostile("action"), "reason": _hostile("ext-reason"),
                 "remains": [_hostile("remains")],
                 "before": {k: _hostile(f"before-{k}") for k in ("native", "jit", "none")},
                 "after": {k: _hostile(f"after-{k}") for k in ("native", "jit", "none")}}
    record = run_report.new_record(_hostile("command"), _hostile("base"), _hostile("tag"),
                                   None)
    return replace(
        record, arch_list=_hostile("arch"), error=_hostile("error"),
        vllm_version=_hostile("version"), vllm_commit=_hostile("commit"),
        base_digest=_hostile("digest"), content_key=_hostile("key"), log=_hostile("log"),
        artifacts=_hostile("artifacts"), image_id=_hostile("id"), tags=[_hostile("tags")],
        decision=run_report.RunDecision(True, _hostile("decision"), (_hostile("chosen"),),
                                        {_hostile("extension"): extension}),
        before={_hostile("before-so"): _hostile_counts("before")},
        after={_hostile("after-so"): _hostile_counts("after")},
        fp4_excluded={_hostile("fp4"): 3},
        kernels_from=run_report.KernelsFrom(_hostile("ref"), _hostile("outcome"),
                                            _hostile("from-digest"), _hostile("reuse"),
                                            _hostile("refusal")),
        kernels_to=[_hostile("pushed")], gpu=_hostile("gpu"))


def _unescaped(line: str, chars: str) -> list[str]:
    """The characters of `chars` in a Markdown line that no backslash escapes."""
    found, escaped = [], False
    for char in line:
        if not escaped and char in chars:
            found.append(char)
        escaped = not escaped and char == "\\"
    return found


@pytest.mark.parametrize("outcome", ["hit", "refused"])
def test_the_main_jobs_summary_passes_every_value_through_the_escaper(outcome: str) -> None:
    """The nightly's $GITHUB_STEP_SUMMARY from a record whose every value is hostile (a
    kernels image's refusal, the rebuild decision naming a base image's file; issue #62):
    each value is there, escaped; no heading, link, HTML, code span or control character
    arrives, and no table gains a cell."""
    record = _hostile_record()
    assert record.kernels_from is not None
    record.kernels_from = replace(record.kernels_from, outcome=outcome)
    text = run_report.markdown(record)
    lines = text.splitlines()
    assert [line for line in lines if line.startswith("#")] == [lines[0]]
    assert lines[0].startswith("## sm121-build: base")
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e]", text)
    for line in lines:
        assert _unescaped(line, "[]<>`&") == [], line
        assert "](" not in line
    tables: dict[int, int] = {}
    for at, line in enumerate(lines):
        if line.startswith("|"):
            start = at if not lines[at - 1].startswith("|") else max(tables)
            tables.setdefault(start, len(_unescaped(line, "|")))
            assert len(_unescaped(line, "|")) == tables[start], line
    assert len(tables) == 2  # the decision's table and the audit's
    shown = ["base", "tag", "error", "version", "commit", "arch", "digest", "key", "log",
             "artifacts", "decision", "extension", "ext-reason", "remains", "before-native",
             "after-none", "before-so", "after-so", "before-cubins", "native", "fp4", "ref",
             "pushed"]
    shown += ["from-digest", "reuse"] if outcome == "hit" else ["refusal"]
    for field in shown:  # each value arrived (escaped), none was dropped to pass
        assert md(_hostile(field)) in text, field
