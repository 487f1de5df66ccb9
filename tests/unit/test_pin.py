"""Version -> git ref, and fetching exact commits from local git repositories."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from devkit.helpers import git
from sm121_build.core.errors import Sm121Error
from sm121_build.source.git_pin import GitRef, fetch_source, version_to_ref


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



@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str]]:
    repo = tmp_path_factory.mktemp("upstream")
    git(repo, "init", "-q", "-b", "main")
    git(repo, "config", "uploadpack.allowAnySHA1InWant", "true")
    commits = {}
    for number in range(3):
        (repo / "CMakeLists.txt").write_text(f"# revision {number}\n")
        git(repo, "add", ".")
        git(repo, "commit", "-q", "-m", f"r{number}")
        commits[f"r{number}"] = git(repo, "rev-parse", "HEAD")
        if number == 1:
            git(repo, "tag", "v0.17.0")
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


def test_an_unreachable_repository_is_named_with_gits_reason(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-repo"
    with pytest.raises(Sm121Error) as caught:
        fetch_source(GitRef("commit", "deadbeef1"), str(missing), tmp_path / "cache")
    assert str(caught.value) == (f"cannot fetch {missing}: fatal: '{missing}' does not appear "
                                 "to be a git repository")


def _git_in(path: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"}
    return subprocess.run(["git", "-C", str(path), *args], check=True, capture_output=True,
                          text=True, env=env).stdout.strip()


@pytest.fixture()
def checkout(tmp_path: Path) -> tuple[Path, str, str]:
    """A real git checkout of the vLLM-shaped fixture with two commits; the first is tagged."""
    from devkit.stockimage import fixture_checkout

    path, first = fixture_checkout(tmp_path / "src")
    _git_in(path, "tag", "v0.19.1")
    (path / "csrc" / "ops.cu").write_text((path / "csrc" / "ops.cu").read_text() + "// next\n")
    _git_in(path, "commit", "-qam", "next")
    return path, first, _git_in(path, "rev-parse", "HEAD")


def test_source_at_another_commit_is_refused_unless_allowed(
        checkout: tuple[Path, str, str]) -> None:
    from sm121_build.source.git_pin import check_checkout

    path, first, head = checkout
    with pytest.raises(Sm121Error, match=rf"--source {path} is at {head[:12]}; the image's vLLM "
                                         rf"is {first[:12]}: check that commit out"):
        check_checkout(path, GitRef("commit", first[:12]))
    with pytest.raises(Sm121Error, match=rf"the image's vLLM is {first[:12]}"):
        check_checkout(path, GitRef("tag", "v0.19.1"))  # the tag names the first commit
    with pytest.raises(Sm121Error, match=r"the image's vLLM is tag v0.20.0 \(a"):
        check_checkout(path, GitRef("tag", "v0.20.0"))
    allowed = check_checkout(path, GitRef("commit", first), allow_other_commit=True)
    assert (allowed.commit, allowed.other_commit.split(";")[0]) == (
        head, f"--source {path} is at {head[:12]}")
    assert check_checkout(path, GitRef("commit", head[:9])).other_commit == ""


def test_uncommitted_changes_are_hashed(checkout: tuple[Path, str, str]) -> None:
    from sm121_build.source.git_pin import check_checkout

    path, _first, head = checkout
    ref = GitRef("commit", head)
    assert check_checkout(path, ref).changes == ""
    (path / ".gitignore").write_text("build/\n")
    _git_in(path, "add", ".gitignore")
    _git_in(path, "commit", "-qm", "ignore")
    ref = GitRef("commit", _git_in(path, "rev-parse", "HEAD"))
    (path / "build").mkdir()
    (path / "build" / "junk.o").write_bytes(b"ignored")
    assert check_checkout(path, ref).changes == ""  # ignored files are not built from
    ops = path / "csrc" / "ops.cu"
    ops.write_text(ops.read_text() + "// edited\n")
    edited = check_checkout(path, ref).changes
    assert len(edited) == 64
    (path / "csrc" / "new.cu").write_text("// untracked\n")
    with_new = check_checkout(path, ref).changes
    assert with_new not in ("", edited)
    (path / "csrc" / "new.cu").write_text("// untracked, changed\n")
    assert check_checkout(path, ref).changes not in ("", edited, with_new)


def test_a_tree_that_is_not_vllm_is_refused_before_anything(tmp_path: Path) -> None:
    from sm121_build.source.git_pin import check_checkout

    with pytest.raises(Sm121Error, match=r"is not a vLLM source tree \(no CMakeLists.txt or "
                                         r"cmake/utils.cmake\)"):
        check_checkout(tmp_path, GitRef("tag", "v0.19.1"))


def test_a_local_git_call_that_hangs_ends_in_minutes_not_half_an_hour(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call on a tree already here (rev-parse, diff, ls-files, config) has the short local
    limit; only what crosses the network (fetch, submodule update) has GIT_TIMEOUT_S."""
    import os

    from sm121_build.source import git_pin as pin

    assert pin.LOCAL_GIT_TIMEOUT_S < pin.GIT_TIMEOUT_S
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "git").write_text("#!/bin/sh\nexec sleep 60\n")  # FAKE: a git that never answers
    (fake / "git").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(pin, "LOCAL_GIT_TIMEOUT_S", 0.5)
    with pytest.raises(Sm121Error, match=r"git rev-parse gave no result in 0\.5 s"):
        pin.resolve_checkout(tmp_path)


