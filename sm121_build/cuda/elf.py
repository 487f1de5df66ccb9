"""ELF section headers and symbol tables, unpacked with `struct` from the raw bytes.

The audit reads thousands of cubins (one ELF per SM per translation unit; a cubin of a
template-heavy extension has hundreds of sections, one `.text`, `.nv.info` and
`.nv.constant0` per kernel).  pyelftools builds a Python object per header field, which made
the section lookup 80 % of a kernel-level audit.  Here a section table is one
`iter_unpack` over its bytes and a name one `bytes.index`; every offset and size a header
gives is checked against the buffer, and any damage is an `ElfError` naming it.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

Buffer = bytes | mmap.mmap
MAGIC = b"\x7fELF"
SHT_SYMTAB, SHT_STRTAB, SHT_NOBITS, SHT_DYNSYM = 2, 3, 8, 11
_SHN_XINDEX = 0xFFFF

# (e_shoff, e_shentsize, e_shnum, e_shstrndx) offsets and formats, section header and
# symbol layouts (st_name, st_info, st_other, st_shndx, st_size positions), per ELF class
_CLASS = {
    1: (0x20, "I", 0x2E, "IIIIIIIIII", "IIIBBH", (0, 3, 4, 5, 2)),
    2: (0x28, "Q", 0x3A, "IIQQQQIIQQ", "IBBHQQ", (0, 1, 2, 3, 5)),
}


class ElfError(ValueError):
    """The bytes are not a readable ELF file; the message says what is wrong."""


@dataclass(frozen=True)
class Section:
    name: str
    type: int
    offset: int
    size: int
    link: int
    entsize: int


@dataclass(frozen=True)
class Elf:
    """The section table of an ELF file held in a buffer (bytes or an mmap)."""

    data: Buffer
    ei_class: int  # 1: ELF32, 2: ELF64
    order: Literal["<", ">"]
    rows: tuple[tuple[int, ...], ...]  # the section headers, unpacked
    names: bytes  # the section name table

    @classmethod
    def read(cls, data: Buffer) -> Elf:
        if len(data) < 0x34 or bytes(data[:4]) != MAGIC:
            raise ElfError("no ELF header")
        ei_class, ei_data = data[4], data[5]
        if ei_class not in _CLASS or ei_data not in (1, 2):
            raise ElfError(f"unknown ELF class {ei_class} or data encoding {ei_data}")
        order: Literal["<", ">"] = "<" if ei_data == 1 else ">"
        at_shoff, off_fmt, at_rest, header_fmt, _, _ = _CLASS[ei_class]
        if len(data) < at_rest + 6:
            raise ElfError("ELF header cut short")
        (shoff,) = struct.unpack_from(order + off_fmt, data, at_shoff)
        shentsize, shnum, shstrndx = struct.unpack_from(order + "HHH", data, at_rest)
        layout = struct.Struct(order + header_fmt)
        if shoff == 0:
            return cls(data, ei_class, order, (), b"")
        if shentsize != layout.size:
            raise ElfError(f"section header size {shentsize}, not {layout.size}")
        if shoff + layout.size > len(data):
            raise ElfError(f"section headers at {shoff:#x} past the end ({len(data)} bytes)")
        first = layout.unpack_from(data, shoff)
        if shnum == 0:  # extended numbering: the count is section 0's sh_size
            shnum = first[5]
        if shstrndx == _SHN_XINDEX:
            shstrndx = first[6]
        end = shoff + shnum * layout.size
        if end > len(data):
            raise ElfError(f"{shnum} section headers at {shoff:#x} run past the end "
                           f"({len(data)} bytes)")
        rows = tuple(layout.iter_unpack(data[shoff:end]))
        if shnum and not 0 <= shstrndx < shnum:
            raise ElfError(f"section name table {shstrndx} of {shnum} sections")
        names = _bounded(data, rows[shstrndx][4], rows[shstrndx][5], "section name table") \
            if shnum else b""
        return cls(data, ei_class, order, rows, names)

    @property
    def sections(self) -> tuple[Section, ...]:
        return tuple(self.at(index) for index in range(len(self.rows)))

    def at(self, index: int) -> Section:
        """Section `index`, its name read (and checked) now."""
        if not 0 <= index < len(self.rows):
            raise ElfError(f"no section {index} of {len(self.rows)}")
        row = self.rows[index]
        return Section(_string(self.names, row[0], "section name"), row[1], row[4], row[5],
                       row[6], row[9])

    def section(self, name: str) -> Section | None:
        """The first section of that name (as the linkers look them up).  Only the headers
        are compared: a cubin has hundreds of sections and one is wanted."""
        wanted = name.encode() + b"\0"
        return next((self.at(index) for index, row in enumerate(self.rows)
                     if self.names.startswith(wanted, row[0])), None)

    def section_data(self, section: Section) -> bytes:
        if section.type == SHT_NOBITS:
            return b""
        return _bounded(self.data, section.offset, section.size, section.name or "section")

    def symbol_rows(self, table: Section) -> tuple[bytes, Iterator[SymbolRow]]:
        """The linked string table of a SHT_SYMTAB or SHT_DYNSYM section and its symbols as
        (st_name, st_info, st_other, st_shndx, st_size) rows; `name()` decodes a st_name.
        Rows, not objects: torch's libraries hold ~10^5 dynamic symbols."""
        if table.type not in (SHT_SYMTAB, SHT_DYNSYM):
            raise ElfError(f"{table.name} is not a symbol table")
        if not 0 < table.link < len(self.rows) or self.rows[table.link][1] != SHT_STRTAB:
            raise ElfError(f"{table.name} names section {table.link} as its string table, "
                           "which is not one")
        strings = self.section_data(self.at(table.link))
        sym_fmt, (at_name, at_info, at_other, at_shndx, at_size) = _CLASS[self.ei_class][4:]
        layout = struct.Struct(self.order + sym_fmt)
        raw = self.section_data(table)
        if len(raw) % layout.size:
            raise ElfError(f"{table.name} holds {len(raw)} bytes, not whole {layout.size}-byte "
                           "symbols")
        return strings, ((row[at_name], row[at_info], row[at_other], row[at_shndx],
                          row[at_size]) for row in layout.iter_unpack(raw))

    def functions(self, table: Section, other_bits: int) -> dict[str, int]:
        """Name -> size of the function symbols (STT_FUNC) whose st_other has any of
        `other_bits`, in table order; only their names are decoded."""
        strings, rows = self.symbol_rows(table)
        return {name(strings, at): size for at, info, other, _shndx, size in rows
                if info & 0xF == STT_FUNC and other & other_bits}


