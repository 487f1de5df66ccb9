"""verify.checks.check_host_code: a placed file's host side against the stock file it
replaces, on real gcc-built shared objects (cuda.host reads them; binutils' readelf is the
oracle for what they hold)."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from devkit.helpers import DATA
from sm121_build.cuda.host import host_side
from sm121_build.verify.checks import check_host_code

HOST = DATA / "host"


def _so(tmp_path: Path, source: str, *flags: str) -> Path:
    out = tmp_path / f"{source}-{len(flags)}.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(HOST / source), *flags],
                   check=True)
    return out


def _readelf_needed(path: Path) -> set[str]:
    text = subprocess.run(["readelf", "-dW", str(path)], capture_output=True, text=True,
                          check=True).stdout
    return {line.split("[", 1)[1].split("]", 1)[0] for line in text.splitlines()
            if "(NEEDED)" in line}


def test_the_host_side_reads_what_readelf_reads(tmp_path: Path) -> None:
    plain = _so(tmp_path, "module.c", "-Wl,--no-as-needed", "-lm")
    side = host_side(plain)
    assert side.ident == "ELF64 x86_64" or side.ident == "ELF64 aarch64"
    assert side.needed == _readelf_needed(plain)
    assert "PyInit_module" in side.symbols.exported
    assert host_side(_so(tmp_path, "module_ctor.c")).initialisers > side.initialisers


def test_an_aot_file_with_a_constructor_or_a_new_export_is_refused(tmp_path: Path) -> None:
    stock, hostile = _so(tmp_path, "module.c"), _so(tmp_path, "module_ctor.c")
    mode = (0o100755, 0o100755)
    problems = check_host_code("_C.abi3.so", stock, hostile, mode, origin="aot")
    assert any("initialiser(s) run at load" in p for p in problems), problems
    assert any("exports 1 symbol(s) the stock file did not, e.g. extra_entry" in p
               for p in problems), problems
    # built from source (here, or placed from artifacts of a build), its own kernels'
    # registrations differ: not judged; the platform checks still apply
    assert check_host_code("_C.abi3.so", stock, hostile, mode, origin="placed") == []
    assert check_host_code("_C.abi3.so", stock, hostile, mode, origin="built") == []
    assert check_host_code("_C.abi3.so", stock, _so(tmp_path, "module.c", "-O2"), mode,
                           origin="aot") == []


def test_a_new_library_a_lost_pyinit_another_platform_or_mode_is_refused(
        tmp_path: Path) -> None:
    stock = _so(tmp_path, "module.c")
    mode = (0o100755, 0o100755)
    linked = _so(tmp_path, "module.c", "-Wl,--no-as-needed", "-lm")
    assert "libm.so.6" in _readelf_needed(linked)
    needs = check_host_code("x.so", stock, linked, mode, origin="built")
    assert any(p.startswith("x.so: needs ") and "libm.so.6" in p for p in needs), needs
    renamed = tmp_path / "renamed.c"
    renamed.write_text((HOST / "module.c").read_text().replace("PyInit_module", "PyInit_other"))
    other = tmp_path / "other.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(other), str(renamed)], check=True)
    lost = check_host_code("x.so", stock, other, mode, origin="built")
    assert any("no longer exports PyInit_module" in p for p in lost), lost
    foreign = tmp_path / "foreign.so"
    shutil.copy2(stock, foreign)
    with open(foreign, "r+b") as handle:
        handle.seek(18)
        handle.write(struct.pack("<H", 183 if host_side(stock).ident.endswith("x86_64")
                                 else 62))
    assert any("is not the stock file's" in p
               for p in check_host_code("x.so", stock, foreign, mode, origin="built"))
    assert any("mode 777, the stock file's 755" in p
               for p in check_host_code("x.so", stock, stock, (0o100755, 0o100777),
                                        origin="aot"))
    assert check_host_code("x.so", None, stock, mode, origin="aot") == []
    # placed files have the stock file's mode too; a file built here its own
    assert any("mode 777" in p for p in check_host_code(
        "x.so", stock, stock, (0o100755, 0o100777), origin="placed"))
    assert check_host_code("x.so", stock, stock, (0o100755, 0o100777), origin="built") == []


@pytest.mark.parametrize("damaged", [b"", b"\x7fELF" + b"\0" * 12])
def test_a_damaged_file_is_a_problem_not_a_crash(tmp_path: Path, damaged: bytes) -> None:
    stock = _so(tmp_path, "module.c")
    bad = tmp_path / "bad.so"
    bad.write_bytes(damaged)
    problems = check_host_code("x.so", stock, bad, (0o100755, 0o100755), origin="aot")
    assert len(problems) == 1 and problems[0].startswith("x.so: ")
