"""patch.py piece by piece: rule loading and its validation, the list rewriting helpers, the
decision (applied / not needed / not applicable, and every refusal), version-keyed
exceptions, the all-or-nothing write and its rollback, and the build's patch step.

Evaluation is real (cmake -P on the fixture's utils.cmake, tests/data/vllm_like); rules are
the shipped ones or written here.  The shapes nightlies produce are in test_guard_rules.py.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
from pathlib import Path

import pytest
from packaging.version import Version

from devkit.helpers import DATA
from devkit.helpers import vllm_like_tree as _tree
from sm121_build.core.errors import PatchDrift, Sm121Error
from sm121_build.cuda.compat import ArchList, parse_target
from sm121_build.source import guard_rules as patch
from sm121_build.source.cmake_lang import Argument
from sm121_build.source.guard_rules import (
    PatchFor,
    _tolerant,
    _write_all,
    added_list,
    apply_all,
    apply_for_build,
    apply_rule,
    breaks_ptxas,
    candidate_entries,
    covered,
    fixable_targets,
    load_rules,
    parse_version,
    read_source_version,
    rewritten_list,
    rules_digest,
    rules_for,
    target_gpu,
)
from sm121_build.source.guards import Call, Guard, evaluate

ARCHS_121 = ArchList.parse("12.1")  # a Spark's arch list

GE13 = "if(${CMAKE_CUDA_COMPILER_VERSION} VERSION_GREATER_EQUAL 13.0)"
FP4 = 'cuda_archs_loose_intersection(FP4_ARCHS "{}" "${{CUDA_ARCHS}}")\n'
DEFAULT_TARGET = parse_target("sm_121")


def _rule_file(folder: Path, body: str, name: str = "r.yaml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(body)
    return folder


def _one_rule(tmp_path: Path, body: str) -> patch.Rule:
    (rule,) = load_rules(_rule_file(tmp_path / "rules", body))
    return rule


REWRITE = "name: r\nfamily: '^FP4\\w*ARCHS$'\nfiles: [CMakeLists.txt]\n"


def _guard(written: str, arch_list: str, kind: str = "quoted",
           targets: tuple[str, ...] = ()) -> Guard:
    arg = Argument(kind, written, 0, 0)  # type: ignore[arg-type]
    call = Call("CMakeLists.txt", 1, "cuda_archs_loose_intersection", "FP4_ARCHS", arch_list,
                arg, (arch_list, "${CUDA_ARCHS}"), "", (), "", True)
    return Guard(call, targets)


# --- rules: loading and validation ----------------------------------------------------------

def test_a_rule_as_loaded(tmp_path: Path) -> None:
    body = (REWRITE + "rewrite: ['{arch}a', '12.0a;12.1a']\nproject: vllm-flash-attn\n"
            "targets: [_a, _b]\nexceptions:\n"
            "  - {file: x.cmake, find: 'a  (b )', replace: c, count: [1, 3], versions: '>=0.5'}\n"
            "  - {file: y.cmake, find: d, replace: e, count: 2, versions: '<0.5',\n"
            "     if_exists: true}\n")
    rule = _one_rule(tmp_path, body)
    assert (rule.name, rule.family.pattern, rule.files, rule.rewrite, rule.action) == (
        "r", "^FP4\\w*ARCHS$", ("CMakeLists.txt",), ("{arch}a", "12.0a;12.1a"), "rewrite")
    assert (rule.project, rule.targets) == ("vllm-flash-attn", ("_a", "_b"))
    assert rule.digest == hashlib.sha256(body.encode()).hexdigest()
    first, second = rule.exceptions
    assert (first.file, first.find, first.replace, first.counts, str(first.versions),
            first.if_exists) == ("x.cmake", "a  (b )", "c", (1, 3), ">=0.5", False)
    assert (second.counts, second.if_exists) == ((2,), True)
    assert [p.file for p in rule.exceptions_for(Version("0.6"))] == ["x.cmake"]
    assert [p.file for p in rule.exceptions_for(Version("0.4"))] == ["y.cmake"]
    assert [p.file for p in rule.exceptions_for(Version("0.7.0rc1"))] == ["x.cmake"]


def test_rule_defaults_and_the_add_action(tmp_path: Path) -> None:
    rule = _one_rule(tmp_path, REWRITE + "add: ['{arch}', '12.0', '12.0a;12.0f']\n")
    assert (rule.action, rule.rewrite, rule.project, rule.targets, rule.exceptions) == (
        "add", ("{arch}", "12.0", "12.0a;12.0f"), "vllm", (), ())


def test_rules_load_sorted_and_once_per_folder(tmp_path: Path) -> None:
    folder = _rule_file(tmp_path / "rules", REWRITE.replace("name: r", "name: b") +
                        "rewrite: ['{arch}a']\n", "b.yaml")
    _rule_file(folder, REWRITE.replace("name: r", "name: a") + "rewrite: ['{arch}a']\n", "a.yaml")
    _rule_file(folder, "not a rule", "notes.txt")
    assert [r.name for r in load_rules(folder)] == ["a", "b"]
    (folder / "c.yaml").write_text("broken: [")
    assert [r.name for r in load_rules(folder)] == ["a", "b"]  # cached: read once


@pytest.mark.parametrize(("body", "message"), [
    ("- a list\n", "expected a mapping"),
    (REWRITE + "rewrite: ['{arch}a']\nextra: 1\nother: 2\n", "unknown key(s) extra, other"),
    (REWRITE, "give exactly one of rewrite: (replace 12.x entries) or add: (append a 12.x "
              "entry)"),
    (REWRITE + "rewrite: ['{arch}a']\nadd: ['12.0']\n", "give exactly one of rewrite:"),
    (REWRITE + "rewrite: '{arch}a'\n", "rewrite must be a non-empty list of strings, got "
                                       "'{arch}a'"),
    (REWRITE + "rewrite: ['']\n", "rewrite must be a non-empty list of strings"),
    (REWRITE + "rewrite: [1]\n", "rewrite must be a non-empty list of strings"),
    (REWRITE + "rewrite: ['12.1']\n", "rewrite form '12.1' is not arch-specific 12.x entries "
                                      "(e.g. '{arch}a', '12.0a')"),
    (REWRITE + "rewrite: ['12.0a;9.0a']\n", "rewrite form '12.0a;9.0a' is not"),
    (REWRITE + "rewrite: ['x12.0a']\n", "rewrite form 'x12.0a' is not"),
    (REWRITE + "rewrite: ['{arch}ab']\n", "rewrite form '{arch}ab' is not"),
    (REWRITE + "add: ['{arch}+PTX']\n", "add form '{arch}+PTX' is not 12.x entries (e.g. "
                                        "'{arch}', '12.0')"),
    (REWRITE + "rewrite: ['{arch}a']\nproject: flash\n",
     "project 'flash' is not one of vllm, vllm-flash-attn"),
    (REWRITE + "rewrite: ['{arch}a']\ntargets: []\n", "targets must be a non-empty list"),
    (REWRITE.replace("files: [CMakeLists.txt]", "files: CMakeLists.txt") +
     "rewrite: ['{arch}a']\n", "files must be a non-empty list of strings"),
    (REWRITE.replace("name: r\n", "") + "rewrite: ['{arch}a']\n", "'name'"),
    (REWRITE.replace("\\w*ARCHS$", "(") + "rewrite: ['{arch}a']\n",
     "missing ), unterminated subpattern"),
    (REWRITE + "rewrite: ['{arch}a']\nexceptions:\n  - {file: x, find: a, replace: b, count: 0,"
               " versions: '>1'}\n", "count must be a positive integer or a list of them, "
                                     "got 0"),
    (REWRITE + "rewrite: ['{arch}a']\nexceptions:\n  - {file: x, find: a, replace: b, count: [],"
               " versions: '>1'}\n", "count must be a positive integer"),
    (REWRITE + "rewrite: ['{arch}a']\nexceptions:\n  - {file: x, find: a, replace: b, "
               "count: [1, x], versions: '>1'}\n", "count must be a positive integer"),
    (REWRITE + "rewrite: ['{arch}a']\nexceptions:\n  - {file: x, find: a, replace: b, count: 1,"
               " versions: 'soon'}\n", "Invalid specifier"),
    ("name: [\n", "while parsing"),
])
def test_a_malformed_rule_is_one_error_naming_the_file(tmp_path: Path, body: str,
                                                        message: str) -> None:
    folder = _rule_file(tmp_path / "rules", body)
    with pytest.raises(Sm121Error) as error:
        load_rules(folder)
    prefix = f"patch rule {folder / 'r.yaml'} is malformed: "
    assert str(error.value).startswith(prefix)
    assert str(error.value)[len(prefix):].lstrip("\"'").startswith(message.lstrip("'"))


def test_the_shipped_rules_and_their_digest() -> None:
    rules = load_rules()
    assert [r.name for r in rules] == ["fp4-sm12x-arch-specific"]
    assert [(m.name, m.projects) for m in patch.load_macro_rules()] == [
        ("sass-from-ptx", ("vllm", "vllm-flash-attn"))]
    texts = [p.read_text() for p in sorted((patch.patches_dir()).glob("*.yaml"))]
    joined = "".join(hashlib.sha256(t.encode()).hexdigest() for t in texts)
    assert rules_digest() == hashlib.sha256(joined.encode()).hexdigest()[:16]
    assert [r.name for r in rules_for()] == ["fp4-sm12x-arch-specific"]
    assert [r.name for r in rules_for("vllm-flash-attn")] == []
    assert fixable_targets() == {"_vllm_fa2_C": "sass-from-ptx"}


def test_covered_and_breaks_ptxas() -> None:
    def guard(variable: str, targets: tuple[str, ...]) -> Guard:
        call = Call("x", 1, "f", variable, "", None, None, "", (), "", True)
        return Guard(call, targets)

    assert covered(guard("NVFP4_BLOCKSCALE_ARCHS", ()))
    assert covered(guard("QUTLASS_ARCHS", ()))
    assert not covered(guard("SCALED_MM_ARCHS", ()))
    assert not covered(guard("XFP4_ARCHS", ()))
    assert not covered(guard("FA2_ARCHS", ()))
    assert not covered(guard("FA2_ARCHS", ()), "vllm-flash-attn")  # sass-from-ptx: no guard
    assert breaks_ptxas(guard("FP4_ARCHS", ("9.0", "12.1")))
    assert not breaks_ptxas(guard("FP4_ARCHS", ("12.1a",)))
    assert not breaks_ptxas(guard("SCALED_MM_ARCHS", ("12.1",)))
    assert not breaks_ptxas(guard("FA2_ARCHS", ("12.1",)))  # an add rule: not a ptxas matter


@pytest.mark.usefixtures("fa2_add_rule")
def test_a_rule_needs_and_covers() -> None:
    fp4, = rules_for()
    fa2, = rules_for("vllm-flash-attn")
    assert fp4.needs(_guard("", "", targets=("12.1",)), DEFAULT_TARGET)
    assert not fp4.needs(_guard("", "", targets=("12.1a",)), DEFAULT_TARGET)
    assert fa2.needs(_guard("", "", targets=("8.0+PTX",)), DEFAULT_TARGET)
    assert fa2.needs(_guard("", "", targets=()), DEFAULT_TARGET)
    assert not fa2.needs(_guard("", "", targets=("12.0",)), DEFAULT_TARGET)
    assert not fa2.needs(Guard(_guard("", "").call, None), DEFAULT_TARGET)  # not evaluable
    assert not fa2.needs(Guard(_guard("", "").call, (), taken=False), DEFAULT_TARGET)


# --- helpers ----------------------------------------------------------------------------------

def test_tolerant_matches_any_whitespace_also_around_parentheses() -> None:
    pattern = _tolerant('set(FP4  "12.0f" )')
    for text in ('set(FP4 "12.0f")', 'set(  FP4\n   "12.0f"\t)', 'set(\nFP4 "12.0f"\n)'):
        assert pattern.fullmatch(text), text
    assert not pattern.fullmatch('set(FP4"12.0f")')
    spaced = _tolerant('set( FP4 )')
    assert spaced.fullmatch("set(FP4)") and spaced.fullmatch("set(\n  FP4\n)")
    assert not pattern.fullmatch('set(FP4 "12.0a")')
    assert _tolerant("a.b").fullmatch("a.b") and not _tolerant("a.b").fullmatch("axb")


@pytest.mark.parametrize(("archs", "gpu"), [
    ("12.1", "sm_121"), ("9.0;12.1a", "sm_121"), ("12.0f;12.1", "sm_120"), ("9.0;8.0", "sm_121"),
    ("", "sm_121"), ("8.0+PTX;12.0", "sm_120"),
])
def test_target_gpu(archs: str, gpu: str) -> None:
    assert target_gpu(ArchList.parse(archs)) == parse_target(gpu)


@pytest.mark.parametrize("text", ["12.1b", "x12.0", '12.1")', "12.1\"", "１２.１"])
def test_what_is_no_arch_list_never_reaches_the_guards(text: str) -> None:
    """The guards and rules take an `ArchList`: what is not one is refused where it is
    parsed, so no CMake script is written with it."""
    with pytest.raises(Sm121Error, match="unknown arch"):
        ArchList.parse(text)


def test_parse_version() -> None:
    assert parse_version("0.19.1") == Version("0.19.1")
    with pytest.raises(Sm121Error) as error:
        parse_version("nightly")
    assert str(error.value) == "vLLM version 'nightly' is not a PEP 440 version"


@pytest.mark.parametrize(("form", "archs", "entries"), [
    ("{arch}a", "12.1", ["12.1a"]),
    ("{arch}a", "9.0;12.1;12.0f;12.1a", ["12.1a", "12.0a"]),
    ("12.0a", "12.1", ["12.0a"]),
    ("12.0a;{arch}a;12.0a", "12.1", ["12.0a", "12.1a"]),
    ("{arch}a", "9.0", []),
    ("{arch}", "9.0;12.0+PTX", ["12.0"]),
    ("12.0a", "9.0", ["12.0a"]),
])
def test_candidate_entries(form: str, archs: str, entries: list[str]) -> None:
    assert candidate_entries(form, ArchList.parse(archs)) == entries


@pytest.mark.parametrize(("written", "expanded", "entries", "new"), [
    ("10.0f;12.0f", "10.0f;12.0f", ["12.1a"], "10.0f;12.1a"),
    ("12.0f;10.0f;12.1", "12.0f;10.0f;12.1", ["12.1a", "12.0a"], "12.1a;12.0a;10.0f"),
    ("${SM100};12.0f", "10.0f;12.0f", ["12.1a"], "${SM100};12.1a"),  # kept as written
    ("${FP4}", "10.0f;12.0f", ["12.1a"], "10.0f;12.1a"),  # 12.x only in the variable
    ("9.0;9.0;12.0f", "9.0;9.0;12.0f", ["12.1a", "9.0"], "9.0;12.1a"),
    ("112.0;12.0f", "112.0;12.0f", ["12.1a"], "112.0;12.1a"),
])
def test_rewritten_list(written: str, expanded: str, entries: list[str], new: str) -> None:
    assert rewritten_list(_guard(written, expanded), entries) == new


@pytest.mark.parametrize(("written", "expanded", "entries", "new"), [
    ("8.0+PTX", "8.0+PTX", ["12.1"], "8.0+PTX;12.1"),
    ("8.0+PTX;12.0", "8.0+PTX;12.0", ["12.0", "12.1"], "8.0+PTX;12.0;12.1"),
    ("${FA2}", "8.0+PTX;9.0", ["12.0"], "8.0+PTX;9.0;12.0"),
    (";8.0;", ";8.0;", ["12.0"], "8.0;12.0"),
])
def test_added_list(written: str, expanded: str, entries: list[str], new: str) -> None:
    assert added_list(_guard(written, expanded), entries) == new


# --- the decision --------------------------------------------------------------------------------

def test_applied_in_check_mode_writes_nothing_and_gives_the_diff(tmp_path: Path) -> None:
    text = f"{GE13}\n  " + FP4.format("10.0f;12.0f") + "endif()\n"
    source = _tree(tmp_path, text)
    (result,) = apply_all(source, PatchFor("0.99.0", ARCHS_121), check=True)
    assert (result.name, result.outcome, result.replacements, result.action) == (
        "fp4-sm12x-arch-specific", "applied", 1, "rewrite")
    assert result.detail == "1 guard call(s) rewritten in 1 file(s)"
    assert result.diff == (
        "--- a/CMakeLists.txt\n+++ b/CMakeLists.txt\n@@ -1,3 +1,3 @@\n"
        f" {GE13}\n"
        '-  cuda_archs_loose_intersection(FP4_ARCHS "10.0f;12.0f" "${CUDA_ARCHS}")\n'
        '+  cuda_archs_loose_intersection(FP4_ARCHS "10.0f;12.1a" "${CUDA_ARCHS}")\n'
        " endif()\n")
    assert (source / "CMakeLists.txt").read_text() == text
    (rewrite,) = result.rewrites
    assert (rewrite.guard.line, rewrite.new_list, rewrite.result) == (2, "10.0f;12.1a", ("12.1a",))
    assert [g.targets for g in result.before] == [("12.1",)]
    assert [g.targets for g in result.after] == [("12.1a",)]
    assert list(tmp_path.rglob(".sm121-*")) == []


def test_the_first_form_that_works_is_taken(tmp_path: Path) -> None:
    source = _tree(tmp_path, FP4.format("12.0f"))
    # the fixture's "12.0f" gives plain 12.1: that form is tried and passed over
    rule = _one_rule(tmp_path, REWRITE + "rewrite: ['12.0f', '12.1a;12.0a', '{arch}a']\n")
    result = apply_rule(rule, source, PatchFor("0.99.0", ARCHS_121))
    assert [(r.new_list, r.result) for r in result.rewrites] == [("12.1a;12.0a", ("12.1a",))]
    assert (source / "CMakeLists.txt").read_text() == FP4.format("12.1a;12.0a")


def test_no_form_that_works_is_drift(tmp_path: Path) -> None:
    text = FP4.format("12.0f")
    source = _tree(tmp_path, text)
    rule = _one_rule(tmp_path, REWRITE + "rewrite: ['12.0f', '12.1f;12.0f']\n")
    with pytest.raises(PatchDrift) as error:
        apply_rule(rule, source, PatchFor("0.99.0", ARCHS_121))
    assert str(error.value) == ("CMakeLists.txt:1: no form of rule r stops FP4_ARCHS giving a "
                                "plain 12.x target (tried 12.0f, 12.1f;12.0f)")
    assert (source / "CMakeLists.txt").read_text() == text


@pytest.mark.parametrize(("text", "archs", "cuda", "outcome", "detail"), [
    (FP4.format("12.0f"), "12.1a", "13.0", "not needed",
     "no guard the rule covers gives a plain 12.x target for 12.1a with CUDA 13.0"),
    (FP4.format("12.0a"), "12.1", "13.0", "not needed",
     "no guard the rule covers gives a plain 12.x target for 12.1 with CUDA 13.0"),
    (FP4.format("10.0f;12.0f"), "9.0", "12.9", "not needed",
     "no guard the rule covers gives a plain 12.x target for 9.0 with CUDA 12.9"),
    (FP4.format("10.0f"), "12.1", "13.0", "not applicable",
     "no guard the rule covers has an SM12x entry in this source"),
    ('cuda_archs_loose_intersection(SCALED_MM_ARCHS "12.0f" "${CUDA_ARCHS}")\n', "12.1", "13.0",
     "not applicable", "no guard the rule covers has an SM12x entry in this source"),
    (f"{GE13}\n" + FP4.format("12.0f") + "endif()\n", "12.1", "12.9", "not applicable",
     "no guard the rule covers has an SM12x entry in this source"),
    ('set(L "9.0")\nlist(APPEND L "10.0f")\n'
     'cuda_archs_loose_intersection(FP4_ARCHS "${L}" "${CUDA_ARCHS}")\n', "12.1", "13.0",
     "not applicable", "no guard the rule covers has an SM12x entry in this source"),
])
def test_nothing_to_do(tmp_path: Path, text: str, archs: str, cuda: str, outcome: str,
                       detail: str) -> None:
    source = _tree(tmp_path, text)
    (result,) = apply_all(source, PatchFor("0.99.0", ArchList.parse(archs), cuda))
    assert (result.outcome, result.detail, result.replacements, result.diff,
            result.rewrites) == (outcome, detail, 0, "", [])
    assert result.after == result.before
    assert (source / "CMakeLists.txt").read_text() == text


def test_a_relevant_guard_giving_nothing_is_not_needed(tmp_path: Path) -> None:
    """An SM12x entry in the list makes the guard relevant even when it gives nothing."""
    source = _tree(tmp_path, FP4.format("12.0a"))
    (result,) = apply_all(source, PatchFor("0.99.0", ArchList.parse("9.0")))
    assert result.outcome == "not needed"


def test_a_guard_without_12x_entries_that_gives_12x_is_relevant(tmp_path: Path) -> None:
    # the fixture's guard has no `+` semantics: a variable list giving plain 12.1 is rewritten
    source = _tree(tmp_path, 'set(L "12.1")\n'
                             'cuda_archs_loose_intersection(FP4_ARCHS "${L}" "${CUDA_ARCHS}")\n')
    (result,) = apply_all(source, PatchFor("0.99.0", ARCHS_121))
    assert result.outcome == "applied"


def test_bracket_and_unquoted_arguments_keep_their_kind(tmp_path: Path) -> None:
    text = ('cuda_archs_loose_intersection(FP4_ARCHS [==[10.0f;12.0f]==] "${CUDA_ARCHS}")\n'
            'cuda_archs_loose_intersection(NVFP4_ARCHS 12.0f "${CUDA_ARCHS}")\n'
            'cuda_archs_loose_intersection(MXFP4_ARCHS [[12.0f]] "${CUDA_ARCHS}")\n')
    source = _tree(tmp_path, text)
    (result,) = apply_all(source, PatchFor("0.99.0", ARCHS_121))
    assert (source / "CMakeLists.txt").read_text() == (
        'cuda_archs_loose_intersection(FP4_ARCHS [==[10.0f;12.1a]==] "${CUDA_ARCHS}")\n'
        'cuda_archs_loose_intersection(NVFP4_ARCHS 12.1a "${CUDA_ARCHS}")\n'
        'cuda_archs_loose_intersection(MXFP4_ARCHS [[12.1a]] "${CUDA_ARCHS}")\n')
    assert (result.replacements, result.detail) == (3, "3 guard call(s) rewritten in 1 file(s)")


def test_rewrites_that_change_a_lists_length_in_one_file(tmp_path: Path) -> None:
    """Each rewrite lands at its own call: the ones after a longer list are not shifted."""
    text = (FP4.format("12.0f") + "# between\n" + FP4.replace("FP4_", "NVFP4_").format("12.0f")
            + FP4.replace("FP4_", "MXFP4_").format("10.0f;12.0f"))
    source = _tree(tmp_path, text)
    (result,) = apply_all(source, PatchFor("0.99.0", ArchList.parse("12.1;12.0")))
    assert result.replacements == 3
    assert (source / "CMakeLists.txt").read_text() == text.replace('"12.0f"', '"12.1a;12.0a"') \
        .replace('"10.0f;12.0f"', '"10.0f;12.1a;12.0a"')
    assert [g.targets for g in result.after] == [("12.1a", "12.0a")] * 3


def test_two_files_are_written_together(tmp_path: Path) -> None:
    source = _tree(tmp_path, FP4.format("12.0f"), q=FP4.replace("FP4_", "QUTLASS_").format(
        "12.0f;10.0f"))
    (result,) = apply_all(source, PatchFor("0.99.0", ARCHS_121))
    assert result.detail == "2 guard call(s) rewritten in 2 file(s)"
    assert (source / "cmake" / "q.cmake").read_text() == FP4.replace("FP4_", "QUTLASS_").format(
        "12.1a;10.0f")
    assert result.diff == (
        "--- a/CMakeLists.txt\n+++ b/CMakeLists.txt\n@@ -1 +1 @@\n-" + FP4.format("12.0f") +
        "+" + FP4.format("12.1a") + "--- a/cmake/q.cmake\n+++ b/cmake/q.cmake\n@@ -1 +1 @@\n-"
        + FP4.replace("FP4_", "QUTLASS_").format("12.0f;10.0f") + "+"
        + FP4.replace("FP4_", "QUTLASS_").format("12.1a;10.0f"))


def test_a_wrapper_that_gives_12x_cannot_be_rewritten(tmp_path: Path) -> None:
    source = _tree(tmp_path, 'fp4_archs(FP4_ARCHS "${CUDA_ARCHS}")\n')
    with (source / "cmake" / "utils.cmake").open("a") as utils:
        utils.write('function(fp4_archs OUT TGT)\n'
                    '  cuda_archs_loose_intersection(${OUT} "12.0f;9.0" "${TGT}")\n'
                    '  set(${OUT} ${${OUT}} PARENT_SCOPE)\nendfunction()\n')
    with pytest.raises(PatchDrift) as error:
        apply_all(source, PatchFor("0.99.0", ArchList.parse("12.1;12.0;9.0")))
    assert str(error.value) == (
        "CMakeLists.txt:1: FP4_ARCHS gives plain 12.1;12.0 through fp4_archs, whose list is inside "
        "that function: rule fp4-sm12x-arch-specific cannot rewrite it")


def test_an_unreadable_covered_guard_is_drift(tmp_path: Path) -> None:
    source = _tree(tmp_path, 'cuda_archs_loose_intersection(FP4_ARCHS "${UNSET}" '
                             '"${CUDA_ARCHS}")\n')
    with pytest.raises(PatchDrift) as error:
        apply_all(source, PatchFor("0.99.0", ARCHS_121))
    assert str(error.value) == (
        "CMakeLists.txt:1: cannot evaluate FP4_ARCHS (${UNSET} is not set once to a literal list "
        "in the scanned files); rule fp4-sm12x-arch-specific covers it, so not building blind")
    other = _tree(tmp_path / "b", 'cuda_archs_loose_intersection(MM_ARCHS "${UNSET}" '
                                  '"${CUDA_ARCHS}")\n')
    assert apply_all(other, PatchFor("0.99.0", ARCHS_121))[0].outcome == "not applicable"


def test_a_call_an_exception_brings_is_rewritten_too(tmp_path: Path) -> None:
    """Guards are found after the version-keyed exceptions: a call one adds is decided too."""
    rule = _one_rule(tmp_path, REWRITE + """rewrite: ['{arch}a']
