"""One door in, one door out, one trust policy: a test per class of defect (issue 45), each
on real nvcc-built files, the real CLI and real files that are not files.

- what a result may not land on: an input, by any spelling; two results on one path
- what an input may cost: a frame that states more than its header, a member larger than its
  ELF headers account for, a tree file past the bound
- files that are not files: FIFOs as inputs, keys and cache entries; a non-ELF or truncated
  input is one error for `aot` as for `audit`
- errors: offsets past the end are one line; one bad file leaves the others done
- trust: a cache entry this tool did not write is compiled again; a signed artifacts folder;
  signatures read as cosign reads them; the tag rule on every command that tags
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
import zstandard

from devkit.helpers import DATA, cli, compile_cached, cuda_home, gencode, one_line_error
from sm121_build.core.errors import Sm121Error
from sm121_build.cuda.fatbin import Entry
from sm121_build.cuda.fatbin_rewrite import read_layout

pytestmark = pytest.mark.slow
ENV = {"CUDA_HOME": str(cuda_home()), "DOCKER_HOST": "unix:///nonexistent.sock"}
PLAIN_PTX = [*gencode("compute_80:compute_80", "compute_80:sm_80"), "--compress-mode=none"]


@pytest.fixture(scope="module")
def jit_so() -> Path:
    """One translation unit: an sm_80 cubin and compute_80 PTX, stored plain (JIT-only on
    sm_121: what `aot` compiles)."""
    return compile_cached("doors_jit", DATA / "kernels.cu", PLAIN_PTX)


@pytest.fixture
def home(tmp_path: Path) -> dict[str, str]:
    """A cache and a state folder of the test's own."""
    return {**ENV, "XDG_CACHE_HOME": str(tmp_path / "cache"),
            "XDG_STATE_HOME": str(tmp_path / "state")}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- one door out ----------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", ["own folder", "through a link", "a wheel's own folder",
                                      "a hard link at the result's path"])
def test_no_result_lands_on_an_input_by_any_spelling(jit_so: Path, tmp_path: Path,
                                                     home: dict[str, str],
                                                     spelling: str) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    source = folder / "x.so"
    source.write_bytes(jit_so.read_bytes())
    out = folder
    if spelling == "through a link":
        (tmp_path / "up").symlink_to(tmp_path)
        out = tmp_path / "up" / "in"
    elif spelling == "a wheel's own folder":
        wheel = folder / "pkg-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr("pkg/x.so", jit_so.read_bytes())
            archive.writestr("pkg-1.0.dist-info/RECORD", "pkg/x.so,,\n")
        source = wheel
    elif spelling == "a hard link at the result's path":
        out = tmp_path / "out"
        out.mkdir()
        os.link(source, out / "x.so")
    before = _sha(source)
    line = one_line_error(cli("aot", str(source), "--out", str(out), "--target", "sm_121",
                              env=home))
    assert "input" in line
    assert _sha(source) == before
    assert not (tmp_path / "cache" / "sm121-build" / "aot").exists()  # refused before work


