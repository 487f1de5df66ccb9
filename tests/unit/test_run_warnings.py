"""The one-line warnings before any work: a base that stopped moving, PTX too new to JIT."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from devkit.helpers import DATA, compile_cached, gencode
from sm121_build.cuda.binary import DEFAULT_POLICY, audit_binary
from sm121_build.cuda.compat import DEFAULT_TARGET
from sm121_build.jobs.framework.run_warnings import STALE_DAYS, age_warning, ptx_warning

NOW = datetime(2026, 11, 24, tzinfo=timezone.utc)


def test_a_base_created_long_ago_is_said_once() -> None:
    assert STALE_DAYS == 30
    said = age_warning("vllm/vllm-openai:cu130-nightly", "2026-04-17T08:00:00.123456789Z", NOW)
    assert said == ("warning: vllm/vllm-openai:cu130-nightly was created 220 days ago "
                    "(2026-04-17): this tag may no longer move; vLLM's release pipeline moves "
                    "vllm/vllm-openai:nightly (CUDA 13.0), :cu129-nightly, :cu134-nightly")
    assert age_warning("x", "2026-10-26T00:00:00Z", NOW) is None  # 29 days
    assert age_warning("x", "2026-10-23T23:00:00Z", NOW) is not None  # 31 days and 1 hour
    assert age_warning("x", "", NOW) is None
    assert age_warning("x", "yesterday", NOW) is None


def test_ptx_newer_than_the_driver_is_said(tmp_path: Path) -> None:
    built = compile_cached("warn-ptx", DATA / "kernels.cu",
                           gencode("compute_80:sm_80", "compute_80:compute_80"))
    report = audit_binary(built, "_vllm_fa2_C.abi3.so", DEFAULT_POLICY, with_kernels=False)
    # nvcc 13.0 writes PTX ISA 9.0: a CUDA 12.8 driver JITs up to 8.7
    said = ptx_warning({"fa2.so": report}, DEFAULT_TARGET, (12, 8))
    assert said is not None and said.startswith("warning: fa2.so carry PTX ISA 9.0, newer than "
                                                "a CUDA 12.8 driver can JIT-compile (max 8.7)")
    assert "the rebuild compiles them to SASS ahead of time" in said
    assert ptx_warning({"fa2.so": report}, DEFAULT_TARGET, (13, 0)) is None
    assert ptx_warning({"gone.so": None}, DEFAULT_TARGET, (12, 8)) is None