exceptions:
  - {file: CMakeLists.txt, find: 'set(X 1)', count: 1, versions: '>0',
     replace: 'cuda_archs_loose_intersection(FP4_LATE_ARCHS "12.0f;12.0f" "${CUDA_ARCHS}")'}
""")
    source = _tree(tmp_path, "set(X 1)\n" + FP4.format("12.0f"))
    result = apply_rule(rule, source, PatchFor("0.99.0", ARCHS_121))
    assert result.outcome == "applied" and len(result.rewrites) == 2
    assert result.replacements == 3  # two calls and the exception's file
    assert (source / "CMakeLists.txt").read_text() == (
        'cuda_archs_loose_intersection(FP4_LATE_ARCHS "12.1a" "${CUDA_ARCHS}")\n'
        + FP4.format("12.1a"))


# --- exceptions -----------------------------------------------------------------------------------

EXCEPTION = REWRITE + """rewrite: ['{{arch}}a']
exceptions:
  - file: {file}
    versions: "=={version}"
    find: 'set(FP4_LIST   "9.0a")'
    replace: 'set(FP4_LIST "12.0f") # \\1'
    count: {count}
{extra}"""
LISTED = ('set(FP4_LIST "9.0a")\n'
          'cuda_archs_loose_intersection(FP4_ARCHS "${FP4_LIST}" "${CUDA_ARCHS}")\n')


def _exception_rule(tmp_path: Path, file: str = "CMakeLists.txt", count: str = "1",
                    extra: str = "") -> patch.Rule:
    return _one_rule(tmp_path, EXCEPTION.format(file=file, version="0.5.0", count=count,
                                                extra=extra))


def test_an_exception_is_applied_literally_and_counted(tmp_path: Path) -> None:
    source = _tree(tmp_path, LISTED)
    result = apply_rule(_exception_rule(tmp_path), source, PatchFor("0.5.0", ARCHS_121))
    assert (source / "CMakeLists.txt").read_text() == (
        'set(FP4_LIST "12.0f") # \\1\n'
        'cuda_archs_loose_intersection(FP4_ARCHS "12.1a" "${CUDA_ARCHS}")\n')
    assert (result.outcome, result.replacements) == ("applied", 2)


def test_an_exception_for_another_version_is_not_applied(tmp_path: Path) -> None:
    source = _tree(tmp_path, LISTED)
    result = apply_rule(_exception_rule(tmp_path), source, PatchFor("0.5.1", ARCHS_121))
    assert (result.outcome, result.replacements) == ("not applicable", 0)
    assert (source / "CMakeLists.txt").read_text() == LISTED


def test_an_exception_alone_is_applied(tmp_path: Path) -> None:
    text = 'set(FP4_LIST "9.0a")\n'
    source = _tree(tmp_path, text)
    result = apply_rule(_exception_rule(tmp_path), source, PatchFor("0.5.0", ARCHS_121))
    assert (result.outcome, result.replacements, result.rewrites) == ("applied", 1, [])
    assert result.detail == "0 guard call(s) rewritten in 1 file(s)"


@pytest.mark.parametrize(("count", "found"), [("2", "1"), ("[2, 3]", "1")])
def test_an_exception_matching_another_count_is_drift(tmp_path: Path, count: str,
                                                      found: str) -> None:
    source = _tree(tmp_path, LISTED)
    with pytest.raises(PatchDrift) as error:
        apply_rule(_exception_rule(tmp_path, count=count), source, PatchFor("0.5.0", ARCHS_121))
    expected = " or ".join(re.findall(r"\d", count))
    assert str(error.value) == (
        f"patch drift in CMakeLists.txt for vLLM 0.5.0: expected {expected} match(es) of "
        f"'set(FP4_LIST \"9.0a\")', found {found}; not building unpatched")  # one line
    assert (source / "CMakeLists.txt").read_text() == LISTED


def test_an_exception_may_match_one_of_several_counts(tmp_path: Path) -> None:
    source = _tree(tmp_path, LISTED)
    result = apply_rule(_exception_rule(tmp_path, count="[2, 1]"), source,
            PatchFor("0.5.0", ARCHS_121))
    assert result.outcome == "applied"


def test_an_exception_for_a_missing_file(tmp_path: Path) -> None:
    source = _tree(tmp_path, LISTED)
    rule = _exception_rule(tmp_path, file="cmake/gone.cmake")
    with pytest.raises(PatchDrift) as error:
        apply_rule(rule, source, PatchFor("0.5.0", ARCHS_121))
    assert str(error.value) == "patch drift: cmake/gone.cmake missing in vLLM 0.5.0 source"
    optional = _exception_rule(tmp_path / "b", file="cmake/gone.cmake",
                               extra="    if_exists: true\n")
    assert apply_rule(optional, source, PatchFor("0.5.0", ARCHS_121)).outcome == "not applicable"
    then = _exception_rule(tmp_path / "c", file="cmake/gone.cmake", extra=(
        "    if_exists: true\n  - {file: CMakeLists.txt, find: 'set(FP4_LIST \"9.0a\")', "
        "replace: 'set(FP4_LIST \"12.0f\")', count: 1, versions: '>0'}\n"))
    result = apply_rule(then, source, PatchFor("0.5.0", ARCHS_121))  # the next one still applies
    assert (result.outcome, result.replacements) == ("applied", 2)


# --- writing all files or none --------------------------------------------------------------------

def test_write_all_keeps_modes_and_leaves_no_temporary_files(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "b.sh").write_text("b")
    (tmp_path / "b.sh").chmod(0o750)
    _write_all(tmp_path, {"a.txt": "A", "b.sh": "B"})
    assert (tmp_path / "a.txt").read_text() == "A" and (tmp_path / "b.sh").read_text() == "B"
    assert stat.S_IMODE((tmp_path / "b.sh").stat().st_mode) == 0o750
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.sh"]


def test_write_all_stages_each_file_beside_its_target(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """os.replace is atomic only within a filesystem: the staged file sits next to its target."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "a").write_text("a")
    (tmp_path / "sub" / "b").write_text("b")
    renames: list[tuple[Path, Path]] = []
    real = os.replace

    def record(src: str, dst: str) -> None:
        renames.append((Path(src), Path(dst)))
        real(src, dst)

    monkeypatch.setattr(patch.os, "replace", record)
    _write_all(tmp_path, {"a": "A", "sub/b": "B"})
    assert [(s.parent, s.name.startswith(".sm121-"), d) for s, d in renames] == [
        (tmp_path, True, tmp_path / "a"), (tmp_path / "sub", True, tmp_path / "sub" / "b")]


