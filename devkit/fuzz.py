"""Fuzz targets for every parser of outside bytes, their seeds, and the drivers that run them.

A *target* takes bytes (and a scratch folder) and hands them to one parser the way the tool
does: it must end in a result or in the error of its class (`Sm121Error`, whose subclasses
the CLI prints as one `error:` line with the class's exit code; `ElfError` for the bare ELF
reader, which its callers turn into one).  Anything else (a traceback) is a crash, and so is
an input that takes more memory or time than the driver's bound.

Two drivers share the targets:
- hypothesis (`tests/unit/test_fuzz.py`, in CI): structured mutations of real seeds (the
  header fields the parsers read set to boundary values, truncations, zero runs, splices of
  two seeds), a fixed derandomized budget per target, so CI runs the same inputs each time;
  `SM121_FUZZ_EXAMPLES` raises the budget and `SM121_FUZZ_RANDOM=1` draws new inputs.
- atheris (coverage-guided, libFuzzer's engine): `python -m devkit.fuzz TARGET [-atheris
  options]`, for the long run (the nightly workflow's fuzz job); every crash it finds is
  written by libFuzzer as `crash-<sha1>` and becomes a case in `REGRESSIONS` below.

Why both: hypothesis runs inside pytest with no native build and shrinks a failure to a
readable case; atheris follows the parsers' branches, which a mutation of seeds alone does
not, but needs its own process per target and hours to pay off.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import resource
import struct
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import zstandard
from cryptography.hazmat.primitives.asymmetric import ec

from sm121_build.core.errors import Sm121Error
from sm121_build.cuda.elf import ElfError

Target = Callable[[bytes, Path], object]
MEMORY_BOUND = 768 << 20  # bytes of peak RSS any one input may add
TIME_BOUND = 20.0  # seconds any one input may take (a loaded 2-core CI machine)


# -- the targets ---------------------------------------------------------------------------


def elf_reader(data: bytes, tmp: Path) -> object:
    """`cuda/elf.Elf`: the section table, every section's bytes, symbol tables."""
    from sm121_build.cuda.elf import SHT_DYNSYM, SHT_SYMTAB, Elf, declared_extent

    declared_extent(data[:1 << 16])
    elf = Elf.read(data)
    for section in elf.sections:
        elf.section_data(section)
        if section.type in (SHT_SYMTAB, SHT_DYNSYM):
            elf.functions(section, 0x10)
    return len(elf.rows)


def host_binary(data: bytes, tmp: Path) -> object:
    """`cuda/fatbin.HostBinary` (what `audit` reads): entries, every payload inflated, the
    kernels of each; and the dynamic symbols verification compares."""
    from sm121_build.cuda.binary import DEFAULT_POLICY, audit_binary
    from sm121_build.cuda.dynsym import dynamic_symbols
    from sm121_build.cuda.fatbin import HostBinary

    path = _file(tmp, "x.so", data)
    with HostBinary.open(path) as binary:
        for entry in binary.entries:
            binary.kernel_sizes(entry)
            binary.kernels(entry)
    dynamic_symbols(path)
    return audit_binary(path, "x.so", DEFAULT_POLICY, with_kernels=True)


def fatbin_layout(data: bytes, tmp: Path) -> object:
    """`cuda/fatbin_rewrite` (what `aot` rewrites): the layout, a rewrite that adds an entry
    to every container, and the verification of the result against the input."""
    from sm121_build.cuda.compat import DEFAULT_TARGET
    from sm121_build.cuda.fatbin_rewrite import entry_options, read_layout, rewrite
    from sm121_build.verify.aot_check import check_aot

    layout = read_layout(data, "fuzz")
    for container in layout.containers:
        for raw in container.entries:
            entry_options(raw)
    grown = {i: (*c.entries, c.entries[0]) for i, c in enumerate(layout.containers)
             if c.entries}
    return check_aot(data, rewrite(data, layout, grown), DEFAULT_TARGET, "fuzz")


