"""The CUDA fatbins inside ELF files: where they are, their containers and entries (the ELF
sections and symbols themselves are read by `cuda/elf`).

A host ELF (.so, executable, relocatable .o) carries device code in `.nv_fatbin` (linked
objects) or `__nv_relfatbin` (relocatable objects).  That section holds one or more fatbin
*containers*, one per translation unit or device link, each a 16-byte header followed by
*entries*: a cubin (ELF for one SM) or PTX text, each with its own header.

Layout (little endian), as produced by nvcc's `fatbinary` since CUDA 9:

    container: u32 magic 0xBA55ED50, u16 version, u16 header size, u64 payload size
    entry:     u16 kind (1 PTX, 2 ELF), u16 version, u32 header size, u64 payload size,
               u32 compressed size, u32 -, u16 minor, u16 major, u32 arch,
               u32 name offset, u32 name length, u64 flags, u64 -, u64 uncompressed size

Entry flags: 0x1 64-bit, 0x10 Linux, 0x2000 LZ4-compressed, 0x8000 zstd-compressed,
0x100000 arch-specific (`sm_90a`), 0x200000 family-specific (`sm_120f`).

Only headers are read (through mmap) unless a payload is asked for, so listing a 381 MB
`_C.abi3.so` touches a few pages per entry.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import struct
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Literal, NamedTuple

from sm121_build.core.errors import CorruptBinaryError
from sm121_build.core.inputs import inflate, inflate_windows, inflating, open_file
from sm121_build.cuda.elf import MAGIC as ELF_MAGIC
from sm121_build.cuda.elf import SHT_NOBITS, Buffer, Elf, ElfError

FATBIN_SECTIONS = (".nv_fatbin", "__nv_relfatbin")
CONTAINER_MAGIC = 0xBA55ED50
CONTAINER_HEADER = struct.Struct("<IHHQ")
ENTRY_HEADER = struct.Struct("<HHIQIIHHIIIQQQ")
ENTRY_MIN_HEADER = ENTRY_HEADER.size  # 64

FLAG_LZ4 = 0x2000
FLAG_ZSTD = 0x8000
FLAG_ARCH_SPECIFIC = 0x100000
FLAG_FAMILY_SPECIFIC = 0x200000

KIND_PTX = 1
KIND_ELF = 2
KIND_LTO = 8  # LTO-IR (NVVM bitcode): linked at run time by nvJitLink, never loaded as is
_KIND_NAMES = {KIND_PTX: "ptx", KIND_ELF: "elf", KIND_LTO: "lto"}

# An ELF symbol's st_other bit that marks a kernel (cuobjdump prints it as ENTRY).
STO_CUDA_ENTRY = 0x10
_PTX_ENTRY = re.compile(rb"\.entry\s+([A-Za-z_$%][\w$]*)")
_PTX_NOT_SPACE = re.compile(rb"\S")

MAX_ENTRY_SIZE = 1 << 31  # a decompressed entry larger than 2 GiB is a damaged header
# nvcc's entries compress up to ~97x (vLLM 0.33.0's sm_90a cubins, zstd); more than this is
# an entry made to expand: memory is bounded by the file's size times this
MAX_RATIO = 512

Kind = Literal["elf", "ptx", "lto", "other"]
Variant = Literal["", "a", "f"]


@dataclass(frozen=True)
class Entry:
    """One cubin or PTX entry of a fatbin, as its header describes it."""

    container: int
    index: int
    kind: Kind
    arch: int
    variant: Variant
    flags: int
    version: tuple[int, int]
    offset: int
    stored_size: int
    size: int
    compression: Literal["lz4", "zstd"] | None
    section: str = ".nv_fatbin"  # where the file keeps it ("" for a file that is device code)

    @property
    def sm(self) -> str:
        """The full target name, family variant included: `sm_120f`."""
        return f"sm_{self.arch}{self.variant}"

    @property
    def cuobjdump_arch(self) -> str:
        """The name cuobjdump prints: it shows `a` always, `f` only on PTX."""
        if self.kind == "elf" and self.variant == "f":
            return f"sm_{self.arch}"
        return self.sm


@dataclass
class HostBinary:
    """A host ELF opened for reading its fatbin entries.  Use as a context manager."""

    path: Path
    entries: list[Entry] = field(default_factory=list)
    raw: RawKind = ""  # a file that is device code itself: a cubin, a fatbin, PTX text
    _file: BinaryIO | None = None
    _map: mmap.mmap | None = None

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> HostBinary:
        binary = cls(Path(path))
        binary._file = open_file(binary.path)  # closed by close()
        try:
            binary._load()
        except BaseException:
            binary.close()
            raise
        return binary

    def __enter__(self) -> HostBinary:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def _load(self) -> None:
        assert self._file is not None
        size = os.fstat(self._file.fileno()).st_size
        if size < 16:
            raise CorruptBinaryError(f"{self.path}: not an ELF file ({size} bytes)")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        self.raw, self.entries = read_entries(self.path, self._map)

    @property
    def mapped(self) -> mmap.mmap | None:
        """The file's bytes while it is open (a map: pages are read when touched)."""
        return self._map

    def payload(self, entry: Entry) -> bytes:
        """The entry's bytes, decompressed."""
        assert self._map is not None, "binary is closed"
        return entry_payload(self._map, entry, str(self.path))

    def kernel_sizes(self, entry: Entry) -> dict[str, int]:
        """The kernels of a cubin entry and the bytes of their code ({} for PTX); its
        payload is held within the run's inflate budget (`inflating`)."""
        if entry.kind != "elf":
            return {}
        with inflating(entry.size):
            payload = self.payload(entry)
            sizes = cubin_kernel_sizes(payload, f"{self.path}: entry {entry.index} "
                                                f"({entry.sm})")
            del payload  # dropped before its bytes go back to the budget
        return sizes

    def every_kernel(self, workers: int) -> Iterator[tuple[Entry, tuple[str, ...]]]:
        """Each entry with its kernel names, in entry order; `workers` threads decompress
        and read entries ahead (zstd and lz4 let go of the GIL: most of the work)."""
        if workers <= 1 or len(self.entries) <= 1:  # a raw cubin: no pool for one entry
            yield from ((entry, self.kernels(entry)) for entry in self.entries)
            return
        with ThreadPoolExecutor(workers) as pool:
            yield from zip(self.entries, pool.map(self.kernels, self.entries), strict=True)

    def kernels(self, entry: Entry) -> tuple[str, ...]:
        """Names of the kernels (global functions) an entry defines, in symbol-table order.
        PTX is read as it inflates, a window at a time, never held whole; a cubin (an ELF:
        its section table is at its end) is held whole.  What either holds is within the
        run's inflate budget (`inflating`), so threads that read entries ahead hold at most
        that much at once, not one entry each."""
        if entry.kind not in ("ptx", "elf"):
            return ()  # LTO-IR (cuFFT's is not plain LZ4 either) and unknown kinds: not read
        if entry.kind == "ptx":
            assert self._map is not None, "binary is closed"
            with entry_windows(self._map, entry, str(self.path)) as windows:
                return ptx_kernels_in(windows)
        with inflating(entry.size):
            payload = self.payload(entry)
            names = cubin_kernels(payload, f"{self.path}: entry {entry.index} ({entry.sm})")
            del payload  # dropped before its bytes go back to the budget
        return names


