"""One rule for a wheel's members, read by `audit` and `aot` alike (`cuda/wheel.py`): a wheel
with a nameless member, two members of one plain name (`pkg/a.so`, `pkg/./a.so`,
`pkg//a.so`), a name that leaves the archive or one with a control character is refused
whole by both, in one line; a RECORD with no row for a member aot would rewrite is refused
before anything is compiled."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest

SPELLINGS = {
    "nameless": [""],
    "dot": ["pkg/./_k.so"],
    "slashes": ["pkg//_k.so"],
    "twice": ["pkg/_k.so"],
    "leaves": ["../_k.so"],
    "absolute": ["/_k.so"],
    "control": ["pkg/_k\n.so"],
    "c1-control": ["pkg/_k\x9b.so"],  # red team round 6: C1, bidi and line separators
    "next-line": ["pkg/_k\x85.so"],
    "bidi": ["pkg/_k\u202e.so"],
    "line-separator": ["pkg/_k\u2028.so"],
    "backslash": ["pkg\\_k.so"],
}


def _wheel(path: Path, elf: bytes, extra: list[str], record: str) -> Path:
    with zipfile.ZipFile(path, "w") as wheel, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wheel.writestr("pkg/_k.so", elf)
        for name in extra:
            wheel.writestr(zipfile.ZipInfo(name), elf[:64])
        wheel.writestr("pkg-1.0.dist-info/RECORD", record)
    return path


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sm121_build", *args], capture_output=True,
                          text=True, timeout=120, check=False, env=env)


@pytest.mark.parametrize("how", sorted(SPELLINGS))
def test_audit_and_aot_refuse_a_wheel_by_one_rule(how: str, jit_only_so: Path,
                                                  tmp_path: Path) -> None:
    wheel = _wheel(tmp_path / "pkg-1.0-py3-none-any.whl", jit_only_so.read_bytes(),
                   SPELLINGS[how], "pkg/_k.so,,\n")
    audited = _cli("audit", str(wheel))
    aoted = _cli("aot", str(wheel), "--out", str(tmp_path / "out"), "--target", "sm_121")
    for done in (audited, aoted):
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, done.stderr
        assert lines[-1].startswith(f"error: {wheel}: holds "), lines
        assert lines[-1].endswith("refused"), lines
    assert audited.stderr.strip().splitlines()[-1] == aoted.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()


def test_a_folder_lists_a_refused_wheel_and_audits_the_rest(jit_only_so: Path,
                                                           tmp_path: Path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    _wheel(folder / "bad-1.0-py3-none-any.whl", jit_only_so.read_bytes(), ["pkg/./_k.so"],
           "pkg/_k.so,,\n")
    _wheel(folder / "good-1.0-py3-none-any.whl", jit_only_so.read_bytes(), [], "pkg/_k.so,,\n")
    done = _cli("audit", str(folder))
    assert done.returncode == 2
    assert "good-1.0-py3-none-any.whl!pkg/_k.so" in done.stdout
    assert "two members named pkg/_k.so (one spelled pkg/./_k.so)" in done.stdout + \
        done.stderr


def test_a_record_without_the_members_row_is_refused_before_any_compile(
        jit_only_so: Path, tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    for tool in ("ptxas", "fatbinary"):
        script = home / "bin" / tool
        script.write_text(f'#!/bin/sh\necho "$@" >> {calls}\ncase "$1" in --version) echo '
                          '"Cuda compilation tools, release 13.0, V13.0.88"; exit 0;; '
                          'esac\nexit 1\n')
        script.chmod(0o755)
    wheel = _wheel(tmp_path / "pkg-1.0-py3-none-any.whl", jit_only_so.read_bytes(), [],
                   "pkg/__init__.py,,\n")
    done = _cli("aot", str(wheel), "--out", str(tmp_path / "out"), "--target", "sm_121",
                "--cuda-home", str(home), "--no-cache",
                env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "c")})
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: {wheel}: its RECORD has no row for pkg/_k.so")
    assert calls.read_text().split("\n")[:-1] == ["--version"], "ptxas compiled before"
    assert "native now" not in done.stdout + done.stderr


def test_a_folder_entry_on_a_members_path_is_refused_by_both(jit_only_so: Path,
                                                             tmp_path: Path) -> None:
    """`pkg/_k.so` and the folder `pkg/_k.so/` cannot both be extracted (red team)."""
    wheel = _wheel(tmp_path / "pkg-1.0-py3-none-any.whl", jit_only_so.read_bytes(),
                   ["pkg/_k.so/"], "pkg/_k.so,,\n")
    for args in (("audit", str(wheel)), ("aot", str(wheel), "--out", str(tmp_path / "o"))):
        done = _cli(*args)
        assert done.returncode == 2
        assert "holds two members named pkg/_k.so (one spelled pkg/_k.so/)" in done.stderr


def test_a_decoy_record_deeper_in_the_wheel_is_never_the_one_updated(
        jit_only_so: Path, tmp_path: Path) -> None:
    """A second `*.dist-info/RECORD` placed first but not at the wheel's top: aot updates
    the real one; two at the top: refused (red team)."""
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    data = jit_only_so.read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    with zipfile.ZipFile(wheel, "w") as out:
        out.writestr("aaa/zzz.dist-info/RECORD", "pkg/_k.so,,\n")
        out.writestr("pkg/_k.so", data)
        out.writestr("pkg-1.0.dist-info/RECORD", f"pkg/_k.so,sha256={digest},{len(data)}\n")
    done = _cli("aot", str(wheel), "--out", str(tmp_path / "out"), "--target", "sm_121",
                env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "c")})
    assert done.returncode == 0, done.stderr
    with zipfile.ZipFile(tmp_path / "out" / wheel.name) as repaired:
        real = repaired.read("pkg-1.0.dist-info/RECORD").decode()
        assert real.startswith("pkg/_k.so,sha256=") and \
            repaired.read("aaa/zzz.dist-info/RECORD") == b"pkg/_k.so,,\n"
    two = tmp_path / "two" / wheel.name
    two.parent.mkdir()
    with zipfile.ZipFile(two, "w") as out:
        out.writestr("pkg/_k.so", jit_only_so.read_bytes())
        out.writestr("zzz-1.0.dist-info/RECORD", "pkg/_k.so,,\n")
        out.writestr("pkg-1.0.dist-info/RECORD", "pkg/_k.so,,\n")
    for args in (("audit", str(two)), ("aot", str(two), "--out", str(tmp_path / "o2"))):
        done = _cli(*args)
        assert done.returncode == 2 and "holds two .dist-info folders" in done.stderr


def test_a_wheel_whose_version_has_an_epoch_is_read_whole_by_both(
        jit_only_so: Path, tmp_path: Path) -> None:
    """`x-1!2.0-...whl`: the epoch's `!` is the version's, not where `WHEEL!MEMBER` splits
    (aot looked for a RECORD row `2.0-py3-none-any.whl!pkg/_k.so`); its name gives `x`."""
    wheel = tmp_path / "x-1!2.0-py3-none-any.whl"
    data = jit_only_so.read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    with zipfile.ZipFile(wheel, "w") as out:
        out.writestr("pkg/a!b/_k.so", data)  # a member's own `!` too
        out.writestr("x-1!2.0.dist-info/RECORD", f"pkg/a!b/_k.so,sha256={digest},{len(data)}\n")
    done = _cli("aot", str(wheel), "--out", str(tmp_path / "out"), "--target", "sm_121",
                env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "c")})
    assert done.returncode == 0, done.stderr
    assert f"{wheel.name}!pkg/a!b/_k.so: 2 module(s) native now" in done.stdout, done.stdout
    with zipfile.ZipFile(tmp_path / "out" / wheel.name) as repaired:
        row = repaired.read("x-1!2.0.dist-info/RECORD").decode()
        assert row.startswith("pkg/a!b/_k.so,sha256=") and digest not in row
    audited = _cli("audit", "--json", str(wheel), "--target", "sm_121", "--driver", "13.0")
    assert audited.returncode == 0, audited.stderr
    assert [(b["name"], b["package"]) for b in json.loads(audited.stdout)["binaries"]] == [
        ("pkg/a!b/_k.so", "x")]


@pytest.mark.parametrize("name", ["x!y-1.0-py3-none-any.whl", "pkg.whl",
                                  "pkg-1.0-x-py3-none-any.whl"])
def test_a_wheel_name_pip_would_not_take_is_refused_by_both(
        name: str, jit_only_so: Path, tmp_path: Path) -> None:
    """A name `packaging.utils.parse_wheel_filename` refuses (`x!y`: not split at its `!`,
    not a distribution `x!y`): one line, the same for audit, aot and `audit --source`; in a
    folder, that one entry is listed and the rest audited."""
    folder = tmp_path / "in"
    folder.mkdir()
    wheel = _wheel(folder / name, jit_only_so.read_bytes(), [], "pkg/_k.so,,\n")
    expected = f"error: {wheel}: not a wheel's file name ("
    source = shutil.copytree(Path(__file__).parents[1] / "data" / "vllm_like", tmp_path / "src")
    for args in (("audit", str(wheel)), ("aot", str(wheel), "--out", str(tmp_path / "o")),
                 ("audit", str(wheel), "--source", str(source))):
        done = _cli(*args)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, done.stderr
        assert lines[-1].startswith(expected) and lines[-1].endswith(
            "not a wheel pip would install; refused"), lines
        assert "Traceback" not in done.stderr
    _wheel(folder / "good-1.0-py3-none-any.whl", jit_only_so.read_bytes(), [], "pkg/_k.so,,\n")
    listed = _cli("audit", "--json", str(folder), "--target", "sm_121", "--driver", "13.0")
    assert listed.returncode == 2
    assert [b["name"] for b in json.loads(listed.stdout)["binaries"]] == [
        "good-1.0-py3-none-any.whl!pkg/_k.so"]
    assert f"unreadable: {name}: not a wheel's file name (" in listed.stderr
    assert not (tmp_path / "o").exists()


def _bomb(path: Path, size: int) -> Path:
    """A wheel whose one member is an ELF of `size` bytes, zeros but for headers that
    account for all of it and name `.nv_fatbin` (it deflates ~1000x)."""
    names = b"\0.nv_fatbin\0.shstrtab\0"
    shoff = size - 192
    rows = bytes(64) + struct.pack("<IIQQQQIIQQ", 1, 1, 2, 0, 64, 16, 0, 0, 8, 0) + \
        struct.pack("<IIQQQQIIQQ", 12, 3, 0, 0, shoff - len(names), len(names), 0, 0, 1, 0)
    head = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9) + struct.pack(
        "<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, shoff, 0, 64, 56, 0, 64, 3, 2)
    info = zipfile.ZipInfo("pkg/a.so")
    info.compress_type = zipfile.ZIP_DEFLATED
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as out, \
            out.open(info, "w") as member:
        member.write(head)
        left = shoff - len(head) - len(names)
        while left > 0:
            member.write(bytes(min(left, 1 << 24)))
            left -= 1 << 24
        member.write(names + rows)
    with zipfile.ZipFile(path, "a") as out:
        out.writestr("pkg-1.0.dist-info/RECORD", "pkg/a.so,,\n")
    return path


def test_a_zip_bomb_member_is_refused_before_it_is_held(tmp_path: Path) -> None:
    wheel = _bomb(tmp_path / "pkg-1.0-py3-none-any.whl", 256 << 20)
    assert wheel.stat().st_size < 2 << 20
    aoted = _cli("aot", str(wheel), "--out", str(tmp_path / "o"), "--target", "sm_121")
    assert aoted.returncode == 2
    assert "pkg/a.so: inflates to 268435456 bytes from" in aoted.stderr
    assert "(more than 200x: a zip bomb); refused" in aoted.stderr
    audited = _cli("audit", str(wheel))
    assert audited.returncode == 2
    assert "not extracted: inflates to 268435456 bytes" in audited.stdout + audited.stderr


def test_a_member_that_is_not_what_its_record_says_is_refused_before_any_compile(
        jit_only_so: Path, tmp_path: Path) -> None:
    """A member swapped after the wheel was made (its RECORD's sha256 another's): aot
    would have written it back with a fresh, valid hash (red team)."""
    wheel = _wheel(tmp_path / "pkg-1.0-py3-none-any.whl", jit_only_so.read_bytes(), [],
                   "pkg/_k.so,sha256=Use6b6rfAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA,4\n")
    done = _cli("aot", str(wheel), "--out", str(tmp_path / "out"), "--target", "sm_121",
                env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "c")})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: {wheel}: its RECORD's sha256 of pkg/_k.so is not the member's (changed "
        "after the wheel was made); refused")
    assert not (tmp_path / "out").exists()


def test_many_small_members_cannot_fill_the_temp_folder(tmp_path: Path) -> None:
    """16 PTX members of 24 MB of spaces each (a 400 KB wheel): audit stops at the wheel's
    budget, not 384 MB later (red team)."""
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as out:
        for i in range(16):
            out.writestr(f"pkg/k{i}.ptx", b"//\n.version 8.0\n.target sm_90\n"
                         b".address_size 64\n" + b" " * (24 << 20))
        out.writestr("pkg-1.0.dist-info/RECORD", "")
    assert wheel.stat().st_size < 1 << 20
    done = _cli("audit", str(wheel))
    assert done.returncode == 2
    assert "its members inflate to more than 200x the wheel's bytes (a decompression " \
        "bomb)" in done.stderr


@pytest.mark.parametrize("hashed", ["", "md5=abc", "foo=bar", "sha512=AAAA"])
def test_a_member_with_no_true_strong_hash_in_its_record_is_refused(
        hashed: str, jit_only_so: Path, tmp_path: Path) -> None:
    """Only sha256/384/512 that are the member's (as pip checks): an empty, weak, unknown or
    wrong hash refuses the wheel before any compile (red team)."""
    wheel = _wheel(tmp_path / "pkg-1.0-py3-none-any.whl", jit_only_so.read_bytes(), [],
                   f"pkg/_k.so,{hashed},\n")
    done = _cli("aot", str(wheel), "--out", str(tmp_path / "out"), "--target", "sm_121")
    assert done.returncode == 2 and done.stderr.rstrip().endswith("refused"), done.stderr
    assert not (tmp_path / "out").exists()


def test_audit_and_aot_tell_a_wheel_by_its_bytes_not_its_name(jit_only_so: Path,
                                                              tmp_path: Path) -> None:
    """#61: one rule says what a wheel is, for `aot` as for `audit` (`unpack.archive_kind`:
    a zip by its first bytes).  A `.whl` that is no zip is no wheel to either (aot called it
    a damaged wheel); a wheel under another name is read as one by both."""
    fake = tmp_path / "fake-1.0-py3-none-any.whl"
    fake.write_bytes(b"hello")
    audited, aoted = _cli("audit", str(fake)), _cli("aot", str(fake), "--out",
                                                     str(tmp_path / "o"))
    assert audited.returncode == aoted.returncode == 2
    assert audited.stderr.startswith(f"error: {fake}: not an ELF file")
    assert aoted.stderr.startswith(f"error: {fake}: not an ELF file")
    renamed = _wheel(tmp_path / "pkg-1.0-py3-none-any.so", jit_only_so.read_bytes(), [],
                     "pkg/_k.so,,\n")
    listed = _cli("audit", "--json", str(renamed), "--target", "sm_121", "--driver", "13.0")
    assert [b["name"] for b in json.loads(listed.stdout)["binaries"]] == ["pkg/_k.so"]
    made = _cli("aot", str(renamed), "--out", str(tmp_path / "out"), "--target", "sm_121")
    assert made.returncode == 2  # read as a wheel: its RECORD is checked (it was no ELF file)
    assert "its RECORD gives pkg/_k.so no sha256 (or stronger) hash" in made.stderr
