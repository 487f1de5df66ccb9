"""The engine goes away mid-run (a FAKE relay in front of the real engine cuts every
connection at a chosen request): one `error:` line, exit 4, and the line names what this
run made there and could not remove (the reader container, the pin tag)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from devkit.dockerenv import client_or_skip, load
from devkit.engineproxy import engine_proxy
from devkit.helpers import one_line_error
from devkit.imagetar import docker_save
from devkit.testtags import RUN

pytestmark = pytest.mark.docker


def _cli(host: str, *args: str) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "sm121_build", *args], capture_output=True,
                          text=True, timeout=120, check=False,
                          env={**os.environ, "DOCKER_HOST": host})


def test_engine_lost_while_reading_an_image(matrix: dict[str, Path], tmp_path: Path) -> None:
    client = client_or_skip()
    tag = f"{RUN}/engine-lost:1"
    load(client, docker_save(tmp_path / "img.tar", [
        {"usr/lib/python3/dist-packages/vllm/_C.abi3.so": matrix["sm121"].read_bytes()}],
        tag=tag))
    try:
        with engine_proxy(b"/archive") as proxy:
            result = _cli(proxy.host, "audit", tag)
        line = one_line_error(result, code=4)
        assert "connection lost" in line or "lost the connection" in line
        readers = client.containers.list(all=True, filters={"name": "sm121-build-read-"})
        assert readers, "the cut left the reader container, as a dead engine would"
        assert f"this run may have left container {readers[0].name} there" in line
        for container in readers:
            container.remove(force=True)
        ok = _cli(client.api.base_url.replace("http+docker://localhost", "unix:///var/run/"
                                              "docker.sock"), "audit", "--json", tag)
        assert ok.returncode == 0 and json.loads(ok.stdout)["binaries"]
    finally:
        client.images.remove(tag, force=True)