def read_entries(path: Path, data: Buffer) -> tuple[RawKind, list[Entry]]:
    """What a file is (`device_file_kind`) and every fatbin entry it holds, wherever it
    keeps them (`code_sections`); only headers are read."""
    size = len(data)
    if size < 16:
        raise CorruptBinaryError(f"{path}: not an ELF file ({size} bytes)")
    raw = device_file_kind(bytes(data[:RAW_PROBE]))
    if raw == "fatbin":
        return raw, list(_walk_section(path, data, CodeSection("", 0, size, True), 0))
    if raw == "ptx":
        return raw, [_ptx_file_entry(path, bytes(data[:RAW_PROBE]), size)]
    if size < 64:
        raise CorruptBinaryError(f"{path}: not an ELF file ({size} bytes)")
    if data[:4] != ELF_MAGIC:
        raise CorruptBinaryError(f"{path}: not an ELF file (bad magic)")
    if raw == "cubin":
        return raw, [_cubin_file_entry(path, data, size)]
    entries: list[Entry] = []
    work = SearchWork(path, size)
    for where in code_sections(path, data):
        first = entries[-1].container + 1 if entries else 0
        if where.strict:
            entries.extend(_walk_section(path, data, where, first))
        else:
            entries.extend(_scan_section(path, data, where, first, work))
    return raw, entries