def fatbin_entry(data: bytes, tmp: Path) -> object:
    """One fatbin entry header and its payload (the aot cache's entries are these), and
    the raw device files (`.cubin`, `.fatbin`, `.ptx`) by their first bytes."""
    from sm121_build.cuda.fatbin import device_file_kind, entry_payload, ptx_kernels, read_entry

    device_file_kind(data[:4096])
    ptx_kernels(data[:1 << 16])
    if len(data) < 64:
        return None
    entry, _end = read_entry(Path("fuzz"), data, 0, len(data))
    return None if entry is None else len(entry_payload(data, entry, "fuzz"))


def wheel_audit(data: bytes, tmp: Path) -> object:
    """A wheel (zip) as `audit` and `aot` read it: members extracted by their first bytes,
    each audited; and aot's member reader and RECORD rewrite."""
    from sm121_build.audit.unpack import binaries
    from sm121_build.cuda.binary import DEFAULT_POLICY, audit_binary
    from sm121_build.cuda.wheel import elf_members, read_record, record_text, wheel_errors

    path = _file(tmp, "x-1.0-py3-none-any.whl", data)  # a name the one rule takes
    with binaries(str(path)) as found:
        for binary in found:
            if binary.skipped is None and binary.host_only_size is None:
                audit_binary(binary.path, binary.name, DEFAULT_POLICY, with_kernels=False)
    with wheel_errors(path), zipfile.ZipFile(path) as wheel:
        members = [info.filename for info, _data in elf_members(wheel, path)]
        if members:
            _name, rows = read_record(wheel, wheel.infolist(), path)
            record_text(rows, {members[0]: b"new"})
    return len(members)


def image_tarball(data: bytes, tmp: Path) -> object:
    """A `docker save` or OCI layout tarball (`audit FILE.tar`): its index, manifests,
    config and layers applied; then the audit's own reading of it, whose `.dist-info`
    RECORDs name each file's package (`audit/distributions.py`)."""
    from sm121_build.audit.unpack import binaries
    from sm121_build.image.layers import extract_files

    path = _file(tmp, "x.tar", data)
    found = extract_files(path, tmp / "fs", lambda name: True)
    with binaries(str(path)) as audited:
        return len(found.files), [b.package for b in audited]


def registry_answers(data: bytes, tmp: Path) -> object:
    """A registry's answers about signatures (`kernels verify`, `--trust-key`): the `.sig`
    and `.att` manifests and their blobs, split from the input, against a trusted key."""
    from sm121_build.image import cosign

    manifest, _, rest = data.partition(b"\n--\n")
    registry = FakeRegistry(manifest, rest)
    trust = cosign.TrustKey(_trusted_key().public_key(), Path("trusted.pub"))
    for check in (lambda: cosign.require_signed(registry, DIGEST, trust),  # type: ignore[arg-type]
                  lambda: cosign.attested(registry, DIGEST, trust,  # type: ignore[arg-type]
                                          "https://sm121-build.dev/provenance/v1")):
        with contextlib.suppress(cosign.Untrusted):
            check()
    return None


def artifacts_manifest(data: bytes, tmp: Path) -> object:
    """An artifacts folder's `manifest.json` (`inject --artifacts`, `kernels publish`)."""
    from sm121_build.jobs.formats.artifacts import load

    folder = tmp / "artifacts"
    folder.mkdir(exist_ok=True)
    _file(folder, "manifest.json", data)
    _file(folder, "_C.abi3.so", b"\x7fELF" + bytes(60))
    return load(folder)


def cmake_reader(data: bytes, tmp: Path) -> object:
    """The host-side CMake reader (`patch`, `--plan`): commands, targets, macros, pins."""
    from sm121_build.core.vllm import projects
    from sm121_build.source.cmake_lang import commands
    from sm121_build.source.external import read_pin, source_targets
    from sm121_build.source.guard_targets import defined_targets
    from sm121_build.source.ptx_sass import _macro_end

    text = data.decode("utf-8", errors="surrogateescape")
    try:
        found = commands(text)
        defined_targets(text)
        _macro_end(text, "set_gencode_flags_for_srcs")
    except ValueError:  # CMakeSyntaxError: the readers' callers make it one line
        found = []
    tree = tmp / "tree"
    (tree / "cmake" / "external_projects").mkdir(parents=True, exist_ok=True)
    _file(tree, "CMakeLists.txt", data)
    project = projects()[0]
    _file(tree, project.cmake, data)
    source_targets(tree)
    with contextlib.suppress(Sm121Error):
        read_pin(tree, project)
    return len(found)


