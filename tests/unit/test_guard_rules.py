"""The guard rules on synthetic CMake: the shapes nightlies produce, evaluated with real cmake -P.

The guard function is the test fixture's (tests/data/vllm_like/cmake/utils.cmake: vLLM's
semantics for `f`, `a` and plain entries); the rule is the shipped one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from devkit.helpers import ROOT
from devkit.helpers import vllm_like_tree as _source
from sm121_build.core.errors import Sm121Error
from sm121_build.cuda.compat import ArchList
from sm121_build.source.guard_rules import PatchFor, apply_all, apply_rule, load_rules
from sm121_build.source.guards import evaluate, find_calls

ARCHS_121 = ArchList.parse("12.1")  # a Spark's arch list

NEW13 = "if(${CMAKE_CUDA_COMPILER_VERSION} VERSION_GREATER_EQUAL 13.0)"


def _snapshot(source: Path) -> dict[str, str]:
    return {p.relative_to(source).as_posix(): p.read_text()
            for p in sorted(source.rglob("*")) if p.is_file()}


def _changed_lines(before: dict[str, str], after: dict[str, str]) -> list[tuple[str, str, str]]:
    out = []
    for name, text in before.items():
        old, new = text.splitlines(), after[name].splitlines()
        assert len(old) == len(new), name
        out += [(name, a.strip(), b.strip()) for a, b in zip(old, new, strict=True) if a != b]
    return out


def test_renamed_and_new_families_get_only_their_12x_entry_rewritten(tmp_path: Path) -> None:
    source = _source(tmp_path, f"""{NEW13}
  cuda_archs_loose_intersection(NVFP4_BLOCKSCALE_ARCHS "12.0f" "${{CUDA_ARCHS}}")
  cuda_archs_loose_intersection(MXFP4_SM12X_ARCHS "10.0f;11.0f;12.0f" "${{CUDA_ARCHS}}")
  cuda_archs_loose_intersection(SCALED_MM_ARCHS "12.0f" "${{CUDA_ARCHS}}")