SymbolRow = tuple[int, int, int, int, int]
STT_FUNC = 2


def name(strings: bytes, at: int) -> str:
    """The NUL-terminated UTF-8 string at `at` of a string table."""
    return _string(strings, at, "symbol name")




def _bounded(data: Buffer, offset: int, size: int, what: str) -> bytes:
    if offset + size > len(data):
        raise ElfError(f"{what} at {offset:#x}, {size} bytes, runs past the end "
                       f"({len(data)} bytes)")
    return bytes(data[offset:offset + size])


def _string(table: bytes, at: int, what: str) -> str:
    end = table.find(b"\0", at)
    if at >= len(table) or end < 0:
        raise ElfError(f"{what} at {at} is not a string of its table ({len(table)} bytes)")
    try:
        return table[at:end].decode()
    except UnicodeDecodeError:
        raise ElfError(f"{what} at {at} is not UTF-8") from None


def declared_extent(head: bytes) -> int | None:
    """How many bytes an ELF file's headers account for, from its first bytes alone: the
    ends of its section header table and of every section, and of every segment its program
    headers name.  None when `head` is no ELF header, or when the tables that say it are not
    in `head` (a section header table further on ends the file as linkers write it: what
    lies before it cannot be judged from here).  A file larger than a known extent holds
    bytes no header names (a zero-filled member made to cost memory, say)."""
    if len(head) < 0x34 or head[:4] != MAGIC or head[4] not in _CLASS or head[5] not in (1, 2):
        return None
    order = "<" if head[5] == 1 else ">"
    wide = head[4] == 2
    if len(head) < (0x40 if wide else 0x34):
        return None
    phoff, shoff = struct.unpack_from(order + ("QQ" if wide else "II"), head,
                                      0x20 if wide else 0x1C)
    phentsize, phnum, shentsize, shnum = struct.unpack_from(
        order + "HHHH", head, 0x36 if wide else 0x2A)
    extent: int = 0x40 if wide else 0x34
    # (offset, entry size, count, row layout, the row's offset and size fields, sections?)
    tables = ((phoff, phentsize, phnum, "IIQQQQQQ" if wide else "IIIIIIII",
               (2, 5) if wide else (1, 4), False),
              (shoff, shentsize, shnum, "IIQQQQIIQQ" if wide else "IIIIIIIIII", (4, 5), True))
    for offset, entsize, count, layout, (at_offset, at_size), sections in tables:
        if not count or not offset:
            continue
        end = offset + entsize * count
        row = struct.Struct(order + layout)
        if entsize != row.size or end > len(head):
            return None  # not in the window: it cannot be judged from here
        extent = max(extent, end)
        for fields in row.iter_unpack(head[offset:end]):
            if sections and fields[1] == SHT_NOBITS:
                continue  # a section that takes no bytes of the file
            extent = max(extent, int(fields[at_offset]) + int(fields[at_size]))
    return extent


def section_table_at(head: bytes) -> tuple[int, int, int] | None:
    """Where an ELF64 little-endian file's section header table is, from its first bytes:
    (offset, size, index of the section name table); None when the layout is another
    (ELF32, big-endian, extended numbering, no table), to be judged on the whole bytes."""
    if len(head) < 0x40 or head[:4] != MAGIC or head[4] != 2 or head[5] != 1:
        return None
    at_shoff, off_fmt, at_rest, header_fmt, _, _ = _CLASS[2]
    (shoff,) = struct.unpack_from("<" + off_fmt, head, at_shoff)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", head, at_rest)
    if shoff == 0 or shnum == 0 or shentsize != struct.calcsize("<" + header_fmt) \
            or shstrndx >= shnum:
        return None
    return shoff, shnum * shentsize, shstrndx


def section_extent(table: bytes, index: int) -> tuple[int, int]:
    """(offset, size) of section `index` in an ELF64 little-endian section header table."""
    layout = struct.Struct("<" + _CLASS[2][3])
    row = layout.unpack_from(table, index * layout.size)
    return int(row[4]), int(row[5])
