"""Device code that is a file of its own: raw cubins (FlashInfer's cubin packages ship
thousands), fatbins and PTX text, audited alone, in a folder and in a wheel, against the real
cuobjdump (`-lelf -lptx`, `-symbols`) on real nvcc 13 output."""

from __future__ import annotations

import json
import re
import shutil
import zipfile
from pathlib import Path

import pytest

from devkit.helpers import CUOBJDUMP_ENTRY, DATA, cli, compile_device_file, gencode, run_cuobjdump
from sm121_build.cuda.binary import DEFAULT_POLICY, audit_binary
from sm121_build.cuda.fatbin import HostBinary, cuobjdump_listing

CUBINS = ["sm_80", "sm_90", "sm_90a", "sm_100f", "sm_120", "sm_120f", "sm_121", "sm_121a"]
NATIVE_ON_SM121 = {"sm_120", "sm_120f", "sm_121", "sm_121a"}


def _cubin(arch: str) -> Path:
    return compile_device_file(f"k_{arch}", DATA / "kernels.cu", "cubin", [f"-arch={arch}"])


def _symbols(path: Path) -> list[str]:
    out = run_cuobjdump("-symbols", str(path)).stdout
    return sorted(re.findall(CUOBJDUMP_ENTRY, out, re.M))


@pytest.mark.parametrize("arch", CUBINS)
def test_a_raw_cubin_equals_cuobjdump(arch: str) -> None:
    path = _cubin(arch)
    oracle = run_cuobjdump("-lelf", str(path))
    assert oracle.returncode == 0, oracle.stderr
    with HostBinary.open(path) as binary:
        assert binary.raw == "cubin" and [e.sm for e in binary.entries] == [arch]
        assert cuobjdump_listing(path, binary.entries, binary.raw) == oracle.stdout.splitlines()
        assert sorted(binary.kernels(binary.entries[0])) == _symbols(path)
    report = audit_binary(path, path.name, DEFAULT_POLICY, with_kernels=True)
    verdict = "native" if arch in NATIVE_ON_SM121 else "none"
    assert report.kernels and set(report.kernels.values()) == {verdict}


def test_a_raw_fatbin_equals_cuobjdump() -> None:
    path = compile_device_file("k", DATA / "kernels.cu", "fatbin", [
        *gencode("compute_90:sm_90", "compute_100f:sm_100f", "compute_120f:compute_120f")])
    oracle = run_cuobjdump("-lelf", "-lptx", str(path))
    assert oracle.returncode == 0, oracle.stderr
    with HostBinary.open(path) as binary:
        assert binary.raw == "fatbin"
        assert cuobjdump_listing(path, binary.entries, binary.raw) == oracle.stdout.splitlines()
    report = audit_binary(path, path.name, DEFAULT_POLICY, with_kernels=True)
    assert report.kernels and set(report.kernels.values()) == {"jit"}  # compute_120f PTX


@pytest.mark.parametrize(("target", "driver", "verdict"), [
    ("compute_120", "13.0", "jit"), ("compute_120a", "13.0", "none"),
    ("compute_121a", "13.0", "jit"), ("compute_90", "12.8", "none")])
def test_ptx_text_is_judged_by_its_target_and_version(target: str, driver: str,
                                                      verdict: str) -> None:
    """PTX 9.0 (nvcc 13.0): a 12.8 driver cannot JIT it; `a` PTX only for its own GPU."""
    path = compile_device_file(f"k_{target}", DATA / "kernels.cu", "ptx", [f"-arch={target}"])
    assert run_cuobjdump("-lptx", str(path)).stdout == ""  # cuobjdump lists no raw PTX
    result = cli("audit", "--json", "--driver", driver, str(path))
    assert result.returncode == 0, result.stderr
    (binary,) = json.loads(result.stdout)["binaries"]
    assert set(binary["kernels"].values()) == {verdict} and len(binary["kernels"]) == 4
    assert list(binary["ptx"]) == [target.replace("compute_", "sm_")]


