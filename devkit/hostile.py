"""Hostile inputs made to cost more than their size (issue #54's work bounds): built here for
the tests of the bounds (tests/unit/test_work_bounds.py) and for the whole-run fuzzer's
worlds (devkit/worlds.py)."""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

from sm121_build.cuda.fatbin import CONTAINER_HEADER as CONTAINER
from sm121_build.cuda.fatbin import CONTAINER_MAGIC
from sm121_build.cuda.fatbin import ENTRY_HEADER as ENTRY  # 64 bytes


def elf_with(sections: list[tuple[str, bytes]]) -> bytes:
    """A minimal ELF64 shared object: each (name, bytes) an allocated PROGBITS section,
    then `.shstrtab` and the section header table."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n, _ in sections) + b".shstrtab\0"
    body = bytearray(64)
    rows = [bytes(64)]
    name_at = 1
    for name, data in sections:
        body += bytes(-len(body) % 16)
        rows.append(struct.pack("<IIQQQQIIQQ", name_at, 1, 0x2, 0, len(body), len(data),
                                0, 0, 16, 0))
        body += data
        name_at += len(name) + 1
    rows.append(struct.pack("<IIQQQQIIQQ", name_at, 3, 0, 0, len(body), len(names), 0, 0,
                            1, 0))
    body += names + bytes(-(len(body) + len(names)) % 8)
    shoff = len(body)
    body += b"".join(rows)
    body[:64] = (b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
                 + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, shoff, 0, 64, 56, 0, 64,
                               len(rows), len(rows) - 1))
    return bytes(body)


def nested_rodata(n: int) -> bytes:
    """`.rodata` of `n` chained PTX entries, each payload a container header claiming the
    rest of the section, then an entry of no known kind: every candidate container walks
    every later entry before it fails."""
    length = n * (ENTRY.size + CONTAINER.size) + ENTRY.size
    out = bytearray()
    for _ in range(n):
        out += ENTRY.pack(1, 0x101, ENTRY.size, CONTAINER.size, 0, 0, 0, 8, 80, 0, 0,
                           0x11, 0, 0)
        body = len(out) + CONTAINER.size
        out += CONTAINER.pack(CONTAINER_MAGIC, 1, CONTAINER.size, length - body)
    out += ENTRY.pack(7, 0, ENTRY.size, 0, 0, 0, 0, 0, 80, 0, 0, 0, 0, 0)
    return elf_with([(".rodata", bytes(out))])


def stored_wheel(path: Path, n: int) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as wheel:
        for i in range(n):
            wheel.writestr(f"pkg/m{i:06d}.so", b"not an ELF file")
    return path