def test_two_results_never_share_a_path(jit_so: Path, tmp_path: Path,
                                        home: dict[str, str]) -> None:
    for name in ("d1", "d2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "x.so").write_bytes(jit_so.read_bytes())
    line = one_line_error(cli("aot", str(tmp_path / "d1" / "x.so"), str(tmp_path / "d2" / "x.so"),
                              "--out", str(tmp_path / "o"), env=home))
    assert "would both be written to" in line
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_a_report_is_never_written_onto_its_input(jit_so: Path, tmp_path: Path) -> None:
    from sm121_build.core.outputs import refuse_onto_inputs

    copy = tmp_path / "x.so"
    copy.write_bytes(jit_so.read_bytes())
    os.link(copy, tmp_path / "same.so")
    for spelling in (copy, tmp_path / "same.so", tmp_path / "." / "x.so"):
        with pytest.raises(Sm121Error, match="the same file as the input"):
            refuse_onto_inputs(spelling, (copy,), "--report")
    with pytest.raises(Sm121Error, match="inside the input"):
        refuse_onto_inputs(tmp_path / "r.json", (tmp_path,), "--report")
    refuse_onto_inputs(tmp_path / "other.json", (copy,), "--report")  # beside it: fine


# -- wheels ----------------------------------------------------------------------------------


def _wheel(path: Path, members: list[tuple[str, bytes]]) -> Path:
    record = io.StringIO(newline="")
    writer = csv.writer(record, lineterminator="\n")
    for name, data in members:  # the members' own hashes, as a wheel records them
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
        writer.writerow([name, f"sha256={digest.decode()}", len(data)])
    writer.writerow(["pkg-1.0.dist-info/RECORD", "", ""])
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members:
            archive.writestr(name, data)
        archive.writestr("pkg-1.0.dist-info/RECORD", record.getvalue())
    return path


def test_record_rows_are_read_and_written_as_csv(jit_so: Path, tmp_path: Path,
                                                 home: dict[str, str]) -> None:
    wheel = _wheel(tmp_path / "pkg-1.0-py3-none-any.whl", [("pkg/a,b.so", jit_so.read_bytes())])
    done = cli("aot", str(wheel), "--out", str(tmp_path / "o"), "--target", "sm_121", env=home)
    assert done.returncode == 0, done.stderr
    with zipfile.ZipFile(tmp_path / "o" / wheel.name) as result:
        rows = {row[0]: row for row in csv.reader(io.StringIO(
            result.read("pkg-1.0.dist-info/RECORD").decode()))}
        member = result.read("pkg/a,b.so")
    assert member != jit_so.read_bytes()
    digest = hashlib.sha256(member).digest()
    assert rows["pkg/a,b.so"][1:] == [
        "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode(), str(len(member))]


def test_a_wheel_with_two_members_of_one_name_is_refused(jit_so: Path, tmp_path: Path,
                                                         home: dict[str, str]) -> None:
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with pytest.warns(UserWarning), zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("pkg/x.so", jit_so.read_bytes())
        archive.writestr("pkg/x.so", b"\x7fELF" + bytes(60))
        archive.writestr("pkg-1.0.dist-info/RECORD", "pkg/x.so,,\n")
    line = one_line_error(cli("aot", str(wheel), "--out", str(tmp_path / "o"), env=home))
    assert "two members named pkg/x.so" in line


# -- what an input may cost --------------------------------------------------------------------

# VmHWM: this process's own peak (ru_maxrss would carry the parent's over the exec)
_PEAK = """
import runpy, sys
sys.argv = ["sm121-build", *sys.argv[1:]]
try:
    runpy.run_module("sm121_build", run_name="__main__")
finally:
    with open("/proc/self/status") as status:
        peak = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
    print(f"PEAK {peak}", file=sys.stderr)
"""


def _with_peak(*args: str, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], int]:
    """Run the CLI and its peak resident memory in MiB (ptxas aside: it is a child); a run
    past 300 s fails the test (a bomb that got through would have ptxas chew on it)."""
    done = subprocess.run([sys.executable, "-c", _PEAK, *args], capture_output=True, text=True,
                          check=False, env={**os.environ, **env}, timeout=300)
    peak = next(int(line.split()[1]) for line in done.stderr.splitlines()
                if line.startswith("PEAK "))
    done.stderr = "\n".join(line for line in done.stderr.splitlines()
                            if not line.startswith("PEAK "))
    return done, peak >> 10


def _ptx_entry(data: bytes) -> tuple[int, Entry]:
    """The file offset of the first PTX entry's header, and the entry."""
    for container in read_layout(data, "stock").containers:
        at = container.offset + 16
        for raw, entry in zip(container.entries, container.described, strict=True):
            if entry.kind == "ptx":
                return at, entry
            at += len(raw)
    raise AssertionError("no PTX entry")


def _as_zstd(data: bytearray, at: int, frame: bytes, declared: int) -> None:
    """Flag the entry whose header is at `at` zstd-compressed, its payload `frame` (padded
    in place), its header declaring `declared` bytes inflated."""
    struct.pack_into("<Q", data, at + 40, struct.unpack_from("<Q", data, at + 40)[0] | 0x8000)
    struct.pack_into("<I", data, at + 16, len(frame))
    struct.pack_into("<Q", data, at + 56, declared)
    start = at + struct.unpack_from("<I", data, at + 4)[0]
    stored = struct.unpack_from("<Q", data, at + 8)[0]
    assert len(frame) <= stored
    data[start:start + stored] = frame.ljust(stored, b"\0")


def _zstd_bomb(so: Path, dest: Path, inflated: int) -> Path:
    """The .so with its PTX entry's payload replaced, in place, by a zstd frame that states
    and yields `inflated` bytes, while the entry header still declares the stock size."""
    data = bytearray(so.read_bytes())
    at, entry = _ptx_entry(bytes(data))
    frame = io.BytesIO()
    with zstandard.ZstdCompressor(level=3).stream_writer(frame, size=inflated,
                                                         closefd=False) as writer:
        stock = bytes(data[entry.offset:entry.offset + entry.size])
        writer.write(stock[:200] + b"//")
        left = inflated - 202
        while left:
            writer.write(b" " * min(left, 1 << 20))
            left -= min(left, 1 << 20)
    _as_zstd(data, at, frame.getvalue(), entry.size)
    dest.write_bytes(bytes(data))
    return dest


def test_a_frame_that_states_more_than_its_header_is_refused_before_it_inflates(
        tmp_path: Path, home: dict[str, str]) -> None:
    big = compile_cached("doors_big", DATA / "big_ptx.cu", PLAIN_PTX)
    bomb = _zstd_bomb(big, tmp_path / "bomb.so", 512 << 20)
    done, peak = _with_peak("aot", str(bomb), "--out", str(tmp_path / "o"), "--timeout", "5",
                            env=home)
    assert "more than the" in one_line_error(done)
    assert peak < 200, f"aot peaked at {peak} MiB on a 512 MiB frame"
    done, peak = _with_peak("audit", "--kernels", str(bomb), env=home)
    assert "more than the" in one_line_error(done)
    assert peak < 200, f"audit peaked at {peak} MiB on a 512 MiB frame"


@pytest.mark.parametrize("head", [b"", b"elf"])
def test_a_member_its_headers_do_not_account_for_is_never_read_whole(
        tmp_path: Path, home: dict[str, str], head: bytes) -> None:
    """A 1 GiB member of zeros (or an ELF header of no sections, then zeros), deflated to a
    few MB: neither `aot` nor `audit` reads it whole or writes it to temp."""
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    elf = b"\x7fELF\x02\x01\x01" + bytes(9) + struct.pack("<HHI", 3, 62, 1) + bytes(40) \
        if head else b""
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        with archive.open("pkg/big.so", "w", force_zip64=True) as member:
            member.write(elf)
            for _ in range(1024):
                member.write(bytes(1 << 20))
        archive.writestr("pkg-1.0-dist-info/RECORD", "pkg/big.so,,\n")
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**home, "TMPDIR": str(temp)}
    done, peak = _with_peak("aot", str(wheel), "--out", str(tmp_path / "o"), env=env)
    if head:
        assert "its ELF headers account for" in one_line_error(done)
    else:
        assert done.returncode == 0 and "nothing to compile" in done.stderr, done.stderr
    assert peak < 200
    done, peak = _with_peak("audit", str(wheel), env=env)
    assert "Traceback" not in done.stderr and peak < 200
    assert sum(f.stat().st_size for f in temp.rglob("*") if f.is_file()) == 0


