"""The whole-run fuzzer's `summary` family: the Markdown a run appends to `--summary-md`
(the main job's `jobs/framework/run_record.markdown`, the audit's `audit/report.markdown`) from
records whose every string is hostile, and the invariants that Markdown keeps whatever the
values: no heading but the title, no `[`, `]`, `<`, `>`, `&`, backtick or `|` that no
backslash escapes outside a code span, every row of a table with the header's cells, no raw
control character, no line over `LINE_BOUND`, and each value's text there (escaped, or as it is in a
code span).

`tests/unit/test_run_record.py` renders one hand-made hostile record with these;
`tests/unit/test_whole_runs.py` renders hypothesis's (`hostile_texts`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from sm121_build.core.console import NAME_LIMIT, md
from sm121_build.jobs.framework import run_record

RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e"
                 "\u2066-\u2069\ud800-\udfff]")
# one value as `md` leaves it: at most NAME_LIMIT characters and the cut said, each escaped
# to at most 7 (`\u202e` is `\\u202e`); a line holds at most 6 values (a table's cells)
VALUE_BOUND = 7 * (NAME_LIMIT + 40)
LINE_BOUND = 6 * VALUE_BOUND + 400
SHOWN_HEAD = 40  # characters of a value whose escaped text must be in the Markdown
# what a record's strings may be: Markdown's headings, links, images, HTML, tables, code
# spans, escapes of the escaper, controls, bidi, a byte that was not UTF-8, huge values
PIECES = ("\n# h", "\n## h", "#", "[x](http://e)", "![i](http://e/i.png)", "<img src=x>",
          "<!--", "&amp;", "|", "\\|", "`a`", "``", "\\", "\\`", "\x1b[2J", "\x1b]0;t\x07",
          "\r", "\x00", "\x85", "\u202e", "\u2066", "\u2028", "\udcff", "\ud800", "*b*",
          "_i_", "~~s~~", "- ", "1. ", "> ", "---", "::error::x", "##[group]", "ü✓", " ")


def unescaped(line: str, chars: str) -> list[str]:
    """The characters of `chars` in a Markdown line that no backslash escapes."""
    found, escaped = [], False
    for char in line:
        if not escaped and char in chars:
            found.append(char)
        escaped = not escaped and char == "\\"
    return found


def outside_code(line: str) -> tuple[str, bool]:
    """The line with its code spans (a backtick no backslash escapes, to the next backtick:
    a backslash in a span is literal) blanked, and whether every span closed."""
    kept: list[str] = []
    escaped, at = False, 0
    while at < len(line):
        char = line[at]
        if char == "`" and not escaped:
            end = line.find("`", at + 1)
            if end < 0:
                return "".join(kept), False
            kept.append("C")
            at = end + 1
            escaped = False
            continue
        kept.append(char)
        escaped = not escaped and char == "\\"
        at += 1
    return "".join(kept), True


def broken_markdown(text: str, title: str, values: dict[str, str],
                    tables: int | None = None) -> list[str]:
    """Every invariant `text` breaks: its first line begins `title` and is the only
    heading; outside code spans no Markdown character arrives unescaped (a `|` only as a
    table's cell border, as many in each row as in its header); no raw control character;
    no line over LINE_BOUND; each of `values` (field -> value) shown by its head, escaped
    or in a code span.
    `tables`: how many tables it must hold (None: any)."""
    broken = []
    lines = text.splitlines()
    if not lines or not lines[0].startswith(title):
        broken.append(f"the title is not first: {lines[:1]!r}")
    headings = [line for line in lines[1:] if line.lstrip(" ").startswith("#")]
    if headings:
        broken.append(f"a heading a value began: {headings[0][:200]!r}")
    found = RAW.search(text)
    if found:
        broken.append(f"a raw control character {found.group()!r}")
    cells: dict[int, int] = {}
    for at, line in enumerate(lines):
        if len(line) > LINE_BOUND:
            broken.append(f"a line of {len(line)} characters, over {LINE_BOUND}")
        plain, closed = outside_code(line)
        if not closed:
            broken.append(f"a code span a value opened: {line[:200]!r}")
        if unescaped(plain, "[]<>&`"):
            broken.append(f"an unescaped {unescaped(plain, '[]<>&`')[0]!r}: {line[:200]!r}")
        pipes = len(unescaped(plain, "|"))
        if line.startswith("|"):
            start = at if at == 0 or not lines[at - 1].startswith("|") else max(cells)
            cells.setdefault(start, pipes)
            if pipes != cells[start]:
                broken.append(f"a row of {pipes - 1} cells in a table of {cells[start] - 1}: "
                              f"{line[:200]!r}")
        elif pipes:
            broken.append(f"an unescaped '|' outside a table: {line[:200]!r}")
    if tables is not None and len(cells) != tables:
        broken.append(f"{len(cells)} tables, not {tables}")
    for field, value in values.items():
        head = md(value[:SHOWN_HEAD])  # as text, or whole in a code span (`md_code`)
        if head not in text and f"`{value[:SHOWN_HEAD]}" not in text:
            broken.append(f"{field}'s value is not shown (escaped): {head[:80]!r}")
    return broken


# -- the main job's record -----------------------------------------------------------------

# the record's fields whose value the Markdown shows (with a kernels image's `hit`: its
# digest and reuse key; any other outcome: why)
SHOWN = ("base", "tag", "error", "version", "commit", "arch", "digest", "key", "log",
         "artifacts", "decision", "extension", "ext-reason", "remains", "before-native",
         "after-none", "before-so", "after-so", "before-cubins", "native", "fp4", "ref",
         "pushed")
SHOWN_HIT = ("from-digest", "reuse")
SHOWN_OTHER = ("refusal",)
# fields a cell joins behind another value (`before → after`, `reason; remains`): kept
# short, so that their head is inside the cell's cut
JOINED = frozenset({"ext-reason", "before-native", "before-jit", "before-none", "after-native",
                    "after-jit", "after-none"})
FIELDS = (*SHOWN, *SHOWN_HIT, *SHOWN_OTHER, "command", "id", "tags", "chosen",
          "after-native", "after-jit", "before-jit", "before-none", "action", "cubins-n",
          "ptx", "jit", "none", "outcome", "gpu", "after-cubins")


def _counts(value: Callable[[str], str], side: str) -> run_record.ExtensionCounts:
    return run_record.ExtensionCounts(
        {value(f"{side}-cubins"): value("cubins-n")}, {value("ptx"): 1},  # type: ignore[dict-item]
        {"native": value("native"), "jit": value("jit"), "none": value("none")})  # type: ignore[dict-item]


def hostile_record(value: Callable[[str], str], outcome: str = "hit") -> run_record.RunRecord:
    """A main job's record whose every string (a count too: a cached record is read from
    the untrusted cache) is `value(field)`; the kernels image's lookup ended `outcome`."""
    extension = {"build": True, "action": value("action"), "reason": value("ext-reason"),
                 "remains": [value("remains")],
                 "before": {k: value(f"before-{k}") for k in ("native", "jit", "none")},
                 "after": {k: value(f"after-{k}") for k in ("native", "jit", "none")}}
    record = run_record.new_record(value("command"), value("base"), value("tag"), None)
    return replace(
        record, arch_list=value("arch"), error=value("error"),
        vllm_version=value("version"), vllm_commit=value("commit"),
        base_digest=value("digest"), content_key=value("key"), log=value("log"),
        artifacts=value("artifacts"), image_id=value("id"), tags=[value("tags")],
        decision=run_record.RunDecision(True, value("decision"), (value("chosen"),),
                                        {value("extension"): extension}),
        before={value("before-so"): _counts(value, "before")},
        after={value("after-so"): _counts(value, "after")},
        fp4_excluded={value("fp4"): 3},
        kernels_from=run_record.KernelsFrom(value("ref"), outcome, value("from-digest"),
                                            value("reuse"), value("refusal")),
        kernels_to=[value("pushed")], gpu=value("gpu"))


