"""flash-attention as vLLM pins it: the declaration read from the vLLM tree, a local checkout
checked against it, and a fetch (real git; local repositories stand in for GitHub) that brings
only the submodules the build needs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from devkit.helpers import DATA, git
from devkit.stockimage import FA_CMAKE, fa_repository, fixture_checkout
from sm121_build.core.errors import Sm121Error
from sm121_build.core.vllm import project_named
from sm121_build.source.external import declared_targets, read_pin, tree_project
from sm121_build.source.git_pin import bring

FA = project_named("vllm-flash-attn")
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid",
           "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1",
           # submodules from local paths (GitHub in real use)
           "GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "protocol.file.allow",
           "GIT_CONFIG_VALUE_0": "always"}


@pytest.fixture
def git_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key, value in GIT_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))



def test_the_pin_is_read_from_the_vllm_tree(tmp_path: Path) -> None:
    assert FA is not None
    source, _ = fixture_checkout(tmp_path / "vllm")
    pin = read_pin(source, FA)
    fa_repo = tmp_path / "vllm-flash-attention"
    assert (pin.repository, pin.commit) == (str(fa_repo), git(fa_repo, "rev-parse", "HEAD"))
    assert pin.declared_in.startswith(f"{FA_CMAKE}:")
    assert declared_targets(source) == {"_vllm_fa2_C", "_vllm_fa3_C"}
    assert tree_project(fa_repo) == FA and tree_project(source) is None


@pytest.mark.parametrize("text, message", [
    ("FetchContent_Declare(vllm-flash-attn GIT_REPOSITORY x GIT_TAG 'a b')\n",
     "GIT_TAG \"'a\" is not a commit or tag"),
    ("FetchContent_Declare(other GIT_REPOSITORY x GIT_TAG abcdef1)\n",
     "no FetchContent_Declare\\(vllm-flash-attn"),
    ("FetchContent_Declare(vllm-flash-attn\n", "not readable as CMake"),
])
def test_a_declaration_it_cannot_use_is_one_error(tmp_path: Path, text: str,
                                                  message: str) -> None:
    assert FA is not None
    (tmp_path / FA_CMAKE).parent.mkdir(parents=True)
    (tmp_path / FA_CMAKE).write_text(text)
    with pytest.raises(Sm121Error, match=message):
        read_pin(tmp_path, FA)


def test_no_declaration_means_the_source_does_not_build_it(tmp_path: Path) -> None:
    assert FA is not None
    with pytest.raises(Sm121Error, match=r"has no cmake/external_projects/vllm_flash_attn\.cmake"):
        read_pin(tmp_path, FA)


def test_a_local_checkout_must_be_at_the_pinned_commit(tmp_path: Path, git_env: None) -> None:
    assert FA is not None
    source, _ = fixture_checkout(tmp_path / "vllm")
    pin = read_pin(source, FA)
    fa_repo = tmp_path / "vllm-flash-attention"
    got = bring(pin, fa_repo)
    assert (got.commit, got.changes, got.other_commit) == (pin.commit, "", "")
    (fa_repo / "CMakeLists.txt").write_text("# edited\n")
    assert bring(pin, fa_repo).changes  # hashed into the content key
    git(fa_repo, "commit", "-qam", "moved on")
    with pytest.raises(Sm121Error, match=rf"--fa-source {fa_repo} is at [0-9a-f]{{12}}; the "
                                         rf"vllm-flash-attn commit {FA_CMAKE}:\d+ pins is "
                                         rf"{pin.commit[:12]}: check that commit out"):
        bring(pin, fa_repo)
    assert bring(pin, fa_repo, allow_other_commit=True).other_commit
    with pytest.raises(Sm121Error, match="is not a vllm-flash-attn tree"):
        bring(pin, DATA / "vllm_like")


def test_a_fetch_brings_the_pinned_commit_and_only_the_needed_submodules(
        tmp_path: Path, git_env: None) -> None:
    assert FA is not None
    subs = {}
    for name in ("cutlass", "ck"):
        subs[name] = tmp_path / name
        subs[name].mkdir()
        (subs[name] / "README").write_text(name)
        git(subs[name], "init", "-q", "-b", "main")
        git(subs[name], "add", "-A")
        git(subs[name], "commit", "-qm", name)
    fa_repo, _ = fa_repository(tmp_path / "fa")
    git(fa_repo, "submodule", "add", "-q", str(subs["cutlass"]), "csrc/cutlass")
    git(fa_repo, "submodule", "add", "-q", str(subs["ck"]), "csrc/composable_kernel")
    git(fa_repo, "commit", "-qm", "submodules")
    pinned = git(fa_repo, "rev-parse", "HEAD")
    git(fa_repo, "commit", "-q", "--allow-empty", "-m", "later")
    vllm = tmp_path / "vllm"
    (vllm / FA_CMAKE).parent.mkdir(parents=True)
    (vllm / FA_CMAKE).write_text((DATA / "vllm_like" / FA_CMAKE).read_text()
                                 .replace("@FA_GIT_REPOSITORY@", str(fa_repo))
                                 .replace("@FA_GIT_TAG@", pinned))
    got = bring(read_pin(vllm, FA), None)
    assert got.commit == pinned
    assert (got.path / "csrc/cutlass/README").read_text() == "cutlass"
    assert not any((got.path / "csrc/composable_kernel").iterdir())  # ROCm only: not fetched
    assert bring(read_pin(vllm, FA), None).path == got.path  # cached
