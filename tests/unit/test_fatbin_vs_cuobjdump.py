"""The reader against the real cuobjdump, on real nvcc 13 output for many targets."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from devkit.helpers import CUOBJDUMP_ENTRY, run_cuobjdump
from sm121_build.cuda.fatbin import HostBinary, cuobjdump_listing
from tests.conftest import MATRIX

VARIANTS = [*MATRIX, "reloc"]


def _symbols_by_cubin(path: Path) -> list[list[str]]:
    """Kernel names per cubin, from `cuobjdump -symbols` (ENTRY symbols)."""
    out = run_cuobjdump("-symbols", str(path)).stdout
    blocks = out.split("Fatbin elf code:")[1:]
    return [re.findall(CUOBJDUMP_ENTRY, block, re.M) for block in blocks]


@pytest.mark.parametrize("variant", VARIANTS)
def test_listing_equals_cuobjdump(matrix: dict[str, Path], variant: str) -> None:
    path = matrix[variant]
    oracle = run_cuobjdump("-lelf", "-lptx", str(path))
    assert oracle.returncode == 0, oracle.stderr
    with HostBinary.open(path) as binary:
        assert cuobjdump_listing(path, binary.entries) == oracle.stdout.splitlines()
        assert binary.entries, "fixture has device code"


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_names_equal_cuobjdump_symbols(matrix: dict[str, Path], variant: str) -> None:
    path = matrix[variant]
    with HostBinary.open(path) as binary:
        ours = [sorted(binary.kernels(e)) for e in binary.entries if e.kind == "elf"]
    assert ours == [sorted(names) for names in _symbols_by_cubin(path)]


def test_kernels_found_in_fixture(plain_so: Path) -> None:
    with HostBinary.open(plain_so) as binary:
        names = {k for e in binary.entries for k in binary.kernels(e)}
    assert {"_Z7add_onePfi", "_ZN4vllm15rms_norm_kernelEPfPKfi",
            "_Z5scaleIfEvPT_S0_i", "_Z5scaleIdEvPT_S0_i"} <= names


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_matches_ptxas_command_line_in_cubin(matrix: dict[str, Path],
                                                     variant: str) -> None:
    """`a`/`f` from the fatbin header agree with the `-arch` ptxas recorded in the cubin, and
    with the `.target` line of a PTX entry (so the PTX-only file is checked too)."""
    checked = 0
    with HostBinary.open(matrix[variant]) as binary:
        for entry in binary.entries:
            if entry.kind == "ptx":
                target = re.search(rb"\.target\s+(sm_\d+[af]?)", binary.payload(entry))
                assert target is not None
                assert target.group(1).decode() == entry.sm
                checked += 1
                continue
            if entry.kind != "elf":
                continue
            note = re.search(rb"-arch (sm_\d+[af]?)", binary.payload(entry))
            if note is None:  # cubins of the runtime's own fatbin carry no tool note
                continue
            assert note.group(1).decode() == entry.sm
            checked += 1
    assert checked, f"{variant}: no entry was compared"


@pytest.mark.parametrize(("variant", "codec"), [("lz4", "lz4"), ("zstd", "zstd")])
def test_compressed_entries_decompress(matrix: dict[str, Path], variant: str, codec: str) -> None:
    with HostBinary.open(matrix[variant]) as binary:
        compressed = [e for e in binary.entries if e.compression]
        assert compressed, "nvcc compressed something"
        assert {e.compression for e in compressed} == {codec}
        for entry in compressed:
            payload = binary.payload(entry)
            assert len(payload) == entry.size > entry.stored_size
            if entry.kind == "elf":
                assert payload[:4] == b"\x7fELF"
            else:
                assert b".version" in payload[:200] and b".entry" in payload


def test_ptx_version_is_the_isa(matrix: dict[str, Path]) -> None:
    with HostBinary.open(matrix["ptx_only"]) as binary:
        for entry in binary.entries:
            text = binary.payload(entry).decode()
            major, minor = re.search(r"\.version (\d+)\.(\d+)", text).groups()  # type: ignore[union-attr]
            assert entry.version == (int(major), int(minor))


def test_relocatable_object_reads_relfatbin(matrix: dict[str, Path]) -> None:
    with HostBinary.open(matrix["reloc"]) as binary:
        found = sorted((e.kind, e.sm) for e in binary.entries)
    assert found == [("elf", "sm_90"), ("ptx", "sm_90")]