endif()
""")
    before = _snapshot(source)
    (result,) = apply_all(source, PatchFor("0.99.0", ARCHS_121))
    assert (result.outcome, result.replacements) == ("applied", 2)
    assert _changed_lines(before, _snapshot(source)) == [
        ("CMakeLists.txt",
         'cuda_archs_loose_intersection(NVFP4_BLOCKSCALE_ARCHS "12.0f" "${CUDA_ARCHS}")',
         'cuda_archs_loose_intersection(NVFP4_BLOCKSCALE_ARCHS "12.1a" "${CUDA_ARCHS}")'),
        ("CMakeLists.txt",
         'cuda_archs_loose_intersection(MXFP4_SM12X_ARCHS "10.0f;11.0f;12.0f" "${CUDA_ARCHS}")',
         'cuda_archs_loose_intersection(MXFP4_SM12X_ARCHS "10.0f;11.0f;12.1a" "${CUDA_ARCHS}")')]
    after = {g.variable: g.result for g in evaluate(source, ARCHS_121)}
    assert after == {"NVFP4_BLOCKSCALE_ARCHS": ("12.1a",), "MXFP4_SM12X_ARCHS": ("12.1a",),
                     "SCALED_MM_ARCHS": ("12.1",)}  # another family: untouched
    patched = _snapshot(source)
    (again,) = apply_all(source, PatchFor("0.99.0", ARCHS_121))
    assert (again.outcome, again.diff) == ("not needed", "")
    assert _snapshot(source) == patched


def test_a_call_split_over_lines_with_comments_is_rewritten_in_place(tmp_path: Path) -> None:
    text = (f"{NEW13}\n  cuda_archs_loose_intersection(   # FP4 for SM12x\n"
            '      FP4_ARCHS  # output\n      "12.0f"   #[[ family ]]\n'
            '      "${CUDA_ARCHS}"\n  )\nendif()\n')
    source = _source(tmp_path, text)
    (result,) = apply_all(source, PatchFor("0.99.0", ARCHS_121))
    assert result.outcome == "applied"
    assert (source / "CMakeLists.txt").read_text() == text.replace('"12.0f"', '"12.1a"')
    (call,) = find_calls(source)
    assert (call.line, call.variable, call.branch) == (2, "FP4_ARCHS", NEW13[3:-1])


def test_nested_if_and_the_cuda_version_branch(tmp_path: Path) -> None:
    text = ('if(VLLM_GPU_LANG STREQUAL "CUDA")\n'
            '  if(${CMAKE_CUDA_COMPILER_VERSION} VERSION_LESS 13.0)\n'
            '    cuda_archs_loose_intersection(FP4_ARCHS "12.0f" "${CUDA_ARCHS}")\n'
            '  else()\n'
            '    cuda_archs_loose_intersection(FP4_ARCHS "12.0f;10.0f" "${CUDA_ARCHS}")\n'
            '  endif()\nendif()\n')
    source = _source(tmp_path, text)
    guards = evaluate(source, ARCHS_121, "13.0")
    assert [(g.line, g.taken, g.targets) for g in guards] == [(3, False, ()), (5, True, ("12.1",))]
    (at13,) = apply_all(source, PatchFor("0.99.0", ARCHS_121), check=True)
    assert [r.guard.line for r in at13.rewrites] == [5]
    assert '"12.1a;10.0f"' in at13.diff and (source / "CMakeLists.txt").read_text() == text
    (at129,) = apply_all(source, PatchFor("0.99.0", ARCHS_121, "12.9"), check=True)
    assert [r.guard.line for r in at129.rewrites] == [3]


def test_a_list_from_a_variable_is_resolved_and_the_call_site_rewritten(tmp_path: Path) -> None:
    text = ('set(FP4_LIST "10.0f;12.0f")\nset(SM100 "10.0f")\n'
            'cuda_archs_loose_intersection(FP4_ARCHS "${FP4_LIST}" "${CUDA_ARCHS}")\n'
            'cuda_archs_loose_intersection(QUTLASS_ARCHS "${SM100};12.0f" "${CUDA_ARCHS}")\n')
    source = _source(tmp_path, text)
    assert [g.targets for g in evaluate(source, ARCHS_121)] == [("12.1",), ("12.1",)]
    (result,) = apply_all(source, PatchFor("0.99.0", ARCHS_121))
    assert (source / "CMakeLists.txt").read_text().splitlines() == [
        'set(FP4_LIST "10.0f;12.0f")', 'set(SM100 "10.0f")',
        'cuda_archs_loose_intersection(FP4_ARCHS "10.0f;12.1a" "${CUDA_ARCHS}")',
        'cuda_archs_loose_intersection(QUTLASS_ARCHS "${SM100};12.1a" "${CUDA_ARCHS}")']
    assert result.replacements == 2


def test_an_unresolvable_covered_list_is_an_error_naming_file_and_line(tmp_path: Path) -> None:
    text = ('set(L "")\nif(WANT_SM12X)\n  list(APPEND L "12.0f")\nendif()\n'
            'cuda_archs_loose_intersection(FP4_ARCHS "${L}" "${CUDA_ARCHS}")\n')
    source = _source(tmp_path, text)
    with pytest.raises(Sm121Error, match=r"^CMakeLists.txt:5: cannot evaluate FP4_ARCHS "
                                         r"\(\$\{L\} is not set once to a literal list"):
        apply_all(source, PatchFor("0.99.0", ARCHS_121))
    assert (source / "CMakeLists.txt").read_text() == text


def test_an_unresolvable_list_that_cannot_hold_12x_is_not_an_error(tmp_path: Path) -> None:
    source = _source(tmp_path, 'set(L "")\nif(A)\n  list(APPEND L "10.0a")\nendif()\n'
                               'cuda_archs_loose_intersection(FP4_ARCHS "${L}" "${CUDA_ARCHS}")\n')
    (guard,) = evaluate(source, ARCHS_121)
    assert guard.result is None and not guard.call.may_give_sm12x
    (result,) = apply_all(source, PatchFor("0.99.0", ARCHS_121))
    assert result.outcome == "not applicable"


def test_an_unquoted_list_is_rewritten_unquoted_and_a_split_one_is_refused(
        tmp_path: Path) -> None:
    source = _source(tmp_path, 'cuda_archs_loose_intersection(FP4_ARCHS 12.0f "${CUDA_ARCHS}")\n')
    apply_all(source, PatchFor("0.99.0", ARCHS_121))
    assert (source / "CMakeLists.txt").read_text() == (
        'cuda_archs_loose_intersection(FP4_ARCHS 12.1a "${CUDA_ARCHS}")\n')
    split = _source(tmp_path / "b", 'cuda_archs_loose_intersection(FP4_ARCHS 10.0f;12.0f '
                                    '"${CUDA_ARCHS}")\n')
    with pytest.raises(Sm121Error, match="unquoted: CMake splits it"):
        apply_all(split, PatchFor("0.99.0", ARCHS_121))


def test_a_wrapper_function_is_evaluated_and_refused_when_it_needs_a_rewrite(
        tmp_path: Path) -> None:
    source = _source(tmp_path, 'fp4_archs(FP4_WRAPPED_ARCHS "${CUDA_ARCHS}")\n'
                               'fp4_archs(OTHER_ARCHS "${CUDA_ARCHS}")\n')
    with (source / "cmake" / "utils.cmake").open("a") as utils:
        utils.write('function(fp4_archs OUT TGT)\n'
                    '  cuda_archs_loose_intersection(_a "12.0f" "${TGT}")\n'
                    '  set(${OUT} ${_a} PARENT_SCOPE)\nendfunction()\n')
    guards = evaluate(source, ARCHS_121)
    assert [(g.variable, g.arch_list, g.targets) for g in guards] == [
        ("FP4_WRAPPED_ARCHS", "(in fp4_archs)", ("12.1",)),
        ("OTHER_ARCHS", "(in fp4_archs)", ("12.1",))]
    with pytest.raises(Sm121Error, match=r"CMakeLists.txt:1: FP4_WRAPPED_ARCHS gives plain 12.1 "
                                         r"through fp4_archs, whose list is inside"):
        apply_all(source, PatchFor("0.99.0", ARCHS_121))


def test_profile_121a_needs_no_rewrite_and_other_files_are_scanned(tmp_path: Path) -> None:
    source = _source(tmp_path, "include(cmake/external_projects/q.cmake)\n",
                     **{"external_projects/q": 'cuda_archs_loose_intersection(QUTLASS_ARCHS '
                                               '"10.0f;12.0f" "${CUDA_ARCHS}")\n'})
    (at121a,) = apply_all(source, PatchFor("0.99.0", ArchList.parse("12.1a")), check=True)
    assert at121a.outcome == "not needed"
    (at121,) = apply_all(source, PatchFor("0.99.0", ARCHS_121))
    assert [r.guard.location for r in at121.rewrites] == ["cmake/external_projects/q.cmake:1"]
    assert "QUTLASS_ARCHS \"10.0f;12.1a\"" in (
        source / "cmake/external_projects/q.cmake").read_text()


def _rules(tmp_path: Path, body: str) -> Path:
    folder = tmp_path / "rules"
    folder.mkdir()
    (folder / "r.yaml").write_text(
        "name: r\nfamily: '^FP4\\w*ARCHS$'\nfiles: [CMakeLists.txt]\n" + body)
    return folder


def test_a_version_keyed_exception_applies_to_its_versions_only(tmp_path: Path) -> None:
    (rule,) = load_rules(_rules(tmp_path, """rewrite: ['{arch}a']