def test_a_tree_file_past_the_bound_is_one_line(tmp_path: Path) -> None:
    from devkit.helpers import vllm_like_tree

    tree = vllm_like_tree(tmp_path, "project(x)\n")
    big = tree / "cmake" / "external_projects" / "huge.cmake"
    big.parent.mkdir(parents=True, exist_ok=True)
    with open(big, "wb") as out:
        out.truncate(128 << 20)  # sparse: 128 MiB of zeros that take no disk
    done = cli("patch", "--check", "--version", "0.33.0", str(tree),
               env={"SM121_CMAKE_ON_HOST": "1"})
    assert "holds 134217728 bytes, more than the" in one_line_error(done)


# -- files that are not files ------------------------------------------------------------------


def test_fifos_are_refused_at_once_never_opened_for_reading(jit_so: Path, tmp_path: Path,
                                                           home: dict[str, str]) -> None:
    fifo = tmp_path / "f.so"
    os.mkfifo(fifo)
    for args in (("aot", str(fifo), "--out", str(tmp_path / "o")),
                 ("audit", str(fifo)),
                 ("kernels", "verify", "127.0.0.1:1/k:t", "--trust-key", str(fifo)),
                 ("kernels", "publish", "--artifacts", str(tmp_path), "--to",
                  "127.0.0.1:1/k", "--sign-key", str(fifo)),
                 ("inject", "--base", "x:y", "--artifacts", str(tmp_path), "--trust-key",
                  str(fifo)),
                 # red team 2: the main job read its key only with --kernels-from
                 ("--base", "x:y", "--trust-key", str(fifo))):
        done = subprocess.run([sys.executable, "-m", "sm121_build", *args], capture_output=True,
                              text=True, timeout=20, env={**os.environ, **home,
                                                          "DOCKER_HOST": "unix:///nonexistent"},
                              check=False)
        assert "FIFO" in one_line_error(done), args