def test_a_wheel_of_raw_cubins_says_how_many_load(tmp_path: Path) -> None:
    """The shape of PyPI's flashinfer-cubin: raw cubins for other GPUs only."""
    wheel = tmp_path / "cubins-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for i, arch in enumerate(["sm_90a", "sm_100f", "sm_100f", "sm_120f"]):
            archive.write(_cubin(arch), f"pkg/cubins/kernel_{i}_{arch}.cubin")
        archive.writestr("pkg/cubins/readme.txt", "not device code")
    result = cli("audit", "--json", str(wheel))
    assert result.returncode == 0, result.stderr
    verdicts = {b["name"]: b["verdict"] for b in json.loads(result.stdout)["binaries"]}
    assert verdicts == {"pkg/cubins/kernel_0_sm_90a.cubin": "none",
                        "pkg/cubins/kernel_1_sm_100f.cubin": "none",
                        "pkg/cubins/kernel_2_sm_100f.cubin": "none",
                        "pkg/cubins/kernel_3_sm_120f.cubin": "native"}
    assert cli("audit", "--require", "native", str(wheel)).returncode == 1


def test_a_folder_mixing_libraries_and_device_files(tmp_path: Path,
                                                    matrix: dict[str, Path]) -> None:
    shutil.copy(matrix["sm121"], tmp_path / "_C.so")
    shutil.copy(_cubin("sm_100f"), tmp_path / "gemm.cubin")
    ptx = compile_device_file("k_compute_120", DATA / "kernels.cu", "ptx",
                              ["-arch=compute_120"])
    shutil.copy(ptx, tmp_path / "attn.ptx")
    (tmp_path / "notes.ptx").write_text("not PTX at all\n")
    result = cli("audit", "--json", str(tmp_path))
    assert result.returncode == 0, result.stderr
    verdicts = {b["name"]: b["verdict"] for b in json.loads(result.stdout)["binaries"]}
    assert verdicts == {"_C.so": "native", "attn.ptx": "jit", "gemm.cubin": "none"}


def test_what_a_file_is_from_its_first_bytes() -> None:
    import struct

    from sm121_build.cuda.fatbin import device_file_kind

    cubin = _cubin("sm_90").read_bytes()[:4096]
    host = bytearray(cubin)
    struct.pack_into("<H", host, 18, 183)  # EM_AARCH64: a host ELF
    assert device_file_kind(cubin) == "cubin" and device_file_kind(bytes(host)) == ""
    assert device_file_kind(cubin[:19]) == ""  # too short to hold e_machine
    assert device_file_kind(struct.pack("<IHHQ", 0xBA55ED50, 1, 16, 0)) == "fatbin"
    assert device_file_kind(b"\x50\xed\x55") == ""
    ptx = b"//\n.version 9.0\n.target sm_120\n.address_size 64\n"
    assert device_file_kind(ptx) == "ptx"
    assert device_file_kind(ptx.replace(b".target", b".tarjet")) == ""
    assert device_file_kind(ptx.replace(b".version", b".versio")) == ""
    assert device_file_kind(ptx + b"\0") == ""  # text has no NUL
    assert device_file_kind(b"") == ""


def test_a_cubin_of_the_older_elf_abi_and_damaged_ones(tmp_path: Path) -> None:
    """ABI 7 cubins (CUDA < 12.8) keep the SM in the low byte of e_flags; a cubin whose
    flags name no SM is refused; `.nv.compat` decides `a` whatever the SM, and without it a
    tkinfo `-arch` of another SM gives no variant."""
    import struct

    from sm121_build.core.errors import CorruptBinaryError

    data = bytearray(_cubin("sm_90a").read_bytes())
    older = tmp_path / "older.cubin"
    data[8] = 7
    struct.pack_into("<I", data, 48, 0x5A)  # sm_90 in the low byte
    older.write_bytes(bytes(data))
    with HostBinary.open(older) as binary:
        assert [e.sm for e in binary.entries] == ["sm_90a"]
    struct.pack_into("<I", data, 48, 0x59)  # sm_89: the recorded -arch sm_90a is another SM
    older.write_bytes(bytes(data))
    with HostBinary.open(older) as binary:  # .nv.compat still says arch-specific
        assert [e.sm for e in binary.entries] == ["sm_89a"]
    data[_compat_09(bytes(data)) + 1] = 0x7F  # no such attribute: the note alone is left
    older.write_bytes(bytes(data))
    with HostBinary.open(older) as binary:
        assert [e.sm for e in binary.entries] == ["sm_89"]
    struct.pack_into("<I", data, 48, 0)
    older.write_bytes(bytes(data))
    with pytest.raises(CorruptBinaryError, match="a cubin whose ELF flags name no SM"):
        HostBinary.open(older)
    damaged = bytearray(_cubin("sm_120f").read_bytes())
    struct.pack_into("<Q", damaged, 40, len(damaged) * 4)  # section headers past the end
    (tmp_path / "damaged.cubin").write_bytes(bytes(damaged))
    with pytest.raises(CorruptBinaryError, match="cubin is not a readable ELF"):
        HostBinary.open(tmp_path / "damaged.cubin")
    tiny = tmp_path / "tiny.ptx"
    tiny.write_bytes(b".version 9")
    with pytest.raises(CorruptBinaryError, match=r"not an ELF file \(10 bytes\)"):
        HostBinary.open(tiny)


