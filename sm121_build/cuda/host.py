"""The host side of a shared object, as the dynamic loader sees it: platform, the libraries
it needs, what it exports, and how many initialisers run when it loads."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from sm121_build.core.errors import CorruptBinaryError
from sm121_build.core.inputs import open_file
from sm121_build.cuda.dynsym import DynamicSymbols, dynamic_symbols
from sm121_build.cuda.elf import MAGIC as ELF_MAGIC
from sm121_build.cuda.elf import Elf, ElfError, name
from sm121_build.cuda.machines import MACHINES

SHT_DYNAMIC = 6
DT_NEEDED, DT_INIT, DT_INIT_ARRAYSZ, DT_PREINIT_ARRAYSZ = 1, 12, 27, 32


@dataclass(frozen=True)
class HostSide:
    ident: str  # "ELF64 x86_64"
    symbols: DynamicSymbols
    needed: frozenset[str]
    initialisers: int  # DT_INIT, and the DT_INIT_ARRAY / DT_PREINIT_ARRAY entries


def host_side(path: Path) -> HostSide:
    try:
        with open_file(path) as handle, \
                mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != ELF_MAGIC or len(data) < 64:
                raise CorruptBinaryError(f"{path.name}: not an ELF file")
            order = "<" if data[5] == 1 else ">"
            machine = struct.unpack_from(order + "H", data, 18)[0]
            ident = f"ELF{32 if data[4] == 1 else 64} " \
                    f"{MACHINES.get(machine, f'machine {machine}')}"
            elf = Elf.read(data)
            needed, initialisers = _dynamic(elf, 8 if data[4] == 2 else 4, order)
    except (OSError, ValueError, struct.error, ElfError) as exc:
        raise CorruptBinaryError(f"{path.name}: not a readable ELF file: {exc}") from None
    return HostSide(ident, dynamic_symbols(path), needed, initialisers)


def _dynamic(elf: Elf, word: int, order: str) -> tuple[frozenset[str], int]:
    section = next((s for s in elf.sections if s.type == SHT_DYNAMIC), None)
    if section is None:
        return frozenset(), 0
    strings = elf.section_data(elf.at(section.link))
    fmt = order + ("qQ" if word == 8 else "iI")
    needed: set[str] = set()
    initialisers = 0
    raw = elf.section_data(section)
    for tag, value in struct.iter_unpack(fmt, raw[:len(raw) // (2 * word) * 2 * word]):
        if tag == DT_NEEDED:
            needed.add(name(strings, value))
        elif tag == DT_INIT:
            initialisers += 1
        elif tag in (DT_INIT_ARRAYSZ, DT_PREINIT_ARRAYSZ):
            initialisers += value // word
        elif tag == 0:
            break
    return frozenset(needed), initialisers
