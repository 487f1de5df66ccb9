"""`sm121-build aot`: real nvcc-built shared objects, the real ptxas 13.0 and fatbinary, with
PyPI's cuobjdump, binutils' readelf and pyelftools as the independent oracles."""

from __future__ import annotations

import base64
import hashlib
import json
import platform
import re
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

from devkit.helpers import (
    DATA,
    cli,
    compile_cached,
    cuda_home,
    cuobjdump,
    gencode,
    one_line_error,
    run_cuobjdump,
)
from sm121_build.cuda.binary import jit_ptx
from sm121_build.cuda.compat import parse_target
from sm121_build.cuda.fatbin_rewrite import entry_options, read_layout, rewrite
from sm121_build.verify.aot_check import check_aot

pytestmark = pytest.mark.slow
ENV = {"CUDA_HOME": str(cuda_home())}
SM80_PTX = gencode("compute_80:compute_80", "compute_80:sm_80")


def _listing(path: Path) -> list[str]:
    done = run_cuobjdump("-lelf", "-lptx", str(path))
    return [re.sub(r"^(\w+ file)\s+\d+: \S+?\.\d+\.", r"\1 ", line)
            for line in done.stdout.splitlines()]


def _readelf_warnings(path: Path) -> str:
    done = subprocess.run(["readelf", "-aW", str(path)], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
    return done.stderr


def _sections(path: Path) -> dict[str, bytes]:
    with open(path, "rb") as handle:
        elf = ELFFile(handle)
        return {s.name: s.data() for s in elf.iter_sections() if s.header.sh_type != "SHT_NOBITS"}


def test_aot_makes_every_jit_only_kernel_native_and_keeps_everything_else(
        jit_only_so: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = cli("aot", str(jit_only_so), "--out", str(out), "--target", "sm_121", env=ENV)
    assert done.returncode == 0, done.stderr
    made = out / jit_only_so.name
    assert "2 module(s) native now" in done.stdout
    # the oracle: every stock cubin and PTX still listed, and one sm_121 cubin per unit
    before, after = _listing(jit_only_so), _listing(made)
    assert sorted(before + ["ELF file sm_121.cubin"] * 2) == sorted(after)
    # binutils reads it without a word
    assert _readelf_warnings(made) == _readelf_warnings(jit_only_so) == ""
    # pyelftools: every section but .nv_fatbin and .rela.dyn is byte for byte the stock's
    stock, new = _sections(jit_only_so), _sections(made)
    assert set(stock) == set(new)
    changed = {name for name in stock if stock[name] != new[name]}
    assert changed <= {".nv_fatbin", ".rela.dyn", ".nvFatBinSegment"}, changed
    # the wrappers: only their data pointers (which the linker also wrote in place) moved
    wrapper = struct.Struct("<IIQQ")
    for a, b in zip(wrapper.iter_unpack(stock[".nvFatBinSegment"]),
                    wrapper.iter_unpack(new[".nvFatBinSegment"]), strict=True):
        assert (a[0], a[1], a[3]) == (b[0], b[1], b[3])
    # .rela.dyn: the same relocations, only the addends of the fatbin pointers moved
    rela = struct.Struct("<QQq")
    moved = [(a, b) for a, b in zip(rela.iter_unpack(stock[".rela.dyn"]),
                                    rela.iter_unpack(new[".rela.dyn"]), strict=True) if a != b]
    assert moved and all(a[:2] == b[:2] for a, b in moved)
    # the audit: every kernel native on sm_121 now (it was JIT only)
    audit = cli("audit", str(made), "--target", "sm_121", "--driver", "13.0", "--require",
                "native")
    assert audit.returncode == 0, audit.stdout + audit.stderr
    stock_audit = cli("audit", str(jit_only_so), "--target", "sm_121", "--driver", "13.0",
                      "--require", "native")
    assert stock_audit.returncode == 1


def test_the_added_code_is_what_ptxas_gives_for_the_recorded_options(
        jit_only_so: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert cli("aot", str(jit_only_so), "--out", str(out), "--target", "sm_121",
               env=ENV).returncode == 0
    made = out / jit_only_so.name
    # b.cu's PTX entry records --maxrregcount=32 (nvcc's -Xptxas), which the JIT applies
    layout = read_layout(jit_only_so.read_bytes(), "stock")
    recorded = [entry_options(raw) for c in layout.containers for raw in c.entries]
    assert "--maxrregcount=32" in recorded
    work = tmp_path / "x"
    work.mkdir()
    subprocess.run([cuobjdump(), "-xptx", "all", str(made)],
                   cwd=work, check=True, capture_output=True)
    subprocess.run([cuobjdump(), "-xelf", "all", str(made)],
                   cwd=work, check=True, capture_output=True)
    ptxs = sorted(work.glob("*.ptx"))
    cubins = sorted(work.glob("*sm_121*.cubin"))
    assert len(ptxs) == 2 and len(cubins) == 2
    ptxas = str(cuda_home() / "bin" / "ptxas")
    fresh = []
    for ptx, options in zip(ptxs, ([], ["--maxrregcount=32"]), strict=True):
        target = work / (ptx.stem + ".fresh.cubin")
        subprocess.run([ptxas, "-arch=sm_121", *options, "-o", str(target), str(ptx)],
                       check=True)
        fresh.append(_text(target))
    assert sorted(map(repr, fresh)) == sorted(map(repr, (_text(c) for c in cubins)))


def _text(cubin: Path) -> dict[str, bytes]:
    with open(cubin, "rb") as handle:
        return {s.name: s.data() for s in ELFFile(handle).iter_sections()
                if s.name.startswith(".text")}


def test_a_file_that_loads_natively_gives_nothing_to_do(tmp_path: Path) -> None:
    native = compile_cached("aot_native", DATA / "kernels.cu",
                            gencode("compute_120:sm_120", "compute_120:compute_120"))
    done = cli("aot", str(native), "--out", str(tmp_path / "out"), "--target", "sm_121",
               env=ENV)
    assert done.returncode == 0, done.stderr
    assert "nothing to compile" in done.stderr
    assert not (tmp_path / "out" / native.name).exists()


def test_a_file_it_cannot_rewrite_is_one_line_and_not_written(jit_only_so: Path,
                                                              tmp_path: Path) -> None:
    data = bytearray(jit_only_so.read_bytes())
    with open(jit_only_so, "rb") as handle:
        segment = ELFFile(handle).get_section_by_name(".nvFatBinSegment")
        at = segment.header.sh_offset
    # the first wrapper's data pointer relocation now names no container: refused
    with open(jit_only_so, "rb") as handle:
        rela = ELFFile(handle).get_section_by_name(".rela.dyn")
        start, size = rela.header.sh_offset, rela.header.sh_size
        address = segment.header.sh_addr
    for pos in range(start, start + size, 24):
        offset, _info, _addend = struct.unpack_from("<QQq", data, pos)
        if offset == address + 8:
            struct.pack_into("<q", data, pos + 16, 8)
    assert struct.unpack_from("<I", data, at)[0] == 0x466243B1
    bad = tmp_path / "bad.so"
    bad.write_bytes(bytes(data))
    out = tmp_path / "out"
    done = cli("aot", str(bad), "--out", str(out), "--target", "sm_121", env=ENV)
    line = one_line_error(done)
    assert "not at a container" in line
    assert not (out / "bad.so").exists()
    assert bad.read_bytes() == bytes(data)


def test_out_inside_the_input_or_through_a_link_is_refused(jit_only_so: Path,
                                                           tmp_path: Path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "x.so").write_bytes(jit_only_so.read_bytes())
    one_line_error(cli("aot", str(folder), "--out", str(folder / "out"), env=ENV))
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "link").symlink_to(victim)
    line = one_line_error(cli("aot", str(folder), "--out", str(tmp_path / "link"), env=ENV))
    assert "link" in line
    assert not any(victim.iterdir())


def test_no_ptxas_is_one_line_before_any_work(jit_only_so: Path, tmp_path: Path) -> None:
    empty = tmp_path / "cuda"
    (empty / "bin").mkdir(parents=True)
    line = one_line_error(cli("aot", str(jit_only_so), "--out", str(tmp_path / "o"),
                              "--cuda-home", str(empty)))
    assert "nvidia-cuda-nvcc" in line


def test_a_wheel_comes_back_repaired_and_pip_installs_it(jit_only_so: Path,
                                                         tmp_path: Path) -> None:
    tag = f"py3-none-linux_{platform.machine()}"  # this host's: pip installs it here
    wheel = tmp_path / f"demo-1.0-{tag}.whl"
    files = {"demo/__init__.py": b"", "demo/_k.abi3.so": jit_only_so.read_bytes(),
             "demo-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n",
             "demo-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\n"
                                         b"Root-Is-Purelib: false\nTag: " + tag.encode() + b"\n"}
    record = "".join(f"{name},{_hash(data)},{len(data)}\n" for name, data in files.items())
    with zipfile.ZipFile(wheel, "w") as out:
        for name, data in files.items():
            out.writestr(name, data)
        out.writestr("demo-1.0.dist-info/RECORD", record + "demo-1.0.dist-info/RECORD,,\n")
    done = cli("aot", str(wheel), "--out", str(tmp_path / "out"), "--target", "sm_121",
               env=ENV)
    assert done.returncode == 0, done.stderr
    repaired = tmp_path / "out" / wheel.name
    assert repaired.stat().st_mode == wheel.stat().st_mode
    with zipfile.ZipFile(repaired) as new:
        so = new.read("demo/_k.abi3.so")
        rows = {r.split(",")[0]: r for r in new.read("demo-1.0.dist-info/RECORD").decode()
                .splitlines()}
        assert new.read("demo/__init__.py") == b""
    assert so != files["demo/_k.abi3.so"]
    assert rows["demo/_k.abi3.so"] == f"demo/_k.abi3.so,{_hash(so)},{len(so)}"
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                          "--no-index", "--target", str(site), str(repaired)],
                         capture_output=True, text=True, check=False)
    assert pip.returncode == 0, pip.stderr
    assert (site / "demo" / "_k.abi3.so").read_bytes() == so


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(
        b"=").decode()


