"""The fatbin walker on crafted sections, byte for byte at every bound it checks.

Real nvcc output (test_fatbin_vs_cuobjdump.py) is always well formed, so it never reaches
the damaged-input checks; these sections are built field by field from the layout in
fatbin.py's docstring, one byte on each side of each limit.  Also the dynamic symbol table
(a gcc-built .so with every binding and visibility) and the cuobjdump-style listing."""

from __future__ import annotations

import ctypes
import io
import platform
import struct
import subprocess
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

from devkit.helpers import DATA, compile_cached, gencode, pyelftools_dynsym
from sm121_build.core.errors import CorruptBinaryError
from sm121_build.cuda import dynsym, fatbin
from sm121_build.cuda.dynsym import dynamic_symbols
from sm121_build.cuda.fatbin import (
    CONTAINER_MAGIC,
    FLAG_ARCH_SPECIFIC,
    FLAG_FAMILY_SPECIFIC,
    FLAG_LZ4,
    FLAG_ZSTD,
    MAX_ENTRY_SIZE,
    MAX_RATIO,
    CodeSection,
    Entry,
    EntryAt,
    _walk_section,
    cuobjdump_listing,
    read_entry,
)

P = Path("x.so")


def entry(kind: int = 2, payload: bytes = b"", header: int = 64, arch: int = 121,
          flags: int = 0x11, compressed: int = 0, uncompressed: int = 0,
          size: int | None = None, version: tuple[int, int] = (8, 9)) -> bytes:
    head = struct.pack("<HHIQIIHHIIIQQQ", kind, 0x101, header,
                       len(payload) if size is None else size, compressed, 0, version[1],
                       version[0], arch, 0, 0, flags, 0, uncompressed)
    return head + b"\0" * (header - 64) + payload


def container(body: bytes, header: int = 16, size: int | None = None) -> bytes:
    return struct.pack("<IHHQ", CONTAINER_MAGIC, 1, header,
                       len(body) if size is None else size) + b"\0" * (header - 16) + body


def walk(section: bytes, first: int = 0) -> list[Entry]:
    return list(_walk_section(P, section, CodeSection(".nv_fatbin", 0, len(section), True),  # type: ignore[arg-type]
                              first))


def test_entries_of_two_containers_with_padding_between() -> None:
    one = container(entry(payload=b"A" * 8, arch=90) + entry(kind=1, payload=b"ptx", arch=90))
    two = container(entry(payload=b"B" * 4, arch=120, flags=FLAG_FAMILY_SPECIFIC))
    section = b"\0" * 8 + one + b"\0" * 16 + two
    found = walk(section, first=5)
    assert [(e.container, e.index, e.kind, e.sm) for e in found] == [
        (5, 0, "elf", "sm_90"), (5, 1, "ptx", "sm_90"), (6, 2, "elf", "sm_120f")]
    assert found[0].offset == 8 + 16 + 64 and found[0].size == found[0].stored_size == 8
    assert found[1].offset == 8 + 16 + 64 + 8 + 64
    assert found[2].offset == len(section) - 4
    assert found[0].version == (8, 9) and found[0].flags == 0x11


def test_a_container_exactly_one_entry_header_long_holds_that_entry() -> None:
    assert [e.size for e in walk(container(entry()))] == [0]


def test_zero_padding_closes_a_container_and_the_next_one_is_read() -> None:
    padded = container(entry(payload=b"A") + b"\0" * 64 + entry(payload=b"never read"))
    found = walk(padded + container(entry(arch=100)))
    assert [(e.container, e.arch) for e in found] == [(0, 121), (1, 100)]


def test_an_entry_of_unknown_kind_is_kept_as_other() -> None:
    assert [e.kind for e in walk(container(entry(kind=0, payload=b"?")))] == ["other"]
    assert [e.kind for e in walk(container(entry(kind=3)))] == ["other"]


def test_trailing_bytes_that_are_not_a_container() -> None:
    good = container(entry())
    assert len(walk(good + b"\x01" * 15)) == 1  # too short to hold a container header
    with pytest.raises(CorruptBinaryError,
                       match=rf"^x.so: bad fatbin container magic 0x1010101 at file offset "
                             rf"{len(good):#x}$"):
        walk(good + b"\x01" * 16)
    with pytest.raises(CorruptBinaryError, match="bad fatbin container magic 0x0 at"):
        walk(good + b"\0" * 7 + b"\x01" + b"\0" * 8)  # not all-zero padding