def entry_payload(data: bytes | mmap.mmap, entry: Entry, where: str) -> bytes:
    """An entry's payload, decompressed (at most the size its header declares); its stored
    bytes are inflated in place (a view of the map), not copied first."""
    if entry.offset + entry.stored_size > len(data):
        raise CorruptBinaryError(f"{where}: entry {entry.index} ({entry.sm}) runs past the "
                                 "end of the file")
    with memoryview(data) as whole, \
            whole[entry.offset:entry.offset + entry.stored_size] as raw:
        if entry.compression is None:
            return bytes(raw)
        return inflate(raw, entry.compression, entry.size,
                       f"{where}: entry {entry.index} ({entry.sm})")


@contextlib.contextmanager
def entry_windows(data: bytes | mmap.mmap, entry: Entry,
                  where: str) -> Iterator[Iterator[bytes]]:
    """An entry's payload a window at a time (`core/inputs.inflate_windows`), its stored
    bytes read in place (a view of the map, not a copy)."""
    if entry.offset + entry.stored_size > len(data):
        raise CorruptBinaryError(f"{where}: entry {entry.index} ({entry.sm}) runs past the "
                                 "end of the file")
    with memoryview(data) as whole, \
            whole[entry.offset:entry.offset + entry.stored_size] as raw, \
            inflate_windows(raw, entry.compression, entry.size,
                            f"{where}: entry {entry.index} ({entry.sm})") as windows:
        yield windows


def ptx_kernels(text: bytes) -> tuple[str, ...]:
    """The `.entry` names of PTX text (`ptx_kernels_in` of the text as one window)."""
    return ptx_kernels_in((text,))


def ptx_kernels_in(windows: Iterable[bytes]) -> tuple[str, ...]:
    """The `.entry` names of PTX text that comes in windows: `bytes.find` to each `.entry`,
    the pattern matched there only (a regex scan of every byte was a sixth of a
    kernel-level audit).  What a window's end leaves undecided (an `.entry` cut, its name
    or the space before it running to the end) is carried into the next, shortened to what
    decides the match (`.entry NAME-SO-FAR`); the names are those of the whole text."""
    names = []
    carry = b""
    for window in windows:
        text = carry + window if carry else window
        carry = text[-5:]  # a `.entry` cut at the window's end (a whole one starts earlier)
        at = text.find(b".entry")
        while at >= 0:
            found = _PTX_ENTRY.match(text, at)
            if found is not None and found.end() < len(text):
                names.append(found.group(1).decode())
            elif found is not None:  # its name may go on in the next window
                carry = b".entry " + found.group(1)
                break
            elif _PTX_NOT_SPACE.search(text, at + 6) is None:  # space to the end: undecided
                carry = b".entry" + (b" " if len(text) > at + 6 else b"")
                break
            at = text.find(b".entry", at + 6)
    if carry.startswith(b".entry"):
        found = _PTX_ENTRY.match(carry)
        if found is not None:
            names.append(found.group(1).decode())
    return tuple(names)


RawKind = Literal["", "cubin", "fatbin", "ptx"]
RAW_PROBE = 4096  # bytes read to tell what a file is
EM_CUDA = 190
_PTX_VERSION = re.compile(rb"^\s*\.version\s+(\d+)\.(\d+)", re.M)
_PTX_TARGET = re.compile(rb"^\s*\.target\s+sm_(\d+)([af]?)\b", re.M)
_TKINFO_ARCH = re.compile(rb"-arch\s+sm_(\d+)([af]?)\b")


