"""The guard rules on REAL vLLM sources: every release sdist on PyPI from 0.10.0 to the newest.

For CUDA 12.8, 12.9 and 13.0 and the profiles 12.1 and 12.1a, with each source's own CMake:
after the rewrite no covered guard gives a plain 12.x target, every line that is not a
rewritten guard's is byte-identical, and a second run changes nothing.  The table
(release, CUDA, profile) -> calls rewritten is written to .cache/guard-survey.md.
"""

from __future__ import annotations

import re
import shutil
import tarfile
import urllib.request
from pathlib import Path

import pytest
from packaging.version import Version

from devkit.helpers import CACHE, cli, pypi_download
from sm121_build.cuda.compat import ArchList
from sm121_build.source.guard_rules import PatchFor, apply_all, breaks_ptxas, covered
from sm121_build.source.guards import effective_archs, evaluate

ARCHS_121 = ArchList.parse("12.1")  # a Spark's arch list

pytestmark = [pytest.mark.vllm]

FIRST = Version("0.10.0")
CUDAS = ("12.8", "12.9", "13.0")
PROFILES = ("12.1", "12.1a")
INDEX = "https://pypi.org/simple/vllm/"


def releases() -> list[str]:
    """Every final vLLM release with an sdist on PyPI, from 0.10.0 to the newest."""
    with urllib.request.urlopen(INDEX, timeout=60) as response:
        html = response.read().decode()
    found = {Version(v) for v in re.findall(r"/vllm-([0-9][0-9.]*(?:\.post\d+)?)\.tar\.gz#", html)}
    return [str(v) for v in sorted(found) if v >= FIRST and not v.is_prerelease]


def cmake_tree(version: str) -> Path:
    """CMakeLists.txt and cmake/ of a release, cached under .cache/vllm-cmake/ (CMake files
    only: the sdist is not kept unless it was cached already)."""
    tree = CACHE / "vllm-cmake" / version
    if (tree / "cmake" / "utils.cmake").exists():
        return tree
    cached = CACHE / "sdists" / f"vllm-{version}.tar.gz"
    folder = cached.parent if cached.exists() else CACHE / "vllm-cmake" / ".download"
    sdist = pypi_download(f"vllm=={version}", folder, sdist=True)
    prefix = f"vllm-{version}/"
    staging = tree.with_name(f".{version}.part")
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and (
            m.name == prefix + "CMakeLists.txt" or m.name.startswith(prefix + "cmake/"))]
        tar.extractall(staging, members=members, filter="data")
    (staging / prefix).rename(tree)
    shutil.rmtree(staging)
    if folder != cached.parent:
        sdist.unlink()
    return tree


def _copy(version: str, dest: Path) -> Path:
    return Path(shutil.copytree(cmake_tree(version), dest))


def _files(source: Path) -> dict[str, list[str]]:
    return {p.relative_to(source).as_posix(): p.read_text().splitlines(True)
            for p in sorted(source.rglob("*")) if p.is_file()}


def survey_one(version: str, cuda: str, profile: str, work: Path) -> tuple[str, list[str]]:
    source = _copy(version, work)
    before = _files(source)
    (result,) = apply_all(source, PatchFor(version, ArchList.parse(profile), cuda))
    after = _files(source)
    rewritten = {(r.guard.file, r.guard.line) for r in result.rewrites}
    for name, lines in before.items():
        assert len(after[name]) == len(lines), (version, cuda, profile, name)
        for number, (old, new) in enumerate(zip(lines, after[name], strict=True), 1):
            # only a rewritten call's lines change (its list may sit on a later line)
            assert old == new or any(f == name and line <= number < line + 8
                                     for f, line in rewritten), (version, name, number, new)
    guards = evaluate(source, ArchList.parse(profile), cuda)
    assert not [g.location for g in guards if breaks_ptxas(g)], (version, cuda, profile)
    others = [(g.location, g.arch_list, g.result) for g in result.before if not covered(g)]
    assert others == [(g.location, g.arch_list, g.result) for g in guards if not covered(g)]
    (again,) = apply_all(source, PatchFor(version, ArchList.parse(profile), cuda))
    assert again.outcome in ("not needed", "not applicable") and not again.rewrites
    assert _files(source) == after
    return result.outcome, [f"{r.guard.variable} \"{r.guard.arch_list}\" -> \"{r.new_list}\""
                            for r in result.rewrites]