def test_container_sizes_at_their_bounds() -> None:
    body = entry()
    assert len(walk(container(body, size=len(body)))) == 1
    with pytest.raises(CorruptBinaryError,
                       match=r"^x.so: fatbin container at 0x0 claims a 16-byte header and 65 "
                             r"bytes, the section has 80 from there$"):
        walk(container(body, size=len(body) + 1))
    assert len(walk(container(body, header=24))) == 1
    with pytest.raises(CorruptBinaryError,
                       match="claims a 15-byte header and 64 bytes, the section has 80 from"):
        walk(struct.pack("<IHHQ", CONTAINER_MAGIC, 1, 15, 64) + body)


def test_entry_header_and_payload_at_their_bounds() -> None:
    data = entry(payload=b"abc", header=72)
    found, after = read_entry(P, data, 0, len(data))  # type: ignore[arg-type]
    assert found is not None and (found.offset, found.size, after) == (72, 3, 75)
    with pytest.raises(CorruptBinaryError,
                       match=r"^x.so: fatbin entry at 0x0 has a nonsense size \(header 72, "
                             r"payload 4, 75 bytes left\)$"):
        read_entry(P, entry(payload=b"abc", header=72, size=4), 0, 75)  # type: ignore[arg-type]
    short = entry(payload=b"abc")[:4] + struct.pack("<I", 63) + entry(payload=b"abc")[8:]
    with pytest.raises(CorruptBinaryError, match=r"\(header 63, payload 3, 67 bytes left\)"):
        read_entry(P, short, 0, len(short))  # type: ignore[arg-type]
    end, nothing = read_entry(P, b"\0" * 64, 0, 100)  # type: ignore[arg-type]
    assert (end, nothing) == (None, 100)
    with pytest.raises(CorruptBinaryError, match="header 0"):
        read_entry(P, entry(kind=2, header=64)[:4] + b"\0" * 60, 0, 64)  # type: ignore[arg-type]


@pytest.mark.parametrize(("flags", "codec"), [(FLAG_LZ4, "lz4"), (FLAG_ZSTD, "zstd"),
                                              (FLAG_LZ4 | FLAG_ZSTD, "lz4"), (0, None)])
def test_compression_flags(flags: int, codec: str | None) -> None:
    data = entry(payload=b"x" * 10, flags=flags, compressed=10, uncompressed=99)
    found, _ = read_entry(P, data, 0, len(data))  # type: ignore[arg-type]
    assert found is not None and found.compression == codec
    assert (found.stored_size, found.size) == ((10, 99) if codec else (10, 10))


@pytest.mark.parametrize(("compressed", "uncompressed", "ok"), [
    (10, 1, True), (1, MAX_RATIO, True), (10, 10 * MAX_RATIO, True), (11, 1, False),
    (0, 1, False), (10, 0, False), (10, MAX_ENTRY_SIZE, False)])
def test_compressed_sizes_at_their_bounds(compressed: int, uncompressed: int, ok: bool) -> None:
    data = entry(payload=b"x" * 10, flags=FLAG_ZSTD, compressed=compressed,
                 uncompressed=uncompressed)
    if ok:
        assert read_entry(P, data, 0, len(data))[0] is not None  # type: ignore[arg-type]
        return
    with pytest.raises(CorruptBinaryError,
                       match=rf"^x.so: compressed fatbin entry at 0x0 has nonsense sizes "
                             rf"\(compressed {compressed}, uncompressed {uncompressed}, "
                             rf"payload 10\)$"):
        read_entry(P, data, 0, len(data))  # type: ignore[arg-type]


@pytest.mark.parametrize(("compressed", "uncompressed"), [
    (1, MAX_RATIO + 1), (10, 10 * MAX_RATIO + 1), (1, MAX_ENTRY_SIZE - 1)])
