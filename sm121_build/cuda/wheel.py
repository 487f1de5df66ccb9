"""Wheels, read and written in one place for `audit` and `aot` alike.

The rule for a wheel's members: a wheel is refused whole (`CorruptBinaryError`, one line
naming it) when its file name is not one pip takes (`wheel_name`: PEP 427, as
`packaging.utils.parse_wheel_filename` parses it; `x!y-1.0-py3-none-any.whl`), a member has
no name, a name with a control character or a backslash, a
name that leaves the archive (absolute, `..`), or a name that another member also has once
spelled plainly (`pkg/a.so`, `pkg/./a.so`, `pkg//a.so`, the folder `pkg/a.so/`); or when two
`.dist-info` folders at its top each hold a RECORD: pip would not install such a wheel the
same way twice, two members would be extracted onto one path, and a decoy RECORD could be
the one updated.  Read once, before anything is extracted or compiled.  A member that is to
be held whole (`require_honest_size`) and what a reader writes out of one wheel in all
(`core/inputs.Inflated`) must not pass `MAX_RATIO` times the bytes they come from.

Reading: the shared objects with device code (`elf_members`, a member read only when its
first bytes are an ELF header whose declared extent holds its size), any member in windows
(`member_chunks`); the RECORD (`read_record`, `require_recorded` before a member is
rewritten, `record_text` after); writing: `copy_wheel`.
"""

from __future__ import annotations

import base64
import contextlib
import csv
import hashlib
import io
import os
import posixpath
import re
import struct
import zipfile
import zlib
from collections.abc import Generator, Iterator, Mapping
from pathlib import Path
from typing import BinaryIO, NamedTuple

from isal import isal_zlib
from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import Version

from sm121_build.core.console import CONTROL
from sm121_build.core.errors import CorruptBinaryError
from sm121_build.core.inputs import MAX_RATIO, RATIO_FLOOR, open_file
from sm121_build.cuda.elf import MAGIC as ELF_MAGIC
from sm121_build.cuda.elf import declared_extent, section_extent, section_table_at


def member_name(name: str) -> str:
    """A member's name as one plain path (`pkg/./a.so` is `pkg/a.so`), its folder marker
    kept."""
    plain = posixpath.normpath(name)
    return plain + "/" if name.endswith("/") and plain != "." else plain


def require_honest_size(info: zipfile.ZipInfo, source: Path) -> None:
    """Before a member is held whole (aot rewrites it in memory; audit writes it out): one
    that inflates more than `MAX_RATIO` times its stored bytes, past the floor, is refused
    (a zip bomb: a 3 MB wheel that would hold 3 GB)."""
    if info.file_size > RATIO_FLOOR and \
            info.file_size > MAX_RATIO * max(info.compress_size, 1):
        raise CorruptBinaryError(
            f"{source}: {info.filename}: inflates to {info.file_size} bytes from "
            f"{info.compress_size} (more than {MAX_RATIO}x: a zip bomb); refused")


def record_of(infos: list[zipfile.ZipInfo], source: Path) -> str | None:
    """The name of the wheel's RECORD: the one `*.dist-info/RECORD` at its top (PEP 427),
    None when it has none; two at its top are refused (a RECORD deeper in the wheel is a
    file like any other, never the wheel's)."""
    top = [i.filename for i in infos if re.fullmatch(r"[^/]+\.dist-info/RECORD", i.filename)]
    if len(top) > 1:
        raise CorruptBinaryError(f"{source}: holds two .dist-info folders ({top[0]}, "
                                 f"{top[1]}): not a wheel pip would install the same way "
                                 "twice; refused")
    return top[0] if top else None


class WheelName(NamedTuple):
    """What a wheel's file name says: its distribution (PEP 503's normal form,
    `nvidia-cublas`) and version (an epoch `1!2.0` included)."""

    distribution: str
    version: Version