def test_a_fifo_in_the_cache_is_passed_over(jit_so: Path, tmp_path: Path,
                                            home: dict[str, str]) -> None:
    first = cli("aot", str(jit_so), "--out", str(tmp_path / "o1"), "--target", "sm_121",
                env=home)
    assert first.returncode == 0, first.stderr
    entry = next(p for p in (tmp_path / "cache").rglob("*") if p.is_file())
    entry.unlink()
    os.mkfifo(entry)
    again = subprocess.run([sys.executable, "-m", "sm121_build", "aot", str(jit_so), "--out",
                            str(tmp_path / "o2"), "--target", "sm_121"], capture_output=True,
                           text=True, timeout=120, env={**os.environ, **home}, check=False)
    assert again.returncode == 0, again.stderr
    assert "compiled again" in again.stderr
    assert _sha(tmp_path / "o1" / jit_so.name) == _sha(tmp_path / "o2" / jit_so.name)


@pytest.mark.parametrize("kind", ["truncated", "text"])
def test_an_input_that_is_no_cuda_binary_is_one_error_for_aot_as_for_audit(
        jit_so: Path, tmp_path: Path, home: dict[str, str], kind: str) -> None:
    bad = tmp_path / "x.so"
    bad.write_bytes(jit_so.read_bytes()[:1000] if kind == "truncated" else b"hello\n" * 100)
    one_line_error(cli("aot", str(bad), "--out", str(tmp_path / "o"), env=home))
    one_line_error(cli("audit", str(bad), env=home))


# -- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("section", [".nv_fatbin", ".nvFatBinSegment", ".rela.dyn"])
def test_a_section_past_the_end_is_one_line_never_a_traceback(
        jit_so: Path, tmp_path: Path, home: dict[str, str], section: str) -> None:
    from sm121_build.cuda.elf import Elf

    data = bytearray(jit_so.read_bytes())
    elf = Elf.read(bytes(data))
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    index = next(i for i, s in enumerate(elf.sections) if s.name == section)
    struct.pack_into("<Q", data, shoff + index * 64 + 24, len(data) + (64 << 10))
    bad = tmp_path / "x.so"
    bad.write_bytes(bytes(data))
    assert "runs past the end" in one_line_error(
        cli("aot", str(bad), "--out", str(tmp_path / "o"), env=home))