def _aot_bytes(stock: bytes, entry_for: dict[int, bytes]) -> bytes:
    layout = read_layout(stock, "stock")
    return rewrite(stock, layout, {i: (*layout.containers[i].entries, e)
                                   for i, e in entry_for.items()})


def _sm121_entries(jit_only_so: Path, tmp_path: Path) -> dict[int, bytes]:
    """The entry `aot` added to each container of the fixture, by the stock container."""
    out = tmp_path / "made"
    assert cli("aot", str(jit_only_so), "--out", str(out), "--target", "sm_121",
               env=ENV).returncode == 0
    made = read_layout((out / jit_only_so.name).read_bytes(), "made")
    stock = read_layout(jit_only_so.read_bytes(), "stock")
    added = {}
    for was, now in zip(stock.registrations, made.registrations, strict=True):
        old, new = stock.containers[was.container], made.containers[now.container]
        if len(new.entries) > len(old.entries):
            added[was.container] = new.entries[len(old.entries)]
    assert added, "aot added no entry"
    return added



def test_verification_refuses_changed_host_code_lost_stock_entries_and_no_cubin(
        jit_only_so: Path, tmp_path: Path) -> None:
    stock = jit_only_so.read_bytes()
    layout = read_layout(stock, "stock")
    entries = _sm121_entries(jit_only_so, tmp_path)
    target = parse_target("sm_121")
    everyone = {r.container: entries[r.container] for r in layout.registrations
                if jit_ptx(layout.containers[r.container].described, target)}
    assert len(everyone) == 2
    good = _aot_bytes(stock, everyone)
    assert check_aot(stock, good, target, "f") == []
    # one container's cubin in both: the other's kernels are not in it
    entry = everyone[min(everyone)]
    crossed = _aot_bytes(stock, dict.fromkeys(everyone, entry))
    assert any("added cubin lacks" in p for p in check_aot(stock, crossed, target, "f"))
    # one byte of host code changed
    with open(jit_only_so, "rb") as handle:
        text = ELFFile(handle).get_section_by_name(".text").header.sh_offset
    tampered = bytearray(good)
    tampered[text + 5] ^= 0xFF
    assert any("outside .nv_fatbin" in p for p in check_aot(stock, bytes(tampered), target, "f"))
    # a container that lost its stock entries (only the new cubin left)
    first = min(everyone)
    lost = rewrite(stock, layout, {**{i: (*layout.containers[i].entries, entry)
                                      for i in everyone}, first: (entry,)})
    assert any("stock entries changed" in p for p in check_aot(stock, lost, target, "f"))
    # a JIT-only container left without a cubin the GPU loads
    partial = _aot_bytes(stock, {i: e for i, e in everyone.items() if i != first})
    assert any("still has no cubin" in p for p in check_aot(stock, partial, target, "f"))