def test_every_release_every_cuda_every_profile(tmp_path: Path) -> None:
    rows = []
    for version in releases():
        for cuda in CUDAS:
            for profile in PROFILES:
                outcome, rewrites = survey_one(version, cuda, profile,
                                               tmp_path / f"{version}-{cuda}-{profile}")
                rows.append((version, cuda, profile, outcome, rewrites))
    lines = ["| vLLM | CUDA | profile | outcome | calls rewritten |", "|---|---|---|---|---|"]
    lines += [f"| {v} | {c} | {p} | {o} | {len(r)}{': ' + '; '.join(r) if r else ''} |"
              for v, c, p, o, r in rows]
    report = CACHE / "guard-survey.md"
    report.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    applied = {(v, c, p) for v, c, p, o, _ in rows if o == "applied"}
    assert len({v for v, *_ in rows}) >= 37
    # What CMake says, checked by hand on the sdists: the releases whose CUDA 13 list keeps
    # 12.1 (0.19.x) hand FP4's "12.0f" a plain 12.1; profile 12.1a never needs a rewrite.
    assert ("0.19.1", "13.0", "12.1") in applied
    assert not {p for _, _, p in applied} - {"12.1"}


def test_the_narrowing_per_release_and_cuda_version(tmp_path: Path) -> None:
    """vLLM narrows 12.1 to its CUDA_SUPPORTED_ARCHS first; the CUDA version picks the branch."""
    for version, cuda, effective, fp4 in (
        ("0.17.0", "13.0", "12.0", ("12.0f",)),
        ("0.19.1", "13.0", "12.1", ("12.1",)),
        ("0.33.0", "13.0", "12.0", ("12.0f",)),
        ("0.33.0", "12.9", "12.1", ("12.1a",)),  # the CUDA 12 branch lists "12.0a;12.1a"
    ):
        source = _copy(version, tmp_path / f"{version}-{cuda}")
        assert str(effective_archs(source, ARCHS_121, cuda)) == effective, (version, cuda)
        first = [g for g in evaluate(source, ARCHS_121, cuda)
                 if g.taken and g.variable.startswith("FP4") and g.targets]
        assert first and all(g.targets == fp4 for g in first), (version, cuda, first)


def test_a_nightly_that_renames_splits_and_adds_a_family(tmp_path: Path) -> None:
    """0.33.0 edited the way nightlies move: the FP4 guard renamed and split over lines, a new
    MXFP4 family added, 12.1 added to the CUDA 13 list (as 0.19 had it)."""
    source = _copy("0.33.0", tmp_path / "src")
    cmake = source / "CMakeLists.txt"
    text = cmake.read_text()
    old = 'cuda_archs_loose_intersection(FP4_SM120_ARCHS "12.0f" "${CUDA_ARCHS}")'
    assert text.count(old) == 1
    text = text.replace(old, 'cuda_archs_loose_intersection(NVFP4_SM12X_ARCHS  # renamed\n'
                        '      "12.0f"\n      "${CUDA_ARCHS}")\n'
                        '    cuda_archs_loose_intersection(MXFP4_ARCHS "10.0f;11.0f;12.0f" '
                        '"${CUDA_ARCHS}")')
    text, lists = re.subn(r'(set\(CUDA_SUPPORTED_ARCHS "[^"]*;12\.0)"\)', r'\1;12.1")', text)
    assert lists >= 2, "0.33.0's CUDA 13 lists"
    cmake.write_text(text)
    (result,) = apply_all(source, PatchFor("0.33.0", ARCHS_121))
    assert sorted((r.guard.variable, r.new_list) for r in result.rewrites) == [
        ("MXFP4_ARCHS", "10.0f;11.0f;12.1a"), ("NVFP4_SM12X_ARCHS", "12.1a"),
        ("QUTLASS_SM120_ARCHS", "12.1a")]
    assert '      "12.1a"\n      "${CUDA_ARCHS}")' in cmake.read_text()