def test_one_bad_file_is_one_line_and_every_other_file_is_done(
        jit_so: Path, tmp_path: Path, home: dict[str, str]) -> None:
    (tmp_path / "good.so").write_bytes(jit_so.read_bytes())
    data = bytearray(jit_so.read_bytes())
    at, entry = _ptx_entry(bytes(data))  # flagged zstd, its plain text no zstd frame
    _as_zstd(data, at, bytes(data[entry.offset:entry.offset + entry.stored_size]),
             2 * entry.size)
    (tmp_path / "bad.so").write_bytes(bytes(data))
    done = cli("aot", str(tmp_path / "good.so"), str(tmp_path / "bad.so"), "--out",
               str(tmp_path / "o"), "--target", "sm_121", env=home)
    assert "bad.so" in one_line_error(done)
    assert (tmp_path / "o" / "good.so").is_file()
    assert not (tmp_path / "o" / "bad.so").exists()


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="a file whose reads fail (EIO) is made by a bind mount: root only")
def test_a_file_the_disk_cannot_read_is_named_and_the_others_are_done(
        jit_so: Path, tmp_path: Path, home: dict[str, str]) -> None:
    """Red team round 5: a file whose read fails with EIO (another process's /proc/PID/mem
    bind-mounted onto it, in a mount namespace of the test's own: what a failing disk
    gives) was `error: Input/output error`, naming no file, the rest of the folder undone.
    It is listed as unreadable by name; every other file is audited."""
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "good.so").write_bytes(jit_so.read_bytes())
    (folder / "bad.so").write_bytes(b"")
    sleeper = subprocess.Popen(["sleep", "120"])
    try:
        done = subprocess.run(
            ["unshare", "-m", "sh", "-c", 'mount --make-rprivate / && mount --bind "$1" "$2" '
             '&& exec "$3" -m sm121_build audit --json "$4"', "sh",
             f"/proc/{sleeper.pid}/mem", str(folder / "bad.so"), sys.executable, str(folder)],
            capture_output=True, text=True, timeout=120, check=False,
            env={**os.environ, **home})
    finally:
        sleeper.kill()
        sleeper.wait()
    assert "unreadable: bad.so: not read: input cannot be read: Input/output error" \
        in done.stderr, done.stderr
    assert done.returncode == 2 and "1 of 2 file(s)" in done.stderr
    assert [b["name"] for b in json.loads(done.stdout)["binaries"]] == ["good.so"]


# -- trust ---------------------------------------------------------------------------------------


def test_a_cache_entry_this_tool_did_not_write_is_compiled_again(
        tmp_path: Path, home: dict[str, str]) -> None:
    """Two modules; after a first run, one cache entry is replaced by the other's (the same
    format, a cubin of other code), and a second run from a cache with no digests (restored
    from elsewhere): both compile again, say so once, and give the first run's bytes."""
    two = compile_cached("doors_two", DATA / "two_tus" / "a.cu", PLAIN_PTX)
    first = cli("aot", str(two), str(DATA.parent / "data" / "kernels.cu"), "--out",
                str(tmp_path / "o1"), "--target", "sm_121", env=home)
    assert first.returncode != 0  # kernels.cu is no ELF file: one line, two.so still done
    entries = sorted(p for p in (tmp_path / "cache").rglob("*") if p.is_file())
    other = compile_cached("doors_jit", DATA / "kernels.cu", PLAIN_PTX)
    done = cli("aot", str(other), "--out", str(tmp_path / "o0"), "--target", "sm_121",
               env=home)
    assert done.returncode == 0, done.stderr
    foreign = sorted(set(p for p in (tmp_path / "cache").rglob("*") if p.is_file())
                     - set(entries))
    entries[0].write_bytes(foreign[0].read_bytes())  # a valid entry, of other code
    again = cli("aot", str(two), "--out", str(tmp_path / "o2"), "--target", "sm_121",
                env=home)
    assert again.returncode == 0, again.stderr
    assert again.stderr.count("compiled again") == 1
    assert _sha(tmp_path / "o1" / two.name) == _sha(tmp_path / "o2" / two.name)
    restored = {**home, "XDG_STATE_HOME": str(tmp_path / "fresh-state")}
    third = cli("aot", str(two), "--out", str(tmp_path / "o3"), "--target", "sm_121",
                env=restored)
    assert "compiled again" in third.stderr
    assert _sha(tmp_path / "o1" / two.name) == _sha(tmp_path / "o3" / two.name)


def _provenance() -> object:
    from sm121_build.jobs.formats.artifacts import Provenance

    return Provenance(base="vllm/vllm-openai:v0.33.0", base_digest="", vllm_version="0.33.0",
                      vllm_commit="abc", arch_list="12.1", patches="",
                      package_dir="usr/lib/python3/dist-packages/vllm", tool_version="0")