@pytest.mark.parametrize("plant", ["edit", "untracked", "ignored", "other-tag", "no-tag"])
def test_a_cached_checkout_not_clean_at_the_ref_is_fetched_again(
        upstream: tuple[str, dict[str, str]], tmp_path: Path, plant: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The cache is untrusted: a planted tree is reused only when git says it is at the ref
    with nothing on top; else it is fetched again, and said once."""
    url, commits = upstream
    path, _ = fetch_source(GitRef("tag", "v0.17.0"), url, tmp_path)
    if plant == "edit":
        (path / "CMakeLists.txt").write_text("evil\n")
    elif plant == "untracked":
        (path / "setup.py").write_text("evil\n")
    elif plant == "ignored":
        (path / ".git" / "info" / "exclude").write_text("*.py\n")
        (path / "setup.py").write_text("evil\n")
    elif plant == "other-tag":
        _git_in(path, "tag", "-f", "v0.17.0", _git_in(path, "commit-tree", "-m", "x",
                                                       "HEAD^{tree}"))
    else:
        _git_in(path, "tag", "-d", "v0.17.0")
    again, commit = fetch_source(GitRef("tag", "v0.17.0"), url, tmp_path)
    assert commit == commits["r1"] and again == path
    assert _git_in(again, "status", "--porcelain", "--ignored") == ""
    assert (again / "CMakeLists.txt").read_text() == "# revision 1\n"
    assert capsys.readouterr().err.count("was not clean") == 1


def test_a_cached_commit_checkout_with_edits_is_fetched_again(
        upstream: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    url, commits = upstream
    path, _ = fetch_source(GitRef("commit", commits["r0"]), url, tmp_path)
    (path / "CMakeLists.txt").write_text("evil\n")
    again, commit = fetch_source(GitRef("commit", commits["r0"]), url, tmp_path)
    assert commit == commits["r0"] and (again / "CMakeLists.txt").read_text() == "# revision 0\n"


def test_a_clean_cached_checkout_is_reused(upstream: tuple[str, dict[str, str]],
                                           tmp_path: Path) -> None:
    url, commits = upstream
    path, _ = fetch_source(GitRef("tag", "v0.17.0"), url, tmp_path)
    marker = (path / ".git").stat().st_ino
    again, commit = fetch_source(GitRef("tag", "v0.17.0"), "/nonexistent/repo", tmp_path)
    assert (again, commit) == (path, commits["r1"]) and (path / ".git").stat().st_ino == marker