def test_the_entries_of_a_fatbin_and_a_ptx_file() -> None:
    fatbin = compile_device_file("k", DATA / "kernels.cu", "fatbin", [
        *gencode("compute_90:sm_90", "compute_100f:sm_100f", "compute_120f:compute_120f")])
    with HostBinary.open(fatbin) as binary:
        assert [(e.kind, e.sm) for e in binary.entries] == [
            ("elf", "sm_90"), ("elf", "sm_100f"), ("ptx", "sm_120f")]
        assert cuobjdump_listing(fatbin, binary.entries, binary.raw) == [
            "ELF file    1: k.1.sm_90.cubin", "ELF file    2: k.2.sm_100.cubin",
            "PTX file    1: k.1.sm_120f.ptx"]
    ptx = compile_device_file("k_compute_121a", DATA / "kernels.cu", "ptx",
                              ["-arch=compute_121a"])
    with HostBinary.open(ptx) as binary:
        (entry,) = binary.entries
        assert (binary.raw, entry.kind, entry.sm, entry.version) == ("ptx", "ptx", "sm_121a",
                                                                     (9, 0))
        assert (entry.offset, entry.size) == (0, ptx.stat().st_size)
        assert sorted(binary.kernels(entry)) == sorted(
            ["_Z7add_onePfi", "_Z5scaleIfEvPT_S0_i", "_Z5scaleIdEvPT_S0_i",
             "_ZN4vllm15rms_norm_kernelEPfPKfi"])


def _compat_09(data: bytes) -> int:
    """The file offset of `.nv.compat`'s attribute 0x09 record (nvcc 13 writes it first)."""
    from sm121_build.cuda.elf import Elf

    elf = Elf.read(data)
    section = elf.section(".nv.compat")
    assert section is not None and data[section.offset:section.offset + 2] == b"\x02\x09"
    return section.offset


@pytest.mark.parametrize(("arch", "value", "named"), [
    ("sm_90", 1, "sm_90a"), ("sm_90a", 0, "sm_90"), ("sm_120f", 1, "sm_120a"),
    ("sm_121a", 0, "sm_121"),
])
def test_the_compat_attribute_decides_a_as_it_does_for_cuobjdump(
        tmp_path: Path, arch: str, value: int, named: str) -> None:
    """cuobjdump 13 takes `a` from `.nv.compat` attribute 0x09 (not from the tkinfo note,
    nor from e_flags): flipped on a real nvcc 13 cubin, both readers follow it."""
    import struct

    data = bytearray(_cubin(arch).read_bytes())
    data[_compat_09(bytes(data)) + 2] = value
    flags = struct.unpack_from("<I", data, 48)[0]
    struct.pack_into("<I", data, 48, flags | 0x8)  # the e_flags bit does not count here
    edited = tmp_path / "edited.cubin"
    edited.write_bytes(bytes(data))
    with HostBinary.open(edited) as binary:
        assert [e.sm for e in binary.entries] == [named]
        assert cuobjdump_listing(edited, binary.entries, binary.raw) == \
            run_cuobjdump("-lelf", str(edited)).stdout.splitlines()