def prove_child(data: bytes, tmp: Path) -> object:
    """What `prove`'s children print (JSON lines from the user's interpreter), as the job
    reads it: every line, bounded, each field checked."""
    from sm121_build.jobs.proofs.prove_child import Asked, Said

    said = Said(Asked(cases=None, kernels=frozenset({"_Z6repackIiEvv"})))
    for line in data.decode("utf-8", "replace").splitlines():
        said.line(line)
    return said.lines - said.ignored


def _covered_proof() -> bytes:
    """The real proof as format 3, its coverage made up (FAKE), two kernels never launched:
    a seed that reaches the coverage checks."""
    import json

    from devkit.fake_gpu import covered

    return json.dumps(covered(json.loads(PROOF.read_text()),
                              {"_C.abi3.so": ["_Z6never1v", "_Z6never2v"]})).encode()


def proof_document(data: bytes, tmp: Path) -> object:
    """A proof document as `kernels publish --proof` reads it: a file, bounded, JSON, each
    field checked and the verdict against its counts."""
    from sm121_build.jobs.proofs.proof_reading import read_proof

    path = tmp / "proof.json"
    path.write_bytes(data)
    return read_proof(path, None)[1]


def _harness_options(path: Path, option: str) -> object:
    """What harness_run.options gives the payload for `--cases PATH` or `--kernels PATH`."""
    from types import SimpleNamespace

    return SimpleNamespace(cases=str(path) if option == "cases" else None,
                           kernels=str(path) if option == "kernels" else None)


def case_file(data: bytes, tmp: Path) -> object:
    """A derivation's cases (`--cases`) as harness_fa2.py and harness_marlin.py read them
    before any GPU work: a file, bounded, JSON, each case typed and checked against what
    the op takes.  Their class of error is ValueError or OSError, which each harness
    prints as one `usage:` line (exit 2)."""
    from sm121_build.jobs.payload import case_files, fa2_kernels, marlin_kernels

    path = tmp / "cases.json"
    path.write_bytes(data)
    found = 0
    for reader in (fa2_kernels.cases_from_json, marlin_kernels.cases_from_json):
        with contextlib.suppress(ValueError, OSError):  # each harness's one `usage:` line
            found += len(case_files.read_cases(_harness_options(path, "cases"), reader)[1])
    return found


def kernel_names(data: bytes, tmp: Path) -> object:
    """A file of kernel names (`--kernels`, the derivations' command lines) as the
    harnesses read it: bounded, a line each, every FA2 name read by `fa2_kernels.parse`
    (refused as a ValueError where it cannot be) and every Marlin name by
    `marlin_kernels.parse`."""
    from sm121_build.jobs.payload import case_files, fa2_kernels, marlin_kernels

    path = tmp / "names.txt"
    path.write_bytes(data)
    names, _ = case_files.read_cases(_harness_options(path, "kernels"), lambda d: [],
                                     fa2_kernels.parse)
    return sum(marlin_kernels.parse(name) is not None for name in names or [])


def _case_seeds() -> list[bytes]:
    """Derived cases of both families from the real vLLM 0.22.0 names (FA2's with the
    sparse ops'), a few of each."""
    import gzip

    from sm121_build.jobs.payload import fa2_kernels, marlin_kernels

    names = NAMES / "vllm-0.22.0-x86_64-fa2-sm90-added.txt.gz"
    fa2 = gzip.decompress(names.read_bytes()).decode().split()
    cases = fa2_kernels.derive(fa2, fa2_kernels.H100, budget=0).to_json()["cases"]
    kept = cases[:6] + [c for c in cases if c["op"] in fa2_kernels.SPARSE_OPS][:2]
    marlin = marlin_kernels.derive(_marlin_names()[:40], marlin_kernels.H100_SIZES)
    return [json.dumps({"cases": kept}).encode(),
            json.dumps({"cases": marlin.to_json()["cases"][:6]}).encode()]