def broken_run_summary(values: dict[str, str], outcome: str) -> list[str]:
    """The invariants the main job's `--summary-md` breaks for the record of `values`."""
    text = run_record.markdown(hostile_record(lambda field: values[field], outcome))
    shown = [*SHOWN, *(SHOWN_HIT if outcome == "hit" else SHOWN_OTHER)]
    return broken_markdown(text, "## sm121-build: ", {f: values[f] for f in shown},
                           tables=2)


# -- the audit's table ---------------------------------------------------------------------

AUDIT_FIELDS = ("target", "name", "arch", "rebuild", "other-name")


def broken_audit_summary(values: dict[str, str]) -> list[str]:
    """The invariants the audit's `--summary-md` breaks for reports whose every string
    (the target as given, a file's name, a section's arch name, a verdict) is hostile."""
    from sm121_build.audit import report
    from sm121_build.cuda.binary import BinaryReport, Policy
    from sm121_build.cuda.compat import parse_target
    from sm121_build.cuda.fatbin import Entry
    from sm121_build.rebuild.decide import Rebuild

    class HostileEntry(Entry):
        @property
        def sm(self) -> str:  # an arch name as another reader might give it
            return f"sm_90{values['arch']}"

    entry = HostileEntry(0, 0, "elf", 90, "", 0, (8, 0), 0, 10, 10, None)
    made = [BinaryReport(values[name], 1, [entry], [], {"native": 0, "jit": 0, "none": 1},
                         {"k": "none"}) for name in ("name", "other-name")]
    verdicts: dict[str, Any] = {r.name: Rebuild(values["rebuild"], values["rebuild"])  # type: ignore[arg-type]
                                for r in made}
    policy = Policy(parse_target("sm_121"), (13, 0))
    text = report.markdown(values["target"], made, policy, verdicts)
    return broken_markdown(text, "### Audit of ", values, tables=1)
