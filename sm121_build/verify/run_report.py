"""What one build or inject run did, as JSON (`--report`) and Markdown (`--summary-md`).

The JSON is the record; the Markdown (for `$GITHUB_STEP_SUMMARY`) is rendered from it, so a
nightly's summary is tested code.  A verified run's record is also kept per content key, so
a later run that skips the build still reports the audit of the image it found.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sm121_build.errors import Sm121Error
from sm121_build.image.facts import cache_dir
from sm121_build.verify.audit import BinaryReport

FORMAT = 2  # 2: `external` (flash-attention commit), `tags`, `image_id`
STATUS_WORDS = {
    "built": "built and verified",
    "injected": "injected and verified",
    "up-to-date": "up to date (build skipped)",
    "not-needed": "no rebuild needed (the stock kernels already run natively)",
    "failed": "FAILED",
}


def binaries(reports: dict[str, BinaryReport]) -> dict[str, dict[str, Any]]:
    """Per .so: cubins and PTX per arch, kernels native / JIT / none on sm_121."""
    return {name: {"cubins": r.arch_counts("elf"), "ptx": r.arch_counts("ptx"),
                   "kernels": dict(r.kernel_counts())}
            for name, r in sorted(reports.items())}


def new_record(command: str, base: str, tag: str, arch: str | None) -> dict[str, Any]:
    return {"format": FORMAT, "command": command, "status": "failed", "base": base,
            "tag": tag, "arch_list": arch, "error": None}


def cached_path(key: str) -> Path:
    return cache_dir() / "reports" / f"{key}.json"


def remember(record: dict[str, Any]) -> None:
    """Keep a verified record under its content key (read back when the build is skipped)."""
    if record.get("content_key"):
        write_json(cached_path(record["content_key"]), record)


def recall(key: str) -> dict[str, Any] | None:
    path = cached_path(key)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_json(path: Path, record: dict[str, Any]) -> None:
    """Atomically: a reader never sees half a report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{sm} ×{n}" for sm, n in counts.items()) or "—"


def _kernels(entry: dict[str, Any] | None) -> str:
    if not entry:
        return "—"
    k = entry["kernels"]
    return f"{k['native']} native, {k['jit']} JIT, {k['none']} none"


def markdown(record: dict[str, Any]) -> str:
    """The run as GitHub-flavoured Markdown: status, provenance, the audit before/after."""
    status = STATUS_WORDS.get(record["status"], record["status"])
    lines = [f"## sm121-build: `{record['base']}` → `{record['tag']}`", "",
             f"**{status}**" + (f": {record['error']}" if record.get("error") else ""), ""]
    facts = [("vLLM", record.get("vllm_version")), ("commit", record.get("vllm_commit")),
             ("arch list", record.get("arch_list")), ("base digest", record.get("base_digest")),
             ("content key", record.get("content_key")), ("build log", record.get("log")),
             ("artifacts", record.get("artifacts"))]
    lines += [f"- {name}: `{value}`" for name, value in facts if value]
    decision = record.get("decision")
    if decision:
        lines += ["", f"Rebuild decision: **{'rebuild' if decision['rebuild'] else 'no rebuild'}"
                  f"**: {decision['reason']}"]
        lines += [f"- `{name}`: {c['native']}/{c['total']} kernels native on sm_121 in the "
                  "stock image" for name, c in sorted(decision["extensions"].items())]
    before: dict[str, Any] = record.get("before") or {}
    after: dict[str, Any] = record.get("after") or {}
    if after:
        lines += ["", "| .so | stock cubins | stock kernels on sm_121 | rebuilt cubins | "
                  "rebuilt kernels on sm_121 |", "| --- | --- | --- | --- | --- |"]
        for name in sorted(set(before) | set(after)):
            old, new = before.get(name), after.get(name)
            lines.append(f"| `{name}` | {_counts(old['cubins']) if old else '—'} | "
                         f"{_kernels(old)} | {_counts(new['cubins']) if new else '—'} | "
                         f"{_kernels(new)} |")
    elif record["status"] == "up-to-date":
        lines += ["", "_No audit kept for the existing image; `--force` rebuilds._"]
    excluded = record.get("fp4_excluded") or {}
    for name, count in sorted(excluded.items()):
        if count:
            lines.append(f"\n{name}: {count} FP4 kernel(s) left out on purpose.")
    return "\n".join(lines) + "\n"


def write_markdown(path: Path, record: dict[str, Any]) -> None:
    """Appends, as `$GITHUB_STEP_SUMMARY` expects."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as out:
        out.write(markdown(record))


@contextmanager
def recorded(record: dict[str, Any], report: Path | None,
             summary_md: Path | None) -> Iterator[dict[str, Any]]:
    """Write the record (`--report`) and its Markdown (`--summary-md`) however the run ends."""
    try:
        yield record
    except Sm121Error as exc:
        record["error"] = str(exc)
        raise
    except KeyboardInterrupt:
        record["error"] = "interrupted"
        raise
    finally:
        if report:
            write_json(report, record)
        if summary_md:
            write_markdown(summary_md, record)