def _marlin_names() -> list[str]:
    import gzip

    file = next(NAMES.glob("*_C*.txt.gz"))
    return [n for n in gzip.decompress(file.read_bytes()).decode().split() if "Marlin" in n]


def _name_seeds() -> list[bytes]:
    import gzip

    fa2 = gzip.decompress((NAMES / "vllm-0.22.0-x86_64-fa2-sm90-added.txt.gz").read_bytes())
    return [b"\n".join(fa2.split()[:12]) + b"\n" + "\n".join(_marlin_names()[:6]).encode()]


NAMES = Path(__file__).resolve().parent.parent / "tests/data/kernel_names"

# a real proof (the lent H200, vLLM 0.22.0's `_C` and FA2 aot'd for sm_90)
PROOF = Path(__file__).resolve().parent.parent / "docs/real-build/prove-sm90-h200/proof.json"

PROVE_LINES = b"\n".join([  # one line of each kind the payloads print
    b'{"device": {"name": "NVIDIA GB10", "major": 12, "minor": 1, "driver": 13000, '
    b'"module": "580.95.05"}}',
    b'{"cubin": "c0", "loaded": true, "found": 3, "missing": [], "missing_count": 0}',
    b'{"cubin": "c1", "loaded": false, "error": "CUDA_ERROR_INVALID_IMAGE"}',
    b'{"done": 2}',
    b'{"launched": "_Z6repackIiEvv", "case": "gptq_marlin_repack/gptq-4bit-256x192"}',
    b'{"recorder": "the profiler could not start: CUPTI_ERROR_NOT_INITIALIZED"}',
    b'{"op": "varlen_fwd", "case": "bf16-d128-causal", "first_s": 11.4}',
    b'{"op": "gptq_marlin_repack", "case": "gptq-4bit-256x192", '
    b'"error": "PTX JIT compilation was disabled"}',
    b'{"saved": 2}',
    b'{"key": "varlen_fwd/bf16-d128-causal", "bitwise_equal": true, "max_abs_diff": 0.0}',
    b'{"schema_error": "_C.gptq_marlin_repack has no argument size_k"}'])


TARGETS: dict[str, Target] = {
    "elf": elf_reader,
    "host-binary": host_binary,
    "fatbin-layout": fatbin_layout,
    "fatbin-entry": fatbin_entry,
    "wheel": wheel_audit,
    "image-tarball": image_tarball,
    "registry": registry_answers,
    "artifacts": artifacts_manifest,
    "cmake": cmake_reader,
    "prove-child": prove_child,
    "proof-document": proof_document,
    "case-file": case_file,
    "kernel-names": kernel_names,
}
EXPECTED: dict[str, tuple[type[BaseException], ...]] = {
    name: (Sm121Error,) for name in TARGETS}
EXPECTED["elf"] = (ElfError,)
# the payload's (standard library only) errors: each harness prints one `usage:` line
EXPECTED["case-file"] = EXPECTED["kernel-names"] = (ValueError, OSError)


def _file(folder: Path, name: str, data: bytes) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


# -- the registry boundary (a fake: no registry runs in a fuzz loop) ------------------------

DIGEST = "sha256:" + "ab" * 32


class FakeDoor:
    """FAKE: the HTTP door's budget of a whole check, with no network to bound."""

    @contextlib.contextmanager
    def budget(self) -> Iterator[None]:
        yield


@dataclass
class FakeRegistry:
    """FAKE: a registry that answers every manifest with `manifest` and every blob with
    `blob` (as a real one's client would: the bound and the digest check applied)."""

    manifest_bytes: bytes
    blob_bytes: bytes
    repo: str = "127.0.0.1:5000/kernels"

    def manifest(self, reference: str) -> bytes | None:
        return self.manifest_bytes or None

    @property
    def door(self) -> FakeDoor:
        return FakeDoor()

    def blob(self, digest: str, limit: int = 1 << 20) -> bytes:
        from sm121_build.image.registry import BlobRefused, digest_of

        if len(self.blob_bytes) > limit:
            raise BlobRefused(f"blob {digest} above {limit} bytes")
        if digest != digest_of(self.blob_bytes):
            raise BlobRefused(f"blob {digest} is not what its digest names")
        return self.blob_bytes


