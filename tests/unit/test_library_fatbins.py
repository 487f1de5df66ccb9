"""Fatbins a library keeps in its own sections (cuFFT in `.data`, cuBLASLt in
`.cask_resource`, cuSPARSE in `.rodata`): found, validated entry by entry, said by section,
and judged by the one aot rule the audit and `aot` share.  Built here as such a library is:
real nvcc fatbins embedded as arrays by the host compiler, next to bytes that only look
like a container (the magic, then nonsense)."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import zipfile
from pathlib import Path

import pytest

from devkit.helpers import DATA, cli, compile_cached, compile_device_file, gencode, run_cuobjdump
from sm121_build.cuda.binary import DEFAULT_POLICY, aot_able, audit_binary
from sm121_build.cuda.fatbin import CONTAINER_MAGIC, HostBinary

MAGIC = struct.pack("<I", CONTAINER_MAGIC)


def _array(name: str, data: bytes, where: str) -> str:
    body = ",".join(str(b) for b in data)
    return (f"{where} unsigned char {name}[{len(data)}] __attribute__((aligned(8), used)) "
            f"= {{{body}}};\n")


def _library(tmp: Path, arrays: list[tuple[str, bytes, str]]) -> Path:
    """A shared object (gcc, no nvcc) whose arrays hold the given bytes, each where its
    qualifier puts it: `const` in .rodata, plain in .data."""
    source = tmp / "lib.c"
    source.write_text("".join(_array(*a) for a in arrays) + "int library_entry(void) "
                      "{ return 0; }\n")
    out = tmp / "libfake.so"
    subprocess.run([shutil.which("gcc") or "cc", "-shared", "-fPIC", "-O0", "-o", str(out),
                    str(source)], check=True)
    return out


@pytest.fixture(scope="module")
def ptx_fatbin() -> bytes:
    """A real fatbin: compute_80 PTX only (JIT-only on sm_121)."""
    return compile_device_file("lib-ptx80", DATA / "kernels.cu", "fatbin",
                               gencode("compute_80:compute_80")).read_bytes()


@pytest.fixture(scope="module")
def native_fatbin() -> bytes:
    return compile_device_file("lib-sm120", DATA / "kernels.cu", "fatbin",
                               gencode("compute_120:sm_120")).read_bytes()


def _decoy() -> bytes:
    """The container magic, version 1, a 16-byte header, a size that fits, then bytes no
    entry header can be: what a constant table may hold by chance."""
    return MAGIC + struct.pack("<HHQ", 1, 16, 128) + bytes(range(128))


def test_fatbins_in_data_and_rodata_are_found_by_section(
        tmp_path: Path, ptx_fatbin: bytes, native_fatbin: bytes) -> None:
    lib = _library(tmp_path, [("in_data", ptx_fatbin, ""),
                              ("in_rodata", native_fatbin, "const"),
                              ("decoy", _decoy(), "const")])
    report = audit_binary(lib, lib.name, DEFAULT_POLICY, with_kernels=True)
    assert report.sections() == {".data": 1, ".rodata": 1}
    assert {(e.section, e.kind, e.sm) for e in report.entries} == {
        (".data", "ptx", "sm_80"), (".rodata", "elf", "sm_120")}
    assert report.containers == {"native": 1, "jit": 1, "none": 0}
    # the library loads its own fatbins: each kernel once per section, named by it
    assert report.kernels is not None
    assert {k.rsplit(" ", 1)[1] for k in report.kernels} == {"[.data]", "[.rodata]"}
    assert report.kernel_counts()["jit"] == report.kernel_counts()["native"] > 0
    # cuobjdump is blind here, and the listing says exactly what it says
    oracle = run_cuobjdump("-lelf", "-lptx", str(lib))
    assert "ELF file" not in oracle.stdout and "PTX file" not in oracle.stdout
    assert report.cuobjdump == []
    # aot cannot reach them: the audit says so, and never calls the file aot-able
    assert aot_able(report, DEFAULT_POLICY.target) is None
    assert report.reach is not None and report.reach.unreachable == {".data": 1}


def test_require_native_fails_on_a_library_fatbin_cuobjdump_does_not_see(
        tmp_path: Path, ptx_fatbin: bytes) -> None:
    lib = _library(tmp_path, [("in_data", ptx_fatbin, "")])
    table = cli("audit", str(lib), "--target", "sm_121", "--driver", "13.0")
    assert table.returncode == 0, table.stderr
    assert "found in .data x1 fatbin(s) (cuobjdump lists .nv_fatbin only)" in table.stdout
    assert "outside .nv_fatbin (1 in .data)" in table.stdout
    strict = cli("audit", str(lib), "--target", "sm_121", "--driver", "13.0",
                 "--require", "native")
    assert strict.returncode == 1, strict.stderr
    assert "JIT" in strict.stderr or "would not load as native" in strict.stderr


def test_bytes_that_only_look_like_a_container_are_not_counted(tmp_path: Path) -> None:
    truncated = MAGIC + struct.pack("<HHQ", 1, 16, 1 << 40)  # a body past the section
    wrong_kind = MAGIC + struct.pack("<HHQ", 1, 16, 64) + struct.pack(
        "<HHIQ", 7, 0x101, 64, 0) + bytes(48)  # an entry kind no fatbin has
    lib = _library(tmp_path, [("a", _decoy(), "const"), ("b", truncated, ""),
                              ("c", wrong_kind, "const")])
    with HostBinary.open(lib) as binary:
        assert binary.entries == []


def test_aot_says_what_it_cannot_reach(tmp_path: Path, ptx_fatbin: bytes) -> None:
    lib = _library(tmp_path, [("in_data", ptx_fatbin, "")])
    done = cli("aot", str(lib), "--out", str(tmp_path / "out"), "--target", "sm_121")
    assert done.returncode == 0, done.stderr
    assert "1 JIT-only fatbin(s) outside .nv_fatbin (1 in .data)" in done.stderr
    assert "nothing to compile: every fatbin aot can reach" in done.stderr
    assert not (tmp_path / "out" / lib.name).exists()


def test_a_ptx_file_is_not_aot_able_for_either(tmp_path: Path) -> None:
    """numba's `jitlink.ptx`: a PTX file with no kernels.  The audit and aot agree: aot
    rewrites shared objects, so neither calls it aot-able."""
    ptx = tmp_path / "jitlink.ptx"
    ptx.write_text(".version 6.0\n.target sm_50\n.address_size 64\n"
                   ".visible .func (.param .b32 r) bar(.param .b32 x) { ret; }\n")
    report = audit_binary(ptx, ptx.name, DEFAULT_POLICY, with_kernels=True)
    assert aot_able(report, DEFAULT_POLICY.target) is None
    assert report.reach is not None and report.reach.refused is not None
    assert "not a shared object" in report.reach.refused
    table = cli("audit", str(ptx), "--target", "sm_121", "--driver", "13.0")
    assert "aot-able" not in table.stdout.replace("not aot-able", "")
    done = cli("aot", str(ptx), "--out", str(tmp_path / "out"), "--target", "sm_121")
    assert done.returncode == 2 and "not an ELF file: aot reads shared objects" in done.stderr


def test_a_registration_aot_would_refuse_is_not_aot_able(tmp_path: Path) -> None:
    """A JIT-only extension whose `.nvFatBinSegment` lies past the end of the file: aot
    refuses it, so the audit says why instead of "aot-able"."""
    so = compile_cached("lib-jit", DATA / "kernels.cu", gencode("compute_80:compute_80"))
    data = bytearray(so.read_bytes())
    from sm121_build.cuda.elf import Elf

    elf = Elf.read(bytes(data))
    index = next(i for i, s in enumerate(elf.sections) if s.name == ".nvFatBinSegment")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    struct.pack_into("<Q", data, shoff + index * 64 + 0x18, len(data) + 4096)  # sh_offset
    broken = tmp_path / "_C.abi3.so"
    broken.write_bytes(bytes(data))
    report = audit_binary(broken, broken.name, DEFAULT_POLICY, with_kernels=True)
    assert aot_able(report, DEFAULT_POLICY.target) is None
    assert report.reach is not None and report.reach.refused is not None
    assert ".nvFatBinSegment" in report.reach.refused
    done = cli("aot", str(broken), "--out", str(tmp_path / "out"), "--target", "sm_121")
    assert done.returncode == 2 and ".nvFatBinSegment" in done.stderr
    stock = audit_binary(so, so.name, DEFAULT_POLICY, with_kernels=True)
    assert aot_able(stock, DEFAULT_POLICY.target) is not None  # the same file, whole: aot-able


def test_a_folder_of_wheels_is_audited_by_distribution(tmp_path: Path,
                                                       ptx_fatbin: bytes) -> None:
    """Every wheel of a folder is opened (members named WHEEL!MEMBER), and each package is
    named by its distribution, not by the `nvidia/` folder they all share."""
    lib = _library(tmp_path, [("in_data", ptx_fatbin, "")])
    native = compile_cached("lib-native", DATA / "kernels.cu", gencode("compute_120:sm_120"))
    jit = compile_cached("lib-jit", DATA / "kernels.cu", gencode("compute_80:compute_80"))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for dist, member, source in (("nvidia_cufft", "nvidia/cu13/lib/libcufft.so.12", lib),
                                 ("nvidia_cublas", "nvidia/cu13/lib/libcublas.so.13", native),
                                 ("nvidia_cusparselt_cu13", "nvidia/cu13/lib/libcusparseLt.so.0",
                                  jit)):
        with zipfile.ZipFile(wheels / f"{dist}-13.0.0-py3-none-manylinux_2_28_x86_64.whl",
                             "w") as wheel:
            wheel.write(source, member)
    (wheels / "notes.txt").write_text("not an archive")
    result = cli("audit", str(wheels), "--json", "--target", "sm_121", "--driver", "13.0")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    names = sorted(b["name"].split("!")[1] for b in data["binaries"])
    assert names == ["nvidia/cu13/lib/libcublas.so.13", "nvidia/cu13/lib/libcufft.so.12",
                     "nvidia/cu13/lib/libcusparseLt.so.0"]
    assert data["binaries"][0]["name"].startswith("nvidia_cublas-13.0.0-py3-none-")
    summary = {p["name"]: (p["files"]["native"], p["files"]["jit"], p["aot"]["files"],
                           p["beyond_aot"]) for p in data["packages"]}
    # cuBLAS native; cuSPARSELt JIT-only in .nv_fatbin: aot fixes it; cuFFT's .data: it
    # cannot, only a build for the GPU does
    assert summary == {"nvidia-cublas": (1, 0, 0, 0), "nvidia-cufft": (0, 1, 0, 1),
                       "nvidia-cusparselt-cu13": (0, 1, 1, 0)}
    table = cli("audit", str(wheels), "--target", "sm_121", "--driver", "13.0").stdout
    assert "nvidia-cusparselt-cu13: 0 of 1 file(s) native (1 jit); kernels" in table
    assert "; aot: 1 file(s), about " in table
    strict = cli("audit", str(wheels), "--require", "native", "--target", "sm_121",
                 "--driver", "13.0")
    assert strict.returncode == 1 and "nothing was checked" not in strict.stderr


def test_a_damaged_wheel_in_a_folder_is_said(tmp_path: Path) -> None:
    (tmp_path / "broken-1.0-py3-none-any.whl").write_bytes(b"PK\x03\x04" + bytes(100))
    result = cli("audit", str(tmp_path), "--target", "sm_121", "--driver", "13.0")
    assert result.returncode == 2
    assert "broken-1.0-py3-none-any.whl" in result.stderr


def test_site_packages_files_are_named_by_their_record(tmp_path: Path) -> None:
    """A folder laid out as site-packages: the `.dist-info` RECORD that lists a file names
    its package; a file no RECORD lists keeps its folder's name."""
    site = tmp_path / "site-packages"
    native = compile_cached("lib-native", DATA / "kernels.cu", gencode("compute_120:sm_120"))
    for dist, rel in (("nvidia_cublas-13.1.0.3", "nvidia/cu13/lib/libcublas.so.13"),
                      ("nvidia_nccl_cu13-2.28.9", "nvidia/cu13/lib/libnccl.so.2")):
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(native, site / rel)
        (site / f"{dist}.dist-info").mkdir()
        (site / f"{dist}.dist-info/RECORD").write_text(f"{rel},sha256=x,1\n")
    (site / "stray").mkdir()
    shutil.copy(native, site / "stray/libx.so")
    result = cli("audit", str(site), "--json", "--target", "sm_121", "--driver", "13.0")
    assert result.returncode == 0, result.stderr
    assert [p["name"] for p in json.loads(result.stdout)["packages"]] == [
        "nvidia-cublas", "nvidia-nccl-cu13", "stray"]