def test_an_entry_made_to_expand_is_refused_before_decompressing(compressed: int,
                                                                 uncompressed: int) -> None:
    """A decompression bomb: a few bytes declaring gigabytes (real nvcc entries expand at
    most ~97x) is refused from its header, before any memory is taken for it."""
    data = entry(payload=b"x" * 10, flags=FLAG_ZSTD, compressed=compressed,
                 uncompressed=uncompressed)
    with pytest.raises(CorruptBinaryError, match=rf"declares {uncompressed} bytes from "
                                                 rf"{compressed} \(over {MAX_RATIO}x"):
        read_entry(P, data, 0, len(data))  # type: ignore[arg-type]


@pytest.mark.parametrize(("flags", "variant"), [
    (FLAG_ARCH_SPECIFIC, "a"), (FLAG_FAMILY_SPECIFIC, "f"),
    (FLAG_ARCH_SPECIFIC | FLAG_FAMILY_SPECIFIC, "a"), (0, "")])
def test_variant_flags(flags: int, variant: str) -> None:
    data = entry(flags=flags)
    found, _ = read_entry(P, data, 0, len(data), EntryAt(3, 7))  # type: ignore[arg-type]
    assert found is not None and (found.variant, found.container, found.index) == (variant, 3, 7)


def _entry(kind: str, arch: int, variant: str = "") -> Entry:
    return Entry(0, 0, kind, arch, variant, 0, (0, 0), 0, 0, 0, None)  # type: ignore[arg-type]


def test_listing_numbers_each_kind_on_its_own_and_skips_other() -> None:
    entries = [_entry("ptx", 90), _entry("elf", 90), _entry("other", 1), _entry("elf", 120, "f"),
               _entry("ptx", 120, "f"), _entry("elf", 90, "a")]
    assert cuobjdump_listing(Path("/lib/libx.so.1"), entries) == [
        "PTX file    1: libx.so.1.sm_90.ptx", "ELF file    1: libx.so.1.sm_90.cubin",
        "ELF file    2: libx.so.2.sm_120.cubin", "PTX file    2: libx.so.2.sm_120f.ptx",
        "ELF file    3: libx.so.3.sm_90a.cubin"]
    assert cuobjdump_listing(Path("plain"), [_entry("elf", 80)]) == [
        "ELF file    1: plain.1.sm_80.cubin"]