@cache
def _trusted_key() -> ec.EllipticCurvePrivateKey:
    return ec.derive_private_key(121, ec.SECP256R1())


# -- seeds ---------------------------------------------------------------------------------

# The nvcc-built files the seeds start from (as tests/conftest.py's MATRIX builds them):
# JIT-only PTX for sm_121 with an sm_80 cubin, and entries stored plain, LZ4 and zstd.
FIXTURES: dict[str, list[str]] = {
    "jit_only": ["-gencode", "arch=compute_80,code=[compute_80,sm_80]"],
    "plain": ["-gencode", "arch=compute_90,code=[compute_90,sm_90]",
              "-gencode", "arch=compute_121,code=sm_121", "--compress-mode=none"],
    "lz4": ["-gencode", "arch=compute_90,code=[compute_90,sm_90]", "--compress-mode=speed"],
    "zstd": ["-gencode", "arch=compute_90,code=[compute_90,sm_90]", "--compress-mode=size"],
}


def fixture_files() -> dict[str, Path]:
    """The seed .so files, built with nvcc once and cached (`devkit.helpers`)."""
    from devkit.helpers import DATA, compile_cached

    return {name: compile_cached(f"fuzz_{name}", DATA / "kernels.cu", flags)
            for name, flags in FIXTURES.items()}



def seeds(name: str, fixtures: dict[str, Path]) -> list[bytes]:
    """Real inputs for a target: the nvcc-built test files (`fixtures`, name -> .so), a
    wheel, tarballs, signatures and manifests made from them, and the regressions."""
    sos = [p.read_bytes() for p in fixtures.values()]
    made: dict[str, Callable[[], list[bytes]]] = {
        "elf": lambda: sos,
        "host-binary": lambda: sos + [_library_kept(so) for so in sos],
        "fatbin-layout": lambda: sos,
        "fatbin-entry": lambda: [e for so in sos for e in _entries(so)][:24],
        "wheel": lambda: [_wheel(sos[0])],
        "image-tarball": lambda: [_docker_save(sos[0])],
        "registry": lambda: _signatures(),
        "artifacts": lambda: [_manifest(sos[0])],
        "cmake": lambda: [*_cmake_files(), b"project(x)\nadd_library(_C MODULE a.cu)\n"],
        "prove-child": lambda: [PROVE_LINES],
        "proof-document": lambda: [PROOF.read_bytes(), _covered_proof()],
        "case-file": _case_seeds,
        "kernel-names": _name_seeds,
    }
    real = made[name]()
    return real + [case for target, case in REGRESSIONS() if target == name] + \
        [found for target, derive in FOUND if target == name for found in derive(real[0])]


def _inflate_damaged(wheel: bytes) -> list[bytes]:
    """The first member's deflate stream damaged mid-way (ISA-L's own IsalError escaped)."""
    at = wheel.index(b"pkg/_C.abi3.so") + len(b"pkg/_C.abi3.so") + 4096
    return [wheel[:at] + bytes(b ^ 0x5A for b in wheel[at:at + 64]) + wheel[at + 64:]]


def _member_offset_past_end(wheel: bytes) -> list[bytes]:
    """The central directory's local-header offset of a member set past the file (seek's
    EINVAL escaped the audit's extraction)."""
    at = wheel.index(b"PK\x01\x02")
    return [wheel[:at + 42] + struct.pack("<I", 0x7FFFFFFF) + wheel[at + 46:],
            wheel[:at + 42] + struct.pack("<I", 0xFFFFFFFF) + wheel[at + 46:]]


