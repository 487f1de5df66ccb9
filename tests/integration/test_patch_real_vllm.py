"""The patch set and the explain evaluation on REAL vLLM sdists from PyPI (0.10.0 .. 0.33.0)."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from sm121_build.errors import Sm121Error
from sm121_build.explain import effective_archs, evaluate
from sm121_build.patch import apply_all
from tests.helpers import CACHE, cli, pypi_download

pytestmark = [pytest.mark.vllm]

# vLLM version -> outcome for TORCH_CUDA_ARCH_LIST=12.1 and 12.1a with CUDA 13.0:
# (outcome, replacements).  Measured with cmake -P on each sdist's own cmake/utils.cmake,
# after vLLM's own narrowing to CUDA_SUPPORTED_ARCHS: most releases list 12.0 but not 12.1
# for CUDA 13, so 12.1 and 12.1a build as 12.0 and FP4's "12.0f" stays 12.0f (fine for
# ptxas, loads on sm_121).  0.19.x lists 12.1: FP4 then gets plain 12.1 and needs the patch.
EXPECTED = {
    "0.10.0": {"12.1": ("not applicable", 0), "12.1a": ("not applicable", 0)},
    "0.10.2": {"12.1": ("not needed", 0), "12.1a": ("not needed", 0)},
    "0.11.0": {"12.1": ("not needed", 0), "12.1a": ("not needed", 0)},
    "0.12.0": {"12.1": ("not needed", 0), "12.1a": ("not needed", 0)},
    "0.13.0": {"12.1": ("not needed", 0), "12.1a": ("not needed", 0)},
    "0.14.0": {"12.1": ("not needed", 0), "12.1a": ("not needed", 0)},
    "0.16.0": {"12.1": ("not needed", 0), "12.1a": ("not needed", 0)},
    "0.17.0": {"12.1": ("not needed", 0), "12.1a": ("not needed", 0)},
    "0.19.1": {"12.1": ("applied", 2), "12.1a": ("not needed", 0)},
    "0.22.0": {"12.1": ("not needed", 0), "12.1a": ("not needed", 0)},
    "0.26.0": {"12.1": ("not needed", 0), "12.1a": ("not needed", 0)},
    "0.30.0": {"12.1": ("not needed", 0), "12.1a": ("not needed", 0)},
    "0.33.0": {"12.1": ("not needed", 0), "12.1a": ("not needed", 0)},
}


def _source(version: str, dest: Path) -> Path:
    sdist = pypi_download(f"vllm=={version}", CACHE / "sdists", sdist=True)
    prefix = f"vllm-{version}/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and (
            m.name == prefix + "CMakeLists.txt" or m.name.startswith(prefix + "cmake/"))]
        tar.extractall(dest, members=members, filter="data")
    return dest / f"vllm-{version}"


@pytest.mark.parametrize("version", sorted(EXPECTED))
@pytest.mark.parametrize("arch", ["12.1", "12.1a"])
def test_outcome_per_release(version: str, arch: str, tmp_path: Path) -> None:
    source = _source(version, tmp_path)
    before = (source / "CMakeLists.txt").read_text()
    (result,) = apply_all(source, version, arch)
    assert (result.outcome, result.replacements) == EXPECTED[version][arch]
    after = evaluate(source, arch)
    plain = [(g.file, g.line, g.result) for g in after if g.breaks_ptxas]
    assert plain == [], "no FP4/QUTLASS guard may hand a plain 12.x target to ptxas"
    assert ((source / "CMakeLists.txt").read_text() != before) == (result.outcome == "applied")
    if result.outcome == "applied":
        # Idempotent: a second run changes nothing and says so.
        (again,) = apply_all(source, version, arch)
        assert again.outcome == "already applied"
        # Only FP4/QUTLASS guards were touched.
        others_before = [g for g in result.before if not g.is_fp4]
        others_after = [g for g in after if not g.is_fp4]
        assert [(g.variable, g.arch_list) for g in others_before] == [
            (g.variable, g.arch_list) for g in others_after]


def test_the_issue_measurement(tmp_path: Path) -> None:
    """vLLM narrows 12.1 to its CUDA_SUPPORTED_ARCHS first: per release and CUDA version."""
    for version, cuda, effective, fp4 in (
        ("0.17.0", "13.0", "12.0", ("12.0f",)),
        ("0.19.1", "13.0", "12.1", ("12.1",)),
        ("0.33.0", "13.0", "12.0", ("12.0f",)),
        ("0.33.0", "12.9", "12.1", ("12.1",)),
    ):
        source = _source(version, tmp_path / f"{version}-{cuda}")
        assert effective_archs(source, "12.1", cuda) == effective, (version, cuda)
        first = [g for g in evaluate(source, "12.1", cuda) if g.is_fp4 and g.arch_list == "12.0f"
                 and g.variable.startswith("FP4")]
        assert first and all(g.result == fp4 for g in first), (version, cuda)
    # 12.1a survives the narrowing where 12.1 is listed and keeps FP4 arch-specific.
    source = tmp_path / "0.19.1-13.0" / "vllm-0.19.1"
    assert effective_archs(source, "12.1a") == "12.1a"
    assert all(g.result == ("12.1a",) for g in evaluate(source, "12.1a")
               if g.is_fp4 and g.arch_list == "12.0f")


def test_patch_follows_the_cuda_version(tmp_path: Path) -> None:
    (at13,) = apply_all(_source("0.33.0", tmp_path / "a"), "0.33.0", "12.1", check=True)
    (at129,) = apply_all(_source("0.33.0", tmp_path / "b"), "0.33.0", "12.1", check=True,
                         cuda_version="12.9")
    assert (at13.outcome, at129.outcome, at129.replacements) == ("not needed", "applied", 2)


def test_drift_is_an_error_and_nothing_is_written(tmp_path: Path) -> None:
    source = _source("0.33.0", tmp_path)
    cmake = source / "CMakeLists.txt"
    text = cmake.read_text().replace(
        'cuda_archs_loose_intersection(FP4_SM120_ARCHS "12.0f" "${CUDA_ARCHS}")',
        'cuda_archs_loose_intersection(FP4_SM120_ARCHS "12.0f" "${CUDA_ARCHS}")\n'
        '    cuda_archs_loose_intersection(FP4_SM120_ARCHS "12.0f" "${CUDA_ARCHS}")\n'
        '    cuda_archs_loose_intersection(FP4_SM120_ARCHS "12.0f" "${CUDA_ARCHS}")')
    cmake.write_text(text)
    qutlass = (source / "cmake/external_projects/qutlass.cmake").read_text()
    with pytest.raises(Sm121Error, match=r"patch drift in CMakeLists.txt for vLLM 0.33.0: "
                                         r"expected 1 or 2 match\(es\) .* found 3"):
        apply_all(source, "0.33.0", "12.1", cuda_version="12.9")
    assert cmake.read_text() == text
    assert (source / "cmake/external_projects/qutlass.cmake").read_text() == qutlass


def test_cli_explain_and_check(tmp_path: Path) -> None:
    source = _source("0.19.1", tmp_path)
    explained = cli("patch", "--explain", "--version", "0.19.1", str(source))
    assert explained.returncode == 0, explained.stderr
    assert "CUDA_ARCHS=12.1: what each guard gives nvcc" in explained.stdout
    assert 'FP4_ARCHS                    "12.0f" -> 12.1  << plain 12.x' in explained.stdout
    # The recipe's "12.0a" keeps ptxas happy by leaving FP4 out of a 12.1 build...
    assert "after patch -> (none)" in explained.stdout
    assert "--arch 12.1a keeps them" in explained.stdout
    checked = cli("patch", "--check", "--version", "0.19.1", str(source))
    assert "would apply (2 replacement(s) in 2 file(s))" in checked.stdout
    assert "+    cuda_archs_loose_intersection(FP4_ARCHS \"12.0a\"" in checked.stdout
    assert '"12.0f"' in (source / "CMakeLists.txt").read_text()  # --check wrote nothing


def test_cli_explain_shows_the_narrowing(tmp_path: Path) -> None:
    source = _source("0.17.0", tmp_path)
    explained = cli("patch", "--explain", "--version", "0.17.0", str(source))
    assert explained.returncode == 0, explained.stderr
    assert ("CUDA_ARCHS=12.0 (narrowed by vLLM's CUDA 13.0 list from 12.1)"
            in explained.stdout)
    assert 'FP4_ARCHS                    "12.0f" -> 12.0f' in explained.stdout
    assert "fp4-sm12x-arch-specific: not needed" in explained.stdout
