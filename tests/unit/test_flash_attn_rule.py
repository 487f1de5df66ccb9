"""Add rules on the flash-attention-shaped fixture (tests/data/fa_like: the guard "8.0+PTX",
its supported-arch list appended per CUDA version, the +PTX semantics of the real function),
evaluated with real cmake -P: FA2's former add rule (tests/data/rules, the `fa2_add_rule`
fixture), and what the shipped rules do to the tree (sass-from-ptx, patches/)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from devkit.helpers import DATA
from sm121_build.core.errors import Sm121Error
from sm121_build.cuda.compat import ArchList, parse_target
from sm121_build.source.guard_rules import PatchFor, apply_all, load_rules
from sm121_build.source.guards import effective_archs, evaluate

ARCHS_121 = ArchList.parse("12.1")  # a Spark's arch list

DEFAULT_TARGET = parse_target("sm_121")


def _fa(tmp_path: Path) -> Path:
    return Path(shutil.copytree(DATA / "fa_like", tmp_path / "fa"))


@pytest.mark.parametrize("cuda", ["12.9", "13.0"])
@pytest.mark.usefixtures("fa2_add_rule")
def test_fa2_gets_a_native_target_and_nothing_else_changes(tmp_path: Path, cuda: str) -> None:
    source = _fa(tmp_path)
    before = (source / "CMakeLists.txt").read_text()
    assert str(effective_archs(source, ARCHS_121, cuda)) == "12.0"  # flash-attention narrows
    assert [(g.variable, g.targets) for g in evaluate(source, ARCHS_121, cuda)] == [
        ("FA2_ARCHS", ("8.0+PTX",)), ("FA3_ARCHS", ())]
    (result,) = apply_all(source,
            PatchFor("0.19.1", ARCHS_121, cuda, DEFAULT_TARGET), project="vllm-flash-attn")
    assert (result.name, result.outcome) == ("fa2-sm12x-native", "applied")
    # {arch} (12.1) is tried first: "8.0+PTX;12.1" still gives 8.0+PTX for CUDA_ARCHS 12.0
    assert [(w.new_list, w.result) for w in result.rewrites] == [("8.0+PTX;12.0", ("12.0",))]
    after = (source / "CMakeLists.txt").read_text()
    assert after == before.replace('(FA2_ARCHS "8.0+PTX"', '(FA2_ARCHS "8.0+PTX;12.0"')
    (again,) = apply_all(source, PatchFor("0.19.1", ARCHS_121, cuda, DEFAULT_TARGET),
                         project="vllm-flash-attn")
    assert again.outcome == "not needed"
    assert (source / "CMakeLists.txt").read_text() == after


@pytest.mark.usefixtures("fa2_add_rule")
def test_a_build_without_sm12x_leaves_fa2_alone(tmp_path: Path) -> None:
    source = _fa(tmp_path)
    (result,) = apply_all(source,
            PatchFor("0.19.1", ArchList.parse("9.0"), gpu=DEFAULT_TARGET),
            project="vllm-flash-attn")
    assert result.outcome == "not applicable"
    assert (source / "CMakeLists.txt").read_text() == (DATA / "fa_like" /
                                                       "CMakeLists.txt").read_text()


@pytest.mark.usefixtures("fa2_add_rule")
def test_a_guard_already_native_is_not_touched(tmp_path: Path) -> None:
    source = _fa(tmp_path)
    text = (source / "CMakeLists.txt").read_text().replace('"8.0+PTX"', '"8.0+PTX;12.0"')
    (source / "CMakeLists.txt").write_text(text)
    (result,) = apply_all(source,
            PatchFor("0.19.1", ARCHS_121, gpu=DEFAULT_TARGET), project="vllm-flash-attn")
    assert result.outcome == "not needed"


@pytest.mark.usefixtures("fa2_add_rule")
def test_vllm_rules_do_not_touch_flash_attention_and_back(tmp_path: Path) -> None:
    source = _fa(tmp_path)
    assert [r.name for r in apply_all(source, PatchFor("0.19.1", ARCHS_121), check=True)] == [
        "fp4-sm12x-arch-specific"]
    assert [r.project for r in load_rules()] == ["vllm-flash-attn", "vllm"]


def _rules(tmp_path: Path, body: str) -> Path:
    folder = tmp_path / "rules"
    folder.mkdir()
    (folder / "r.yaml").write_text("name: r\nfamily: '^FA2_ARCHS$'\nfiles: [CMakeLists.txt]\n"
                                   + body)
    return folder


@pytest.mark.parametrize("body, message", [
    ("add: ['12.0']\nrewrite: ['12.0a']\n", "give exactly one of"),
    ("targets: [_x]\n", "give exactly one of"),
    ("add: ['9.0']\n", "add form '9.0' is not 12.x entries"),
    ("add: ['12.0']\nproject: flashinfer\n", "project 'flashinfer' is not one of"),
    ("add: ['12.0']\ntargets: []\n", "targets must be a non-empty list"),
])
def test_a_malformed_add_rule_is_one_error(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(Sm121Error, match=f"patch rule .* is malformed: {message}"):
        load_rules(_rules(tmp_path, body))


def test_an_add_that_cannot_reach_the_gpu_is_an_error(tmp_path: Path) -> None:
    (rule,) = load_rules(_rules(tmp_path, "add: ['{arch}']\nproject: vllm-flash-attn\n"))
    from sm121_build.source.guard_rules import apply_rule

    with pytest.raises(Sm121Error, match=r"CMakeLists.txt:\d+: no form of rule r stops "
                                         r"FA2_ARCHS giving sm_121 no native code "
                                         r"\(tried 8.0\+PTX;12.1\)"):
        apply_rule(rule, _fa(tmp_path), PatchFor("0.19.1", ARCHS_121, gpu=DEFAULT_TARGET))


def test_patch_explain_shows_the_same_ptx_rule_on_flash_attention(tmp_path: Path) -> None:
    from devkit.helpers import cli

    source = _fa(tmp_path)
    result = cli("patch", "--explain", str(source))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == ("vllm-flash-attn (as vLLM builds it), CUDA_ARCHS=12.0 (narrowed by its "
                        "CUDA 13.0 list from 12.1): what each guard gives nvcc")
    assert lines[-1].startswith("sass-from-ptx: would apply (set_gencode_flags_for_srcs in "
                                "cmake/utils.cmake:")
    assert lines[-1].endswith("gives PTX-only sources sm_120 SASS from the same PTX)")
    assert (source / "CMakeLists.txt").read_text() == (DATA / "fa_like" /
                                                       "CMakeLists.txt").read_text()
    assert (source / "cmake" / "utils.cmake").read_text() == (
        DATA / "fa_like" / "cmake" / "utils.cmake").read_text()
    applied = cli("patch", str(source))
    assert applied.returncode == 0 and "sass-from-ptx: applied" in applied.stdout
    assert 'CODE "sm_120")' in applied.stdout
    again = cli("patch", str(source))
    assert "sass-from-ptx: not needed (set_gencode_flags_for_srcs already has it)" in again.stdout


def test_the_build_patch_step_gives_flash_attention_sass_in_process(tmp_path: Path) -> None:
    """`apply_for_build`, as the main job calls it (vLLM's tree, then flash-attention's for the
    archs vLLM hands it): the sass-from-ptx rule lands in flash-attention's utils.cmake with
    the GPU's SASS; `apply_macros(check=True)` writes nothing."""
    from sm121_build.source.guard_rules import apply_for_build, apply_macros

    vllm = Path(shutil.copytree(DATA / "vllm_like", tmp_path / "vllm"))
    fa = _fa(tmp_path)
    original = (fa / "cmake" / "utils.cmake").read_text()
    checked = apply_macros(fa, "vllm-flash-attn", ArchList.parse("12.0"), DEFAULT_TARGET,
                           check=True)
    assert [r.outcome for r in checked] == ["applied"]
    assert (fa / "cmake" / "utils.cmake").read_text() == original  # check: nothing written
    lines = apply_for_build(vllm, {"vllm-flash-attn": fa},
            PatchFor("0.33.0", ARCHS_121, "13.0", DEFAULT_TARGET), vllm=False)
    # the fixture's vLLM tree hands flash-attention 12.1 as it is (0.33.0 narrows it to 12.0)
    assert lines == ["sass-from-ptx (vllm-flash-attn, CUDA_ARCHS 12.1): applied "
                     "(set_gencode_flags_for_srcs in cmake/utils.cmake:81 gives PTX-only "
                     "sources sm_121 SASS from the same PTX)"]
    patched = (fa / "cmake" / "utils.cmake").read_text()
    assert 'CODE "sm_121")' in patched and patched.startswith(original[:200])
    again = apply_for_build(vllm, {"vllm-flash-attn": fa},
            PatchFor("0.33.0", ARCHS_121, "13.0", DEFAULT_TARGET), vllm=False)
    assert again == ["sass-from-ptx (vllm-flash-attn, CUDA_ARCHS 12.1): not needed "
                     "(set_gencode_flags_for_srcs already has it)"]


