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


def _sections(cubin: bytes) -> dict[str, bytes]:
    import io

    from elftools.elf.elffile import ELFFile  # the tests' independent ELF reader

    elf = ELFFile(io.BytesIO(cubin))
    return {s.name: s.data() for s in elf.iter_sections() if s.header.sh_type != "SHT_NOBITS"}


def test_split_compile_gives_the_code_of_a_plain_compile_on_real_vllm_ptx() -> None:
    """ptxas's --split-compile (what aot's schedule gives a module that would set the wall)
    makes the same cubin as a plain ptxas, on the real CUTLASS PTX of vLLM 0.33.0's `_C`:
    every section byte for byte, `.note.nv.tkinfo` (ptxas's own run notes, never the same
    twice) aside."""
    from sm121_build.cuda.binary import jit_ptx
    from sm121_build.cuda.compat import DEFAULT_TARGET
    from sm121_build.cuda.fatbin import entry_payload, ptx_kernels
    from sm121_build.cuda.fatbin_rewrite import entry_options, read_layout
    from sm121_build.cuda.ptxas import Compile, arch_for, checked_options, find_toolchain, run_ptxas

    wheel = pypi_download("vllm==0.33.0", CACHE / "wheels", platform="manylinux_2_28_aarch64")
    with zipfile.ZipFile(wheel) as archive:
        data = archive.read("vllm/_C_stable_libtorch.abi3.so")
    layout = read_layout(data, "_C")
    modules = []
    for container in layout.containers:
        entry = jit_ptx(container.described, DEFAULT_TARGET)
        if entry is not None:
            raw = container.entries[container.described.index(entry)]
            ptx = entry_payload(data, entry, "_C")
            modules.append((ptx, entry, tuple(checked_options(entry_options(raw)))))
    # the module with the most kernels among those ptxas compiles in seconds
    ptx, entry, options = max((m for m in modules if len(m[0]) < 2_000_000),
                              key=lambda m: len(ptx_kernels(m[0])))
    assert len(ptx_kernels(ptx)) >= 4, "a module with several kernels, so a split splits"
    toolchain = find_toolchain(cuda_home())
    arch = arch_for(DEFAULT_TARGET, entry.variant)
    plain = run_ptxas(toolchain, ptx, Compile(arch, options, 1, 600))
    split = run_ptxas(toolchain, ptx, Compile(arch, options, 4, 600))
    ours, theirs = _sections(plain.cubin), _sections(split.cubin)
    assert list(ours) == list(theirs)
    assert any(name.startswith(".text.") for name in ours)
    differing = [name for name in ours if ours[name] != theirs[name]]
    assert set(differing) <= {".note.nv.tkinfo"}, differing
    assert plain.cpu_seconds > 0 and plain.peak_rss > 0