def test_a_full_section_moves_to_a_new_segment_and_its_old_pages_are_cut(tmp_path: Path) -> None:
    """.nv_fatbin of several 64 KiB pages and no room: the section moves to a new PT_LOAD,
    the whole pages it left are cut from the file (every later segment keeps its address),
    so the file grows by about the new entries, not by the section."""
    big = compile_cached("aot_big", DATA / "big_ptx.cu", SM80_PTX)
    with open(big, "rb") as handle:
        section = ELFFile(handle).get_section_by_name(".nv_fatbin").header.sh_size
    assert section > 3 * 65536
    out = tmp_path / "out"
    done = cli("aot", str(big), "--out", str(out), "--target", "sm_121", "--no-cache", env=ENV)
    assert done.returncode == 0, done.stderr
    made = out / big.name
    layout = read_layout(big.read_bytes(), "stock")
    new_layout = read_layout(made.read_bytes(), "made")
    added = new_layout.size - layout.size
    assert 0 < added < section // 4  # the new sm_121 cubin, zstd: not a copy of the section
    assert made.stat().st_size - big.stat().st_size < added + 2 * 65536
    assert _readelf_warnings(made) == _readelf_warnings(big)
    with open(big, "rb") as a, open(made, "rb") as b:
        before = {s.name: (s.header.sh_addr, s.data()) for s in ELFFile(a).iter_sections()
                  if s.header.sh_type != "SHT_NOBITS"}
        after = {s.name: (s.header.sh_addr, s.data()) for s in ELFFile(b).iter_sections()
                 if s.header.sh_type != "SHT_NOBITS"}
        loads = [(p.header.p_vaddr, p.header.p_memsz) for p in ELFFile(b).iter_segments()
                 if p.header.p_type == "PT_LOAD"]
    assert {n for n in before if before[n] != after[n]} <= {".nv_fatbin", ".rela.dyn",
                                                            ".nvFatBinSegment"}
    # the new section lies in a mapped segment of its own, above every other
    address = after[".nv_fatbin"][0]
    assert any(v <= address < v + m for v, m in loads)
    assert address > max(v + m for v, m in loads[:-1])
    assert sorted([*_listing(big), "ELF file sm_121.cubin"]) == sorted(_listing(made))
    audit = cli("audit", str(made), "--target", "sm_121", "--driver", "13.0", "--require",
                "native")
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert check_aot(big.read_bytes(), made.read_bytes(), parse_target("sm_121"), "f") == []