@pytest.fixture(scope="module")
def symbols_so(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A .so with every kind of dynamic symbol (gcc)."""
    src = tmp_path_factory.mktemp("dynsym") / "s.cpp"
    src.write_text("""
extern int needed_global(void);
extern int needed_weak(void) __attribute__((weak));
extern "C" int exported_default(void) {
    return needed_global() + (needed_weak ? needed_weak() : 0);
}
extern "C" __attribute__((weak)) int exported_weak(void) { return 1; }
extern "C" __attribute__((visibility("protected"))) int exported_protected(void) { return 2; }
extern "C" __attribute__((visibility("hidden"))) int hidden_fn(void) { return 3; }
template <typename T> struct Holder { static int value; };
template <typename T> int Holder<T>::value = 4;
extern "C" int use_unique(void) { return Holder<int>::value; }
static int local_fn(void) { return 5; }
extern "C" int call_local(void) { return local_fn(); }
""")
    out = src.with_suffix(".so")
    subprocess.run(["g++", "-shared", "-fPIC", "-O0", "-o", str(out), str(src)], check=True)
    return out


def test_dynamic_symbols_by_binding_and_visibility(symbols_so: Path) -> None:
    found = dynamic_symbols(symbols_so)
    assert {"_Z13needed_globalv"} <= found.undefined
    assert "_Z11needed_weakv" not in found.undefined | found.exported  # weak undefined
    assert {"exported_default", "exported_weak", "exported_protected", "use_unique",
            "call_local"} <= found.exported
    assert "_ZN6HolderIiE5valueE" in found.exported  # STB_GNU_UNIQUE (template static)
    assert not {"hidden_fn", "local_fn"} & (found.exported | found.undefined)
    assert "" not in found.exported


@pytest.fixture(scope="module")
def elf32_so(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 32-bit shared object (binutils: `as --32`, `ld -m elf_i386`: an x86 host's)."""
    if platform.machine() != "x86_64":
        pytest.skip(f"a 32-bit x86 object needs an x86_64 host's binutils, not "
                    f"{platform.machine()}'s")
    folder = tmp_path_factory.mktemp("elf32")
    (folder / "t.s").write_text(".globl f32\n.type f32,@function\nf32: call undef32@PLT\n ret\n"
                                ".weak w32\n.type w32,@function\nw32: ret\n"
                                ".globl h32\n.hidden h32\nh32: ret\n")
    subprocess.run(["as", "--32", "-o", str(folder / "t.o"), str(folder / "t.s")], check=True)
    out = folder / "t.so"
    subprocess.run(["ld", "-m", "elf_i386", "-shared", "-o", str(out), str(folder / "t.o")],
                   check=True)
    return out


def test_dynamic_symbols_agree_with_pyelftools(symbols_so: Path, host_only_so: Path,
                                               elf32_so: Path) -> None:
    libstdcxx = subprocess.run(["g++", "-print-file-name=libstdc++.so"], capture_output=True,
                               text=True, check=True).stdout.strip()
    for path in (symbols_so, host_only_so, elf32_so, Path(libstdcxx).resolve()):
        found = dynamic_symbols(path)
        assert (set(found.undefined), set(found.exported)) == pyelftools_dynsym(path), path
    assert dynamic_symbols(elf32_so) == dynsym.DynamicSymbols(frozenset({"undef32"}),
                                                              frozenset({"f32", "w32"}))
    assert len(dynamic_symbols(Path(libstdcxx).resolve()).exported) > 1000


_TRAITS = "std::char_traits<char>"
_STANDARD_ABBREVIATIONS = {  # Ss, Si, So, Sd: c++filt spells them out, libstdc++ need not
    f"std::basic_string<char, {_TRAITS}, std::allocator<char> >": "std::string",
    f"std::basic_istream<char, {_TRAITS} >": "std::istream",
    f"std::basic_ostream<char, {_TRAITS} >": "std::ostream",
    f"std::basic_iostream<char, {_TRAITS} >": "std::iostream"}


def _abbreviated(name: str) -> str:
    for full, short in _STANDARD_ABBREVIATIONS.items():
        name = name.replace(full, short)
    return name.replace(" >", ">")


def test_demangle_agrees_with_cxxfilt_on_a_real_library() -> None:
    """Every exported name of the system libstdc++ (C++ and C names, vtables, typeinfo,
    templates), demangled in-process, against binutils' c++filt (the oracle)."""
    libstdcxx = subprocess.run(["g++", "-print-file-name=libstdc++.so"], capture_output=True,
                               text=True, check=True).stdout.strip()
    names = sorted(dynamic_symbols(Path(libstdcxx).resolve()).exported)
    # C names that spell a type code (`i` is `int` to the demangler) stay names, as in c++filt
    names += ["_ZN3c1013MessageLoggerC1EPKciib", "_Z", "_Zfoo", "_ZN3c10", "aoti_torch_x", "",
              "i", "Pc", "v"]
    oracle = subprocess.run(["c++filt"], input="\n".join(names) + "\n", capture_output=True,
                            text=True, check=True).stdout.split("\n")[:len(names)]
    ours = [dynsym.demangle(name) for name in names]
    assert [_abbreviated(name) for name in ours] == [_abbreviated(name) for name in oracle]
    assert sum(a != b for a, b in zip(names, ours, strict=True)) > 1000  # really demangled
    assert dynsym.demangle("_ZN3c1013MessageLoggerC1EPKciib") == \
        "c10::MessageLogger::MessageLogger(char const*, int, int, bool)"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def test_demangle_frees_what_the_cxx_runtime_allocates() -> None:
    """glibc's count of allocated bytes does not grow over 10 000 calls (a lost buffer per
    call would add ~0.8 MB)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    name = "_ZN3c1013MessageLoggerC1EPKciib"
    assert dynsym.demangle(name) != name
    before = libc.mallinfo2().uordblks
    for _ in range(10_000):
        dynsym.demangle(name)
    assert libc.mallinfo2().uordblks - before < 100_000


def test_demangle_without_a_cxx_runtime_keeps_the_name(monkeypatch: pytest.MonkeyPatch) -> None:
    # STAND-IN: a host where libstdc++ cannot be loaded (every machine here has one).
    monkeypatch.setattr(dynsym, "_cxa_demangle", lambda: None)
    assert dynsym.demangle("_ZN3c104cuda12device_countEv") == "_ZN3c104cuda12device_countEv"


def test_dynamic_symbols_refuse_what_is_not_a_little_endian_table(tmp_path: Path,
                                                                  symbols_so: Path) -> None:
    data = bytearray(symbols_so.read_bytes())
    data[5] = 2  # EI_DATA: big-endian
    flipped = tmp_path / "be.so"
    flipped.write_bytes(bytes(data))
    with pytest.raises(CorruptBinaryError, match=r"be\.so: a big-endian ELF file \(no CUDA host"):
        dynamic_symbols(flipped)
    with open(symbols_so, "rb") as handle:
        elf = ELFFile(handle)
        dynstr = elf.get_section_by_name(".dynstr")
        start, size = dynstr["sh_offset"], dynstr["sh_size"]
    unterminated = bytearray(symbols_so.read_bytes())
    unterminated[start:start + size] = b"x" * size  # names without their NUL
    bad = tmp_path / "nonul.so"
    bad.write_bytes(bytes(unterminated))
    with pytest.raises(CorruptBinaryError, match=r"nonul\.so: not a readable ELF file: "):
        dynamic_symbols(bad)


def _dynsym_edit(source: Path, dest: Path, symbol: str | None, byte: int, value: int) -> Path:
    """A copy of an ELF64 .so with one byte changed: of `symbol`'s Elf64_Sym entry, or of the
    .dynsym section header when `symbol` is None."""
    data = bytearray(source.read_bytes())
    with open(source, "rb") as handle:
        elf = ELFFile(handle)
        table = elf.get_section_by_name(".dynsym")
        assert table is not None
        if symbol is None:
            index = next(i for i, s in enumerate(elf.iter_sections()) if s.name == ".dynsym")
            at = elf["e_shoff"] + index * elf["e_shentsize"]
        else:
            number = next(i for i, s in enumerate(table.iter_symbols()) if s.name == symbol)
            at = table["sh_offset"] + number * table["sh_entsize"]
    data[at + byte] = value
    dest.write_bytes(bytes(data))
    return dest


def test_a_hidden_or_internal_symbol_in_dynsym_is_not_exported(tmp_path: Path,
                                                               symbols_so: Path) -> None:
    for visibility in (1, 2):  # STV_INTERNAL, STV_HIDDEN (the linker puts none there)
        edited = _dynsym_edit(symbols_so, tmp_path / f"v{visibility}.so", "exported_default", 5,
                              visibility)
        assert "exported_default" not in dynamic_symbols(edited).exported
    protected = _dynsym_edit(symbols_so, tmp_path / "p.so", "exported_default", 5, 3)
    assert "exported_default" in dynamic_symbols(protected).exported


def test_a_dynsym_of_partial_entries_is_unreadable(tmp_path: Path, symbols_so: Path) -> None:
    with open(symbols_so, "rb") as handle:
        size = ELFFile(handle).get_section_by_name(".dynsym")["sh_size"]
    assert size % 24 == 0 and size % 256 != 255
    cut = _dynsym_edit(symbols_so, tmp_path / "cut.so", None, 32, (size % 256) + 1)  # sh_size
    with pytest.raises(CorruptBinaryError, match=r"cut\.so: not a readable ELF file: "):
        dynamic_symbols(cut)


def test_dynamic_symbols_of_files_without_a_table_or_unreadable(tmp_path: Path,
                                                                host_only_so: Path) -> None:
    obj = tmp_path / "o.o"
    (tmp_path / "o.c").write_text("int f(void) { return 1; }\n")
    subprocess.run(["gcc", "-c", "-o", str(obj), str(tmp_path / "o.c")], check=True)
    assert dynamic_symbols(obj) == dynsym.DynamicSymbols(frozenset(), frozenset())
    assert "answer" in dynamic_symbols(host_only_so).exported
    with pytest.raises(CorruptBinaryError, match=r"^/nonexistent.so: cannot open: No such file"):
        dynamic_symbols(Path("/nonexistent.so"))
    junk = tmp_path / "junk.so"
    junk.write_bytes(b"\x7fELF" + b"\xff" * 60)
    with pytest.raises(CorruptBinaryError, match=r"junk.so: not a readable ELF file: "):
        dynamic_symbols(junk)


def test_a_bad_entry_deep_in_a_section_is_named_with_its_file_and_offset() -> None:
    good = container(entry(payload=b"A" * 8))
    bad_entry = bytearray(entry(payload=b"abc"))
    bad_entry[4:8] = struct.pack("<I", 63)
    section = good + container(bytes(bad_entry))
    start = len(good) + 16
    with pytest.raises(CorruptBinaryError,
                       match=rf"^x.so: fatbin entry at {start:#x} has a nonsense size "
                             rf"\(header 63, payload 3, 67 bytes left\)$"):
        walk(section)


def _elf_copy(source: Path, dest: Path) -> Path:
    dest.write_bytes(source.read_bytes())
    return dest


def _fatbin_header(path: Path) -> tuple[int, int, int]:
    """(file offset of .nv_fatbin's section header, its sh_offset, its sh_size)."""
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as handle:
        elf = ELFFile(handle)
        for index, section in enumerate(elf.iter_sections()):
            if section.name == ".nv_fatbin":
                where = elf["e_shoff"] + index * elf["e_shentsize"]
                return where, section["sh_offset"], section["sh_size"]
    raise AssertionError("no .nv_fatbin")


def test_host_files_too_small_missing_or_damaged(tmp_path: Path,
                                                 matrix: dict[str, Path]) -> None:
    with pytest.raises(CorruptBinaryError, match=r"^/nonexistent.so: cannot open: No such"):
        fatbin.HostBinary.open("/nonexistent.so")
    tiny = tmp_path / "tiny.so"
    tiny.write_bytes(b"\x7fELF" + b"\0" * 59)
    with pytest.raises(CorruptBinaryError, match=r"tiny.so: not an ELF file \(63 bytes\)$"):
        fatbin.HostBinary.open(tiny)
    tiny.write_bytes(b"\x7fELF" + b"\xff" * 60)  # 64 bytes: read as an ELF header, damaged
    with pytest.raises(CorruptBinaryError, match=r"tiny.so: not a readable ELF file: "):
        fatbin.HostBinary.open(tiny)
    so = _elf_copy(matrix["plain"], tmp_path / "magic.so")
    _, start, _ = _fatbin_header(so)
    data = bytearray(so.read_bytes())
    data[start:start + 4] = b"\xde\xad\xbe\xef"
    so.write_bytes(bytes(data))
    with pytest.raises(CorruptBinaryError,
                       match=rf"^{so}: bad fatbin container magic 0xefbeadde at file offset "
                             rf"{start:#x}$"):
        fatbin.HostBinary.open(so)


def test_a_fatbin_section_past_the_end_of_the_file(tmp_path: Path,
                                                   matrix: dict[str, Path]) -> None:
    so = _elf_copy(matrix["plain"], tmp_path / "long.so")
    where, start, _ = _fatbin_header(so)
    size = so.stat().st_size
    data = bytearray(so.read_bytes())
    data[where + 32:where + 40] = struct.pack("<Q", size - start + 1)  # sh_size, one too many
    so.write_bytes(bytes(data))
    with pytest.raises(CorruptBinaryError, match=rf"^{so}: fatbin section runs past the end"):
        fatbin.HostBinary.open(so)
    data[where + 32:where + 40] = struct.pack("<Q", size - start)  # up to the last byte: read
    so.write_bytes(bytes(data))
    with pytest.raises(CorruptBinaryError, match="bad fatbin container magic"):
        fatbin.HostBinary.open(so)  # the bytes after the fatbin are not a container


def test_kernel_names_of_ptx_entries_and_a_damaged_cubin(tmp_path: Path,
                                                         matrix: dict[str, Path]) -> None:
    with fatbin.HostBinary.open(matrix["plain"]) as binary:
        cubin = next(e for e in binary.entries if e.kind == "elf" and binary.kernels(e))
        ptx = next(e for e in binary.entries if e.kind == "ptx")
        names = binary.kernels(cubin)
        assert names and set(binary.kernels(ptx)) == set(names)
    so = _elf_copy(matrix["plain"], tmp_path / "cubin.so")
    data = bytearray(so.read_bytes())
    data[cubin.offset:cubin.offset + 64] = b"\xff" * 64  # the cubin's ELF header
    so.write_bytes(bytes(data))
    with fatbin.HostBinary.open(so) as binary, pytest.raises(CorruptBinaryError,
                       match=rf"^{so}: entry {cubin.index} \({cubin.sm}\): cubin is not a "
                             "readable ELF"):
        binary.kernels(binary.entries[cubin.index])


def test_a_device_function_is_not_a_kernel() -> None:
    so = compile_cached("device-fn", DATA / "device_fn.cu", gencode("compute_90:sm_90"))
    with fatbin.HostBinary.open(so) as binary:
        cubin = next(e for e in binary.entries if e.kind == "elf" and binary.kernels(e))
        assert binary.kernels(cubin) == ("_Z10uses_twicePfi",)  # not its `twice` helper
        assert [e.container for e in binary.entries] == [0, 1]  # numbered from 0


def test_a_closed_binary_reads_nothing(matrix: dict[str, Path]) -> None:
    with fatbin.HostBinary.open(matrix["plain"]) as binary:
        first = binary.entries[0]
        handle = binary._file
    assert handle is not None and handle.closed
    assert binary._file is None and binary._map is None
    with pytest.raises(AssertionError, match=r"^binary is closed$"):
        binary.payload(first)
    binary.close()  # twice is harmless


def _patch_section_header(path: Path, name: str, offset: int, fmt: str, value: int,
                          payload: tuple[int, int] | None = None) -> None:
    """Overwrite one field of a section header: of the host ELF, or (`payload`: the
    cubin's file offset and size) of a cubin stored uncompressed inside it."""
    from elftools.elf.elffile import ELFFile

    data = bytearray(path.read_bytes())
    base, size = payload or (0, len(data))
    elf = ELFFile(io.BytesIO(bytes(data[base:base + size])))
    for index, section in enumerate(elf.iter_sections()):
        if section.name == name:
            where = base + elf["e_shoff"] + index * elf["e_shentsize"] + offset
            struct.pack_into(fmt, data, where, value)
            path.write_bytes(bytes(data))
            return
    raise AssertionError(f"no {name}")


def test_a_nobits_fatbin_section_holds_no_entries(tmp_path: Path,
                                                  matrix: dict[str, Path]) -> None:
    so = _elf_copy(matrix["plain"], tmp_path / "nobits.so")
    _patch_section_header(so, ".nv_fatbin", 4, "<I", 8)  # sh_type = SHT_NOBITS
    with fatbin.HostBinary.open(so) as binary:
        assert binary.entries == []


def test_a_cubin_whose_symbols_name_no_string_table(tmp_path: Path,
                                                    matrix: dict[str, Path]) -> None:
    so = _elf_copy(matrix["plain"], tmp_path / "strtab.so")
    with fatbin.HostBinary.open(so) as binary:
        cubin = next(e for e in binary.entries if e.kind == "elf" and binary.kernels(e))
    original = so.read_bytes()
    _patch_section_header(so, ".symtab", 40, "<I", 0, (cubin.offset, cubin.size))  # sh_link
    with fatbin.HostBinary.open(so) as binary, pytest.raises(
            CorruptBinaryError, match=r"cubin is not a readable ELF: .symtab names section 0 "
                                      r"as its string table, which is not one$"):
        binary.kernels(binary.entries[cubin.index])
    so.write_bytes(original)
    _patch_section_header(so, ".symtab", 4, "<I", 1, (cubin.offset, cubin.size))  # PROGBITS
    with fatbin.HostBinary.open(so) as binary, pytest.raises(
            CorruptBinaryError, match=r"^.*strtab.so: entry \d+ \(sm_80\): cubin is not a "
                                      r"readable ELF: .symtab is not a symbol table$"):
        binary.kernels(binary.entries[cubin.index])


def test_a_compressed_entry_that_does_not_decompress(tmp_path: Path,
                                                     matrix: dict[str, Path]) -> None:
    so = _elf_copy(matrix["zstd"], tmp_path / "zstd.so")
    with fatbin.HostBinary.open(so) as binary:
        packed = next(e for e in binary.entries if e.compression == "zstd")
    data = bytearray(so.read_bytes())
    data[packed.offset:packed.offset + 8] = b"\xff" * 8  # the zstd frame's magic and header
    so.write_bytes(bytes(data))
    with fatbin.HostBinary.open(so) as binary, pytest.raises(
            CorruptBinaryError, match=rf"^{so}: entry {packed.index} \({packed.sm}\) does not "
                                      r"decompress: "):
        binary.payload(binary.entries[packed.index])
