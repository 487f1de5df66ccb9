"""Per-kernel verdicts over several translation units: a kernel is only as good as its worst
copy (whichever TU's copy the runtime picks must load).  Real nvcc, two .cu files built for
different targets and linked into one .so."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from devkit.helpers import DATA, compile_cached, gencode
from sm121_build.cuda.binary import Policy, audit_binary
from sm121_build.cuda.compat import parse_target

DEFAULT_TARGET = Policy(parse_target("sm_121"), (13, 0))


@pytest.fixture(scope="module", params=["ab", "ba"])
def two_tus(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """Linked in both orders: the verdict may not depend on which copy comes last."""
    a = compile_cached("tu_a", DATA / "two_tus" / "a.cu", gencode("compute_121:sm_121"),
                       shared=False)
    b = compile_cached("tu_b", DATA / "two_tus" / "b.cu", gencode("compute_90:sm_90"),
                       shared=False)
    out = tmp_path_factory.mktemp("tus") / "two.so"
    # linked by the host linker: nvcc's own link step would add a device-link cubin
    objects = [str(a), str(b)] if request.param == "ab" else [str(b), str(a)]
    subprocess.run(["g++", "-shared", "-o", str(out), *objects], check=True)
    return out


def test_a_kernel_is_as_good_as_its_worst_translation_unit(two_tus: Path) -> None:
    report = audit_binary(two_tus, "two.so", DEFAULT_TARGET, True)
    kernels = {name.split("(")[0]: verdict for name, verdict in (report.kernels or {}).items()}
    assert kernels == {"_Z13only_a_kernelPf": "native", "_Z13only_b_kernelPf": "none",
                       "_Z13shared_kernelILi1EEvPf": "none"}
    assert report.arch_counts("elf") == {"sm_90": 1, "sm_121": 1}