def test_the_audit_calls_jit_only_fatbins_with_ptx_aot_able_and_the_result_not(
        jit_only_so: Path, tmp_path: Path) -> None:
    def aot_field(path: Path) -> object:
        done = cli("audit", str(path), "--target", "sm_121", "--driver", "13.0", "--json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)["binaries"][0]["aot"]

    before = aot_field(jit_only_so)
    assert isinstance(before, dict) and before["fatbins"] == 2 and before["kernels"] > 0
    assert before["ptx_bytes"] > 0 and before["cpu_seconds"] >= 0
    table = cli("audit", str(jit_only_so), "--target", "sm_121", "--driver", "13.0").stdout
    assert "aot-able: 2 fatbin(s) with PTX and no sm_121 cubin" in table
    assert cli("aot", str(jit_only_so), "--out", str(tmp_path / "o"), "--target", "sm_121",
               env=ENV).returncode == 0
    assert aot_field(tmp_path / "o" / jit_only_so.name) is None
    # a GPU whose cubins the file has (sm_80 runs on sm_86): nothing to aot
    done = cli("audit", str(jit_only_so), "--target", "sm_86", "--driver", "13.0", "--json")
    assert json.loads(done.stdout)["binaries"][0]["aot"] is None


def test_links_already_in_out_are_never_written_through(jit_only_so: Path,
                                                        tmp_path: Path) -> None:
    """--out DIR holding a link (a folder, or the file's own name) that leads out of it: one
    line, nothing written outside."""
    tree = tmp_path / "in" / "vllm"
    tree.mkdir(parents=True)
    shutil.copy2(jit_only_so, tree / "_C.abi3.so")
    victim = tmp_path / "victim"
    victim.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "vllm").symlink_to(victim)
    line = one_line_error(cli("aot", str(tmp_path / "in"), "--out", str(out), "--target",
                              "sm_121", env=ENV))
    assert "is a link" in line and not any(victim.iterdir())
    (out / "vllm").unlink()
    (out / "vllm").mkdir()
    (out / "vllm" / "_C.abi3.so").symlink_to(victim / "file")
    line = one_line_error(cli("aot", str(tmp_path / "in"), "--out", str(out), "--target",
                              "sm_121", env=ENV))
    assert "symlink: not written over" in line and not any(victim.iterdir())


