"""vLLM's real _C/_moe_C built for sm_121 from a release's sources (docs/real-build.md).

Needs torch with CUDA, nvcc >= 13.0 and about 25 minutes on 16 cores, so it runs only where
SM121_REAL_BUILD_SDIST (a vLLM sdist) and SM121_REAL_BUILD_CUTLASS (the nvidia-cutlass
wheel) are set; elsewhere it is skipped with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from real_build import skip_reason  # noqa: E402


def test_real_vllm_extensions_for_sm121(tmp_path: Path) -> None:
    reason = skip_reason()
    if reason:
        pytest.skip(f"real vLLM build: {reason}")
    sdist, cutlass = (os.environ.get("SM121_REAL_BUILD_SDIST"),
                      os.environ.get("SM121_REAL_BUILD_CUTLASS"))
    if not sdist or not cutlass:
        pytest.skip("real vLLM build: set SM121_REAL_BUILD_SDIST and SM121_REAL_BUILD_CUTLASS")
    report = tmp_path / "report"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "real_build.py"), "--sdist", sdist,
         "--cutlass", cutlass, "--work", str(tmp_path / "work"), "--report", str(report),
         "--probe-unpatched"], check=False)
    assert result.returncode == 0
    data = json.loads((report / "report.json").read_text())
    probe = data["unpatched_probe"]
    if any(g["breaks_ptxas"] for g in data["guards_before"]):
        assert probe["ptxas_message"], "an FP4 guard let plain 12.x in: ptxas must reject it"
    else:
        assert probe["ptxas_message"] is None
    assert not any(g["breaks_ptxas"] for g in data["guards_after"])
    assert data["abi"]["problems"] == []
    for name in ("_C.abi3.so", "_moe_C.abi3.so"):
        binary = data["binaries"][name]
        assert binary["kernels"]["native"] > 0, name
        assert binary["load_library"]["loaded"] is True, name
