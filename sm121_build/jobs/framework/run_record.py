"""What one build or inject run did, as JSON (`--report`) and Markdown (`--summary-md`).

The JSON is the record; the Markdown (for `$GITHUB_STEP_SUMMARY`) is rendered from it, so a
nightly's summary is tested code.  A verified run's record is also kept per content key, so
a later run that skips the build still reports the audit of the image it found.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar

from sm121_build.core.console import Steps, md, md_code, notice, say_json, shown
from sm121_build.core.errors import Sm121Error
from sm121_build.core.inputs import read_input
from sm121_build.core.outputs import NotWritten, append_text, replace_text
from sm121_build.core.paths import cache_dir
from sm121_build.cuda.binary import BinaryReport
from sm121_build.cuda.compat import DEFAULT_GPU, ArchList, is_default_gpu

# the Markdown table of the files' counts: its header (the table's default GPU: a constant,
# not a value from outside)
COUNTS_HEADER = (f"| .so | stock cubins | stock kernels on {DEFAULT_GPU} | rebuilt cubins | "
                 f"rebuilt kernels on {DEFAULT_GPU} |")


FORMAT = 2  # 2: `external` (flash-attention commit), `tags`, `image_id`
class RunStatus(str, Enum):
    """How a run of the main job or inject ended (the record's `status`)."""

    BUILT = "built"
    INJECTED = "injected"
    UP_TO_DATE = "up-to-date"
    NOT_NEEDED = "not-needed"
    PLANNED = "planned"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value

    @property
    def words(self) -> str:
        return STATUS_WORDS[self]


STATUS_WORDS = {
    RunStatus.BUILT: "built and verified",
    RunStatus.INJECTED: "injected and verified",
    RunStatus.UP_TO_DATE: "up to date (build skipped)",
    RunStatus.NOT_NEEDED: "no rebuild needed (no extension gains native code from a rebuild)",
    RunStatus.PLANNED: "planned only (--plan): nothing built",
    RunStatus.FAILED: "FAILED",
}
# the runs whose verified files can be published (--kernels-to)
PUBLISHABLE = frozenset({RunStatus.BUILT, RunStatus.UP_TO_DATE, RunStatus.INJECTED})


@dataclass(frozen=True)
class ExtensionCounts:
    """One .so as the report shows it: cubins and PTX per arch, kernels native / JIT / none
    on sm_121."""

    cubins: dict[str, int]
    ptx: dict[str, int]
    kernels: dict[str, int]

    @classmethod
    def of(cls, report: BinaryReport) -> ExtensionCounts:
        return cls(report.arch_counts("elf"), report.arch_counts("ptx"),
                   {str(k): v for k, v in report.kernel_counts().items()})

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ExtensionCounts:
        return cls(dict(data["cubins"]), dict(data["ptx"]), dict(data["kernels"]))


def extension_counts(reports: dict[str, BinaryReport]) -> dict[str, ExtensionCounts]:
    return {name: ExtensionCounts.of(r) for name, r in sorted(reports.items())}


@dataclass(frozen=True)
class ExternalSource:
    """An external project's tree the build used (flash-attention)."""

    commit: str
    repository: str
    changes: str = ""  # sha256 of uncommitted changes in a --fa-source checkout
    other_commit: str = ""  # why a checkout at another commit than the pin was accepted


@dataclass(frozen=True)
class Pulled:
    before: str | None  # the local image ID the reference named before the pull
    after: str


@dataclass(frozen=True)
class KernelsFrom:
    """A kernels image looked up (`--kernels-from`) or named (`inject --from`)."""

    ref: str
    outcome: str  # hit, miss, unreachable (the registry could not be asked), refused
    digest: str = ""  # what was pulled, by digest
    reuse_key: str = ""
    why: str = ""  # of a miss, an unreachable registry or a refusal


@dataclass
class RunRecord:
    """What one build or inject run did, written however it ends: so it is filled as the
    run's stages end, each through one method below taking that stage's value (no other
    module assigns a field).  `as_json` is its one serializer (report.schema.json); unset
    fields are left out."""

    command: str
    base: str
    tag: str
    arch_list: str | None
    status: RunStatus = RunStatus.FAILED
    error: str | None = None
    vllm_version: str | None = None
    vllm_commit: str | None = None
    base_digest: str | None = None
    pulled: Pulled | None = None
    source_other_commit: str | None = None
    source_changes: str | None = None
    external: dict[str, ExternalSource] = field(default_factory=dict)
    content_key: str | None = None
    extensions: list[str] | None = None
    decision: RunDecision | None = None  # main_plan.choose_to_build: per extension
    log: str | None = None
    before: dict[str, ExtensionCounts] | None = None
    after: dict[str, ExtensionCounts] | None = None
    fp4_excluded: dict[str, int] | None = None
    abi_symbols_checked: int | None = None
    artifacts: str | None = None
    kernels_from: KernelsFrom | None = None
    kernels_to: list[str] | None = None  # the kernels image's tags pushed (--kernels-to)
    image_id: str | None = None
    tags: list[str] | None = None
    steps: list[dict[str, Any]] | None = None  # name, seconds, ok: every step, in order
    gpu: str | None = None  # the GPU the run serves (--gpu): left out for the Spark's default

    REQUIRED: ClassVar[tuple[str, ...]] = ("command", "status", "base", "tag", "arch_list",
                                           "error")

    def as_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"format": FORMAT}
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name in self.REQUIRED or value not in (None, {}):
                data[item.name] = _plain(value)
        return data

    # -- one method per stage value ----------------------------------------------------------
    def base_inspected(self, vllm_version: str, base_digest: str) -> None:
        self.vllm_version, self.base_digest = vllm_version, base_digest

    def serves(self, gpu: str) -> None:
        """The GPU the run serves, when it is not the Spark's sm_121 (whose reports stay as
        they were)."""
        self.gpu = None if is_default_gpu(gpu) else gpu

    def base_pulled(self, pulled: Pulled) -> None:
        self.pulled = pulled

    def source_checked(self, other_commit: str, changes: str) -> None:
        """A --source checkout: why another commit was accepted, its uncommitted changes."""
        self.source_other_commit = other_commit or None
        self.source_changes = changes or None

    def external_copied(self, name: str, source: ExternalSource) -> None:
        self.external[name] = source

    def decided(self, decision: RunDecision) -> None:
        self.decision = decision
        if not decision.chosen:
            self.status = RunStatus.NOT_NEEDED

    def build_named(self, vllm_version: str, commit: str, arch_list: ArchList,
                   content_key: str | None = None,
                   extensions: tuple[str, ...] | None = None) -> None:
        """What is built (or injected): vLLM, commit, arch list; a build's key and files."""
        self.vllm_version, self.vllm_commit = vllm_version, commit
        self.arch_list = str(arch_list)
        if content_key is not None:
            self.content_key = content_key
        if extensions is not None:
            self.extensions = list(extensions)

    def log_opened(self, log: Path) -> None:
        self.log = str(log)

    def verified(self, stock: dict[str, BinaryReport], built: dict[str, BinaryReport],
                          fp4_excluded: dict[str, int], abi_checked: int) -> None:
        self.before, self.after = extension_counts(stock), extension_counts(built)
        self.fp4_excluded, self.abi_symbols_checked = fp4_excluded, abi_checked

    def exported(self, folder: Path | None) -> None:
        """The --out folder (None: the files went to a temporary folder only)."""
        self.artifacts = str(folder) if folder else None

    def tagged(self, image_id: str, tags: list[str]) -> None:
        self.image_id, self.tags = image_id, tags

    def kernels_looked_up(self, used: KernelsFrom) -> None:
        self.kernels_from = used

    def kernels_pushed(self, tags: list[str]) -> None:
        self.kernels_to = tags

    def ended(self, status: RunStatus) -> None:
        self.status = status

    def keep_audit_of(self, kept: dict[str, Any]) -> None:
        """The audit a verified run of the same content key recorded (its `as_json`)."""
        with suppress(KeyError, TypeError, ValueError, AttributeError):
            self.before = {n: ExtensionCounts.from_json(b) for n, b in kept["before"].items()}
            self.after = {n: ExtensionCounts.from_json(b) for n, b in kept["after"].items()}
            self.fp4_excluded = {str(n): int(c) for n, c in kept["fp4_excluded"].items()}
            self.log = str(kept["log"])


