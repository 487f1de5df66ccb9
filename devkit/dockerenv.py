"""The Docker engine for integration tests: real engine, locally made images only."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import docker
import docker.errors
import pytest

from devkit.testtags import cached, engine_used

BASE_IMAGE = cached("debian-gxx:bookworm")  # the suite's cache: reused by the next run


def client_or_skip() -> docker.DockerClient:
    """A connected client; CI sets SM121_REQUIRE_DOCKER=1 so a missing engine fails there."""
    try:
        client = docker.from_env(timeout=900)
        client.ping()
        engine_used.append(True)  # the session's end removes this run's images there
        return client
    except docker.errors.DockerException as exc:
        if os.environ.get("SM121_REQUIRE_DOCKER") == "1":
            raise
        pytest.skip(f"no Docker engine: {exc}")


def ensure_debian_gxx(client: docker.DockerClient) -> str:
    """A minimal Debian with python3 and g++ (nvcc's host compiler), made by debootstrap:
    no registry needed."""
    return ensure_debian(client, BASE_IMAGE, "python3,g++")


def ensure_debian(client: docker.DockerClient, image: str, packages: str) -> str:
    """A debootstrap minbase Debian 12 with `packages`, imported as `image` (kept)."""
    try:
        client.images.get(image)
        return image
    except docker.errors.ImageNotFound:
        pass
    debootstrap = shutil.which("debootstrap") or "/usr/sbin/debootstrap"
    with tempfile.TemporaryDirectory(prefix="sm121-rootfs-") as root:
        subprocess.run([debootstrap, "--variant=minbase", f"--include={packages}", "bookworm",
                        root],
                       check=True, stdout=subprocess.DEVNULL)
        tar = subprocess.Popen(["tar", "-C", root, "-c", "."], stdout=subprocess.PIPE)
        assert tar.stdout is not None
        repository, tag = image.split(":")
        client.api.import_image_from_stream(tar.stdout, repository=repository, tag=tag)
        if tar.wait() > 1:  # 1: a file changed while read (harmless); 2: fatal
            raise RuntimeError(f"tar of the debootstrap root failed ({tar.returncode})")
    return image


def load(client: docker.DockerClient, tarball: Path) -> None:
    with open(tarball, "rb") as handle:
        client.images.load(handle.read())