def test_a_data_section_whose_name_is_not_in_the_name_table_is_one_error(
        tmp_path: Path) -> None:
    """Found by the fuzzer on its library-kept seed: a data section's name offset past the
    section name table escaped the search of data sections as the ELF reader's own error."""
    from sm121_build.core.errors import CorruptBinaryError
    from sm121_build.cuda.elf import Elf

    so = compile_cached("lib-jit", DATA / "kernels.cu", gencode("compute_80:compute_80"))
    data = bytearray(so.read_bytes())
    elf = Elf.read(bytes(data))
    index = next(i for i, s in enumerate(elf.sections) if s.name == ".rodata")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    struct.pack_into("<I", data, shoff + index * 64, 1 << 30)  # sh_name
    broken = tmp_path / "broken.so"
    broken.write_bytes(bytes(data))
    with pytest.raises(CorruptBinaryError, match="not a readable ELF file"):
        HostBinary.open(broken)
    done = cli("audit", str(broken), "--target", "sm_121", "--driver", "13.0")
    assert done.returncode == CorruptBinaryError.exit_code, done.stderr
    assert done.stderr.count("error: ") == 1 and "Traceback" not in done.stderr


def test_a_record_that_cannot_be_read_is_said(tmp_path: Path) -> None:
    """A RECORD that is not UTF-8 text names no package: the run says so, and its files
    keep their folder's name."""
    site = tmp_path / "site-packages"
    native = compile_cached("lib-native", DATA / "kernels.cu", gencode("compute_120:sm_120"))
    (site / "nvidia/cu13/lib").mkdir(parents=True)
    shutil.copy(native, site / "nvidia/cu13/lib/libcublas.so.13")
    (site / "nvidia_cublas-13.1.0.3.dist-info").mkdir()
    (site / "nvidia_cublas-13.1.0.3.dist-info/RECORD").write_bytes(b"\xff\xfe not text")
    result = cli("audit", str(site), "--json", "--target", "sm_121", "--driver", "13.0")
    assert result.returncode == 0, result.stderr
    assert "unreadable: nvidia_cublas-13.1.0.3.dist-info/RECORD" in result.stderr
    assert [p["name"] for p in json.loads(result.stdout)["packages"]] == ["nvidia"]
