"""PyPI's flashinfer-cubin (0.6.13, 458 MB): FlashInfer's ahead-of-time trtllm-gen kernels,
15,970 raw `.cubin` files, none of them inside a shared object.  What a Spark owner needs to
hear from the audit: how many of them load on sm_121 (none: sm_100/sm_103 only)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from devkit.helpers import CACHE, pypi_download

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
    assert cubins == {"sm_100f": 13646, "sm_103a": 1628, "sm_100": 324, "sm_103": 324,
                      "sm_100a": 48}