def device_file_kind(head: bytes) -> RawKind:
    """What a file that is device code itself is, from its first bytes: a cubin (an ELF for
    `EM_CUDA`), a fatbin (its container magic), PTX text (a `.version` and a `.target` line);
    "" for anything else (a host ELF included)."""
    if head[:4] == ELF_MAGIC and len(head) >= 20 and struct.unpack_from("<H", head, 18)[0] \
            == EM_CUDA:
        return "cubin"
    if len(head) >= 4 and struct.unpack_from("<I", head)[0] == CONTAINER_MAGIC:
        return "fatbin"
    if b"\0" not in head and _PTX_VERSION.search(head) and _PTX_TARGET.search(head):
        return "ptx"
    return ""


# Where cuobjdump (13.0) reads that a cubin is arch-specific (`sm_90a`), found by editing
# real cubins and checked on every cubin of flashinfer-cubin 0.6.13: `.nv.compat` attribute
# 0x09 where the section has it (CUDA 13's ptxas: 1 for `a`); else the `-arch` ptxas
# recorded in `.note.nv.tkinfo` (CUDA 12.9's ptxas); else ABI 8's e_flags bit 0x8 (nvasm's
# hand-written SASS records no -arch).  `f` shows in none of them (cuobjdump prints sm_100f
# cubins as sm_100): the recorded `-arch` gives it.
COMPAT_ARCH_SPECIFIC = 0x09
EF_CUDA_ACCELERATORS_V2 = 0x8


def _cubin_file_entry(path: Path, data: Buffer, size: int) -> Entry:
    """A raw cubin as one entry: its SM from the ELF flags (ABI 8, CUDA 12.8+: bits 8-15;
    before: bits 0-7), `a`/`f` as cuobjdump names them (above)."""
    abi, flags = data[8], struct.unpack_from("<I", data, 48)[0]
    arch = (flags >> 8) & 0xFF if abi >= 8 else flags & 0xFF
    if not arch:
        raise CorruptBinaryError(f"{path}: a cubin whose ELF flags name no SM")
    compat_bytes, tkinfo = _sections(path, data, ".nv.compat", ".note.nv.tkinfo")
    compat = _compat_attribute(compat_bytes, COMPAT_ARCH_SPECIFIC)
    recorded = _TKINFO_ARCH.search(tkinfo)
    noted = (recorded.group(2) or b"-") if recorded and int(recorded.group(1)) == arch \
        else b""  # b"-": a plain -arch was recorded
    variant: Variant = "f" if noted == b"f" else ""
    if compat is not None:
        variant = "a" if compat == 1 else variant
    elif noted:
        variant = "a" if noted == b"a" else variant
    elif abi >= 8 and flags & EF_CUDA_ACCELERATORS_V2:
        variant = "a"
    return Entry(0, 0, "elf", arch, variant, 0, (0, 0), 0, size, size, None, "")


def _compat_attribute(raw: bytes, wanted: int) -> int | None:
    """A one-byte attribute of `.nv.compat` (records as in `.nv.info`: format, attribute,
    then a value of 1 or 2 bytes, or a 2-byte size and that many bytes), None if absent."""
    at = 0
    while at + 4 <= len(raw):
        form, attribute = raw[at], raw[at + 1]
        if form == 2 and attribute == wanted:
            return raw[at + 2]
        at += 4 + (struct.unpack_from("<H", raw, at + 2)[0] if form == 4 else 0)
    return None


def _sections(path: Path, data: Buffer, *names: str) -> list[bytes]:
    """Sections' bytes by name (b"" for one that is absent), the headers read once."""
    try:
        elf = Elf.read(data)
        found = [elf.section(name) for name in names]
        return [elf.section_data(section) if section is not None else b"" for section in found]
    except ElfError as exc:
        raise CorruptBinaryError(f"{path}: cubin is not a readable ELF: {exc}") from None


def _ptx_file_entry(path: Path, head: bytes, size: int) -> Entry:
    version, target = _PTX_VERSION.search(head), _PTX_TARGET.search(head)
    assert version is not None and target is not None  # device_file_kind said "ptx"
    variant: Variant = "a" if target.group(2) == b"a" else "f" if target.group(2) == b"f" \
        else ""
    return Entry(0, 0, "ptx", int(target.group(1)), variant, 0,
                 (int(version.group(1)), int(version.group(2))), 0, size, size, None, "")


