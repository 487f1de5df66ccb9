"""The struct-based ELF reader (`verify/elf.py`) against pyelftools, an independent reader,
on real files (gcc's shared object, nvcc's host objects and their cubins), and on hand-built
ELF files for what real files rarely show: ELF32, big-endian, extended section numbering,
and damage of each header field it trusts."""

from __future__ import annotations

import io
import struct
import subprocess
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

from sm121_build.cuda.elf import SHT_NOBITS, SHT_STRTAB, SHT_SYMTAB, Elf, ElfError, name
from sm121_build.cuda.fatbin import HostBinary

Rows = list[tuple[str, int, int, int, int]]


def _reference(data: bytes) -> tuple[list[tuple[str, int, int, int, int, int]], Rows]:
    """pyelftools' sections (name, type number, offset, size, link, entsize) and the raw
    rows of `.symtab` named through its string table."""
    elf = ELFFile(io.BytesIO(data))
    types = {"SHT_NULL": 0, "SHT_PROGBITS": 1, "SHT_SYMTAB": 2, "SHT_STRTAB": 3,
             "SHT_NOBITS": 8, "SHT_DYNSYM": 11}
    sections = [(s.name, types.get(s["sh_type"], -1), s["sh_offset"], s["sh_size"],
                 s["sh_link"], s["sh_entsize"]) for s in elf.iter_sections()]
    table = elf.get_section_by_name(".symtab")
    rows: Rows = []
    if isinstance(table, SymbolTableSection):
        for at, info, other, shndx, _value, size in struct.iter_unpack("<IBBHQQ",
                                                                       table.data()):
            rows.append((table.stringtable.get_string(at), info, other, shndx, size))
    return sections, rows


def _ours(data: bytes) -> tuple[list[tuple[str, int, int, int, int, int]], Rows]:
    elf = Elf.read(data)
    sections = [(s.name, s.type if s.type in (0, 1, 2, 3, 8, 11) else -1, s.offset, s.size,
                 s.link, s.entsize) for s in elf.sections]
    table = elf.section(".symtab")
    rows: Rows = []
    if table is not None:
        strings, found = elf.symbol_rows(table)
        rows = [(name(strings, at), info, other, shndx, size)
                for at, info, other, shndx, size in found]
    return sections, rows


def test_sections_and_symbols_equal_pyelftools_on_real_files(
        matrix: dict[str, Path], host_only_so: Path) -> None:
    files = {"gcc .so": host_only_so.read_bytes()}
    for label, path in matrix.items():
        files[f"nvcc {label}"] = path.read_bytes()
        with HostBinary.open(path) as binary:
            for entry in binary.entries:
                if entry.kind == "elf":
                    files[f"{label} cubin {entry.index}"] = binary.payload(entry)
    kernels = 0
    for label, data in files.items():
        ours = _ours(data)
        assert ours == _reference(data), label
        if "cubin" in label:
            elf = Elf.read(data)
            table = elf.section(".symtab")
            assert table is not None
            entries = elf.functions(table, 0x10)  # STO_CUDA_ENTRY: what cuobjdump calls ENTRY
            assert list(entries) == [row[0] for row in ours[1]
                                     if row[1] & 0xF == 2 and row[2] & 0x10]
            kernels += len(entries)
    assert sum("cubin" in label for label in files) >= 5 and kernels >= 5


