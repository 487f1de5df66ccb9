"""The kernels image's keys and tags, and its commands refused before any work (the
publish/pull/inject round trip runs on a real registry in tests/integration/
test_e2e_docker.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from devkit.helpers import cli, one_line_error
from sm121_build.core.errors import Sm121Error
from sm121_build.image.facts import VllmInstall
from sm121_build.jobs.formats.artifacts import Manifest, Provenance
from sm121_build.jobs.kernel_images.kernels_image import (
    cuda_flavour,
    moving_tag,
    package_root,
    refusal,
    reuse_key,
    tags_for,
)

MANIFEST: dict[str, Any] = {
    "format": 1, "base": "vllm/vllm-openai:nightly", "base_digest": "vllm/vllm-openai@sha256:1",
    "vllm_version": "0.33.0", "vllm_commit": "v0.33.0", "vllm_commit_id": "a" * 40,
    "torch_version": "2.11.0+cu130", "arch_list": "12.1", "patches": "rules-1",
    "package_dir": "/usr/local/lib/python3.12/dist-packages/vllm",
    "files": {"_C_stable_libtorch.abi3.so": {}, "vllm_flash_attn/_vllm_fa2_C.abi3.so": {}}}


def test_the_reuse_key_ignores_the_base_and_names_what_injection_needs() -> None:
    key = reuse_key(Manifest.from_json(MANIFEST))
    other_base = {**MANIFEST, "base": "mirror.local/vllm:nightly", "base_digest": "x@sha256:2",
                  "package_dir": "/opt/venv/lib/python3.12/site-packages/vllm"}
    assert reuse_key(Manifest.from_json(other_base)) == key  # the arm64 image, a re-push, a mirror
    for field, value in (("vllm_commit_id", "b" * 40), ("torch_version", "2.11.0+cu129"),
                         ("arch_list", "12.1a"), ("patches", "rules-2"),
                         ("files", {"_C_stable_libtorch.abi3.so": {}}),
                         ("platform", "linux/arm64")):
        assert reuse_key(Manifest.from_json({**MANIFEST, field: value})) != key, field
    # the same build's arm64 and amd64 files: two kernels images, never one key
    assert reuse_key(Manifest.from_json({**MANIFEST, "platform": "linux/arm64"})) != \
        reuse_key(Manifest.from_json({**MANIFEST, "platform": "linux/amd64"}))


def test_tags_pin_the_build_and_carry_the_moving_tag() -> None:
    tags = tags_for("ghcr.io/me/kernels", Manifest.from_json(MANIFEST), ("nightly", "bad/tag"))
    assert tags == [f"ghcr.io/me/kernels:k-{reuse_key(Manifest.from_json(MANIFEST))}",
                    "ghcr.io/me/kernels:0.33.0-aaaaaaaaaaaa-cu130-sm121",
                    "ghcr.io/me/kernels:nightly", "ghcr.io/me/kernels:bad_tag"]
    two = tags_for("r", Manifest.from_json({**MANIFEST, "arch_list": "12.0;12.1a"}))
    assert two[1] == "r:0.33.0-aaaaaaaaaaaa-cu130-sm120-sm121a"
    # one vLLM commit ships as several CUDA builds (nightly, cu129-nightly): never one tag
    cu129 = tags_for("r", Manifest.from_json({**MANIFEST, "torch_version": "2.11.0+cu129"}))
    assert cu129[1] == "r:0.33.0-aaaaaaaaaaaa-cu129-sm121"
    assert tags_for("r", Manifest.from_json({**MANIFEST, "torch_version": "2.11.0"}))[1] == \
        "r:0.33.0-aaaaaaaaaaaa-sm121"  # a torch naming no CUDA build
    twice = tags_for("r", Manifest.from_json(MANIFEST), ("nightly", "nightly"))
    assert twice.count("r:nightly") == 1


@pytest.mark.parametrize(("torch", "flavour"), [
    ("2.11.0+cu130", "cu130"), ("2.9.1+cu129", "cu129"), ("2.11.0", ""),
    ("2.11.0+cpu", ""), ("2.11.0+rocm6.4", ""), ("", "")])
def test_the_cuda_flavour_comes_from_torchs_local_version(torch: str, flavour: str) -> None:
    assert cuda_flavour(torch) == flavour


@pytest.mark.parametrize(("base", "tag"), [
    ("vllm/vllm-openai:nightly", "nightly"), ("vllm/vllm-openai:cu129-nightly", "cu129-nightly"),
    ("vllm/vllm-openai", "latest"), ("localhost:5000/v:0.33.0", "0.33.0"),
    (f"vllm/vllm-openai@sha256:{'1' * 64}", ""), (f"sha256:{'2' * 64}", "")])
def test_the_moving_tag_is_the_bases_own(base: str, tag: str) -> None:
    assert moving_tag(base) == tag


def test_files_built_for_another_vllm_or_torch_are_refused_with_the_reason() -> None:
    built = Provenance.from_json(MANIFEST)
    fits = _vllm("0.33.0", "a" * 40, "2.11.0+cu130")
    assert refusal(built, fits, "base:1") is None
    assert refusal(built, _vllm("0.33.0", "a" * 40, None), "base:1") is None  # torch unknown
    why = refusal(built, _vllm("0.33.0", "a" * 40, "2.10.0+cu130"), "base:1")
    assert why is not None and why.what == ("were built against torch 2.11.0+cu130; base:1 has "
                                          "torch 2.10.0+cu130")
    why = refusal(built, _vllm("0.33.0", "b" * 40, "2.11.0+cu130"), "base:1")
    assert why is not None and why.what == (f"were built for vLLM 0.33.0 ({'a' * 40}); base:1 "
                                          f"has 0.33.0 ({'b' * 40})")
    assert refusal(built, _vllm("0.33.1", "a" * 40, "2.11.0+cu130"), "base:1") is not None
    arm = Provenance.from_json({**MANIFEST, "platform": "linux/arm64"})
    why = refusal(arm, fits, "base:1", "linux/amd64")
    assert why is not None and why.what == "were made for linux/arm64; base:1 is linux/amd64"
    assert refusal(arm, fits, "base:1", "linux/arm64") is None
    assert Provenance.from_json(arm.as_json()) == arm  # the field travels through manifests


def _vllm(version: str, commit: str, torch: str | None) -> VllmInstall:
    return VllmInstall(version=version, commit_id=commit, site_packages="/x", python="3.12",
                       extensions=(), cuda_include=None, cuda_lib=None, cuda_home=None,
                       nvrtc_needs_link=False, torch_version=torch)


def test_the_package_folder_must_stay_inside_the_image() -> None:
    root = package_root(Manifest.from_json(MANIFEST))
    assert root == "usr/local/lib/python3.12/dist-packages/vllm"
    outside = Manifest.from_json({"package_dir": "../../etc"})
    assert package_root(outside) == "etc"  # normalised under /
    with pytest.raises(Sm121Error, match="names no package folder"):
        package_root(Manifest.from_json({"package_dir": "/"}))


def test_publish_and_inject_from_are_refused_before_the_engine(tmp_path: Path) -> None:
    env = {"DOCKER_HOST": "unix:///nonexistent.sock"}  # exit 4 if the engine were asked
    line = one_line_error(cli("kernels", "publish", "--artifacts", str(tmp_path), "--to",
                              "ghcr.io/me/k:tag", env=env))
    assert "a repository without a tag" in line
    line = one_line_error(cli("kernels", "publish", "--artifacts", str(tmp_path), "--to",
                              "ghcr.io/me/k", env=env))
    assert "no manifest.json" in line
    line = one_line_error(cli("inject", "--base", "x:y", env=env))
    assert "--artifacts DIR or --from REF" in line
    line = one_line_error(cli("inject", "--base", "x:y", "--artifacts", str(tmp_path),
                              "--from", "r:k", env=env))
    assert "--artifacts DIR or --from REF" in line
    line = one_line_error(cli("inject", "--base", "x:y", "--from", "Bad Ref", env=env))
    assert "Bad Ref" in line


def test_labels_use_the_built_images_names() -> None:
    from sm121_build.jobs.kernel_images.kernels_image import _labels

    labels = _labels(Manifest.from_json(MANIFEST))
    assert labels["io.github.sm121-build.kind"] == "kernels"
    assert labels["io.github.sm121-build.reuse-key"] == reuse_key(Manifest.from_json(MANIFEST))
    assert labels["io.github.sm121-build.vllm.version"] == "0.33.0"
    assert labels["io.github.sm121-build.torch.version"] == "2.11.0+cu130"
    assert labels["io.github.sm121-build.arch-list"] == "12.1"
    assert labels["org.opencontainers.image.base.digest"] == "vllm/vllm-openai@sha256:1"
    assert labels["io.github.sm121-build.extensions"] == (
        "_C_stable_libtorch.abi3.so,vllm_flash_attn/_vllm_fa2_C.abi3.so")


def test_the_main_jobs_kernels_options_are_checked_before_the_engine(tmp_path: Path) -> None:
    env = {"DOCKER_HOST": "unix:///nonexistent.sock"}
    line = one_line_error(cli("--base", "x:y", "--no-build", env=env))
    assert "--no-build goes with --kernels-from REPO" in line
    line = one_line_error(cli("--base", "x:y", "--kernels-from", "ghcr.io/me/k:1", env=env))
    assert "--kernels-from ghcr.io/me/k:1: a repository without a tag" in line
    line = one_line_error(cli("local", "--source", str(tmp_path), "--out",
                              str(tmp_path / "o"), "--kernels-from", "r/k", env=env))
    assert "No such option '--kernels-from'" in line
    line = one_line_error(cli("--base", "x:y", "--kernels-to", "ghcr.io/me/k@sha256:" + "1" * 64,
                              env=env))
    assert "--kernels-to ghcr.io/me/k@sha256:" in line and "a repository without a tag" in line
    line = one_line_error(cli("local", "--source", str(tmp_path), "--out",
                              str(tmp_path / "o"), "--kernels-to", "r/k", env=env))
    assert "No such option '--kernels-to'" in line