def cubin_kernels(cubin: bytes, where: str) -> tuple[str, ...]:
    """Kernel names in a cubin: function symbols that carry STO_CUDA_ENTRY."""
    return tuple(cubin_kernel_sizes(cubin, where))


def cubin_kernel_sizes(cubin: bytes, where: str) -> dict[str, int]:
    """Each kernel of a cubin and the bytes of its code (the symbol's size), in symbol-table
    order."""
    try:
        elf = Elf.read(cubin)
        symtab = elf.section(".symtab")
        return elf.functions(symtab, STO_CUDA_ENTRY) if symtab is not None else {}
    except ElfError as exc:
        raise CorruptBinaryError(f"{where}: cubin is not a readable ELF: {exc}") from None


class CodeSection(NamedTuple):
    """A section that can hold fatbin containers, and how it is read: `strict` for the
    fatbin section the CUDA runtime registers (every byte a container or padding, damage an
    error), else searched (containers a library loads itself)."""

    name: str
    start: int
    length: int
    strict: bool


SHT_PROGBITS, SHF_ALLOC, SHF_EXECINSTR = 1, 0x2, 0x4


def code_sections(path: Path, data: mmap.mmap | bytes) -> list[CodeSection]:
    """Where a host ELF can keep device code: its executable fatbin section (else the
    relocatable one, as cuobjdump reads them), then every other allocated data section
    (`.data`, `.rodata`, `.ldata`, `.cask_resource`...): cuFFT keeps its kernels in
    `.data`, cuBLASLt and cuSPARSELt some in `.cask_resource`, cuSPARSE some in `.rodata`,
    where cuobjdump does not look.  Code, non-allocated (debug) and bss-like sections hold
    none; `__nv_relfatbin` beside an `.nv_fatbin` is device-link input, not loaded."""
    try:
        elf = Elf.read(data)  # the ELF and section headers only: a few pages of the map
    except ElfError as exc:
        raise CorruptBinaryError(f"{path}: not a readable ELF file: {exc}") from None
    found: list[CodeSection] = []
    fatbins = [s for s in (elf.section(name) for name in FATBIN_SECTIONS)
               if s is not None and s.type != SHT_NOBITS]
    for section in fatbins[:1]:  # like cuobjdump without -all
        if section.offset + section.size > len(data):
            raise CorruptBinaryError(
                f"{path}: fatbin section runs past the end of the file (truncated?)")
        found.append(CodeSection(section.name, section.offset, section.size, True))
    for index, row in enumerate(elf.rows):
        kind, flags, offset, size = row[1], row[2], row[4], row[5]
        if kind != SHT_PROGBITS or not flags & SHF_ALLOC or flags & SHF_EXECINSTR \
                or size < CONTAINER_HEADER.size + ENTRY_MIN_HEADER or offset + size > len(data):
            continue  # a section past the end holds nothing this reader can trust
        try:
            name = elf.at(index).name
        except ElfError as exc:
            raise CorruptBinaryError(f"{path}: not a readable ELF file: {exc}") from None
        if name not in FATBIN_SECTIONS:
            found.append(CodeSection(name, offset, size, False))
    return found


_MAGIC_BYTES = struct.pack("<I", CONTAINER_MAGIC)
MAX_ENTRY_HEADER = 4096  # nvcc writes 64-byte headers, with the entry's name and options
# Searching a file's data sections may look at this many times the file's bytes (each
# searched section once, each entry header checked, each padding scanned), plus the slack:
# real containers are read once and bytes that merely match the magic fail at their
# header, but candidates nested in one another fail only at the end of the entries they
# share, each walked again for every candidate (quadratic work)
SEARCH_WORK = 4
SEARCH_SLACK = 1 << 20


