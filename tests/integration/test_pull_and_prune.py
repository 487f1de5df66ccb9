"""A moving tag in a real registry (Debian's docker-registry on loopback, standing in for
Docker Hub): `--pull` picks up a new image under the same tag and rebuilds; without it the
run stays on what is here.  Then `prune` removes only what the tool made, beyond the newest.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import docker
import docker.errors
import pytest

from devkit.registry import local_registry, push, push_copy
from devkit.stockimage import StockImage, stock_workspace
from devkit.testtags import RUN

pytestmark = [pytest.mark.docker, pytest.mark.slow]

OUT = f"{RUN}/pulled"


@dataclass
class Moving:
    client: docker.DockerClient
    stock: StockImage
    remote: str  # 127.0.0.1:PORT/<this run's prefix>/vllm:nightly
    work: Path
    env: dict[str, str]

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sm121_build", *args], capture_output=True,
                              text=True, check=False, env=self.env)

    def build(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run("--base", self.remote, "--source", str(self.stock.checkout), *args)

    def image_id(self, ref: str) -> str | None:
        try:
            return str(self.client.images.get(ref).id)
        except docker.errors.ImageNotFound:
            return None


def _cleanup(client: docker.DockerClient, registry: str) -> None:
    for image in client.images.list():
        for tag in image.tags:
            if tag.startswith((OUT, registry)):
                client.images.remove(tag, force=True)


@pytest.fixture(scope="module")
def moving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Moving]:
    client, work, stock = stock_workspace(tmp_path_factory, "pull")
    with local_registry(work) as registry:
        remote = f"{registry}/{RUN}/vllm:nightly"
        push_copy(client, stock.tag, remote, work)
        client.images.remove(remote)  # only the registry has it under that name now
        env = {**os.environ, "XDG_CACHE_HOME": str(work / "cache"),
               "TMPDIR": str(work / "tmp")}
        yield Moving(client, stock, remote, work, env)
        _cleanup(client, registry)


def test_pull_follows_the_moving_tag_and_prune_keeps_the_newest(moving: Moving,
                                                                tmp_path: Path) -> None:
    first = moving.build("--pull=missing", "--tag", f"{OUT}:nightly-sm121", "--versioned-tag",
                         "--report", str(tmp_path / "first.json"))
    assert first.returncode == 0, first.stderr
    assert f"==> pull {moving.remote}" in first.stderr
    # the pull's last word: bytes, time and rate from the engine's own events
    assert re.search(rf"\n    pulled {re.escape(moving.remote)}: [\d.]+ [KMG]?B in \d+s "
                     r"\([\d.]+ [KMG]?B/s\), \d+ layers \(\d+ already here\)\n", first.stderr), \
        first.stderr
    record = json.loads((tmp_path / "first.json").read_text())
    assert record["pulled"]["before"] is None
    base_id = moving.image_id(moving.remote)
    assert base_id
    versioned = (f"{OUT}:nightly-sm121-0.19.1-{moving.stock.commit[:12]}"
                 f"-b{base_id.split(':')[1][:9]}")
    assert record["tags"] == [f"{OUT}:nightly-sm121", versioned]
    first_id = moving.image_id(versioned)
    assert first_id and first_id == moving.image_id(f"{OUT}:nightly-sm121")

    # the tag moves in the registry: a new night's image
    context = tmp_path / "night2"
    context.mkdir()
    (context / "Dockerfile").write_text(f"FROM {moving.stock.tag}\n"
                                        "RUN echo night2 > /etc/sm121-night\n")
    night2, _ = moving.client.images.build(path=str(context), rm=True, forcerm=True)
    push(moving.client, str(night2.id), moving.remote)
    moving.client.images.get(moving.remote).tag(moving.remote.rsplit(":", 1)[0], "hold")
    moving.client.images.remove(moving.remote)
    moving.client.images.get(base_id).tag(moving.remote.rsplit(":", 1)[0], "nightly")
    old_base = moving.image_id(moving.remote)

    stale = moving.build("--tag", f"{OUT}:nightly-sm121")
    assert stale.returncode == 0, stale.stderr
    assert stale.stdout.startswith(f"up to date: {OUT}:nightly-sm121")  # nothing pulled

    pulled = moving.build("--pull", "--tag", f"{OUT}:nightly-sm121", "--versioned-tag",
                          "--report", str(tmp_path / "second.json"))
    assert pulled.returncode == 0, pulled.stderr
    second = json.loads((tmp_path / "second.json").read_text())
    assert second["pulled"] == {"before": old_base, "after": str(night2.id)}
    assert second["status"] == "built" and "==> build" in pulled.stderr
    assert second["content_key"] != record["content_key"]
    assert second["tags"][1] != versioned and moving.image_id(versioned) == first_id
    assert moving.image_id(f"{OUT}:nightly-sm121") != first_id

    # the user tags the newest build and the replaced base too; prune must leave both alone
    moving.client.images.get(base_id).tag(OUT, "users-old-base")
    moving.client.images.get(f"{OUT}:nightly-sm121").tag(OUT, "users-pick")
    kept_by_user = moving.image_id(f"{OUT}:users-pick")
    unrelated = moving.image_id(moving.stock.tag)
    pruned = moving.run("prune", "--keep", "1")
    assert pruned.returncode == 0, pruned.stderr
    assert f"removed {first_id.split(':')[1][:12]} ({versioned})" in pruned.stdout
    assert moving.image_id(versioned) is None and moving.image_id(first_id) is None
    assert moving.image_id(f"{OUT}:nightly-sm121") == kept_by_user
    # the old base is still tagged (by the user): kept, and said so
    assert f"(old {moving.remote}): tagged" in pruned.stdout
    assert moving.image_id(f"{OUT}:users-old-base") == base_id
    assert moving.image_id(moving.stock.tag) == unrelated
    again = moving.run("prune", "--keep", "1")
    assert "removed 0 image(s)" in again.stdout


def test_pull_from_an_unreachable_registry_is_one_line(moving: Moving) -> None:
    result = moving.run("--base", "127.0.0.1:9/nobody/vllm:nightly", "--pull")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: cannot pull 127.0.0.1:9/nobody/vllm:nightly: ")
    assert "Traceback" not in result.stderr


def test_pull_of_an_image_id_is_refused(moving: Moving) -> None:
    image_id = moving.image_id(moving.stock.tag)
    assert image_id
    result = moving.run("--base", image_id, "--tag", f"{OUT}:x", "--pull")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"error: --pull needs a repository reference, not the image ID {image_id}")
