"""Version -> git ref, and fetching exact commits from local git repositories."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from sm121_build.errors import Sm121Error
from sm121_build.pin import GitRef, fetch_source, version_to_ref


@pytest.mark.parametrize(("version", "commit_id", "expected"), [
    ("0.17.0", None, GitRef("tag", "v0.17.0")),
    ("0.17.0", "gb31e9326a", GitRef("commit", "b31e9326a")),
    ("0.10.0+cu126", None, GitRef("tag", "v0.10.0")),
    ("0.19.2rc1.dev154+g1c2c1eb8b", None, GitRef("commit", "1c2c1eb8b")),
    ("0.19.2rc1.dev154+g1c2c1eb8b.d20260101", None, GitRef("commit", "1c2c1eb8b")),
    ("0.11.1rc2.dev3+gabcdef1.cu130", None, GitRef("commit", "abcdef1")),
    ("0.18.0rc1", None, GitRef("tag", "v0.18.0rc1")),
])
def test_version_to_ref(version: str, commit_id: str | None, expected: GitRef) -> None:
    assert version_to_ref(version, commit_id) == expected


@pytest.mark.parametrize("version", ["not-a-version", "0.19.2.dev154", "1.0..0"])
def test_unmappable_versions_show_the_string(version: str) -> None:
    with pytest.raises(Sm121Error) as info:
        version_to_ref(version)
    assert repr(version) in str(info.value)


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=cwd,
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str]]:
    repo = tmp_path_factory.mktemp("upstream")
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "config", "uploadpack.allowAnySHA1InWant", "true")
    commits = {}
    for number in range(3):
        (repo / "CMakeLists.txt").write_text(f"# revision {number}\n")
        _git(repo, "add", ".")
        _git(repo, "commit", "-q", "-m", f"r{number}")
        commits[f"r{number}"] = _git(repo, "rev-parse", "HEAD")
        if number == 1:
            _git(repo, "tag", "v0.17.0")
    return f"file://{repo}", commits


def test_fetch_tag(upstream: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    url, commits = upstream
    path, commit = fetch_source(GitRef("tag", "v0.17.0"), url, tmp_path)
    assert commit == commits["r1"]
    assert (path / "CMakeLists.txt").read_text() == "# revision 1\n"


@pytest.mark.parametrize("length", [40, 9])
def test_fetch_commit_full_and_abbreviated(upstream: tuple[str, dict[str, str]], tmp_path: Path,
                                           length: int) -> None:
    url, commits = upstream
    path, commit = fetch_source(GitRef("commit", commits["r0"][:length]), url, tmp_path)
    assert commit == commits["r0"]
    assert (path / "CMakeLists.txt").read_text() == "# revision 0\n"
    again, _ = fetch_source(GitRef("commit", commits["r0"][:length]), url, tmp_path)
    assert again == path  # cached


def test_commit_not_found_names_commit_and_repo(upstream: tuple[str, dict[str, str]],
                                                tmp_path: Path) -> None:
    url, _ = upstream
    with pytest.raises(Sm121Error, match=f"commit deadbeef1 not found in {url}"):
        fetch_source(GitRef("commit", "deadbeef1"), url, tmp_path)
    assert [p for p in tmp_path.iterdir()] == []  # no half-made checkout left


def test_tag_not_found(upstream: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    url, _ = upstream
    with pytest.raises(Sm121Error, match=r"tag v9\.9\.9 not found"):
        fetch_source(GitRef("tag", "v9.9.9"), url, tmp_path)