class SearchWork:
    """What searching one file's data sections may still cost, in bytes looked at: a
    fixed multiple of the file's size, so the search is linear in it; spent, the file is
    refused in one line."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.left = SEARCH_WORK * size + SEARCH_SLACK

    def spend(self, count: int, section: str) -> None:
        """`count` more bytes looked at in `section`; refused once the budget is spent."""
        self.left -= count
        if self.left < 0:
            raise CorruptBinaryError(
                f"{self.path}: {section}: candidate fatbin containers cost more than "
                f"{SEARCH_WORK}x the file's bytes to check (containers nested to make the "
                "search quadratic?); refused")


def _scan_section(path: Path, data: Buffer, where: CodeSection, first_container: int,
                  work: SearchWork) -> Iterator[Entry]:
    """The containers of a searched section: found by their magic, and kept only when the
    whole container holds together (`_checked_container`); bytes that merely match the
    magic (a constant, a pointer) are passed over.  What it costs is spent from `work`."""
    end = where.start + where.length
    container = first_container
    work.spend(where.length, where.name)
    pos = data.find(_MAGIC_BYTES, where.start, end)
    while pos >= 0:
        checked = _checked_container(work, data, pos, end, EntryAt(container, 0, where.name))
        if checked is None:
            pos = data.find(_MAGIC_BYTES, pos + 1, end)
            continue
        entries, after = checked
        yield from entries
        container += 1
        pos = data.find(_MAGIC_BYTES, after, end)


def _checked_container(work: SearchWork, data: Buffer, pos: int, end: int,
                       at: EntryAt) -> tuple[list[Entry], int] | None:
    """The entries of the container at `pos` and where it ends, when it is one: version 1,
    a 16-byte header, a body inside the section, filled by entries of known kinds (cubin,
    PTX, LTO-IR), each with a sane header and payload inside the body, up to zero padding;
    a cubin stored plain starts with the ELF magic.  None for anything else.  Each entry
    header and padding looked at is spent from `work` (which names the file)."""
    if pos + CONTAINER_HEADER.size > end:
        return None
    _magic, version, header_size, fat_size = CONTAINER_HEADER.unpack_from(data, pos)
    body, body_end = pos + header_size, pos + header_size + fat_size
    if version != 1 or header_size != CONTAINER_HEADER.size or body_end > end \
            or fat_size < ENTRY_MIN_HEADER:
        return None
    entries: list[Entry] = []
    while body + ENTRY_MIN_HEADER <= body_end:
        work.spend(ENTRY_MIN_HEADER, at.section)
        kind, _v, entry_header = struct.unpack_from("<HHI", data, body)
        if kind == 0 and entry_header == 0:
            work.spend(body_end - body, at.section)
            if any(data[body:body_end]):
                return None
            break
        if kind not in _KIND_NAMES or entry_header > MAX_ENTRY_HEADER:
            return None
        try:
            entry, body = read_entry(work.path, data, body, body_end,
                                     EntryAt(at.container, len(entries), at.section))
        except CorruptBinaryError:
            return None
        if entry is None or not 0 < entry.arch < 1000 or (
                entry.kind == "elf" and entry.compression is None
                and data[entry.offset:entry.offset + 4] != ELF_MAGIC):
            return None
        entries.append(entry)
    if not entries:
        return None
    return entries, body_end


def _walk_section(path: Path, data: Buffer, where: CodeSection,
                  first_container: int) -> Iterator[Entry]:
    """The containers of the registered fatbin section, every byte a container or the zero
    padding between them: anything else is damage, said as such."""
    start, end, section = where.start, where.start + where.length, where.name
    pos = start
    container = first_container
    index = 0
    while pos + CONTAINER_HEADER.size <= end:
        magic, _version, header_size, fat_size = CONTAINER_HEADER.unpack_from(data, pos)
        if magic != CONTAINER_MAGIC:
            if not any(data[pos:pos + 8]):
                pos += 8  # alignment padding between containers
                continue
            raise CorruptBinaryError(
                f"{path}: bad fatbin container magic {magic:#x} at file offset {pos:#x}")
        body = pos + header_size
        body_end = body + fat_size
        if header_size < CONTAINER_HEADER.size or body_end > end:
            raise CorruptBinaryError(
                f"{path}: fatbin container at {pos:#x} claims a {header_size}-byte header "
                f"and {fat_size} bytes, the section has {max(end - pos, 0)} from there")
        while body + ENTRY_MIN_HEADER <= body_end:
            entry, body = read_entry(path, data, body, body_end,
                                     EntryAt(container, index, section))
            if entry is None:
                break
            index += 1
            yield entry
        pos = body_end
        container += 1


class EntryAt(NamedTuple):
    """Which entry of the binary: its container's and its own number there, and the
    section that holds it."""

    container: int = 0
    number: int = 0
    section: str = ".nv_fatbin"


FIRST_ENTRY = EntryAt()


def read_entry(path: Path, data: bytes | mmap.mmap, pos: int, end: int,
               at: EntryAt = FIRST_ENTRY) -> tuple[Entry | None, int]:
    """The entry whose header starts at `pos` of a container ending at `end`, and where the
    next one starts (None at the zero padding that closes the container)."""
    container, index, section = at
    (kind, _version, header_size, payload_size, compressed, _unknown, minor, major, arch,
     _name_off, _name_len, flags, _zero_field, uncompressed) = ENTRY_HEADER.unpack_from(data, pos)
    if kind == 0 and header_size == 0:
        return None, end  # zero padding closes the container
    payload = pos + header_size
    if header_size < ENTRY_MIN_HEADER or payload + payload_size > end:
        raise CorruptBinaryError(
            f"{path}: fatbin entry at {pos:#x} has a nonsense size "
            f"(header {header_size}, payload {payload_size}, {end - pos} bytes left)")
    compression: Literal["lz4", "zstd"] | None = None
    if flags & FLAG_LZ4:
        compression = "lz4"
    elif flags & FLAG_ZSTD:
        compression = "zstd"
    if compression and not (0 < compressed <= payload_size and 0 < uncompressed < MAX_ENTRY_SIZE):
        raise CorruptBinaryError(
            f"{path}: compressed fatbin entry at {pos:#x} has nonsense sizes "
            f"(compressed {compressed}, uncompressed {uncompressed}, payload {payload_size})")
    if compression and uncompressed > compressed * MAX_RATIO:
        raise CorruptBinaryError(
            f"{path}: compressed fatbin entry at {pos:#x} declares {uncompressed} bytes from "
            f"{compressed} (over {MAX_RATIO}x: a decompression bomb?); refused")
    variant: Variant = ""
    if flags & FLAG_ARCH_SPECIFIC:
        variant = "a"
    elif flags & FLAG_FAMILY_SPECIFIC:
        variant = "f"
    entry = Entry(
        container=container,
        index=index,
        kind=_KIND_NAMES.get(kind, "other"),  # type: ignore[arg-type]
        arch=arch,
        variant=variant,
        flags=flags,
        version=(major, minor),
        offset=payload,
        stored_size=compressed if compression else payload_size,
        size=uncompressed if compression else payload_size,
        compression=compression,
        section=section,
    )
    return entry, payload + payload_size


def cuobjdump_listing(path: Path, entries: list[Entry], raw: RawKind = "") -> list[str]:
    """The lines `cuobjdump -lelf -lptx FILE` prints to stdout for these entries (a raw
    cubin is named without a number; for PTX text cuobjdump prints nothing)."""
    stem = path.name.rsplit(".", 1)[0]  # the whole name when it has no dot
    if raw == "cubin":
        return [f"ELF file {1:4d}: {stem}.{e.cuobjdump_arch}.cubin" for e in entries]
    if raw == "ptx":
        return []
    lines = []
    counters = {"elf": 0, "ptx": 0}
    for entry in entries:
        if entry.kind not in counters or (raw == "" and entry.section not in FATBIN_SECTIONS):
            continue  # cuobjdump lists cubins and PTX of the fatbin section only
        counters[entry.kind] += 1
        number = counters[entry.kind]
        if entry.kind == "elf":
            lines.append(f"ELF file {number:4d}: {stem}.{number}.{entry.cuobjdump_arch}.cubin")
        else:
            lines.append(f"PTX file {number:4d}: {stem}.{number}.{entry.cuobjdump_arch}.ptx")
    return lines