def test_cli_explain_and_check(tmp_path: Path) -> None:
    source = _copy("0.19.1", tmp_path / "src")
    explained = cli("patch", "--explain", "--version", "0.19.1", str(source))
    assert explained.returncode == 0, explained.stderr
    assert "CUDA_ARCHS=12.1: what each guard gives nvcc" in explained.stdout
    assert re.search(r'CMakeLists.txt:\d+ +FP4_ARCHS +"12.0f" -> 12.1  << plain 12.x: ptxas '
                     r'rejects e2m1x2, rewritten "12.1a" -> 12.1a', explained.stdout)
    assert re.search(r'FP4_ARCHS +"12.0a;12.1a" -> \(branch not taken\)', explained.stdout)
    checked = cli("patch", "--check", "--version", "0.19.1", str(source))
    assert "would apply (2 guard call(s) rewritten in 2 file(s))" in checked.stdout
    assert "+    cuda_archs_loose_intersection(FP4_ARCHS \"12.1a\"" in checked.stdout
    assert '"12.0f"' in (source / "CMakeLists.txt").read_text()  # --check wrote nothing


def test_cli_explain_shows_the_narrowing(tmp_path: Path) -> None:
    source = _copy("0.17.0", tmp_path / "src")
    explained = cli("patch", "--explain", "--version", "0.17.0", str(source))
    assert explained.returncode == 0, explained.stderr
    assert ("CUDA_ARCHS=12.0 (narrowed by vLLM's CUDA 13.0 list from 12.1)"
            in explained.stdout)
    assert re.search(r'FP4_ARCHS +"12.0f" -> 12.0f', explained.stdout)
    assert "fp4-sm12x-arch-specific: not needed" in explained.stdout


def test_cli_explain_flags_targets_gb10_cannot_load(tmp_path: Path) -> None:
    source = _copy("0.17.0", tmp_path / "src")
    explained = cli("patch", "--explain", "--cuda-version", "12.9", "--version", "0.17.0",
                    str(source))
    assert explained.returncode == 0, explained.stderr
    assert re.search(r'FP4_ARCHS +"12.0a" -> 12.0a  << 12.0a: sm_121 cannot load it',
                     explained.stdout)
    assert re.search(r'FP4_ARCHS +"12.0f" -> \(branch not taken\)', explained.stdout)


def test_sass_from_ptx_applies_to_every_release(tmp_path: Path) -> None:
    """The rule finds set_gencode_flags_for_srcs in every release's cmake/utils.cmake, and the
    source's own macro, run through cmake -P, then gives a PTX-only list SASS for the GPU from
    the same PTX and a native list nothing more; a second run is a no-op."""
    from sm121_build.cuda.compat import parse_target
    from sm121_build.source.guard_rules import apply_macros
    from sm121_build.source.ptx_sass import gencode_flags

    gpu = parse_target("sm_121")
    outcomes = {}
    for version in releases():
        source = _copy(version, tmp_path / version)
        effective = effective_archs(source, ARCHS_121, "13.0")
        (result,) = apply_macros(source, "vllm", effective, gpu)
        outcomes[version] = result.outcome
        if result.outcome != "applied":
            continue
        utils = (source / "cmake" / "utils.cmake").read_text()
        sass = "sm_121" if "12.1" in effective.items else "sm_120"
        flags = gencode_flags(utils, ArchList.parse("7.5;8.0;8.7;8.9+PTX"))
        assert flags[-1] == f"arch=compute_89,code={sass}"
        assert not any(f.endswith(sass) and "compute_80" in f
                       for f in gencode_flags(utils, ArchList.parse("8.0+PTX;12.0f")))
        (again,) = apply_macros(source, "vllm", effective, gpu)
        assert again.outcome == "not needed", version
    assert len(outcomes) >= 37
    assert set(outcomes.values()) == {"applied"}, outcomes
