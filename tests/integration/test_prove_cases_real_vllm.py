"""prove's FA2 cases come from the kernels (issue #63 part 2) of a REAL file: PyPI's vLLM
0.22.0 x86_64 wheel, whose `_vllm_fa2_C` holds only sm_80 code, so that aot adds a sm_90
cubin for each of its kernels.  The names the audit lists there are the fixture the unit
tests read (tests/data/kernel_names), and every one of them reads as an FA2 kernel."""

from __future__ import annotations

import gzip
import json
import zipfile
from pathlib import Path

import pytest

from devkit.helpers import CACHE, cli, pypi_download
from sm121_build.jobs.payload import fa2_kernels

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
DATA = Path(__file__).parents[1] / "data" / "kernel_names"
MEMBERS = {"vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": "vllm-0.22.0-x86_64-fa2-sm90-added",
           "vllm/_C.abi3.so": "vllm-0.22.0-x86_64-C-sm90-added"}


@pytest.mark.parametrize("member", sorted(MEMBERS))
def test_the_kernel_name_fixtures_are_the_wheels(tmp_path: Path, member: str) -> None:
    wheel = pypi_download("vllm==0.22.0", CACHE / "wheels", platform="manylinux_2_28_x86_64")
    with zipfile.ZipFile(wheel) as archive:
        so = Path(archive.extract(member, tmp_path))
    done = cli("audit", str(so), "--target", "sm_90", "--kernels", "--json")
    assert done.returncode == 0, done.stderr
    kernels = json.loads(done.stdout)["binaries"][0]["kernels"]
    added = sorted(name for name, verdict in kernels.items() if verdict == "jit")
    fixture = DATA / f"{MEMBERS[member]}.txt.gz"
    assert gzip.decompress(fixture.read_bytes()).decode().split() == added
    if "fa2" in member:
        assert all(fa2_kernels.parse(name) is not None for name in added)