def _nameless_member(wheel: bytes) -> list[bytes]:
    """A member with an empty name (atheris, 2026-11-26: zipfile's `is_dir()` raised
    IndexError in the audit's and aot's member loops)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(wheel)) as source, zipfile.ZipFile(out, "w") as copy:
        for info in source.infolist():
            copy.writestr(info, source.read(info))
        copy.writestr(zipfile.ZipInfo(""), b"\x7fELF")
    return [out.getvalue()]


def _not_utf8_name(wheel: bytes) -> list[bytes]:
    """A member name flagged UTF-8 that is not (atheris, 2026-11-26: zipfile's
    UnicodeDecodeError escaped the audit)."""
    at = wheel.index(b"PK\x01\x02")
    flags = struct.unpack_from("<H", wheel, at + 8)[0] | 0x800
    name = at + 46
    return [wheel[:at + 8] + struct.pack("<H", flags) + wheel[at + 10:name] + b"\x80"
            + wheel[name + 1:]]


def _zip_version(wheel: bytes) -> list[bytes]:
    """A central directory entry that needs "zip file version 12.6" (atheris, 2026-11-26:
    zipfile's NotImplementedError escaped the audit)."""
    at = wheel.index(b"PK\x01\x02")
    return [wheel[:at + 6] + struct.pack("<H", 126) + wheel[at + 8:]]


# Crashes the fuzzers found, as the seed they grew from and the change that made them
# (each fixed; kept as seeds for ever):
FOUND: tuple[tuple[str, Callable[[bytes], list[bytes]]], ...] = (
    ("wheel", _nameless_member),
    ("wheel", _zip_version),
    ("wheel", _not_utf8_name),
    # tarfile's ReadError from the outer tarball's index escaped `extract_files`
    ("image-tarball", lambda tar: [tar[:len(tar) // 2], tar[:1024] + bytes(512)]),
    ("wheel", _inflate_damaged),
    ("wheel", _member_offset_past_end),
)


def _library_kept(so: bytes) -> bytes:
    """The file's fatbin section renamed (`.nv_fatbin` -> `.xv_fatbin`, same length): its
    containers then lie where a library keeps its own (cuFFT's `.data`), which the reader
    finds by searching, not by walking."""
    from sm121_build.cuda.elf import Elf

    elf = Elf.read(so)
    names = elf.rows[elf.sections.index(next(s for s in elf.sections
                                             if s.name == ".shstrtab"))][4]
    at = so.index(b"\0.nv_fatbin\0", names)
    return so[:at] + b"\0.xv_fatbin\0" + so[at + 12:]


def _cmake_files() -> list[bytes]:
    data = Path(__file__).parent.parent / "tests" / "data"
    return [p.read_bytes() for p in sorted(data.rglob("*.cmake"))][:6]


def _entries(so: bytes) -> list[bytes]:
    from sm121_build.cuda.fatbin_rewrite import NoFatbin, read_layout

    try:
        layout = read_layout(so, "seed")
    except NoFatbin:
        return []
    return [raw for container in layout.containers for raw in container.entries]


def _wheel(so: bytes) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as wheel:
        wheel.writestr("pkg/_C.abi3.so", so)
        wheel.writestr("pkg/__init__.py", "")
        wheel.writestr("pkg-1.0.dist-info/RECORD",
                       "pkg/_C.abi3.so,sha256=x,1\npkg/__init__.py,,\n"
                       "pkg-1.0.dist-info/RECORD,,\n")
    return out.getvalue()


def _docker_save(so: bytes) -> bytes:
    from devkit.imagetar import docker_save

    with tempfile.TemporaryDirectory() as tmp:
        path = docker_save(Path(tmp) / "image.tar", [{
            "usr/lib/vllm/_C.abi3.so": so,
            "usr/lib/vllm-1.0.dist-info/RECORD": b"vllm/_C.abi3.so,sha256=x,1\n"}])
        return path.read_bytes()


def _signatures() -> list[bytes]:
    from cryptography.hazmat.primitives import hashes

    from sm121_build.image import cosign
    from sm121_build.image.registry import digest_of

    key = _trusted_key()
    body = cosign.payload("127.0.0.1:5000/kernels", DIGEST)
    signature = base64.b64encode(key.sign(body, ec.ECDSA(hashes.SHA256())))
    manifest = json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": cosign.SIMPLE_SIGNING, "digest": digest_of(body), "size": len(body),
         "annotations": {cosign.SIGNATURE_ANNOTATION: signature.decode()}}]}).encode()
    return [manifest + b"\n--\n" + body]


