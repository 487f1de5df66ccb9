"""A real registry on loopback for pull/push tests: Debian's `docker-registry` (distribution
2.x), storage in a temp folder.  The engine treats 127.0.0.0/8 as an insecure registry, so
plain HTTP works without daemon configuration.  Docker Hub is the boundary it stands in for.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import docker
import pytest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def local_registry(work: Path) -> Iterator[str]:
    """`127.0.0.1:PORT` of a running registry, stopped on exit."""
    binary = shutil.which("docker-registry") or "/usr/bin/docker-registry"
    if not Path(binary).exists():
        pytest.fail("docker-registry is not installed (apt-get install docker-registry)")
    port = _free_port()
    (work / "registry").mkdir(parents=True, exist_ok=True)
    config = work / "registry.yml"
    config.write_text(f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: "
                      f"{work / 'registry'}\n  delete:\n    enabled: true\n"
                      f"http:\n  addr: 127.0.0.1:{port}\nlog:\n  level: error\n")
    process = subprocess.Popen([binary, "serve", str(config)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=1)
                break
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        else:
            pytest.fail("the local registry did not start")
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=30)


def push(client: docker.DockerClient, source: str, remote: str) -> str:
    """Tag `source` as `remote` and push it; returns the pushed image's ID."""
    repository, tag = remote.rsplit(":", 1)
    image = client.images.get(source)
    image.tag(repository, tag)
    for event in client.api.push(repository, tag=tag, stream=True, decode=True):
        if "error" in event:
            raise RuntimeError(f"push of {remote} failed: {event['error']}")
    return str(image.id)


def push_copy(client: docker.DockerClient, source: str, remote: str, work: Path) -> str:
    """Push a copy of `source` (one LABEL added: its own image ID) as `remote`.  A push
    records a RepoDigest on the image pushed, which would change the shared fixture image's
    digest reference for every later test; the copy takes it instead.  Returns the copy's ID."""
    context = work / f"copy-{abs(hash(remote))}"
    context.mkdir(parents=True, exist_ok=True)
    (context / "Dockerfile").write_text(
        f"FROM {source}\nLABEL io.github.sm121-build.test.copy-of={json.dumps(source)}\n")
    image, _ = client.images.build(path=str(context), rm=True, forcerm=True)
    return push(client, str(image.id), remote)
