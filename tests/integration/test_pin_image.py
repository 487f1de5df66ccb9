"""`pin` reads an ARM64 image's vLLM version and commit without starting a container."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from devkit.dockerenv import client_or_skip, load
from devkit.helpers import CACHE, cli, cuda_home, one_line_error, pypi_download
from devkit.imagetar import docker_save
from devkit.testtags import RUN

pytestmark = [pytest.mark.docker, pytest.mark.vllm]
SITE = "usr/local/lib/python3.12/dist-packages"


def test_pin_reads_real_version_file_from_image(matrix: dict[str, Path], tmp_path: Path) -> None:
    client = client_or_skip()
    wheel = pypi_download("vllm==0.17.0", CACHE / "vllm")
    files: dict[str, bytes | None] = {}
    with zipfile.ZipFile(wheel) as zf:
        files[f"{SITE}/vllm/_version.py"] = zf.read("vllm/_version.py")
        for name in zf.namelist():
            if name.startswith("vllm-0.17.0.dist-info/") and not name.endswith("RECORD"):
                files[f"{SITE}/{name}"] = zf.read(name)
    files[f"{SITE}/vllm/_C.abi3.so"] = matrix["sm90"].read_bytes()
    files[f"{SITE}/vllm/_moe_C.abi3.so"] = matrix["sm90"].read_bytes()
    files[f"{SITE}/nvidia/cu13/include/cuda_fp4.h"] = b"/* header */"
    files[f"{SITE}/nvidia/cu13/lib/libnvrtc.so.13"] = b"\x7fELF"
    files["usr/local/cuda-12.9/bin/nvcc"] = b"#!/bin/sh\n"
    files["usr/local/cuda-12.9/targets/sbsa-linux/include/cuda.h"] = (
        (cuda_home() / "include" / "cuda.h").read_bytes().replace(b"13000", b"12090"))
    tag = f"{RUN}/pin-arm64:1"
    load(client, docker_save(tmp_path / "img.tar", [files], tag=tag, architecture="arm64"))
    try:
        before = {c.id for c in client.containers.list(all=True)}
        result = cli("pin", "--json", tag, env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
        assert result.returncode == 0, result.stderr
        assert {c.id for c in client.containers.list(all=True)} == before
        data = json.loads(result.stdout)
        assert data["platform"] == "linux/arm64"
        vllm = data["vllm"]
        assert vllm["version"] == "0.17.0" and vllm["commit_id"] == "gb31e9326a"
        assert data["git_ref"] == {"kind": "commit", "value": "b31e9326a"}
        assert vllm["python"] == "3.12"
        assert vllm["site_packages"] == f"/{SITE}"
        assert vllm["extensions"] == ["_C.abi3.so", "_moe_C.abi3.so"]
        assert vllm["cuda_include"] == f"/{SITE}/nvidia/cu13/include"
        assert vllm["nvrtc_needs_link"] is True
        assert (vllm["cuda_home"], vllm["cuda_version"]) == ("/usr/local/cuda-12.9", "12.9")
        human = cli("pin", tag, env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
        assert "git ref    commit b31e9326a" in human.stdout
    finally:
        client.images.remove(tag, force=True)


def test_image_without_vllm(tmp_path: Path) -> None:
    client = client_or_skip()
    tag = f"{RUN}/no-vllm:1"
    load(client, docker_save(tmp_path / "img.tar", [{"etc/hostname": b"x"}], tag=tag))
    try:
        result = cli("pin", tag, env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
        line = one_line_error(result)  # after the inspect step's lines
        assert line.startswith(f"error: image {tag} has no vLLM installed")
        assert result.stderr.startswith(f"==> inspect {tag}\n    ✕ inspect {tag} (")
    finally:
        client.images.remove(tag, force=True)