def test_aot_for_another_gpu_adds_its_cubins(jit_only_so: Path, tmp_path: Path) -> None:
    """RTX 50-series (sm_120) JITs the same PTX: `--target sm_120` adds sm_120 cubins."""
    done = cli("aot", str(jit_only_so), "--out", str(tmp_path / "o"), "--target", "sm_120",
               env=ENV)
    assert done.returncode == 0, done.stderr
    made = tmp_path / "o" / jit_only_so.name
    assert sorted(_listing(made)) == sorted([*_listing(jit_only_so),
                                             *["ELF file sm_120.cubin"] * 2])
    audit = cli("audit", str(made), "--target", "sm_120", "--driver", "13.0", "--require",
                "native")
    assert audit.returncode == 0, audit.stdout + audit.stderr


@pytest.mark.parametrize("field", [0x20, 0x28, 0x36, 0x38, 0x3A, 0x3C])
def test_a_file_with_damaged_headers_is_one_line_never_a_traceback(
        jit_only_so: Path, tmp_path: Path, field: int) -> None:
    """The ELF header's table offsets and counts set to nonsense (what a crafted file hands
    the rewrite): one `error:` line or nothing to do, no traceback, nothing half-written."""
    data = bytearray(jit_only_so.read_bytes())
    struct.pack_into("<H", data, field, 0xFFFF)
    bad = tmp_path / "bad.so"
    bad.write_bytes(bytes(data))
    done = cli("aot", str(bad), "--out", str(tmp_path / "out"), "--target", "sm_121", env=ENV)
    assert "Traceback" not in done.stderr
    assert done.returncode in (0, 2), done.stderr
    if done.returncode == 2:
        one_line_error(done)
    assert not (tmp_path / "out" / "bad.so").exists() or done.returncode == 0


def test_a_cubin_of_other_kernels_from_a_lying_ptxas_is_refused(jit_only_so: Path,
                                                                tmp_path: Path) -> None:
    """A ptxas that exits 0 with a valid sm_121 cubin of an unrelated kernel: the file is
    not written, and the line names the kernel the added cubin lacks (red team)."""
    other = tmp_path / "other.cu"
    other.write_text("__global__ void totally_other(float* x) { x[0] = 1.0f; }\n")
    ptx = tmp_path / "other.ptx"
    subprocess.run([str(cuda_home() / "bin" / "nvcc"), "-ptx", "-arch=compute_80", "-o",
                    str(ptx), str(other)], check=True)
    home = tmp_path / "cuda" / "bin"
    home.mkdir(parents=True)
    real = cuda_home() / "bin"
    (home / "fatbinary").symlink_to(real / "fatbinary")
    (home / "ptxas").write_text(
        f'#!/bin/sh\ncase "$1" in --version) exec {real}/ptxas --version;; esac\n'
        'for a in "$@"; do [ "$prev" = -o ] && out=$a; prev=$a; done\n'
        f'exec {real}/ptxas -arch=sm_121 -o "$out" {ptx}\n')
    (home / "ptxas").chmod(0o755)
    done = cli("aot", str(jit_only_so), "--out", str(tmp_path / "out"), "--target",
               "sm_121", "--cuda-home", str(home.parent), "--no-cache", env=ENV)
    assert done.returncode == 2, done.stderr
    assert "added cubin lacks" in done.stderr and "(first: " in done.stderr
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