def _elf(bits: int, order: str, sections: list[tuple[bytes, int, bytes, int]],
         extended: bool = False) -> bytearray:
    """An ELF file with these (name, type, data, link) sections after a null section and a
    `.shstrtab` (the last section), in either class and byte order; `extended` writes the
    section count and name-table index the way files with >= 0xff00 sections do."""
    names = b"\0" + b"".join(n + b"\0" for n, _, _, _ in sections) + b".shstrtab\0"
    header_size, entry_size = (64, 64) if bits == 64 else (52, 40)
    body = bytearray()
    placed = []
    for section_name, kind, data, link in [*sections, (b".shstrtab", SHT_STRTAB, names, 0)]:
        placed.append((names.index(section_name + b"\0"), kind, header_size + len(body),
                       len(data), link))
        body += data
    shoff = header_size + len(body)
    count, strndx = len(placed) + 1, len(placed)
    ident = b"\x7fELF" + bytes([1 if bits == 32 else 2, 1 if order == "<" else 2, 1]) + \
        bytes(9)
    if bits == 64:
        header = ident + struct.pack(order + "HHIQQQIHHHHHH", 1, 190, 1, 0, 0, shoff, 0,
                                     header_size, 0, 0, entry_size,
                                     0 if extended else count,
                                     0xFFFF if extended else strndx)
        row = order + "IIQQQQIIQQ"
    else:
        header = ident + struct.pack(order + "HHIIIIIHHHHHH", 1, 190, 1, 0, 0, shoff, 0,
                                     header_size, 0, 0, entry_size,
                                     0 if extended else count,
                                     0xFFFF if extended else strndx)
        row = order + "IIIIIIIIII"
    out = bytearray(header) + body
    null = (0, 0, 0, 0, 0, count if extended else 0, strndx if extended else 0, 0, 0, 0)
    out += struct.pack(row, *null)
    for at, kind, offset, size, link in placed:
        entsize = 24 if bits == 64 and kind == SHT_SYMTAB else 16 if kind == SHT_SYMTAB else 0
        out += struct.pack(row, at, kind, 0, 0, offset, size, link, 0, 1, entsize)
    return out


def _symbols(bits: int, order: str) -> tuple[bytes, bytes]:
    strings = b"\0kernel\0helper\0"
    if bits == 64:
        table = struct.pack(order + "IBBHQQ", 0, 0, 0, 0, 0, 0) + \
            struct.pack(order + "IBBHQQ", 1, 0x12, 0x10, 1, 0, 96) + \
            struct.pack(order + "IBBHQQ", 8, 0x12, 0, 1, 0, 32)
    else:
        table = struct.pack(order + "IIIBBH", 0, 0, 0, 0, 0, 0) + \
            struct.pack(order + "IIIBBH", 1, 0, 96, 0x12, 0x10, 1) + \
            struct.pack(order + "IIIBBH", 8, 0, 32, 0x12, 0, 1)
    return table, strings


@pytest.mark.parametrize("bits", [32, 64])
@pytest.mark.parametrize("order", ["<", ">"])
@pytest.mark.parametrize("extended", [False, True])
def test_both_classes_both_byte_orders_and_extended_numbering(bits: int, order: str,
                                                              extended: bool) -> None:
    table, strings = _symbols(bits, order)
    data = bytes(_elf(bits, order, [(b".symtab", SHT_SYMTAB, table, 2),
                                    (b".strtab", SHT_STRTAB, strings, 0),
                                    (b".bss", SHT_NOBITS, b"", 0)], extended))
    elf = Elf.read(data)
    assert [s.name for s in elf.sections] == ["", ".symtab", ".strtab", ".bss", ".shstrtab"]
    symtab = elf.section(".symtab")
    assert symtab is not None
    assert elf.functions(symtab, 0x10) == {"kernel": 96}  # `helper` lacks the entry bit
    assert elf.functions(symtab, 0x10 | 0x01) == {"kernel": 96}
    bss = elf.section(".bss")
    assert bss is not None and elf.section_data(bss) == b""
    assert elf.section(".nv_fatbin") is None
    assert elf.section(".symta") is None and elf.section("symtab") is None  # whole names only
    if bits == 64 and order == "<" and not extended:
        assert _ours(data)[0] == _reference(data)[0]  # pyelftools reads the hand-built file


def _damaged(change: tuple[int, str, int] | None = None) -> bytearray:
    table, strings = _symbols(64, "<")
    data = _elf(64, "<", [(b".symtab", SHT_SYMTAB, table, 2),
                          (b".strtab", SHT_STRTAB, strings, 0)])
    if change:
        at, fmt, value = change
        struct.pack_into(fmt, data, at, value)
    return data


def _section_header(data: bytes, index: int) -> int:
    return int(struct.unpack_from("<Q", data, 0x28)[0]) + 64 * index


