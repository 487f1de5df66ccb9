"""`sm121-build aot` on REAL vLLM 0.33.0 files: PyPI's aarch64 wheel (the DGX Spark one, so
the R_AARCH64_RELATIVE path), `_moe_C_stable_libtorch` whose one Marlin kernel is JIT only on
sm_121.  cuobjdump (PyPI) is the oracle; the audit must find every kernel native after."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from devkit.helpers import CACHE, cli, cuda_home, pypi_download, run_cuobjdump

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
MEMBER = "vllm/_moe_C_stable_libtorch.abi3.so"


def test_aot_makes_moe_c_of_the_real_0_33_0_aarch64_wheel_native(tmp_path: Path) -> None:
    wheel = pypi_download("vllm==0.33.0", CACHE / "wheels", platform="manylinux_2_28_aarch64")
    stock = tmp_path / "stock" / "_moe_C_stable_libtorch.abi3.so"
    stock.parent.mkdir()
    with zipfile.ZipFile(wheel) as archive:
        stock.write_bytes(archive.read(MEMBER))
    before = cli("audit", str(stock), "--target", "sm_121", "--driver", "13.0", "--json")
    assert before.returncode == 0, before.stderr
    done = cli("aot", str(stock), "--out", str(tmp_path / "out"), "--target", "sm_121",
               env={"CUDA_HOME": str(cuda_home())})
    assert done.returncode == 0, done.stderr
    made = tmp_path / "out" / stock.name
    listed_before = run_cuobjdump("-lelf", "-lptx", str(stock)).stdout.splitlines()
    listed_after = run_cuobjdump("-lelf", "-lptx", str(made)).stdout.splitlines()
    # every stock cubin and PTX is still there, and exactly the new sm_121 cubins were added
    added = [".".join(line.rsplit(".", 2)[-2:]) for line in listed_after]
    for line in listed_before:
        added.remove(".".join(line.rsplit(".", 2)[-2:]))
    assert added and set(added) == {"sm_121.cubin"}, added
    after = cli("audit", str(made), "--target", "sm_121", "--driver", "13.0", "--require",
                "native")
    assert after.returncode == 0, after.stdout[-2000:] + after.stderr