def wheel_name(path: Path) -> WheelName | None:
    """The one reading of a wheel's file name (`packaging.utils.parse_wheel_filename`, as
    pip reads it): None for a file not named `*.whl` (a zip by another name names no
    distribution); a `*.whl` whose name pip would not take is refused in one line."""
    if not path.name.endswith(".whl"):
        return None
    try:
        name, version, _build, _tags = parse_wheel_filename(path.name)
    except InvalidWheelFilename as exc:
        raise CorruptBinaryError(
            f"{path}: not a wheel's file name ({exc}; PEP 427: "
            "NAME-VERSION[-BUILD]-PYTHON-ABI-PLATFORM.whl): not a wheel pip would install; "
            "refused") from None
    return WheelName(str(name), version)


def checked_members(wheel: zipfile.ZipFile, source: Path) -> list[zipfile.ZipInfo]:
    """The wheel's members, in its order, once the one rule holds for its name and every
    one of its members."""
    wheel_name(source)
    seen: set[str] = set()
    infos = wheel.infolist()
    for info in infos:
        name = info.filename
        why = ""
        if not name:
            why = "a member with no name (a damaged archive)"
        elif "\\" in name or CONTROL.search(name):  # the control characters console escapes
            why = f"a member named {name!r}, with a control character or a backslash"
        else:
            plain = member_name(name)
            if plain.startswith("/") or plain == ".." or plain.startswith("../"):
                why = f"a member {name!r} whose path leaves the archive"
            elif plain.rstrip("/") in seen:  # `pkg/a.so` and the folder `pkg/a.so/` too
                why = f"two members named {plain.rstrip('/')}" + (
                    f" (one spelled {name})" if plain.rstrip("/") != name else "")
            seen.add(plain.rstrip("/"))
        if why:
            raise CorruptBinaryError(f"{source}: holds {why}: not a wheel pip would install "
                                     "the same way twice; refused")
    record_of(infos, source)
    return infos


HEAD_WINDOW = 1 << 16  # a member's first bytes: the ELF header and program headers
MAX_RECORD = 64 << 20  # a wheel's RECORD: torch's is ~2 MB
_DIST_INFO = re.compile(r"(?:^|/)([^/]+?)-[^/-]+\.dist-info/RECORD\Z")


def is_record(path: str) -> bool:
    """A `NAME-VERSION.dist-info/RECORD` file."""
    return record_owner(path) is not None


def record_owner(path: str) -> str | None:
    """The distribution name a RECORD's `.dist-info` folder gives, as written there."""
    found = _DIST_INFO.search(path)
    return found.group(1) if found else None


def elf_members(wheel: zipfile.ZipFile, source: Path) -> Iterator[tuple[zipfile.ZipInfo, bytes]]:
    """The shared objects of a wheel that are ELF files, with their bytes.  A wheel with a
    member of no name or two members of one name is refused (pip would not install it the
    same way twice); a member is read only when its first bytes are an ELF header whose
    declared extent holds its size."""
    for info in checked_members(wheel, source):
        if info.is_dir() or not (info.filename.endswith(".so") or ".so." in info.filename):
            continue
        data = elf_member(wheel, info, source)
        if data is not None:
            yield info, data


@contextlib.contextmanager
def wheel_errors(source: Path) -> Iterator[None]:
    """Whatever a damaged zip raises while it is read (a bad header, CRC or deflate stream,
    a member zipfile cannot read) as one `CorruptBinaryError` naming the wheel."""
    try:
        yield
    except CorruptBinaryError as exc:
        if str(source) in str(exc):
            raise
        raise CorruptBinaryError(f"{source}: {exc}") from None
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError,
            ValueError, OSError) as exc:
        raise CorruptBinaryError(f"{source}: damaged wheel ({type(exc).__name__}: "
                                 f"{str(exc)[:80]})") from None