def _artifacts(folder: Path, so: Path) -> None:
    from sm121_build.jobs.formats.artifacts import export

    provenance = _provenance()
    export(folder, {"_C.abi3.so": so}, provenance, {}, None)


def test_a_trust_key_requires_the_folders_signature(jit_so: Path, tmp_path: Path) -> None:
    from devkit.keys import key_pair
    from sm121_build.image.cosign import SigningKey, TrustKey, Untrusted
    from sm121_build.jobs.formats.artifacts import SIGNATURE, load

    private, public = key_pair(tmp_path, "k")
    _, other = key_pair(tmp_path, "other")
    signed, unsigned = tmp_path / "signed", tmp_path / "unsigned"
    from sm121_build.jobs.formats.artifacts import export

    provenance = _provenance()
    export(signed, {"_C.abi3.so": jit_so}, provenance, {},
           SigningKey.load(private, None))
    export(unsigned, {"_C.abi3.so": jit_so}, provenance, {})
    trust = TrustKey.load(public)
    assert load(signed, trust).files
    assert load(unsigned).files  # no key asked for: as before
    with pytest.raises(Untrusted, match="not signed"):
        load(unsigned, trust)
    with pytest.raises(Untrusted, match="not signed by"):
        load(signed, TrustKey.load(other))
    manifest = json.loads((signed / "manifest.json").read_text())
    manifest["vllm_commit"] = "def"
    (signed / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    with pytest.raises(Untrusted, match="changed since it was signed"):
        load(signed, trust)
    assert (signed / SIGNATURE).is_file()
    # an independent verifier reads the signature over the manifest's exact bytes
    export(signed, {"_C.abi3.so": jit_so}, provenance, {}, SigningKey.load(private, None))
    import base64
    (tmp_path / "sig.der").write_bytes(base64.b64decode((signed / SIGNATURE).read_text()))
    openssl = subprocess.run(["openssl", "dgst", "-sha256", "-verify", str(public),
                              "-signature", str(tmp_path / "sig.der"),
                              str(signed / "manifest.json")], capture_output=True, text=True,
                             check=False)
    assert openssl.stdout.strip() == "Verified OK", openssl.stderr
    # the CLI: refused (exit 3) before the engine is asked (DOCKER_HOST points nowhere)
    done = cli("inject", "--base", "x:y", "--artifacts", str(unsigned), "--trust-key",
               str(public), env=ENV)
    assert "not signed" in one_line_error(done, code=3)
    done = cli("inject", "--base", "x:y", "--artifacts", str(unsigned), env={
        **ENV, "SM121_TRUST_KEY": str(public)})
    assert "not signed" in one_line_error(done, code=3)


class _Blobs(BaseHTTPRequestHandler):
    """A registry's blob endpoint on loopback: 404 for `missing`, 2 MiB for `huge`, the
    payload for the rest; manifests from `MANIFESTS`."""

    MANIFESTS: ClassVar[dict[str, bytes]] = {}
    BLOBS: ClassVar[dict[str, bytes]] = {}

    def do_GET(self) -> None:
        name = self.path.rsplit("/", 1)[-1]
        body = (self.MANIFESTS if "/manifests/" in self.path else self.BLOBS).get(name)
        if body is None:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        return


@pytest.fixture
def registry() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Blobs)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}/kernels"
    server.shutdown()