def test_the_build_patch_step_on_a_vllm_shaped_tree_in_process(tmp_path: Path) -> None:
    """`apply_for_build` on the tree itself (vllm=True): the guard rules, then the macro rule
    for the archs this tree's CMake narrows `12.1` to (12.0 with CUDA 13: SASS sm_120)."""
    from sm121_build.source.guard_rules import apply_for_build

    tree = _fa(tmp_path)
    lines = apply_for_build(tree, {}, PatchFor("0.33.0", ARCHS_121, "13.0", DEFAULT_TARGET))
    assert lines == [
        "fp4-sm12x-arch-specific: not applicable (no guard the rule covers has an SM12x entry "
        "in this source)",
        "sass-from-ptx: applied (set_gencode_flags_for_srcs in cmake/utils.cmake:81 gives "
        "PTX-only sources sm_120 SASS from the same PTX)"]
    assert 'CODE "sm_120")' in (tree / "cmake" / "utils.cmake").read_text()


def test_the_version_of_a_tree_whose_version_file_is_not_utf8(tmp_path: Path) -> None:
    from sm121_build.source.guard_rules import read_source_version

    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "_version.py").write_bytes(
        b"# \xe9t\xe9\n__version__ = version = '0.33.0'\n")
    assert read_source_version(tmp_path) == "0.33.0"
    sdist = tmp_path / "sdist"
    sdist.mkdir()
    (sdist / "PKG-INFO").write_bytes(b"Metadata-Version: 2.1\nName: vllm\nVersion: 0.28.0\n"
                                     b"Author: Jos\xe9\n")
    assert read_source_version(sdist) == "0.28.0"
