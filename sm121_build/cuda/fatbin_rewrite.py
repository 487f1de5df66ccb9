"""Add entries to the fatbin containers of a host ELF, inside its own `.nv_fatbin` section.

How a shared object registers its device code (read off nvcc's output): `.nvFatBinSegment`
holds one 24-byte wrapper per translation unit (u32 magic 0x466243b1, u32 version, u64 data
pointer, u64 file-name pointer); each data pointer is filled at load time by an
`R_X86_64_RELATIVE` / `R_AARCH64_RELATIVE` relocation whose addend is the address of that
unit's container in `.nv_fatbin`.  Host code passes the wrapper to
`__cudaRegisterFatBinary`; the runtime reads the one container the pointer names and the
driver picks the best entry of it.

The rewrite lays the containers out again, in their order, each followed by the entries it
gains, and moves each relocation's addend (and the pointer's own bytes, where the linker
also wrote the value in place) to its container's new address.  When they fit the section,
they stay in its place; else the whole section moves to a new read-only PT_LOAD at the end of
the file (the program header table moves there too, as patchelf does: the old one has no
room for another entry), the section header follows it, and the old bytes are cut out in
whole pages (every later segment keeps its address; the segment that held the section is
split around the hole, what is left of it under a page stays as zeros, and the file offsets
after the cut shift down by the pages cut).  A reader of the first `.nv_fatbin`
(cuobjdump) sees every container; host code, symbols and every other section stay byte for
byte.  A file this module cannot rewrite safely is refused before anything is written.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from sm121_build.core.errors import CorruptBinaryError
from sm121_build.cuda.elf import MAGIC as ELF_MAGIC
from sm121_build.cuda.elf import SHT_NOBITS, Buffer, Elf, ElfError
from sm121_build.cuda.fatbin import (
    CONTAINER_HEADER,
    CONTAINER_MAGIC,
    Entry,
    EntryAt,
    read_entry,
)
from sm121_build.cuda.machines import EM_AARCH64, EM_X86_64, MACHINES

WRAPPER_MAGIC = 0x466243B1
_WRAPPER = struct.Struct("<IIQQ")
_ENTRY_HEAD = struct.Struct("<HHIQ")  # kind, version, header size, payload size
_RELA = struct.Struct("<QQq")  # r_offset, r_info, r_addend
CONTAINER_ALIGN = 8
SHT_RELA = 4
SHF_ALLOC = 2
RELATIVE = {EM_X86_64: 8, EM_AARCH64: 1027}  # R_X86_64_RELATIVE, R_AARCH64_RELATIVE


class NoFatbin(CorruptBinaryError):
    """A host ELF with no registered device code: nothing to rewrite (not a damaged file)."""


@dataclass(frozen=True)
class Container:
    """One fatbin container as it lies in the file: its entries' raw bytes (header and
    payload each), in order."""

    offset: int  # file offset of the container header
    entries: tuple[bytes, ...]
    described: tuple[Entry, ...]  # the same entries as the fatbin reader describes them

    @property
    def size(self) -> int:
        return CONTAINER_HEADER.size + sum(len(e) for e in self.entries)


@dataclass(frozen=True)
class Registration:
    """A wrapper's data pointer: the file offsets of its relocation's addend (and of the
    pointer's own bytes), and the container it names."""

    addend_at: int
    pointer_at: int
    container: int


@dataclass(frozen=True)
class Layout:
    """Where a host ELF keeps its fatbins and how it registers them."""

    machine: str
    offset: int  # the section's file offset
    address: int  # its virtual address
    size: int
    containers: tuple[Container, ...]
    registrations: tuple[Registration, ...]

    def address_of(self, container_offset: int) -> int:
        return self.address + container_offset - self.offset


def read_layout(data: Buffer, where: str, keep_bytes: bool = True) -> Layout:
    """The `.nv_fatbin` section, its containers and their registrations; a file this module
    cannot rewrite safely is a `CorruptBinaryError` that says why (any offset or size past
    the end of the file among them: never an exception of the parser's own)."""
    try:
        return _read_layout(data, where, keep_bytes)
    except ElfError as exc:
        raise CorruptBinaryError(f"{where}: not a readable ELF file: {exc}") from None
    except (struct.error, ValueError, IndexError, OverflowError) as exc:
        raise CorruptBinaryError(f"{where}: its headers do not hold together "
                                 f"({type(exc).__name__}: {str(exc)[:80]})") from None


def _read_layout(data: Buffer, where: str, keep_bytes: bool) -> Layout:
    if data[:4] != ELF_MAGIC or len(data) < 64:
        raise CorruptBinaryError(f"{where}: not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise CorruptBinaryError(f"{where}: not a 64-bit little-endian ELF file")
    e_type, machine = struct.unpack_from("<HH", data, 16)
    if machine not in RELATIVE:
        raise CorruptBinaryError(f"{where}: ELF machine {machine} is neither x86_64 nor aarch64")
    if e_type != 3:  # ET_DYN: a shared object, whose fatbin pointers are relocated
        raise CorruptBinaryError(f"{where}: not a shared object (ELF type {e_type})")
    try:
        elf = Elf.read(data)
        sections = elf.sections
    except ElfError as exc:
        raise CorruptBinaryError(f"{where}: not a readable ELF file: {exc}") from None
    fatbin = next((s for s in sections if s.name == ".nv_fatbin" and s.type != SHT_NOBITS),
                  None)
    segment = next((s for s in sections if s.name == ".nvFatBinSegment"), None)
    if fatbin is None or segment is None:
        raise NoFatbin(f"{where}: no .nv_fatbin and .nvFatBinSegment sections")
    for section in (fatbin, segment):
        if section.type != SHT_NOBITS and section.offset + section.size > len(data):
            raise CorruptBinaryError(
                f"{where}: {section.name} at {section.offset:#x}, {section.size} bytes, runs "
                f"past the end of the file ({len(data)} bytes; truncated?)")
    index = sections.index(fatbin)
    address = elf.rows[index][3]
    containers = _containers(data, Span(fatbin.offset, fatbin.size, keep_bytes), where)
    starts = {elf_address: i for i, elf_address in enumerate(
        address + c.offset - fatbin.offset for c in containers)}
    seg_index = sections.index(segment)
    seg_address = elf.rows[seg_index][3]
    relocations = _relative_addends(elf, RELATIVE[machine], where)
    registrations = []
    raw = elf.section_data(segment)
    for at in range(0, len(raw) - _WRAPPER.size + 1, _WRAPPER.size):
        magic, _version, _data, _name = _WRAPPER.unpack_from(raw, at)
        if magic != WRAPPER_MAGIC:
            continue
        field = seg_address + at + 8
        found = relocations.get(field)
        if found is None:
            raise CorruptBinaryError(
                f"{where}: the fatbin wrapper at {seg_address + at:#x} has no RELATIVE "
                "relocation for its data pointer (packed or absolute relocations are not "
                "rewritten)")
        addend_at, addend = found
        if addend not in starts:
            raise CorruptBinaryError(
                f"{where}: the fatbin wrapper at {seg_address + at:#x} points at {addend:#x}, "
                "not at a container of .nv_fatbin")
        registrations.append(Registration(addend_at, segment.offset + at + 8, starts[addend]))
    if not registrations:
        raise CorruptBinaryError(f"{where}: .nvFatBinSegment holds no fatbin wrapper")
    return Layout(MACHINES[machine], fatbin.offset, address, fatbin.size, tuple(containers),
                  tuple(registrations))


class Span(NamedTuple):
    """Where a section lies, and whether its entries' bytes are copied out (a rewrite needs
    them; the check of a layout, the audit's, only their headers)."""

    start: int
    size: int
    keep_bytes: bool


def _containers(data: Buffer, span: Span, where: str) -> list[Container]:
    """The containers of a section, as the fatbin reader walks them (zero padding skipped)."""
    found: list[Container] = []
    pos, end = span.start, span.start + span.size
    while pos + CONTAINER_HEADER.size <= end:
        magic, _version, header_size, body = CONTAINER_HEADER.unpack_from(data, pos)
        if magic != CONTAINER_MAGIC:
            if not any(data[pos:pos + CONTAINER_ALIGN]):
                pos += CONTAINER_ALIGN
                continue
            raise CorruptBinaryError(f"{where}: bad fatbin container magic at {pos:#x}")
        if header_size != CONTAINER_HEADER.size or pos + header_size + body > end:
            raise CorruptBinaryError(f"{where}: fatbin container at {pos:#x} has a header of "
                                     f"{header_size} bytes or runs past its section")
        entries: list[bytes] = []
        described: list[Entry | None] = []
        at, stop = pos + header_size, pos + header_size + body
        while at + _ENTRY_HEAD.size <= stop:
            kind, _v, head, payload = _ENTRY_HEAD.unpack_from(data, at)
            if kind == 0 and head == 0:
                break
            if head < 64 or at + head + payload > stop:
                raise CorruptBinaryError(f"{where}: fatbin entry at {at:#x} has a nonsense size")
            entries.append(bytes(data[at:at + head + payload]) if span.keep_bytes else b"")
            described.append(read_entry(Path(where), data, at, stop,
                                        EntryAt(len(found), len(described)))[0])
            at += head + payload
        if any(data[at:stop]):
            raise CorruptBinaryError(f"{where}: fatbin container at {pos:#x} holds bytes "
                                     "after its last entry")
        found.append(Container(pos, tuple(entries), tuple(e for e in described if e)))
        pos = stop
    return found


def _relative_addends(elf: Elf, relative: int, where: str) -> dict[int, tuple[int, int]]:
    """Every RELATIVE relocation of the allocated RELA sections: the address it fills ->
    (the file offset of its addend, the addend)."""
    found: dict[int, tuple[int, int]] = {}
    for index, row in enumerate(elf.rows):
        kind, flags = row[1], row[2]
        if kind != SHT_RELA or not flags & SHF_ALLOC:
            continue  # REL or RELR: a wrapper covered only by those is refused by the caller
        section = elf.at(index)
        raw = elf.section_data(section)
        if len(raw) % _RELA.size:
            raise CorruptBinaryError(f"{where}: {section.name} is not whole RELA entries")
        for n, (offset, info, addend) in enumerate(_RELA.iter_unpack(raw)):
            if info & 0xFFFFFFFF == relative:
                found[offset] = (section.offset + n * _RELA.size + 16, addend)
    return found


def entry_options(raw: bytes) -> str:
    """The ptxas options an entry records (fatbinary's `--cmdline`, nvcc's `-Xptxas`), which
    the driver applies when it JIT-compiles the entry's PTX: a (u32 offset, u32 length) pair
    after the 64-byte header names them."""
    head = struct.unpack_from("<I", raw, 4)[0]
    if head < 72:
        return ""
    at, length = struct.unpack_from("<II", raw, 64)
    if not length or at + length > head:
        return ""
    return raw[at:at + length].split(b"\0", 1)[0].decode("ascii", "replace").strip()


def container_bytes(entries: Sequence[bytes]) -> bytes:
    body = b"".join(entries)
    return CONTAINER_HEADER.pack(CONTAINER_MAGIC, 1, CONTAINER_HEADER.size, len(body)) + body


def laid_out_size(layout: Layout, replaced: Mapping[int, Sequence[bytes]]) -> int:
    """The bytes the containers take, laid out from the section's start, with `replaced`
    (container index -> its new entries) in place of their stock entries."""
    pos = 0
    for index, container in enumerate(layout.containers):
        pos = _aligned(pos)
        entries = replaced.get(index, container.entries)
        pos += CONTAINER_HEADER.size + sum(len(e) for e in entries)
    return pos


def rewrite(data: bytes, layout: Layout, replaced: Mapping[int, Sequence[bytes]]) -> bytes:
    """The file with its containers laid out again and the addends moved (the module's
    docstring says where they go); headers whose values do not fit (a crafted file) are a
    `CorruptBinaryError`."""
    try:
        return _rewrite(data, layout, replaced)
    except (struct.error, ValueError, IndexError, OverflowError, MemoryError) as exc:
        raise CorruptBinaryError(f"cannot be rewritten: its headers do not hold together "
                                 f"({type(exc).__name__}: {str(exc)[:80]})") from None


def _rewrite(data: bytes, layout: Layout, replaced: Mapping[int, Sequence[bytes]]) -> bytes:
    needed = laid_out_size(layout, replaced)
    shift: Callable[[int], int] = _same
    if needed <= layout.size:
        out, place = bytearray(data), (layout.address, layout.offset)
    else:
        out, place, shift = _cut_and_append(data, layout, needed)
    address, offset = place
    moved: list[int] = []
    pos = 0
    for index, container in enumerate(layout.containers):
        pos = _aligned(pos)
        if index in replaced:
            raw = container_bytes(replaced[index])
        else:
            raw = data[container.offset:container.offset + container.size]
        out[offset + pos:offset + pos + len(raw)] = raw
        moved.append(address + pos)
        pos += len(raw)
    if needed <= layout.size:  # what the stock containers took past the new ones: zeros
        out[offset + pos:offset + layout.size] = bytes(layout.size - pos)
    for registration in layout.registrations:
        new = moved[registration.container]
        struct.pack_into("<q", out, shift(registration.addend_at), new)
        # a linker that also wrote the value in place (--apply-dynamic-relocs) gets it moved
        old = layout.address_of(layout.containers[registration.container].offset)
        if struct.unpack_from("<Q", data, registration.pointer_at)[0] == old:
            struct.pack_into("<Q", out, shift(registration.pointer_at), new)
    return bytes(out)


def _same(pos: int) -> int:
    return pos


SEGMENT_ALIGN = 0x10000  # a 64 KiB page: what aarch64 kernels may use, a multiple of 4 KiB
PHDR = struct.Struct("<IIQQQQQQ")  # type, flags, offset, vaddr, paddr, filesz, memsz, align
SHDR = struct.Struct("<IIQQQQIIQQ")  # name, type, flags, addr, offset, size, link, info, ...
PT_LOAD, PT_PHDR, PF_R = 1, 6, 4


def program_headers(data: bytes) -> list[list[int]]:
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    if phentsize != PHDR.size or phoff + phnum * PHDR.size > len(data):
        raise CorruptBinaryError(f"program headers of {phentsize} bytes at {phoff:#x}: "
                                 "not an ELF64 table inside the file")
    return [list(PHDR.unpack_from(data, phoff + i * PHDR.size)) for i in range(phnum)]


def section_headers(data: bytes) -> tuple[int, list[list[int]]]:
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    if shentsize != SHDR.size or shoff + shnum * SHDR.size > len(data):
        raise CorruptBinaryError("section headers are not an ELF64 table inside the file")
    return shoff, [list(SHDR.unpack_from(data, shoff + i * SHDR.size)) for i in range(shnum)]


def _cut_and_append(data: bytes, layout: Layout,
                    needed: int) -> tuple[bytearray, tuple[int, int], Callable[[int], int]]:
    """The file with the section's old bytes cut out (in whole pages, so every later
    segment keeps its address; the segment that held the section is split in two around the
    hole) and a new read-only PT_LOAD appended for the section and the program header table.
    Returns the file, the section's new (address, offset) and the map of old file offsets."""
    rows = program_headers(data)
    loads = [r for r in rows if r[0] == PT_LOAD]
    start, end = layout.offset, layout.offset + layout.size
    holder = next((r for r in loads if r[2] <= start and end <= r[2] + r[5]), None)
    if holder is None:
        raise CorruptBinaryError(".nv_fatbin lies in no PT_LOAD segment")
    align = max([SEGMENT_ALIGN, *(r[7] for r in loads)])
    delta = layout.size // align * align
    cut_end = start + delta
    for row in rows:
        if row is not holder and row[2] < cut_end and row[2] + row[5] > start and row[5]:
            raise CorruptBinaryError(f"segment type {row[0]:#x} overlaps .nv_fatbin")

    def shift(pos: int) -> int:
        return pos - delta if pos >= cut_end else pos

    # the section's bytes past the cut stay as zeros: the split segment still maps them
    out = bytearray(data[:start]) + bytearray(layout.size - delta) + bytearray(data[end:])
    new_rows: list[list[int]] = []
    for row in rows:
        if row is holder and delta:
            head = start - row[2]
            tail = cut_end - row[2]
            new_rows.append([*row[:5], head, head, row[7]])
            new_rows.append([row[0], row[1], start, row[3] + tail, row[4] + tail,
                             row[5] - tail, row[6] - tail, row[7]])
        else:
            new_rows.append([row[0], row[1], shift(row[2]), *row[3:]])
    shoff, sections = section_headers(data)
    fatbin = next((s for s in sections if (s[3], s[4], s[5]) == (layout.address,
                                                                  layout.offset, layout.size)),
                  None)
    if fatbin is None:
        raise CorruptBinaryError(".nv_fatbin's section header was not found again")
    for section in sections:
        if section is not fatbin:
            section[4] = shift(section[4])
    base = _round(len(out), SEGMENT_ALIGN)
    address = _round(max(r[3] + r[6] for r in loads), SEGMENT_ALIGN)
    table = (len(new_rows) + 1) * PHDR.size
    at = _round(table, 64)
    segment = [PT_LOAD, PF_R, base, address, address, at + needed, at + needed, SEGMENT_ALIGN]
    new_rows.insert(max(i for i, r in enumerate(new_rows) if r[0] == PT_LOAD) + 1, segment)
    for row in new_rows:
        if row[0] == PT_PHDR:  # it names the table: now the new one
            row[2:7] = [base, address, address, table, table]
    fatbin[3:6] = [address + at, base + at, needed]
    out.extend(bytes(base + at + needed - len(out)))
    for i, row in enumerate(new_rows):
        PHDR.pack_into(out, base + i * PHDR.size, *row)
    for i, section in enumerate(sections):
        SHDR.pack_into(out, shift(shoff) + i * SHDR.size, *section)
    struct.pack_into("<Q", out, 0x20, base)
    struct.pack_into("<Q", out, 0x28, shift(shoff))
    struct.pack_into("<H", out, 0x38, len(new_rows))
    return out, (address + at, base + at), shift


def _round(value: int, to: int) -> int:
    return -(-value // to) * to


def _aligned(pos: int) -> int:
    return -(-pos // CONTAINER_ALIGN) * CONTAINER_ALIGN
