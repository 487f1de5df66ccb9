"""Audit an image in the local engine: its filesystem is read, no container is started."""

from __future__ import annotations

from pathlib import Path

import pytest

from devkit.dockerenv import client_or_skip, load
from devkit.helpers import cli
from devkit.imagetar import HardLink, docker_save
from devkit.testtags import RUN

pytestmark = pytest.mark.docker


def test_arm64_image_audited_on_x86_without_running_it(matrix: dict[str, Path],
                                                       tmp_path: Path) -> None:
    client = client_or_skip()
    tag = f"{RUN}/audit-arm64:1"
    layers: list[dict[str, bytes | None]] = [
        {"usr/lib/python3/dist-packages/vllm/_C.abi3.so": matrix["sm90"].read_bytes()},
        {"usr/lib/python3/dist-packages/vllm/_moe_C.abi3.so": matrix["sm121"].read_bytes(),
         "usr/lib/python3/dist-packages/vllm/.wh.old.so": b""},
    ]
    load(client, docker_save(tmp_path / "img.tar", layers, tag=tag, architecture="arm64"))
    try:
        before = {c.id for c in client.containers.list(all=True)}
        result = cli("audit", "--json", tag)
        assert result.returncode == 0, result.stderr
        assert {c.id for c in client.containers.list(all=True)} == before
        import json

        data = {b["name"]: b["verdict"] for b in json.loads(result.stdout)["binaries"]}
        assert data == {"/usr/lib/python3/dist-packages/vllm/_C.abi3.so": "none",
                        "/usr/lib/python3/dist-packages/vllm/_moe_C.abi3.so": "native"}
        required = cli("audit", "--require", "native", tag)
        assert required.returncode == 1
    finally:
        client.images.remove(tag, force=True)


def test_a_hard_linked_extension_in_an_image_is_audited(matrix: dict[str, Path],
                                                        tmp_path: Path) -> None:
    """`_C.abi3.so` as the second name of a file whose first name is no .so (the engine's
    archive stream sends it as a link to a member the audit does not keep)."""
    client = client_or_skip()
    tag = f"{RUN}/audit-hardlink:1"
    site = "usr/lib/python3/dist-packages/vllm"
    layers: list[dict[str, bytes | HardLink | None]] = [
        {"opt/blob.bin": matrix["sm90"].read_bytes(), f"{site}/_C.abi3.so": HardLink(
            "opt/blob.bin"), f"{site}/_moe_C.abi3.so": matrix["sm121"].read_bytes()}]
    load(client, docker_save(tmp_path / "img.tar", layers, tag=tag, architecture="arm64"))
    try:
        for args in ((), ("--include", "*/vllm/*")):
            result = cli("audit", "--json", *args, tag)
            assert result.returncode == 0, result.stderr
            import json

            data = {b["name"]: b["verdict"] for b in json.loads(result.stdout)["binaries"]}
            assert data == {f"/{site}/_C.abi3.so": "none", f"/{site}/_moe_C.abi3.so": "native"}
        assert cli("audit", "--require", "native", tag).returncode == 1
    finally:
        client.images.remove(tag, force=True)


def test_image_not_found_is_one_line() -> None:
    client_or_skip()
    result = cli("audit", f"{RUN}/does-not-exist:nope")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"error: image {RUN}/does-not-exist:nope not found in the local Docker engine: "
        f"`docker pull {RUN}/does-not-exist:nope` or `docker load` it first")


def test_engine_not_running_is_one_line() -> None:
    result = cli("audit", "some/image:tag", env={"DOCKER_HOST": "unix:///nonexistent.sock"})
    assert result.returncode == 4  # EngineUnavailable
    assert result.stderr.startswith("error: cannot reach the Docker engine at unix:///nonexist")
    assert len(result.stderr.strip().splitlines()) == 1
