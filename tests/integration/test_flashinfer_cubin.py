"""PyPI's flashinfer-cubin (0.6.13, 458 MB): FlashInfer's ahead-of-time trtllm-gen kernels,
15,970 raw `.cubin` files, none of them inside a shared object.  What a Spark owner needs to
hear from the audit: how many of them load on sm_121 (none: sm_100/sm_103 only)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

import pytest

from devkit.helpers import CACHE, CUOBJDUMP_ENTRY, pypi_download, run_cuobjdump
from sm121_build.cuda.fatbin import HostBinary, cuobjdump_listing

pytestmark = [pytest.mark.vllm]


def test_the_flashinfer_cubin_wheel_loads_nothing_on_sm121() -> None:
    wheel = pypi_download("flashinfer_cubin==0.6.13", CACHE / "wheels",
                          platform="any")
    result = subprocess.run([sys.executable, "-m", "sm121_build", "audit", "--json",
                             "--no-kernels", str(wheel)], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    binaries = json.loads(result.stdout)["binaries"]
    assert len(binaries) == 15970
    assert Counter(b["verdict"] for b in binaries) == {"none": 15970}
    cubins: Counter[str] = Counter()
    for binary in binaries:
        cubins.update(binary["cubins"])
    # `a` from the `.note.nv.tkinfo` -arch (1,676) or, where there is no note, from ABI 8's
    # e_flags bit 0x8 (cuobjdump's names; a reader of the note alone saw 648 plain cubins)
    assert cubins == {"sm_100f": 13646, "sm_103a": 1952, "sm_100a": 312, "sm_100": 60}
    # named by the distribution the wheel installs; aot can fix none of it, a build all
    assert json.loads(result.stdout)["packages"] == [
        {"name": "flashinfer-cubin", "files": {"native": 0, "jit": 0, "partial": 0,
                                               "none": 15970}, "kernels": None,
         "aot": {"files": 0, "cpu_seconds": 0.0}, "beyond_aot": 15970}]


def test_real_flashinfer_cubins_equal_cuobjdump(tmp_path: Path) -> None:
    """Every 400th cubin of the wheel (40 files, each arch among them): the listing equals
    `cuobjdump -lelf`, the kernels its ENTRY symbols, each of which `-res-usage` lists."""
    wheel = pypi_download("flashinfer_cubin==0.6.13", CACHE / "wheels", platform="any")
    with zipfile.ZipFile(wheel) as archive:
        members = sorted(n for n in archive.namelist() if n.endswith(".cubin"))[::400]
        paths = [Path(archive.extract(n, tmp_path)) for n in members]
    seen: set[str] = set()
    for path in paths:
        with HostBinary.open(path) as binary:
            assert binary.raw == "cubin", path
            listing = cuobjdump_listing(path, binary.entries, binary.raw)
            kernels = sorted(binary.kernels(binary.entries[0]))
            seen.add(binary.entries[0].sm)
        assert listing == run_cuobjdump("-lelf", str(path)).stdout.splitlines(), path
        symbols = run_cuobjdump("-symbols", str(path)).stdout
        assert kernels == sorted(re.findall(CUOBJDUMP_ENTRY, symbols,
                                            re.M)), path
        usage = run_cuobjdump("-res-usage", str(path)).stdout  # every function, kernels too
        assert set(kernels) <= set(re.findall(r"^ Function (\S+):$", usage, re.M)), path
    assert len(paths) == 40 and {"sm_100f", "sm_103a"} <= seen
