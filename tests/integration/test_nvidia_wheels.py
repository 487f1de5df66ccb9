"""Real NVIDIA libraries from PyPI, where cuobjdump is blind: cuFFT keeps its kernels in
`.data`/`.ldata`, cuBLASLt and cuSPARSELt some in `.cask_resource`, cuSPARSE some in
`.rodata`.  The audit must count every one of them; the oracle is an independent scan
written here (pyelftools for the sections, a brute-force search for the container magic in
every section, each container walked with its own `struct` reads), and cuobjdump itself for
what lies in `.nv_fatbin`."""

from __future__ import annotations

import json
import mmap
import struct
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

from devkit.helpers import CACHE, pypi_download, run_cuobjdump

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# (spec, the file of it to check); x86_64 wheels (the layout is the same on aarch64)
WHEELS = {
    "nvidia_cufft==12.5.0.14": "nvidia/cu13/lib/libcufft.so.12",
    "nvidia_cusparse==12.9.4.2": "nvidia/cu13/lib/libcusparse.so.12",
    "nvidia_cusparselt_cu13==0.10.0": "nvidia/cu13/lib/libcusparseLt.so.0",
    "nvidia_cublas==13.10.0.20": "nvidia/cu13/lib/libcublasLt.so.13",
}
KINDS = {1: "ptx", 2: "elf", 8: "lto"}


def _wheel(spec: str) -> Path:
    return pypi_download(spec, CACHE / "nvidia", platform="manylinux2014_x86_64",
                         tags="x86_64")


def _oracle(path: Path) -> Counter[tuple[str, str, int]]:
    """(section, kind, arch) of every entry of every container that holds together, in any
    section with file bytes: independent of the tool's ELF and fatbin readers."""
    found: Counter[tuple[str, str, int]] = Counter()
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0,
                                               access=mmap.ACCESS_READ) as data:
        for section in ELFFile(handle).iter_sections():
            if section["sh_type"] == "SHT_NOBITS":
                continue
            start = section["sh_offset"]
            end = start + section["sh_size"]
            at = data.find(b"\x50\xed\x55\xba", start, end)
            while at >= 0:
                entries = _container(data, at, end)
                if entries is None:
                    at = data.find(b"\x50\xed\x55\xba", at + 1, end)
                    continue
                size = struct.unpack_from("<Q", data, at + 8)[0]
                found.update((section.name, kind, arch) for kind, arch in entries)
                at = data.find(b"\x50\xed\x55\xba", at + 16 + size, end)
    return found


def _container(data: mmap.mmap, at: int, end: int) -> list[tuple[str, int]] | None:
    version, header, size = struct.unpack_from("<HHQ", data, at + 4)
    if version != 1 or header != 16 or at + 16 + size > end:
        return None
    pos, stop, entries = at + 16, at + 16 + size, []
    while pos + 64 <= stop:
        kind, _v, head, payload = struct.unpack_from("<HHIQ", data, pos)
        if kind == 0 and head == 0:
            break
        if kind not in KINDS or head < 64 or pos + head + payload > stop:
            return None
        entries.append((KINDS[kind], struct.unpack_from("<I", data, pos + 28)[0]))
        pos += head + payload
    return entries or None


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """spec -> (the wheel, its library extracted)."""
    dest = tmp_path_factory.mktemp("nvidia")
    out = {}
    for spec, member in WHEELS.items():
        wheel = _wheel(spec)
        with zipfile.ZipFile(wheel) as archive:
            out[spec] = (wheel, Path(archive.extract(member, dest / spec.split("==")[0])))
    return out


def _audit(*args: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-m", "sm121_build", "audit", "--json",
                           "--target", "sm_121", "--driver", "13.0", *args],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, object] = json.loads(done.stdout)
    return result


@pytest.mark.parametrize("spec", list(WHEELS))
def test_every_entry_of_every_section_against_an_independent_scan(
        spec: str, unpacked: dict[str, tuple[Path, Path]]) -> None:
    _wheel_path, library = unpacked[spec]
    oracle = _oracle(library)
    binaries = _audit("--no-kernels", str(library))["binaries"]
    assert isinstance(binaries, list) and len(binaries) == 1
    seen = Counter((e["section"], e["kind"], int(e["arch"][3:].rstrip("af")))
                   for e in binaries[0]["entries"])
    assert seen == oracle
    outside = {s for s, _k, _a in oracle} - {".nv_fatbin"}
    assert outside, f"{library.name} keeps every fatbin in .nv_fatbin: not the case tested"


def test_cufft_is_no_longer_empty_and_require_native_fails(
        unpacked: dict[str, tuple[Path, Path]]) -> None:
    """cuFFT 12 has no `.nv_fatbin` at all: cuobjdump lists nothing, and the audit used to
    say "no device code".  Its 18,227 fatbins are in `.data` and `.ldata`: 6,573 LTO-IR
    entries (nvJitLink's, not the driver's), PTX for sm_75-90, sm_120 cubins."""
    _wheel_path, library = unpacked["nvidia_cufft==12.5.0.14"]
    assert "ELF file" not in run_cuobjdump("-lelf", "-lptx", str(library)).stdout
    report = _audit(str(library))["binaries"][0]
    assert report["sections"] == {".data": 18215, ".ldata": 12}
    assert report["lto_fatbins"] == 6573
    assert report["kernel_counts"]["jit"] > 7000 and report["kernel_counts"]["native"] > 400
    assert report["aot"] is None and report["aot_unreachable"] == {".data": 8123, ".ldata": 12}
    strict = subprocess.run([sys.executable, "-m", "sm121_build", "audit", str(library),
                             "--require", "native", "--target", "sm_121", "--driver", "13.0"],
                            capture_output=True, text=True, check=False)
    assert strict.returncode == 1, strict.stderr


def test_the_nv_fatbin_listing_still_equals_cuobjdump(
        unpacked: dict[str, tuple[Path, Path]]) -> None:
    """Where cuobjdump does look, the listing is its own, line for line: the fatbins found
    elsewhere are not slipped into it."""
    _wheel_path, library = unpacked["nvidia_cusparse==12.9.4.2"]
    ours = subprocess.run([sys.executable, "-m", "sm121_build", "audit", "--format",
                           "cuobjdump", str(library)], capture_output=True, text=True,
                          check=False)
    theirs = run_cuobjdump("-lelf", "-lptx", str(library))
    assert theirs.returncode == 0 and ours.returncode == 0, ours.stderr
    assert ours.stdout.splitlines() == theirs.stdout.splitlines()
    assert len(theirs.stdout.splitlines()) == 1507


def test_a_folder_of_the_wheels_names_each_distribution(
        unpacked: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    for wheel, _library in unpacked.values():
        (tmp_path / wheel.name).hardlink_to(wheel)
    packages = {p["name"] for p in _audit("--no-kernels", str(tmp_path))["packages"]}
    assert packages == {"nvidia-cufft", "nvidia-cusparse", "nvidia-cusparselt-cu13",
                        "nvidia-cublas"}