@dataclass(frozen=True)
class RunDecision:
    """The run's decision, made once: rebuild or not and why, the extensions chosen (to build
    or aot), and per extension of the base what its plan says (its `action`: build, aot or
    keep; kernels before and after; the reason; what stays non-native)."""

    rebuild: bool
    reason: str
    chosen: tuple[str, ...] = ()
    extensions: dict[str, dict[str, Any]] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"rebuild": self.rebuild, "reason": self.reason, "chosen": list(self.chosen),
                "extensions": self.extensions}


def _plain(value: Any) -> Any:
    if isinstance(value, RunDecision):
        return value.as_json()
    if isinstance(value, Enum):
        return value.value
    if is_dataclass(value) and not isinstance(value, type):
        return {k: v for k, v in asdict(value).items() if v != ""}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def new_record(command: str, base: str, tag: str, arch: ArchList | None) -> RunRecord:
    """A run's record as it starts: what it was asked (the arch list in torch's form)."""
    return RunRecord(command, base, tag, str(arch) if arch is not None else None)


def cached_path(key: str) -> Path:
    return cache_dir() / "reports" / f"{key}.json"


def remember(record: RunRecord) -> None:
    """Keep a verified record under its content key (read back when the build is skipped)."""
    if record.content_key:
        write_json(cached_path(record.content_key), record)