def _manifest(so: bytes) -> bytes:
    import hashlib

    stub = b"\x7fELF" + bytes(60)
    return json.dumps({
        "format": 1, "base": "vllm/vllm-openai:v0.33.0", "vllm_version": "0.33.0",
        "vllm_commit": "abc", "arch_list": "12.1", "package_dir": "usr/lib/vllm",
        "tool_version": "0", "files": {"_C.abi3.so": {
            "sha256": hashlib.sha256(stub).hexdigest(), "mode": "755"}}}).encode()


@cache
def REGRESSIONS() -> tuple[tuple[str, bytes], ...]:
    """The cases of the sweeps and the crashes the fuzzers found, each a seed for ever:
    (target, input)."""
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\0" * (64 << 20))
    entry = struct.pack("<HHIQIIHHIIIQQQ", 1, 0x101, 64, len(bomb), len(bomb), 0, 0, 8, 80,
                        0, 0, 0x8000 | 0x11, 0, 745) + bomb
    deep = b"[" * 200_000
    return (
        ("fatbin-entry", entry),  # a frame that states 64 MiB where the header says 745
        ("registry", deep + b"\n--\n" + deep),  # JSON nested past the recursion limit
        ("artifacts", deep),
        ("cmake", b"\0" * (1 << 20)),
        ("cmake", b"a()\n" * 50_000),  # the line count was quadratic in the commands
        ("wheel", b"PK\x05\x06" + bytes(18)),
        ("cmake", "\u00e9t(x)\n".encode()),  # a letter no CMake identifier takes: an assert
        # atheris, 2026-11-26: a zstd frame whose window descriptor asks for 2 GiB
        ("fatbin-entry", struct.pack("<HHIQIIHHIIIQQQ", 1, 0x101, 64, 12, 12, 0, 0, 8, 80, 0,
                                     0, 0x8000 | 0x11, 0, 745)
         + b"\x28\xb5\x2f\xfd\x00\xa8\x19\x00\x00abc"),
        # atheris, 2026-11-26: an xz outer tarball (lzma's memory is the file's to choose;
        # under the fuzzer's cap its decoder raised SystemError)
        ("image-tarball", b"\xfd7zXZ\x00" + bytes(4096)),
        # atheris, 2026-11-26: a legacy .lzma header asking for a 4 GiB dictionary, which
        # tarfile's "r:*" handed to lzma (a MemoryError under the cap)
        ("image-tarball", b"l" + bytes(104) + b"\xff\xff\xff\xff" + bytes(27) + b"\x04"),
    )


# -- mutation (the hypothesis driver's) ----------------------------------------------------

BOUNDARY = (0, 1, 2, 0x7F, 0x80, 0xFF, 0x100, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000,
            0xFFFFFFFF, 1 << 32, (1 << 63) - 1, (1 << 64) - 1)


def hot_offsets(data: bytes) -> list[int]:
    """Where the parsers read sizes and offsets in a seed: the ELF header, every section
    header, every fatbin container and entry header (the fields a crafted file sets)."""
    from sm121_build.cuda.elf import Elf

    found = list(range(0, min(len(data), 64), 2))
    try:
        elf = Elf.read(data)
        shoff = struct.unpack_from("<Q", data, 0x28)[0] if data[4] == 2 else 0
        found += [shoff + i * 64 + f for i in range(len(elf.rows)) for f in (4, 24, 32, 40)]
    except (ElfError, struct.error, IndexError):
        pass
    at = data.find(b"\x50\xed\x55\xba")
    while at >= 0 and len(found) < 4000:
        found += [at + 6, at + 8] + [at + 16 + f for f in (0, 4, 8, 16, 20, 28, 48, 56)]
        at = data.find(b"\x50\xed\x55\xba", at + 4)
    return [o for o in found if o < len(data)]