def elf_member(wheel: zipfile.ZipFile, info: zipfile.ZipInfo, source: Path) -> bytes | None:
    """A member's bytes when it is an ELF file whose headers account for its size and name
    a `.nv_fatbin` section; None when it is no ELF file (read no further than its first
    bytes) or has no device code (its section table and names streamed through a window,
    never held whole).  Said as `WHEEL!MEMBER`: never split again (a wheel's version may
    hold an epoch's `!`, a member's name any `!`)."""
    name = f"{source.name}!{info.filename}"
    with wheel.open(info) as member:
        head = member.read(HEAD_WINDOW)
    if head[:4] != ELF_MAGIC:
        return None
    extent = declared_extent(head)  # None: not judged from the first bytes
    if extent is not None and info.file_size > extent:
        raise CorruptBinaryError(
            f"{name}: {info.file_size} bytes, more than the "
            f"{extent} its ELF headers account for; refused (not read)")
    if not streamed_has_fatbin(wheel, info, head, name):
        return None
    require_honest_size(info, source)  # before it is held whole
    with wheel.open(info) as member:
        data = member.read(info.file_size + 1)
    if len(data) != info.file_size:
        raise CorruptBinaryError(f"{name}: {len(data)} bytes, not the {info.file_size} the "
                                 "wheel declares")
    return data


MAX_SECTION_TABLE = 64 << 20  # a section header table, or its name table, held while streamed


def streamed_has_fatbin(wheel: zipfile.ZipFile, info: zipfile.ZipInfo, head: bytes,
                        name: str) -> bool:
    """Whether a member's section names include `.nv_fatbin`, reading it in windows: once
    for its section header table, once more for the name table (`cuda/elf` reads both)."""
    found = section_table_at(head)
    if found is None:
        return True  # another layout: read_layout decides, on the whole bytes
    shoff, size, shstrndx = found
    table = stream_range(wheel, info, shoff, size, name)
    names = stream_range(wheel, info, *section_extent(table, shstrndx), name)
    return b"\0.nv_fatbin\0" in b"\0" + names


def stream_range(wheel: zipfile.ZipFile, info: zipfile.ZipInfo, offset: int, size: int,
                  name: str) -> bytes:
    """Bytes [offset, offset + size) of a member, streamed (a window at a time)."""
    if size > MAX_SECTION_TABLE or offset + size > info.file_size:
        raise CorruptBinaryError(f"{name}: a section table of {size} bytes at {offset:#x} "
                                 f"does not fit its {info.file_size} bytes")
    kept = bytearray()
    at = 0
    with wheel.open(info) as member:
        while len(kept) < size:
            chunk = member.read(1 << 20)
            if not chunk:
                raise CorruptBinaryError(f"{name}: cut short")
            lo, hi = max(offset - at, 0), min(offset + size - at, len(chunk))
            if lo < hi:
                kept += chunk[lo:hi]
            at += len(chunk)
    return bytes(kept)


def read_record(wheel: zipfile.ZipFile, infos: list[zipfile.ZipInfo],
                 where: Path) -> tuple[str, list[list[str]]]:
    """The RECORD member's name and its rows (CSV, as PEP 376 writes it), read once."""
    record = record_of(infos, where)  # the one at the wheel's top: never a decoy deeper
    if record is None:
        raise CorruptBinaryError(f"{where}: no .dist-info/RECORD: not a wheel")
    info = wheel.getinfo(record)
    if info.file_size > MAX_RECORD:
        raise CorruptBinaryError(f"{where}: its RECORD holds {info.file_size} "
                                 f"bytes, more than {MAX_RECORD}")
    try:
        rows = list(csv.reader(io.StringIO(wheel.read(info).decode("utf-8"), newline="")))
    except (UnicodeDecodeError, csv.Error) as exc:
        raise CorruptBinaryError(f"{where}: its RECORD is not CSV: {exc}") from None
    return record, rows


def require_recorded(rows: list[list[str]], members: Mapping[str, bytes],
                     source: Path) -> None:
    """Before any compile: each member to rewrite (name -> its bytes) has a RECORD row, and
    where the row records a sha256, it is the member's (a member swapped after the wheel
    was made would otherwise come back with a fresh, valid hash)."""
    recorded = {row[0]: row[1:] for row in rows if row}
    for member, data in members.items():
        if member not in recorded:
            raise CorruptBinaryError(f"{source}: its RECORD has no row for {member}")
        hashed, size = [*recorded[member], "", ""][:2]
        algorithm, _, digest = hashed.partition("=")
        if algorithm not in ("sha256", "sha384", "sha512"):  # as pip checks a wheel
            raise CorruptBinaryError(f"{source}: its RECORD gives {member} no sha256 (or "
                                     f"stronger) hash ({hashed or 'none'!r}); refused")
        if digest != base64.urlsafe_b64encode(
                hashlib.new(algorithm, data).digest()).rstrip(b"=").decode() or (
                    size and size != str(len(data))):
            raise CorruptBinaryError(f"{source}: its RECORD's {algorithm} of {member} is not "
                                     "the member's (changed after the wheel was made); "
                                     "refused")