def test_signatures_are_read_as_cosign_reads_them(tmp_path: Path, registry: str) -> None:
    """Before the valid signature: one whose blob is missing (404), one of 2 MiB, one by
    another key.  The valid one is enough; without it, a refusal naming the count."""
    import base64

    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    from devkit.keys import key_pair
    from sm121_build.image import cosign
    from sm121_build.image.registry import Registry, digest_of

    private, public = key_pair(tmp_path, "k")
    stranger = ec.generate_private_key(ec.SECP256R1())
    key = cosign.SigningKey.load(private, None).key
    digest = "sha256:" + "ab" * 32
    body = cosign.payload(registry, digest)
    huge = b"x" * (2 << 20)

    def layer(blob: bytes, signer: ec.EllipticCurvePrivateKey = key,
              name: str | None = None) -> dict[str, object]:
        signature = base64.b64encode(signer.sign(blob, ec.ECDSA(hashes.SHA256()))).decode()
        return {"mediaType": cosign.SIMPLE_SIGNING, "digest": name or digest_of(blob),
                "size": len(blob), "annotations": {cosign.SIGNATURE_ANNOTATION: signature}}

    _Blobs.BLOBS = {digest_of(body): body, digest_of(huge): huge}
    layers = [layer(body, name="sha256:" + "00" * 32), layer(huge), layer(body, stranger)]
    tag = cosign.signature_tag(digest)
    _Blobs.MANIFESTS = {tag: json.dumps({"layers": layers}).encode()}
    trust = cosign.TrustKey.load(public)
    said = r"^no signature of .* \(3 signature\(s\): 2 unreadable, 1 not valid\) verifies with"
    with pytest.raises(cosign.Untrusted, match=said):
        cosign.require_signed(Registry(registry), digest, trust)
    _Blobs.MANIFESTS = {tag: json.dumps({"layers": [*layers, layer(body)]}).encode()}
    cosign.require_signed(Registry(registry), digest, trust)  # the valid one is enough


def test_kernels_publish_never_moves_a_users_tag(tmp_path: Path) -> None:
    from devkit.fakeengine import FakeEngine
    from sm121_build.image import ledger
    from sm121_build.image.api import ImageInfo
    from sm121_build.jobs.formats.artifacts import load
    from sm121_build.jobs.kernel_images.kernels_image import Publication, publish

    engine = FakeEngine(tmp_path / "engine")  # FAKE: the engine (no Docker in unit tests)
    (tmp_path / "root").mkdir()
    users = engine.add_image("127.0.0.1:5000/k:nightly", tmp_path / "root",
                             ImageInfo(ref="mine", id="", repo_digests=(), os="linux",
                                       architecture="amd64", variant="", labels={},
                                       layers=()), [])
    folder = tmp_path / "artifacts"
    so = compile_cached("doors_jit", DATA / "kernels.cu", PLAIN_PTX)
    _artifacts(folder, so)
    with pytest.raises(Sm121Error, match=r"already names image .* --replace-tag"):
        publish(engine, load(folder), Publication("127.0.0.1:5000/k", ("nightly",)),
                tmp_path / "log")
    assert engine.tags["127.0.0.1:5000/k:nightly"] == users
    assert not engine.built
    # a kernels image this tool published may give its moving tag to the next one
    ledger.record_built(users, ["127.0.0.1:5000/k:nightly"], "", "kernels image of v0.32")
    from sm121_build.jobs.framework.pipeline import TagRule, require_tags_free
    from sm121_build.jobs.kernel_images.kernels_image import _a_kernels_image

    require_tags_free(engine, ["127.0.0.1:5000/k:nightly"],
                      TagRule(False, "", None, _a_kernels_image, "the tag"))


def test_no_command_writes_a_report_or_out_onto_its_inputs(jit_so: Path,
                                                           tmp_path: Path) -> None:
    """The second sweep's cases: `--summary-md` onto the audited file (or a hard link of
    it, or into the audited folder), `--report` onto the trust key or into the artifacts
    folder, `--out` that is the artifacts folder, `local --out` that is the source tree."""
    from devkit.keys import key_pair

    audited = tmp_path / "x.so"
    audited.write_bytes(jit_so.read_bytes())
    os.link(audited, tmp_path / "notes.md")
    folder = tmp_path / "artifacts"
    _artifacts(folder, jit_so)
    _, public = key_pair(tmp_path, "k")
    before = {p: _sha(p) for p in (audited, public, folder / "manifest.json")}
    for args in (("audit", str(audited), "--summary-md", str(audited)),
                 ("audit", str(audited), "--summary-md", str(tmp_path / "notes.md")),
                 ("audit", str(folder), "--summary-md", str(folder / "summary.md")),
                 ("inject", "--base", "x:y", "--artifacts", str(folder), "--trust-key",
                  str(public), "--report", str(public)),
                 ("inject", "--base", "x:y", "--artifacts", str(folder), "--report",
                  str(folder / "manifest.json")),
                 ("inject", "--base", "x:y", "--artifacts", str(folder), "--out",
                  str(folder)),
                 ("local", "--source", str(tmp_path), "--out", str(tmp_path))):
        line = one_line_error(cli(*args, env=ENV))
        assert "input" in line or "vLLM" in line, (args, line)
    assert {p: _sha(p) for p in before} == before
    assert not (folder / "summary.md").exists()