def mutate(data: bytes, steps: list[tuple[str, int, int, bytes]]) -> bytes:
    """Apply (operation, offset, value, other seed) steps: set a u8/u16/u32/u64 field,
    truncate, insert zeros, splice another seed's tail."""
    out = bytearray(data)
    for operation, offset, value, other in steps:
        if not out:
            break
        at = offset % len(out)
        if operation in ("u8", "u16", "u32", "u64"):
            width = {"u8": 1, "u16": 2, "u32": 4, "u64": 8}[operation]
            out[at:at + width] = (value % (1 << (8 * width))).to_bytes(width, "little")
        elif operation == "truncate":
            del out[at:]
        elif operation == "zeros":
            out[at:at] = bytes(value % 4096)
        elif operation == "splice":
            out[at:] = other[offset % max(len(other), 1):]
    return bytes(out)


# -- running one input ---------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """How one input ended: its result's type or its error's first line; a crash is the
    exception that is not of the target's class, a bound the one it broke."""

    ended: str
    crash: BaseException | None = None
    broke: str = ""


def run_one(name: str, data: bytes) -> Outcome:
    """Feed one input to a target in a scratch folder, within the bounds: the address space
    is capped at what the process maps now plus `MEMORY_BOUND` while it runs (an allocation
    past it fails, and is reported as the bound broken), the time measured."""
    started = time.monotonic()
    before = _resident()
    with tempfile.TemporaryDirectory(prefix="sm121-fuzz-") as tmp, _memory_capped():
        try:
            ended = type(TARGETS[name](data, Path(tmp))).__name__
        except MemoryError:
            return Outcome("MemoryError", broke=f"peak memory over {MEMORY_BOUND >> 20} MiB "
                                                "more than before the input")
        except EXPECTED[name] as exc:
            ended = f"{type(exc).__name__}: {str(exc)[:120]}"
            if "MemoryError" in str(exc):  # an allocation past the cap, said as an error
                return Outcome(ended, broke=f"peak memory over {MEMORY_BOUND >> 20} MiB "
                                            "(an error of its class said so)")
        except Exception as exc:
            return Outcome(f"crash: {type(exc).__name__}", exc)
    seconds = time.monotonic() - started
    grown = _peak_resident() - before
    if grown > MEMORY_BOUND:
        return Outcome(ended, broke=f"peak resident memory grew by {grown >> 20} MiB")
    if seconds > TIME_BOUND:
        return Outcome(ended, broke=f"took {seconds:.1f} s")
    return Outcome(ended)


@contextlib.contextmanager
def _memory_capped() -> Iterator[None]:
    """RLIMIT_AS at the process's mapped size now plus `MEMORY_BOUND`, restored after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    mapped = _mapped_bytes()
    cap = mapped + MEMORY_BOUND
    if mapped == 0 or (hard != resource.RLIM_INFINITY and cap > hard):
        yield
        return
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _resident() -> int:
    """Resident memory now, the peak reset to it (Linux: clear_refs 5), so the peak after an
    input is that input's own."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS:")


def _peak_resident() -> int:
    return _status("VmHWM:")


def _status(field: str) -> int:
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in status.splitlines()
                 if line.startswith(field)), 0)


def _mapped_bytes() -> int:
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


# -- the long run (atheris) ----------------------------------------------------------------


def main(argv: list[str]) -> int:
    """`python -m devkit.fuzz TARGET [libFuzzer options]`: coverage-guided, seeded from a
    corpus folder written from `seeds` (fixtures built with nvcc, as the tests build them)."""
    if len(argv) < 2 or argv[1] not in TARGETS:
        print(f"usage: python -m devkit.fuzz {{{','.join(TARGETS)}}} [libFuzzer options]",
              file=sys.stderr)
        return 2
    import atheris  # type: ignore[import-untyped]

    name = argv[1]
    corpus = Path(os.environ.get("SM121_FUZZ_CORPUS", f".cache/fuzz/{name}"))
    corpus.mkdir(parents=True, exist_ok=True)
    for number, seed in enumerate(seeds(name, fixture_files())):
        (corpus / f"seed-{number}").write_bytes(seed)

    run_one(name, b"")  # every module the target needs imported, then all instrumented
    atheris.instrument_all()

    def one(data: bytes) -> None:
        outcome = run_one(name, data)
        if outcome.crash is not None:
            raise outcome.crash
        if outcome.broke:
            raise AssertionError(f"{name}: {outcome.broke}")

    atheris.Setup([argv[0], str(corpus), *argv[2:]], one)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
