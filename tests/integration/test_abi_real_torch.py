"""The ABI check on real vLLM and torch wheels from PyPI (aarch64, the DGX Spark's platform).

vLLM pins the exact torch its extensions were compiled against (`Requires-Dist: torch==…`).
A release against the torch it pins must pass with every torch symbol found; an older release
against a newer torch must be refused, naming the symbol the newer torch no longer exports
(torch 2.11 changed `c10::MessageLogger`'s constructor, which vLLM 0.17.0's `_C` calls).
The image is a folder (`DirectoryFiles`, the engine's per-path reads over a local tree); the
libraries and extensions are the real ones, read the way verification reads them.
"""

from __future__ import annotations

import re
import subprocess
import zipfile
from pathlib import Path

import pytest

from devkit.dirfiles import DirectoryFiles
from devkit.helpers import CACHE, pypi_download
from sm121_build.cuda.dynsym import dynamic_symbols
from sm121_build.verify.checks import TORCH_LIB, check_abi, image_torch_exports

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SITE = "/usr/local/lib/python3.12/dist-packages"
TORCH = "2.11.0"
OLDER, OLDER_TORCH = "0.17.0", "2.10.0"  # the release the reference Spark measurement used
MATCHING = "0.20.0"  # the first vLLM whose aarch64 wheel pins torch 2.11.0
OLD_LOGGER = "_ZN3c1013MessageLoggerC1EPKciib"  # MessageLogger(char const*, int, int, bool)
NEW_LOGGER = "_ZN3c1013MessageLoggerC1ENS_14SourceLocationEib"  # (SourceLocation, int, bool)


def _pinned_torch(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(metadata).decode()
    found = re.search(r"^Requires-Dist: torch==([\w.+]+)\s*$", text, re.MULTILINE)
    assert found, f"{wheel.name} pins no torch version"
    return found.group(1)


def _extensions(wheel: Path, dest: Path) -> dict[str, Path]:
    """Every compiled extension of a vLLM wheel, by its path in the package."""
    with zipfile.ZipFile(wheel) as archive:
        members = [n for n in archive.namelist() if n.startswith("vllm/") and n.endswith(".so")]
        for member in members:
            archive.extract(member, dest)
    return {member: dest / member for member in members}


@pytest.fixture(scope="module")
def torch_image(tmp_path_factory: pytest.TempPathFactory) -> tuple[DirectoryFiles, int]:
    """An image holding torch 2.11.0's `torch/lib` and `version.py` from PyPI's wheel, and
    how many libraries the wheel has there."""
    wheel = pypi_download(f"torch=={TORCH}", CACHE / "torch", platform="manylinux_2_28_aarch64")
    root = tmp_path_factory.mktemp("torch-image")
    site = root / SITE.lstrip("/")
    with zipfile.ZipFile(wheel) as archive:
        wanted = [n for n in archive.namelist()
                  if TORCH_LIB.search("/" + n) or n == "torch/version.py"]
        for member in wanted:
            archive.extract(member, site)
    return DirectoryFiles(root), sum(1 for n in wanted if n != "torch/version.py")


@pytest.fixture(scope="module")
def exported(torch_image: tuple[DirectoryFiles, int],
             tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    files, libraries = torch_image
    tmp = tmp_path_factory.mktemp("verify")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp / "cache"))
        found, read = image_torch_exports(files, "sha256:" + "1" * 64, SITE, tmp)
    assert read == libraries == 19  # libc10, libc10_cuda, libtorch_cpu, libtorch_cuda, …
    return found


def test_a_release_against_the_torch_it_pins(exported: set[str],
                                             tmp_path: Path) -> None:
    wheel = pypi_download(f"vllm=={MATCHING}", CACHE / "vllm", platform="manylinux_2_35_aarch64")
    assert _pinned_torch(wheel) == TORCH
    extensions = _extensions(wheel, tmp_path)
    assert {"vllm/_C.abi3.so", "vllm/_C_stable_libtorch.abi3.so", "vllm/_moe_C.abi3.so",
            "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"} <= set(extensions)
    result = check_abi(extensions, exported, 19, TORCH)
    assert result.missing == {}
    assert result.problems() == []
    assert result.checked > 500  # the C++ ABI of every extension and the stable C shim
    assert NEW_LOGGER in exported and OLD_LOGGER not in exported
    assert NEW_LOGGER in dynamic_symbols(extensions["vllm/_C.abi3.so"]).undefined


def test_an_older_release_against_a_newer_torch_is_refused(exported: set[str],
                                                           tmp_path: Path) -> None:
    wheel = pypi_download(f"vllm=={OLDER}", CACHE / "vllm")
    assert _pinned_torch(wheel) == OLDER_TORCH
    extensions = _extensions(wheel, tmp_path)
    result = check_abi(extensions, exported, 19, TORCH)
    # exactly the extensions that log through c10 lack exactly that constructor
    assert result.missing == {"vllm/_C.abi3.so": (OLD_LOGGER,),
                              "vllm/_flashmla_C.abi3.so": (OLD_LOGGER,)}
    assert result.problems() == [
        f"ABI: vllm/{name} needs 1 torch symbol(s) the image's torch {TORCH} does not export, "
        f"e.g. c10::MessageLogger::MessageLogger(char const*, int, int, bool) ({OLD_LOGGER}): "
        "built against another torch?" for name in ("_C.abi3.so", "_flashmla_C.abi3.so")]


def test_the_older_torch_exported_what_the_older_release_needs(tmp_path: Path) -> None:
    """The oracle for the refusal: binutils' `nm -D` on torch 2.10.0's libc10.so (PyPI's
    aarch64 wheel, a CPU build) finds the constructor vLLM 0.17.0 calls defined there, and
    not yet 2.11.0's replacement."""
    wheel = pypi_download(f"torch=={OLDER_TORCH}", CACHE / "torch",
                          platform="manylinux_2_28_aarch64")
    with zipfile.ZipFile(wheel) as archive:
        library = Path(archive.extract("torch/lib/libc10.so", tmp_path))
    listing = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True,
                             text=True, check=True).stdout
    defined = {line.split()[-1] for line in listing.splitlines() if line.strip()}
    assert OLD_LOGGER in defined and NEW_LOGGER not in defined
    assert len(defined) > 1000