def test_a_large_elf_with_no_device_code_is_never_read_whole(
        tmp_path: Path, home: dict[str, str]) -> None:
    """A sparse 2 GiB file behind an ELF header, and a wheel member of 1 GiB whose section
    header table sits at its end: `aot` reads their headers (the member's streamed through
    a window), finds no `.nv_fatbin`, and never holds them whole."""
    header = bytearray(b"\x7fELF\x02\x01\x01" + bytes(9) + struct.pack("<HHI", 3, 62, 1)
                       + bytes(40))
    size = 1 << 30
    struct.pack_into("<Q", header, 0x28, size - 64)  # e_shoff: one null section at the end
    struct.pack_into("<HHH", header, 0x3A, 64, 1, 0)  # e_shentsize, e_shnum, e_shstrndx
    sparse = tmp_path / "big.so"
    with open(sparse, "wb") as out:
        out.write(header)
        out.truncate(2 * size)
    struct.pack_into("<Q", header, 0x28, 2 * size - 64)
    with open(sparse, "r+b") as out:
        out.write(header)
    done, peak = _with_peak("aot", str(sparse), "--out", str(tmp_path / "o"), env=home)
    assert peak < 200, f"aot peaked at {peak} MiB on a sparse 2 GiB file"
    assert "Traceback" not in done.stderr
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    struct.pack_into("<Q", header, 0x28, size - 64)
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        with archive.open("pkg/big.so", "w", force_zip64=True) as member:
            member.write(bytes(header))
            for _ in range(1023):
                member.write(bytes(1 << 20))
            member.write(bytes((1 << 20) - 64 - 64))
            member.write(bytes(64))  # the null section header
        archive.writestr("pkg-1.0.dist-info/RECORD", "pkg/big.so,,\n")
    done, peak = _with_peak("aot", str(wheel), "--out", str(tmp_path / "o2"), env=home)
    assert peak < 200, f"aot peaked at {peak} MiB on a 1 GiB member"
    assert "nothing to compile" in done.stderr, done.stderr


def test_an_oversized_folder_signature_is_untrusted_not_a_bad_input(
        jit_so: Path, tmp_path: Path) -> None:
    from devkit.keys import key_pair

    folder = tmp_path / "artifacts"
    _artifacts(folder, jit_so)
    (folder / "manifest.json.sig").write_bytes(b"A" * (1 << 20))
    _, public = key_pair(tmp_path, "k")
    done = cli("inject", "--base", "x:y", "--artifacts", str(folder), "--trust-key",
               str(public), env=ENV)
    assert "not signed by" in one_line_error(done, code=3)


def test_a_result_gets_the_mode_a_shell_would_give_it(tmp_path: Path) -> None:
    """A result written whole (a temporary file renamed over the name) is not left 0600, as
    the temporary file is made: a new one takes 0666 less the umask, one written over keeps
    the mode it had (a proof a lent H200 wrote was 0600)."""
    from sm121_build.core.outputs import replace_bytes

    old = os.umask(0o022)
    try:
        replace_bytes(tmp_path / "new.json", b"{}")
        (tmp_path / "kept.json").write_bytes(b"old")
        (tmp_path / "kept.json").chmod(0o640)
        replace_bytes(tmp_path / "kept.json", b"{}")
        replace_bytes(tmp_path / "asked.so", b"x", 0o755)
        os.umask(0o077)
        replace_bytes(tmp_path / "private.json", b"{}")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {"new.json": 0o644, "kept.json": 0o640, "asked.so": 0o755,
                     "private.json": 0o600}