def test_write_all_rolls_back_after_an_oserror(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("a", "b", "c"):
        (tmp_path / name).write_text(name)
    real = os.replace
    done: list[str] = []

    def fail_third(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        if len(done) == 2:
            raise OSError(28, "No space left on device")
        real(src, dst)
        done.append(str(dst))

    monkeypatch.setattr(patch.os, "replace", fail_third)
    with pytest.raises(OSError, match="No space left"):
        _write_all(tmp_path, {"a": "A", "b": "B", "c": "C"})
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {"a": "a", "b": "b", "c": "c"}


def test_write_all_stages_nothing_when_a_folder_is_read_only(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              ) -> None:
    (tmp_path / "a").write_text("a")
    (tmp_path / "b").write_text("b")
    made: list[str] = []
    real = patch.tempfile.mkstemp

    def second_fails(*args: object, **kwargs: object) -> tuple[int, str]:
        if made:
            raise PermissionError(13, "Permission denied")
        handle, name = real(*args, **kwargs)  # type: ignore[call-overload]
        made.append(name)
        return handle, name  # type: ignore[no-any-return]

    monkeypatch.setattr(patch.tempfile, "mkstemp", second_fails)
    with pytest.raises(PermissionError):
        _write_all(tmp_path, {"a": "A", "b": "B"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]
    assert (tmp_path / "a").read_text() == "a"


def test_a_failed_write_leaves_the_tree_as_it_was(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    q = FP4.replace("FP4_", "QUTLASS_").format("12.0f")
    source = _tree(tmp_path, FP4.format("12.0f"), q=q)
    calls = []

    def fail_second(src: str, dst: str) -> None:
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(5, "I/O error")
        os.rename(src, dst)

    monkeypatch.setattr(patch.os, "replace", fail_second)
    with pytest.raises(OSError):
        apply_all(source, PatchFor("0.99.0", ARCHS_121))
    assert (source / "CMakeLists.txt").read_text() == FP4.format("12.0f")
    assert (source / "cmake" / "q.cmake").read_text() == q


# --- around the rules --------------------------------------------------------------------------

def test_read_source_version(tmp_path: Path) -> None:
    assert read_source_version(tmp_path) is None
    (tmp_path / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.19.1\n")
    assert read_source_version(tmp_path) == "0.19.1"
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "_version.py").write_text("x = 1\n")
    assert read_source_version(tmp_path) == "0.19.1"  # no version in it: PKG-INFO
    (tmp_path / "vllm" / "_version.py").write_text("__version__ = version = '0.20.0'\n")
    assert read_source_version(tmp_path) == "0.20.0"


@pytest.mark.usefixtures("fa2_add_rule")
def test_the_build_patch_step_lines(tmp_path: Path) -> None:
    """vLLM's rules, then flash-attention's for the archs vLLM narrows the request to."""
    source = _tree(tmp_path, f'{GE13}\n  set(CUDA_SUPPORTED_ARCHS "9.0;12.0")\nendif()\n'
                             'cuda_archs_loose_intersection(CUDA_ARCHS "${CUDA_SUPPORTED_ARCHS}" '
                             '"${CUDA_ARCHS}")\n' + FP4.format("12.0a"))
    fa = Path(shutil.copytree(DATA / "fa_like", tmp_path / "fa"))
    lines = apply_for_build(source, {"vllm-flash-attn": fa},
            PatchFor("0.99.0", ArchList.parse("12.1;12.0"), "13.0", DEFAULT_TARGET))
    assert lines == [
        "fp4-sm12x-arch-specific: not needed (no guard the rule covers gives a plain 12.x "
        "target for 12.1;12.0 with CUDA 13.0)",
        "fa2-sm12x-native (vllm-flash-attn, CUDA_ARCHS 12.0): applied (1 guard call(s) given a "
        "target in 1 file(s))"]
    assert '"8.0+PTX;12.0"' in (fa / "CMakeLists.txt").read_text()
    plain = _tree(tmp_path / "b", FP4.format("12.0f"))
    assert apply_for_build(plain, {}, PatchFor("0.99.0", ARCHS_121, "12.9", DEFAULT_TARGET)) == [
        "fp4-sm12x-arch-specific: applied (1 guard call(s) rewritten in 1 file(s))"]


@pytest.mark.usefixtures("fa2_add_rule")
def test_an_add_rule_reports_the_gpu(tmp_path: Path) -> None:
    fa = Path(shutil.copytree(DATA / "fa_like", tmp_path / "fa"))
    text = (fa / "CMakeLists.txt").read_text().replace('"8.0+PTX"', '"8.0+PTX;12.0"')
    (fa / "CMakeLists.txt").write_text(text)
    (result,) = apply_all(fa,
            PatchFor("0.19.1", ARCHS_121, gpu=DEFAULT_TARGET), project="vllm-flash-attn")
    assert (result.outcome, result.detail, result.action) == (
        "not needed", "no guard the rule covers gives sm_121 no native code for 12.1 with CUDA "
        "13.0", "add")
    (result,) = apply_all(fa, PatchFor("0.19.1", ArchList.parse("9.0")), project="vllm-flash-attn")
    assert result.detail == "no guard the rule covers is built for a 9.0 build here"


def test_a_rule_sees_only_its_files_and_the_copy_brings_utils(tmp_path: Path) -> None:
    rule = _one_rule(tmp_path, REWRITE + "rewrite: ['{arch}a']\n")
    assert rule.files == ("CMakeLists.txt",)
    outside = FP4.replace("FP4_", "FP4_OUTSIDE_").format("12.0f")
    source = _tree(tmp_path, FP4.format("12.0f"), other=outside)
    result = apply_rule(rule, source, PatchFor("0.99.0", ARCHS_121))
    assert [(g.variable, g.targets) for g in result.before] == [("FP4_ARCHS", ("12.1",))]
    assert [g.targets for g in result.after] == [("12.1a",)]
    assert (source / "cmake" / "other.cmake").read_text() == outside
    assert [(g.variable, g.targets) for g in evaluate(source, ARCHS_121)] == [
        ("FP4_ARCHS", ("12.1a",)), ("FP4_OUTSIDE_ARCHS", ("12.1",))]


def test_a_rule_scanning_only_a_file_under_cmake(tmp_path: Path) -> None:
    """The scratch copy already has cmake/ (the scanned file) and gets utils.cmake beside it."""
    rule = _one_rule(tmp_path, REWRITE.replace("[CMakeLists.txt]", "[cmake/q.cmake]") +
                     "rewrite: ['{arch}a']\n")
    source = _tree(tmp_path, FP4.format("12.0f"), q=FP4.format("10.0f;12.0f"))
    result = apply_rule(rule, source, PatchFor("0.99.0", ARCHS_121))
    assert [r.guard.location for r in result.rewrites] == ["cmake/q.cmake:1"]
    assert (source / "CMakeLists.txt").read_text() == FP4.format("12.0f")
    assert (source / "cmake" / "q.cmake").read_text() == FP4.format("10.0f;12.1a")


# --- add rules, the CUDA version and the GPU --------------------------------------------------

NARROWING = (f'{GE13}\n  set(CUDA_SUPPORTED_ARCHS "9.0;12.0")\nelse()\n'
             '  set(CUDA_SUPPORTED_ARCHS "9.0;12.0;12.1")\nendif()\n'
             'cuda_archs_loose_intersection(CUDA_ARCHS "${CUDA_SUPPORTED_ARCHS}" '
             '"${CUDA_ARCHS}")\n')
ADD = REWRITE + "add: ['{arch}', '12.0']\n"


def test_an_add_rule_follows_what_the_cuda_version_builds(tmp_path: Path) -> None:
    rule = _one_rule(tmp_path, ADD)
    source = _tree(tmp_path, NARROWING + FP4.format("9.0"))
    at13 = apply_rule(rule, source, PatchFor("0.99.0", ArchList.parse("9.0;12.1"), "13.0"))
    assert (at13.outcome, at13.detail) == (
        "not applicable", "no guard the rule covers is built for a 9.0;12.1 build here")
    at129 = apply_rule(rule, source, PatchFor("0.99.0", ArchList.parse("9.0;12.1"), "12.9"))
    assert (at129.outcome, at129.detail, at129.action) == (
        "applied", "1 guard call(s) given a target in 1 file(s)", "add")
    assert [(r.new_list, r.result) for r in at129.rewrites] == [("9.0;12.1", ("9.0", "12.1"))]
    again = apply_rule(rule, source, PatchFor("0.99.0", ArchList.parse("9.0;12.1"), "12.9"))
    assert (again.outcome, again.detail) == (
        "not needed", "no guard the rule covers gives sm_121 no native code for 9.0;12.1 with "
                      "CUDA 12.9")


def test_the_forms_are_tried_for_the_build_s_cuda_version(tmp_path: Path) -> None:
    """With CUDA 12.9 this tree keeps 12.1; "12.0f" then still gives plain 12.1."""
    rule = _one_rule(tmp_path, REWRITE + "rewrite: ['12.0f', '{arch}a']\n")
    source = _tree(tmp_path, NARROWING + FP4.format("12.0f"))
    result = apply_rule(rule, source, PatchFor("0.99.0", ARCHS_121, "12.9"))
    assert [(r.new_list, r.result) for r in result.rewrites] == [("12.1a", ("12.1a",))]


WRAPPED = ('function(fp4_w OUT TGT)\n  cuda_archs_loose_intersection(${OUT} "9.0;12.0a" "${TGT}")\n'
           '  set(${OUT} ${${OUT}} PARENT_SCOPE)\nendfunction()\n')


@pytest.mark.parametrize(("archs", "gives"), [("9.0;12.1;12.0", "9.0;12.0a"), ("12.1", "nothing")])
def test_an_add_rule_cannot_reach_into_a_wrapper(tmp_path: Path, archs: str, gives: str) -> None:
    source = _tree(tmp_path, NARROWING + 'fp4_w(FP4_ARCHS "${CUDA_ARCHS}")\n')
    with (source / "cmake" / "utils.cmake").open("a") as utils:
        utils.write(WRAPPED)
    with pytest.raises(PatchDrift) as error:
        apply_rule(_one_rule(tmp_path, ADD), source,
                   PatchFor("0.99.0", ArchList.parse(archs), "12.9"))
    assert str(error.value) == (
        f"CMakeLists.txt:7: FP4_ARCHS gives {gives} through fp4_w, whose list is inside that "
        "function: rule r cannot add to it")


@pytest.mark.usefixtures("fa2_add_rule")
def test_external_projects_get_the_archs_vllm_hands_them_and_the_gpu(tmp_path: Path) -> None:
    source = _tree(tmp_path, NARROWING)
    fa = Path(shutil.copytree(DATA / "fa_like", tmp_path / "fa"))
    text = (fa / "CMakeLists.txt").read_text().replace('"8.0+PTX"', '"8.0+PTX;12.0"')
    (fa / "CMakeLists.txt").write_text(text)
    for cuda, handed in (("12.9", "9.0;12.0;12.1"), ("13.0", "9.0;12.0")):
        got, (result,) = patch.apply_external(source, fa, "vllm-flash-attn",
                PatchFor("0.99.0", ArchList.parse("9.0;12.0;12.1"), cuda, DEFAULT_TARGET))
        assert str(got) == handed
        assert (result.outcome, result.detail) == (
            "not needed", f"no guard the rule covers gives sm_121 no native code for {handed} "
                          f"with CUDA {cuda}")
    (result,) = apply_all(fa,
            PatchFor("0.99.0", ArchList.parse("12.0"), gpu=DEFAULT_TARGET),
            project="vllm-flash-attn")
    assert "gives sm_121 no native code" in result.detail  # not the sm_120 of 12.0
    assert apply_for_build(source, {"vllm-flash-attn": fa},
            PatchFor("0.99.0", ArchList.parse("12.0"), "12.9", DEFAULT_TARGET)) == [
        "fp4-sm12x-arch-specific: not applicable (no guard the rule covers has an SM12x entry in "
        "this source)",
        "fa2-sm12x-native (vllm-flash-attn, CUDA_ARCHS 12.0): not needed (no guard the rule "
        "covers gives sm_121 no native code for 12.0 with CUDA 12.9)"]


def test_the_build_patch_step_uses_the_build_s_cuda_version(tmp_path: Path) -> None:
    source = _tree(tmp_path, f"{GE13}\nelse()\n  " + FP4.format("12.0f") + "endif()\n")
    assert apply_for_build(source, {}, PatchFor("0.99.0", ARCHS_121, "12.9", DEFAULT_TARGET)) == [
        "fp4-sm12x-arch-specific: applied (1 guard call(s) rewritten in 1 file(s))",
        "sass-from-ptx: not applicable (cmake/utils.cmake defines no set_gencode_flags_for_srcs)"]


# --- the re-evaluation's safety nets (CMake stood in where it would have to disagree) ---------

def test_a_form_that_still_breaks_after_the_rewrite_is_drift(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """STAND-IN: `intersect` says the form works; the real re-evaluation says it does not."""
    monkeypatch.setattr(patch, "intersect",
                        lambda source, archs, lists, cuda: [("12.1a",)] * len(lists))
    text = FP4.format("12.0f") + FP4.replace("FP4_", "FP4_B_").format("12.0f")
    source = _tree(tmp_path, text)
    rule = _one_rule(tmp_path, REWRITE + "rewrite: ['12.0f;12.1f']\n")
    with pytest.raises(PatchDrift) as error:
        apply_rule(rule, source, PatchFor("0.99.0", ArchList.parse("12.1;12.0")))
    assert str(error.value) == ("rule r leaves CMakeLists.txt:1 FP4_ARCHS yielding 12.1;12.0 for "
                                "0.99.0")
    assert (source / "CMakeLists.txt").read_text() == text


def test_an_add_that_still_gives_nothing_is_drift(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """STAND-IN: `intersect` says the added entry gives 12.1; CMake gives nothing."""
    monkeypatch.setattr(patch, "intersect",
                        lambda source, archs, lists, cuda: [("12.1",)] * len(lists))
    source = _tree(tmp_path, FP4.format("8.0a"))
    rule = _one_rule(tmp_path, REWRITE + "add: ['12.5']\n")
    with pytest.raises(PatchDrift) as error:
        apply_rule(rule, source, PatchFor("0.99.0", ArchList.parse("9.0;12.1")))
    assert str(error.value) == "rule r leaves CMakeLists.txt:1 FP4_ARCHS yielding nothing for " \
                               "0.99.0"


def test_a_rewrite_that_would_move_another_family_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """STAND-IN: the re-evaluation reports a guard outside the family giving something new."""
    real = patch._evaluate

    def second_differs(*args: object) -> list[Guard]:
        guards = real(*args)  # type: ignore[arg-type]
        if args[1]:  # the patched copy
            return [Guard(g.call, ("9.0",)) if not g.variable.startswith("FP4") else g
                    for g in guards]
        return guards

    monkeypatch.setattr(patch, "_evaluate", second_differs)
    text = FP4.format("12.0f") + 'cuda_archs_loose_intersection(MM_ARCHS "12.0f" "${CUDA_ARCHS}")\n'
    source = _tree(tmp_path, text)
    with pytest.raises(PatchDrift) as error:
        apply_all(source, PatchFor("0.99.0", ARCHS_121))
    assert str(error.value) == ("rule fp4-sm12x-arch-specific would change guards outside its "
                                "family; not applied")
    assert (source / "CMakeLists.txt").read_text() == text
