"""A shared object's dynamic symbols (`.dynsym`, what `nm -D` shows) and C++ names as
`c++filt` shows them: what host-code verification compares between a built file and its
stock one (`cuda/host.py`, `verify/checks.py`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from sm121_build.core.errors import CorruptBinaryError
from sm121_build.core.inputs import open_file
from sm121_build.cuda.elf import MAGIC as ELF_MAGIC
from sm121_build.cuda.elf import Elf, ElfError
from sm121_build.cuda.elf import name as symbol_name

# ELF symbol fields (the gABI): bindings that take part in dynamic linking, and the
# visibilities that export.  STB_GNU_UNIQUE (template static data, as in torch's libraries)
# is what some readers call STB_LOOS, the first OS-specific binding.
_STB_GLOBAL, _STB_WEAK, _STB_GNU_UNIQUE = 1, 2, 10
_SHN_UNDEF = 0
_STV_EXPORTING = (0, 3)  # STV_DEFAULT, STV_PROTECTED


@dataclass(frozen=True)
class DynamicSymbols:
    """A shared object's dynamic symbol table: what it needs and what it exports."""

    undefined: frozenset[str]  # STB_GLOBAL undefined (weak ones may stay unresolved)
    exported: frozenset[str]  # defined, global or weak, default or protected visibility


def dynamic_symbols(path: Path) -> DynamicSymbols:
    """`.dynsym` (what `nm -D` shows), unpacked with `struct` from the raw section: torch's
    libraries hold ~10^5 symbols, which pyelftools read one at a time (~1.8 s for
    libtorch_cpu.so)."""
    handle = open_file(path)  # closed below
    undefined: set[str] = set()
    exported: set[str] = set()
    try:
        with handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] == ELF_MAGIC and data[5] == 2:  # EI_DATA: ELFDATA2MSB
                raise CorruptBinaryError(f"{path}: a big-endian ELF file (no CUDA host is)")
            elf = Elf.read(data)
            table = elf.section(".dynsym")
            if table is None:
                return DynamicSymbols(frozenset(), frozenset())
            strings, rows = elf.symbol_rows(table)
            for at, info, other, shndx, _size in rows:
                bind = info >> 4
                if bind not in (_STB_GLOBAL, _STB_WEAK, _STB_GNU_UNIQUE) or not at:
                    continue
                if shndx == _SHN_UNDEF:
                    if bind == _STB_GLOBAL:
                        undefined.add(symbol_name(strings, at))
                elif other & 3 in _STV_EXPORTING:
                    exported.add(symbol_name(strings, at))
    except (ElfError, ValueError, OSError) as exc:  # ValueError: mmap of an empty file
        raise CorruptBinaryError(f"{path}: not a readable ELF file: {exc}") from None
    return DynamicSymbols(frozenset(undefined), frozenset(exported))


@cache
def _cxa_demangle() -> tuple[Callable[..., int | None], ctypes.CDLL] | None:
    """libstdc++'s `__cxa_demangle` and libc (whose `free` releases its result), or None
    where the C++ runtime cannot be loaded."""
    try:
        cxx = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = cxx.__cxa_demangle
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_void_p
    function.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.POINTER(ctypes.c_int)]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free.restype = None
    return function, libc


# A mangled name's back-references (`S_`, `S0_` ... substitutions, `T_` ... template
# parameters): each can repeat everything before it, so a name of 300 bytes with 50 of them
# demangles to hundreds of MB (the C++ runtime builds it whole).  Real names have few (vLLM
# 0.22.0's 1,837 added kernels: at most 7, demangled at most 2.7x their length).
_BACK_REFERENCE = re.compile(r"S[0-9A-Z]*_|T[0-9]*_")
MAX_BACK_REFERENCES = 24  # at most 2**12 times the name's length, whatever the name
MAX_MANGLED = 4096


def demangle(symbol: str) -> str:
    """A C++ symbol as `c++filt` shows it (`_ZN3c104cuda12device_countEv` ->
    `c10::cuda::device_count()`); a C name, a name the C++ runtime cannot demangle, or any
    name where no C++ runtime can be loaded, unchanged.  A name from outside whose
    demangled form could be unbounded (longer than `MAX_MANGLED`, or more than
    `MAX_BACK_REFERENCES` back-references) is shown mangled: it is never demangled."""
    found = _cxa_demangle() if symbol.startswith("_Z") else None
    if found is None or len(symbol) > MAX_MANGLED or \
            len(_BACK_REFERENCE.findall(symbol)) > MAX_BACK_REFERENCES:
        return symbol
    function, libc = found
    result = function(symbol.encode(), None, None, None)  # NULL: not demangled
    if not result:
        return symbol
    try:
        return ctypes.string_at(result).decode()
    finally:
        libc.free(result)
