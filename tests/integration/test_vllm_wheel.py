"""The reader on a real vLLM wheel from PyPI (aarch64, the DGX Spark's platform)."""

from __future__ import annotations

from pathlib import Path

import pytest

from devkit.helpers import CACHE, pypi_download, run_cuobjdump
from sm121_build.audit.unpack import Reading, binaries
from sm121_build.cuda.binary import Policy, audit_binary
from sm121_build.cuda.compat import parse_target
from sm121_build.cuda.fatbin import HostBinary, cuobjdump_listing

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VERSION = "0.17.0"  # the release the reference Spark measurement used
CHECKED = ("vllm/_C.abi3.so", "vllm/_moe_C.abi3.so", "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
           "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so")


@pytest.fixture(scope="module")
def wheel() -> Path:
    return pypi_download(f"vllm=={VERSION}", CACHE / "vllm")


def test_listing_equals_cuobjdump_on_real_vllm(wheel: Path) -> None:
    with binaries(str(wheel), Reading(include=tuple(CHECKED))) as found:
        assert sorted(b.name for b in found) == sorted(CHECKED)
        for binary in found:
            oracle = run_cuobjdump("-lelf", "-lptx", str(binary.path))
            assert oracle.returncode == 0
            with HostBinary.open(binary.path) as opened:
                ours = cuobjdump_listing(binary.path, opened.entries)
            assert ours == oracle.stdout.splitlines(), binary.name
            assert len(ours) > 50


def test_real_vllm_verdicts_for_sm121(wheel: Path) -> None:
    policy = Policy(parse_target("sm_121"), (13, 0))
    with binaries(str(wheel), Reading(include=("vllm/_C.abi3.so",
                                               "vllm/vllm_flash_attn/*"))) as found:
        reports = {b.name: audit_binary(b.path, b.name, policy, with_kernels=True)
                   for b in found}
    c = reports["vllm/_C.abi3.so"]
    # Stock 0.17.0 ships sm_120 cubins: some kernels native on sm_121, others not at all.
    assert c.arch_counts("elf")["sm_120"] > 0
    counts = c.kernel_counts()
    assert counts["native"] > 1000 and counts["none"] > 0
    assert c.verdict == "partial"
    # FA3 is Hopper-only (sm_90a): nothing of it loads on sm_121.
    assert reports["vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"].verdict == "none"