exceptions:
  - file: CMakeLists.txt
    versions: "==0.5.0"
    find: 'set(FP4_LIST "9.0a")'
    replace: 'set(FP4_LIST "12.0f")'
    count: 1
"""))
    text = ('set(FP4_LIST "9.0a")\n'
            'cuda_archs_loose_intersection(FP4_ARCHS "${FP4_LIST}" "${CUDA_ARCHS}")\n')
    other = _source(tmp_path / "a", text)
    assert apply_rule(rule, other, PatchFor("0.6.0", ARCHS_121)).outcome == "not applicable"
    keyed = _source(tmp_path / "b", text)
    result = apply_rule(rule, keyed, PatchFor("0.5.0", ARCHS_121))
    assert result.outcome == "applied"
    assert (keyed / "CMakeLists.txt").read_text() == (
        'set(FP4_LIST "12.0f")\n'
        'cuda_archs_loose_intersection(FP4_ARCHS "12.1a" "${CUDA_ARCHS}")\n')
    drifted = _source(tmp_path / "c", text.replace("9.0a", "9.0"))
    with pytest.raises(Sm121Error, match=r"patch drift in CMakeLists\.txt for vLLM 0\.5\.0: "
                                         r"expected 1 match"):
        apply_rule(rule, drifted, PatchFor("0.5.0", ARCHS_121))


@pytest.mark.parametrize("body, message", [
    ("rewrite: ['12.1']\n", "rewrite form '12.1' is not arch-specific"),
    ("rewrite: []\n", "rewrite must be a non-empty list"),
    ("rewrite: ['{arch}a']\nextra: 1\n", "unknown key"),
])
def test_a_malformed_rule_is_one_error(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(Sm121Error, match=f"patch rule .* is malformed: {message}"):
        load_rules(_rules(tmp_path, body))


def test_a_relative_source_path_is_evaluated(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    _source(tmp_path, 'cuda_archs_loose_intersection(FP4_ARCHS "12.0f" "${CUDA_ARCHS}")\n')
    monkeypatch.chdir(tmp_path)
    (guard,) = evaluate(Path("src"), ARCHS_121)
    assert guard.targets == ("12.1",)


def test_a_tree_rewritten_for_121_keeps_fp4_for_121a(tmp_path: Path) -> None:
    """#15: the recipe's 12.0a gave a 12.1a build nothing; the rewrite keeps FP4 for both."""
    source = _source(tmp_path, f'{NEW13}\n  cuda_archs_loose_intersection(FP4_ARCHS "12.0f" '
                               '"${CUDA_ARCHS}")\nendif()\n')
    assert apply_all(source, PatchFor("0.99.0", ARCHS_121))[0].outcome == "applied"
    (again,) = apply_all(source, PatchFor("0.99.0", ArchList.parse("12.1a")))
    assert again.outcome == "not needed"
    assert [g.targets for g in again.before] == [("12.1a",)]


def test_cli_patch_of_a_relative_path(tmp_path: Path) -> None:
    import subprocess
    import sys

    _source(tmp_path, f'{NEW13}\n  cuda_archs_loose_intersection(FP4_ARCHS "12.0f" '
                      '"${CUDA_ARCHS}")\nendif()\n')
    result = subprocess.run([sys.executable, "-m", "sm121_build", "patch", "--explain",
                             "--version", "0.99.0", "src"], cwd=tmp_path, capture_output=True,
                            text=True, check=False,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    assert 'FP4_ARCHS' in result.stdout and 'rewritten "12.1a" -> 12.1a' in result.stdout
