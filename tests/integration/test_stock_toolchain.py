"""Stock images as they really are: no cmake, no nvcc, and builds that fail inside the builder.

Each image here is the stock-like fixture (devkit/stockimage.py) with something removed by a
real `docker build` (`RUN rm …`); every build below is real (nvcc, ptxas, cmake in the
builder stage).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import docker
import docker.errors
import pytest

from devkit.stockimage import StockImage, stock_workspace
from devkit.testtags import RUN

pytestmark = [pytest.mark.docker, pytest.mark.slow]

PREFIX = f"{RUN}/toolchain"


def _derive(client: docker.DockerClient, stock: StockImage, tag: str, run: str,
            work: Path) -> str:
    context = work / tag.rsplit(":", 1)[1]
    context.mkdir()
    (context / "Dockerfile").write_text(f"FROM {stock.tag}\nRUN {run}\n")
    client.images.build(path=str(context), tag=tag, rm=True, forcerm=True)
    return tag


class Toolchain:
    def __init__(self, client: docker.DockerClient, stock: StockImage, work: Path) -> None:
        self.client, self.stock, self.work = client, stock, work
        self.env = {**os.environ, "XDG_CACHE_HOME": str(work / "cache"),
                    "TMPDIR": str(work / "tmp")}

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sm121_build", *args], capture_output=True,
                              text=True, check=False, env=self.env)

    def tags(self) -> set[str]:
        return {t for i in self.client.images.list() for t in i.tags if t.startswith(PREFIX)}


def _cleanup(client: docker.DockerClient) -> None:
    for image in client.images.list():
        for tag in image.tags:
            if tag.startswith(PREFIX):
                client.images.remove(tag, force=True)


@pytest.fixture(scope="module")
def toolchain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Toolchain]:
    client, work, stock = stock_workspace(tmp_path_factory, "toolchain")
    _cleanup(client)
    yield Toolchain(client, stock, work)
    _cleanup(client)


def test_image_without_cmake_builds_with_the_tools_brought_into_the_builder(
        toolchain: Toolchain) -> None:
    base = _derive(toolchain.client, toolchain.stock, f"{PREFIX}:no-cmake",
                   "rm -rf /opt/cmake /usr/local/bin/cmake", toolchain.work)
    result = toolchain.run("--base", base, "--source", str(toolchain.stock.checkout),
                           "--tag", f"{PREFIX}:no-cmake-sm121")
    assert result.returncode == 0, result.stderr
    assert "build tools: no cmake, ninja, g++ 12 (nvcc takes <= 15), nvcc" in result.stderr
    assert "the builder brings cmake (this machine)" in result.stderr
    # the final image is the pristine base plus the two .so files: no cmake crept in
    built = toolchain.client.images.get(f"{PREFIX}:no-cmake-sm121")
    stock_layers = toolchain.client.images.get(base).attrs["RootFS"]["Layers"]
    assert built.attrs["RootFS"]["Layers"][:len(stock_layers)] == stock_layers
    # the default run: _C, _moe_C and the fixture's JIT-only FA2, one layer each
    assert len(built.attrs["RootFS"]["Layers"]) == len(stock_layers) + 3
    check = toolchain.client.containers.run(f"{PREFIX}:no-cmake-sm121", [
        "sh", "-c", "command -v cmake || ls /sm121 || echo clean"], remove=True)
    assert check.decode().strip() == "clean"


def test_image_without_nvcc_fails_before_any_build(toolchain: Toolchain) -> None:
    base = _derive(toolchain.client, toolchain.stock, f"{PREFIX}:no-nvcc",
                   "rm -f /usr/local/cuda-13.0/bin/nvcc", toolchain.work)
    images = {i.id for i in toolchain.client.images.list(all=True)}
    result = toolchain.run("--base", base, "--source", str(toolchain.stock.checkout),
                           "--tag", f"{PREFIX}:no-nvcc-sm121")
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: image {base} has no nvcc")
    assert "cuda-nvcc" in last
    assert "==> source" not in result.stderr and "==> build" not in result.stderr
    assert {i.id for i in toolchain.client.images.list(all=True)} == images


def test_image_without_gxx_fails_before_any_build(toolchain: Toolchain) -> None:
    base = _derive(toolchain.client, toolchain.stock, f"{PREFIX}:no-gxx",
                   "rm -f /usr/bin/g++* /usr/bin/c++ /usr/bin/*-linux-gnu-g++*",
                   toolchain.work)
    result = toolchain.run("--base", base, "--source", str(toolchain.stock.checkout))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(
        f"error: image {base} has no host C++ compiler")


def test_compile_error_in_the_builder_is_named_in_one_line(toolchain: Toolchain,
                                                           tmp_path: Path) -> None:
    checkout = Path(shutil.copytree(toolchain.stock.checkout, tmp_path / "src", symlinks=True))
    ops = checkout / "csrc" / "ops.cu"
    ops.write_text(ops.read_text() + "\nint planted = planted_undefined_name;\n")
    result = toolchain.run("--base", toolchain.stock.tag, "--source", str(checkout), "--tag",
                           f"{PREFIX}:syntax", "--force")
    assert result.returncode == 5  # BuildFailed
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: docker build failed: build failed: compiler: "
                           "/sm121/src/csrc/ops.cu(")
    assert 'error: identifier "planted_undefined_name" is undefined' in last
    assert "full log: " in last
    assert "exit code" not in last
    assert f"{PREFIX}:syntax" not in toolchain.tags()
