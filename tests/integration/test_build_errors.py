"""The main job's bad inputs: one line, non-zero exit, nothing tagged or left behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from devkit.dockerenv import client_or_skip, load
from devkit.helpers import cli, one_line_error
from devkit.imagetar import docker_save
from devkit.testtags import RUN, is_this_runs


def test_bad_image_reference() -> None:
    line = one_line_error(cli("--base", "Not A Ref!"))
    assert "is not a valid image reference" in line


@pytest.mark.docker
def test_bad_arch() -> None:
    client_or_skip()
    line = one_line_error(cli("--base", f"{RUN}/missing:1", "--arch", "sm121"))
    assert "'sm121' is not a CUDA architecture" in line


def test_engine_not_running() -> None:
    line = one_line_error(cli("--base", "vllm/vllm-openai:cu130-nightly",
                         env={"DOCKER_HOST": "unix:///nonexistent.sock"}), 4)
    assert "cannot reach the Docker engine" in line


@pytest.mark.docker
def test_image_not_found() -> None:
    client_or_skip()
    line = one_line_error(cli("--base", f"{RUN}/missing:1"))
    assert f"image {RUN}/missing:1 not found in the local Docker engine" in line


@pytest.mark.docker
def test_image_without_vllm(tmp_path: Path) -> None:
    client = client_or_skip()
    tag = f"{RUN}/no-vllm-build:1"
    load(client, docker_save(tmp_path / "img.tar", [{"etc/os-release": b"x"}], tag=tag))
    temp = tmp_path / "tmp"  # the run's own TMPDIR: other processes' temp files do not count
    temp.mkdir()
    def results() -> set[str]:  # this run's alone: another run on the engine tags its own
        return {t for image in client.images.list() for t in image.tags
                if is_this_runs(t) and t.endswith("-sm121")}

    before = results()
    try:
        line = one_line_error(cli("--base", tag, env={"XDG_CACHE_HOME": str(tmp_path / "c"),
                                                      "TMPDIR": str(temp)}))
        assert f"image {tag} has no vLLM installed" in line
        assert results() == before
        assert list(temp.iterdir()) == []
    finally:
        client.images.remove(tag, force=True)