@pytest.mark.parametrize(("where", "fmt", "value", "message"), [
    (0x3A, "<H", 40, r"^section header size 40, not 64$"),
    (0x28, "<Q", 1 << 20, r"^section headers at 0x100000 past the end"),
    (0x3C, "<H", 200, r"^200 section headers at 0x[0-9a-f]+ run past the end"),
    (0x3E, "<H", 9, r"^section name table 9 of 4 sections$"),
    ("shstrtab size", "<Q", 1 << 20, r"^section name table at 0x[0-9a-f]+, 1048576 bytes, "
                                     r"runs past the end"),
    ("symtab name", "<I", 999, r"^section name at 999 is not a string of its table"),
    ("symtab link", "<I", 1, r"^\.symtab names section 1 as its string table, which is "
                             r"not one$"),
    ("symtab link", "<I", 77, r"^\.symtab names section 77 as its string table"),
    ("symtab type", "<I", 1, r"^\.symtab is not a symbol table$"),
    ("symtab size", "<Q", 30, r"^\.symtab holds 30 bytes, not whole 24-byte symbols$"),
])
def test_every_trusted_field_damaged_is_an_error(where: int | str, fmt: str, value: int,
                                                 message: str) -> None:
    data = _damaged()
    fields = {"symtab name": (1, 0), "symtab type": (1, 4), "symtab link": (1, 40),
              "symtab size": (1, 32), "shstrtab size": (3, 32)}
    at = where if isinstance(where, int) else \
        _section_header(data, fields[where][0]) + fields[where][1]
    struct.pack_into(fmt, data, at, value)
    with pytest.raises(ElfError, match=message):
        elf = Elf.read(bytes(data))
        symtab = elf.section(".symtab") or elf.at(1)
        elf.functions(symtab, 0x10)


def test_symbol_names_outside_or_unterminated_or_not_utf8() -> None:
    for strings, message in [(b"\0kernel", r"^symbol name at 1 is not a string of its table"),
                             (b"\0ker\xffnel\0helper\0", r"^symbol name at 1 is not UTF-8$")]:
        table, _ = _symbols(64, "<")
        data = bytes(_elf(64, "<", [(b".symtab", SHT_SYMTAB, table, 2),
                                    (b".strtab", SHT_STRTAB, strings, 0)]))
        elf = Elf.read(data)
        symtab = elf.section(".symtab")
        assert symtab is not None
        with pytest.raises(ElfError, match=message):
            elf.functions(symtab, 0x10)


def test_what_is_not_an_elf_header() -> None:
    for data, message in [(b"\x7fELF", r"^no ELF header$"), (b"MZ" + bytes(62), r"^no ELF"),
                          (b"\x7fELF\x03\x01" + bytes(58), r"^unknown ELF class 3 or data "
                                                           r"encoding 1$"),
                          (b"\x7fELF\x02\x00" + bytes(58), r"encoding 0$"),
                          (b"\x7fELF\x02\x01" + bytes(48), r"^ELF header cut short$")]:
        with pytest.raises(ElfError, match=message):
            Elf.read(data)
    no_sections = Elf.read(b"\x7fELF\x02\x01\x01" + bytes(57))  # e_shoff 0: none
    assert no_sections.sections == () and no_sections.section(".symtab") is None
    with pytest.raises(ElfError, match=r"^no section 0 of 0$"):
        no_sections.at(0)


def test_a_32_bit_object_from_gcc_when_it_can_make_one(tmp_path: Path) -> None:
    source = tmp_path / "f.c"
    source.write_text("int f(void) { return 1; }\n")
    made = subprocess.run(["gcc", "-m32", "-c", "-o", str(tmp_path / "f.o"), str(source)],
                          capture_output=True, check=False)
    if made.returncode:
        pytest.skip("gcc has no -m32 here (gcc-multilib); the hand-built ELF32 tests remain")
    data = (tmp_path / "f.o").read_bytes()
    elf = Elf.read(data)
    assert elf.ei_class == 1
    assert [s.name for s in elf.sections] == [s.name for s in
                                              ELFFile(io.BytesIO(data)).iter_sections()]
    symtab = elf.section(".symtab")
    assert symtab is not None
    strings, rows = elf.symbol_rows(symtab)
    assert "f" in {name(strings, at) for at, info, *_ in rows if info & 0xF == 2}
