"""aot takes the newest ptxas it finds, not the first: the `cu134-nightly`-on-a-Spark case.

DGX OS puts CUDA 13.0 in /usr/local/cuda (first on PATH); an image built with a newer CUDA
ships PTX of a newer ISA, which that ptxas cannot read (and a 13.0 driver cannot JIT).  Real
parts: PyPI's CUDA 13.5 wheels (nvcc, cicc, the headers) make a real ISA 9.5 PTX into a real
shared object; the older ptxas is the machine's real CUDA 13.0 one."""

from __future__ import annotations

import os
import platform
import stat
import subprocess
import zipfile
from pathlib import Path

import pytest

from devkit.helpers import CACHE, cli, cuda_home, pypi_download, run_cuobjdump

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
NEWER = "13.5.37"
WHEELS = ("nvidia_cuda_nvcc", "nvidia_nvvm", "nvidia_cuda_runtime", "nvidia_cuda_crt")
KERNELS = b"""
__global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }
__global__ void plus(float* x) { x[threadIdx.x] += 2.0f; }
"""


@pytest.fixture(scope="module")
def newer_cuda(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """CUDA 13.5's compiler from PyPI, unpacked as the wheels lay it out (nvidia/cu13)."""
    root = tmp_path_factory.mktemp("cuda135")
    for name in WHEELS:
        wheel = pypi_download(f"{name}=={NEWER}", CACHE / "nvidia",
                              platform=f"manylinux2014_{platform.machine()}",
                              tags=platform.machine())  # this host's, to run here
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(root)
    home = root / "nvidia" / "cu13"
    for tool in [*(home / "bin").iterdir(), *(home / "nvvm" / "bin").iterdir()]:
        if tool.is_file():
            tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return home


@pytest.fixture(scope="module")
def isa95_so(newer_cuda: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A shared object whose kernels are sm_80 cubins and ISA 9.5 compute_80 PTX."""
    work = tmp_path_factory.mktemp("isa95")
    (work / "k.cu").write_bytes(KERNELS)
    subprocess.run([str(newer_cuda / "bin" / "nvcc"), "-shared", "-Xcompiler", "-fPIC",
                    "-gencode", "arch=compute_80,code=[compute_80,sm_80]", "-cudart", "none",
                    str(work / "k.cu"), "-o", str(work / "k.so")], check=True, timeout=300)
    ptx = run_cuobjdump("-ptx", str(work / "k.so")).stdout
    assert ".version 9.5" in ptx, "the PTX is of CUDA 13.5's ISA"
    return work / "k.so"


def _older_first() -> dict[str, str]:
    """CUDA 13.0's ptxas first on PATH, as DGX OS has it; no CUDA_HOME."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_HOME"}
    env["PATH"] = f"{cuda_home() / 'bin'}:{env['PATH']}"
    return env


def test_the_older_ptxas_alone_says_what_the_ptx_needs_and_how_to_get_it(
        isa95_so: Path, tmp_path: Path) -> None:
    done = cli("aot", str(isa95_so), "--out", str(tmp_path / "out"), "--target", "sm_121",
               "--no-cache", env=_older_first())
    assert done.returncode == 2, done.stderr
    assert "its PTX is ISA 9.5, which needs CUDA 13.5's ptxas or newer; the newest found is " \
        "ptxas 13.0." in done.stderr
    assert "pip install 'sm121-build[cuda]'" in done.stderr
    assert "left JIT-only" not in done.stderr  # a 13.0 driver cannot JIT it either
    assert "a driver older than CUDA 13.5 cannot JIT it either" in done.stderr
    assert not (tmp_path / "out" / isa95_so.name).exists()


def test_the_newest_ptxas_found_compiles_it_wherever_it_is_in_the_search(
        isa95_so: Path, newer_cuda: Path, tmp_path: Path) -> None:
    env = {**_older_first(), "CUDA_HOME": str(newer_cuda)}  # the newer one looked at first
    env["PATH"] = f"{env['PATH']}:{newer_cuda / 'bin'}"  # and on PATH after the older one
    done = cli("aot", str(isa95_so), "--out", str(tmp_path / "out"), "--target", "sm_121",
               "--no-cache", env=env)
    assert done.returncode == 0, done.stderr
    assert f"with ptxas {NEWER} ({newer_cuda / 'bin'})" in done.stderr
    listed = run_cuobjdump("-lelf", str(tmp_path / "out" / isa95_so.name)).stdout
    assert "sm_121" in listed


def test_cuda_home_given_wins_even_when_older(isa95_so: Path, newer_cuda: Path,
                                              tmp_path: Path) -> None:
    env = {**_older_first(), "CUDA_HOME": str(newer_cuda)}
    done = cli("aot", str(isa95_so), "--out", str(tmp_path / "out"), "--target", "sm_121",
               "--no-cache", "--cuda-home", str(cuda_home()), env=env)
    assert done.returncode == 2
    assert "the newest found is ptxas 13.0." in done.stderr


def test_doctor_names_the_ptxas_aot_uses_and_the_newest_isa_it_reads(newer_cuda: Path) -> None:
    env = {**_older_first(), "CUDA_HOME": str(newer_cuda),
           "DOCKER_HOST": "unix:///nonexistent.sock"}
    done = cli("doctor", env=env)
    assert f"ptxas {NEWER} ({newer_cuda / 'bin'}), reads PTX ISA up to 9.5" in done.stdout, \
        done.stdout