def record_text(rows: list[list[str]], replaced: dict[str, bytes]) -> bytes:
    """The RECORD's new text: the rows of the replaced members with their new sha256 and
    size, every other row as it was (each replaced member has a row: checked before its
    compile)."""
    new = []
    for row in rows:
        if row and row[0] in replaced:
            data = replaced[row[0]]
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            row = [row[0], f"sha256={digest.decode()}", str(len(data))]
        new.append(row)
    text = io.StringIO(newline="")
    csv.writer(text, lineterminator="\n").writerows(new)
    return text.getvalue().encode()


def copy_wheel(wheel: zipfile.ZipFile, infos: list[zipfile.ZipInfo],
               replaced: dict[str, bytes], record: tuple[str, bytes], out: BinaryIO) -> None:
    """The wheel again into `out`: the replaced members' new bytes, the new RECORD, every
    other member byte for byte (streamed)."""
    with zipfile.ZipFile(out, "w") as copy:
        for info in infos:
            if info.filename == record[0]:
                copy.writestr(info, record[1])
            elif info.filename in replaced:
                copy.writestr(info, replaced[info.filename],
                              compress_type=zipfile.ZIP_DEFLATED)
            else:
                with wheel.open(info) as member, copy.open(info, "w") as to:
                    while chunk := member.read(1 << 20):
                        to.write(chunk)


_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length
_CHUNK = 4 << 20


def member_chunks(archive: Path, wheel: zipfile.ZipFile,
                   info: zipfile.ZipInfo) -> Generator[bytes, None, None]:
    """A member's bytes in windows: deflated ones through ISA-L's inflate (twice zlib's
    speed on a wheel's `.so` files), size and CRC-32 checked as zipfile checks them; stored
    ones, or what zipfile refuses in its own words (deflate64, encrypted), through the
    wheel's `ZipFile` (its central directory read once, not once a member)."""
    if info.compress_type != zipfile.ZIP_DEFLATED or info.flag_bits & 1:
        with wheel.open(info) as source:
            while chunk := source.read(_CHUNK):
                yield chunk
        return
    with open_file(archive, "wheel") as handle:
        handle.seek(info.header_offset)
        signature, name_length, extra_length = _LOCAL_HEADER.unpack(
            handle.read(_LOCAL_HEADER.size).ljust(_LOCAL_HEADER.size, b"\0"))
        if signature != b"PK\x03\x04":
            raise zipfile.BadZipFile(f"{info.filename}: no local file header")
        handle.seek(name_length + extra_length, os.SEEK_CUR)
        inflater = isal_zlib.decompressobj(-15)
        left, crc, size = info.compress_size, 0, 0
        while left:
            chunk = handle.read(min(left, _CHUNK))
            if not chunk:
                raise zipfile.BadZipFile(f"{info.filename}: cut short")
            left -= len(chunk)
            data = inflater.decompress(chunk, _CHUNK)
            while data:
                crc, size = isal_zlib.crc32(data, crc), size + len(data)
                if size > info.file_size:
                    raise zipfile.BadZipFile(f"{info.filename}: inflates past the "
                                             f"{info.file_size} bytes it declares")
                yield data
                data = inflater.decompress(inflater.unconsumed_tail, _CHUNK) \
                    if inflater.unconsumed_tail else b""
        data = inflater.flush()
        crc, size = isal_zlib.crc32(data, crc), size + len(data)
        yield data
        if (crc, size) != (info.CRC, info.file_size):
            raise zipfile.BadZipFile(f"{info.filename}: bad CRC-32 or size (damaged member)")