def recall(key: str) -> dict[str, Any] | None:
    path = cached_path(key)
    try:
        data = json.loads(read_input(path, 64 << 20, "cached record"))
    except (OSError, ValueError, RecursionError, Sm121Error):
        return None
    return data if isinstance(data, dict) else None


def write_json(path: Path, record: RunRecord) -> None:
    """Atomically: a reader never sees half a report."""
    replace_text(path, json.dumps(record.as_json(), indent=2) + "\n")


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{sm} ×{n}" for sm, n in counts.items()) or "—"


def _kernels(entry: ExtensionCounts | None) -> str:
    if not entry:
        return "—"
    k = entry.kernels
    return f"{k['native']} native, {k['jit']} JIT, {k['none']} none"


def _md_counts(counts: dict[str, int]) -> str:
    return md(_counts(counts))


def _md_kernels(entry: ExtensionCounts | None) -> str:
    return md(_kernels(entry))


def _md_change(before: dict[str, Any], after: dict[str, Any], key: str) -> str:
    return md(f"{before[key]} → {after[key]}")


def markdown(record: RunRecord) -> str:
    """The run as GitHub-flavoured Markdown: status, provenance, the audit before/after.
    Every value in it passes through the one escaper (`md`, `md_code`): a record's values
    come from outside (a registry's refusal, a base image's files, a cached record), and
    none may add a heading, a link, HTML or a table cell."""
    status = RunStatus(record.status).words
    lines = [f"## sm121-build: {md_code(record.base)} → {md_code(record.tag or '')}", "",
             f"**{md(status)}**" + (f": {md(record.error)}" if record.error else ""), ""]
    facts = [("vLLM", record.vllm_version), ("commit", record.vllm_commit),
             ("arch list", record.arch_list), ("base digest", record.base_digest),
             ("content key", record.content_key), ("build log", record.log),
             ("artifacts", record.artifacts)]
    lines += [f"- {md(name)}: {md_code(str(value))}" for name, value in facts if value]
    lines += kernels_lines(record, "- ", md_code, md)
    decision = record.decision
    if decision:
        lines += ["", f"Rebuild decision: **{md('rebuild' if decision.rebuild else 'no rebuild')}"
                  f"**: {md(str(decision.reason))}"]
        lines += ["", "| extension | built | native | JIT only | none | why |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for name, e in sorted(decision.extensions.items()):
            b, a = e["before"], e["after"]
            why = "; ".join(str(w) for w in [e["reason"], *e["remains"]])
            lines.append(f"| {md_code(str(name))} | {md('yes' if e['build'] else 'no')} | "
                         f"{_md_change(b, a, 'native')} | {_md_change(b, a, 'jit')} | "
                         f"{_md_change(b, a, 'none')} | {md(why)} |")
    before = record.before or {}
    after = record.after or {}
    if after:
        lines += ["", COUNTS_HEADER, "| --- | --- | --- | --- | --- |"]
        for name in sorted(set(before) | set(after)):
            old, new = before.get(name), after.get(name)
            lines.append(f"| {md_code(name)} | {_md_counts(old.cubins if old else {})} | "
                         f"{_md_kernels(old)} | {_md_counts(new.cubins if new else {})} | "
                         f"{_md_kernels(new)} |")
    elif record.status == RunStatus.UP_TO_DATE:
        lines += ["", "_No audit kept for the existing image; `--force` rebuilds._"]
    excluded = record.fp4_excluded or {}
    for name, count in sorted(excluded.items()):
        if count:
            lines.append(f"\n{md_code(name)}: {md(str(count))} FP4 kernel(s) left out on "
                         "purpose.")
    return "\n".join(lines) + "\n"


def write_markdown(path: Path, record: RunRecord) -> None:
    """Appends, as `$GITHUB_STEP_SUMMARY` expects."""
    append_text(path, markdown(record))


@contextmanager
def recorded(record: RunRecord, report: Path | None, summary_md: Path | None,
             steps: Steps | None = None, as_json: bool = False) -> Iterator[RunRecord]:
    """Write the record (`--report`) and its Markdown (`--summary-md`) however the run ends;
    with `steps`, their times go in and the run ends with its summary on stderr; `as_json`:
    the record on stdout too.  Each is written whole or not at all; one that cannot be (a
    full disk) is said and the others are still written, and the run ends with the error
    that ended it, else with that of the first result not written."""
    failing = False
    try:
        yield record
    except Sm121Error as exc:
        record.error, failing = str(exc), True
        raise
    except KeyboardInterrupt:
        record.error, failing = "interrupted", True
        raise
    except BaseException:
        failing = True
        raise
    finally:
        if steps is not None:
            record.steps = [{"name": name, "seconds": seconds, "ok": ok}
                            for name, seconds, ok in steps.timings]
        unwritten: list[NotWritten] = []
        for write, path in ((write_json, report), (write_markdown, summary_md)):
            if path:
                try:
                    write(path, record)
                except NotWritten as exc:
                    unwritten.append(exc)
        # a run that did something ends with it; a failed one ends with its error line
        # (the record, --report and --json keep its step times)
        if steps is not None and steps.timings and record.error is None:
            for line in summary_lines(record):
                notice(line)
        if as_json:
            try:
                say_json(record.as_json())
            except NotWritten as exc:
                unwritten.append(exc)
        for other in unwritten[0 if failing else 1:]:
            notice(f"note: {other}")
        if unwritten and not failing:
            raise unwritten[0]


def kernels_lines(record: RunRecord, bullet: str = "  ",
                  name: Callable[[str], str] = shown,
                  text: Callable[[str], str] = shown) -> list[str]:
    """What a run took from, and gave to, a registry of kernels images: each reference
    and digest through `name`, every other value through `text` (plain text: `shown`;
    Markdown: `md_code` and `md`)."""
    lines = []
    used = record.kernels_from
    if used:
        lines.append(f"{bullet}kernels from {name(used.ref)}: {text(used.outcome)}"
                     + (f" ({name(used.digest)}, reuse key {text(used.reuse_key)})"
                        if used.outcome == "hit" else f" ({text(used.why)})" if used.why
                        else ""))
    for tag in record.kernels_to or []:
        lines.append(f"{bullet}kernels pushed: {name(tag)}")
    return lines


def summary_lines(record: RunRecord) -> list[str]:
    """The end of a run, always: how it ended, each step's time, what is native now, and
    what stays non-native and why (the decide step's reasons, kept or built alike)."""
    lines = [f"summary: {record.status}"]
    if record.steps:
        lines.append("  steps: " + ", ".join(f"{s['name']} {s['seconds']:.1f}s"
                                              + ("" if s["ok"] else " (failed)")
                                              for s in record.steps))
    lines += kernels_lines(record)
    for name, after in (record.after or {}).items():
        before = (record.before or {}).get(name)
        was = f"{before.kernels['native']} → " if before and before.kernels else ""
        if after.kernels:
            total = sum(after.kernels.values())
            lines.append(f"  {shown(name)}: {was}{after.kernels['native']} of {total} kernels "
                         f"native on {record.gpu or DEFAULT_GPU}")
    plans = record.decision.extensions if record.decision else {}
    stays = [(name, why) for name, plan in plans.items() for why in plan.get("remains", [])]
    if stays:
        lines.append("  stays non-native:")
        lines.extend(f"    {shown(name)}: {shown(why)}" for name, why in stays)
    elif plans:
        lines.append("  stays non-native: nothing the plan knows of")
    return lines
