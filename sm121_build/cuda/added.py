"""The cubins a file gained over its stock file (what `aot` added), and what each defines.

An aot'd file keeps every stock entry byte for byte (`verify/aot_check.py`) and adds cubins
after them; so an added cubin is an ELF entry of the new file whose stored bytes no ELF entry
of the stock file has.  Found by content, not by position: the reader needs no layout of the
rewrite, and a file made any other way (a rebuild that kept some cubins) is read alike.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sm121_build.core.inputs import inflating
from sm121_build.cuda.compat import Target, cubin_loads
from sm121_build.cuda.elf import Elf, ElfError
from sm121_build.cuda.fatbin import Entry, HostBinary, cubin_kernels

# SASS of sm_70 and later: 16-byte instructions, the opcode in the low 12 bits (BPT.TRAP,
# EXIT, NOP as nvcc 13.0 writes them for sm_121, tests/unit/test_prove.py)
_BPT, _EXIT, _NOP = 0x95C, 0x94D, 0x918
STUB_INSTRUCTIONS = 16  # a trap stub's instructions besides NOPs, at most
_TEXT = ".text."


def trap_stubs(cubin: bytes, arch: int) -> dict[str, str]:
    """The kernels of a cubin that can only trap, each with the evidence: code that holds a
    trap (BPT) and no EXIT, in at most `STUB_INSTRUCTIONS` instructions besides NOPs (what
    `#if __CUDA_ARCH__ ... #else __trap()` compiles to for a GPU it was not written for).
    No launch of one can end but in a trap.  {} before sm_70 (another encoding) or for a
    cubin whose sections cannot be read."""
    if arch < 70:
        return {}
    found = {}
    try:
        elf = Elf.read(cubin)
        for section in elf.sections:
            if not section.name.startswith(_TEXT) or not 0 < section.size <= 16 * 1024:
                continue
            code = elf.section_data(section)
            ops = [int.from_bytes(code[at:at + 2], "little") & 0xFFF
                   for at in range(0, len(code) - 15, 16)]
            ops = [op for op in ops if op != _NOP]
            if _BPT in ops and _EXIT not in ops and len(ops) <= STUB_INSTRUCTIONS:
                found[section.name[len(_TEXT):]] = (
                    f"a trap stub: its SASS (sm_{arch}) is {len(ops)} instruction(s) besides "
                    "NOPs, a trap (BPT) and no EXIT: any launch of it traps")
    except ElfError:
        return {}
    return found


@dataclass(frozen=True)
class AddedCubin:
    """One added cubin: its number among the file's added cubins (from 1), its entry and
    the kernels (STO_CUDA_ENTRY symbols) it defines, in symbol-table order."""

    number: int
    entry: Entry
    kernels: tuple[str, ...]

    @property
    def sm(self) -> str:
        return self.entry.sm

    def loads_on(self, gpu: Target) -> bool:
        """Whether the GPU loads this cubin natively (CUDA's rule: same major, minor at most
        the GPU's; an `a` cubin on its own arch only)."""
        return cubin_loads(self.entry.arch, self.entry.variant, gpu)


# what the caller does with each added cubin's bytes (decompressed) while they are held
Keep = Callable[[AddedCubin, bytes], None]


def _stored(binary: HostBinary, entry: Entry) -> bytes:
    data = binary.mapped
    assert data is not None, "binary is closed"
    return bytes(data[entry.offset:entry.offset + entry.stored_size])


def _stock_cubins(stock: HostBinary) -> set[tuple[int, bytes]]:
    """(stored size, digest) of every cubin entry of the stock file."""
    return {(e.stored_size, hashlib.blake2b(_stored(stock, e), digest_size=20).digest())
            for e in stock.entries if e.kind == "elf"}


def added_entries(stock: HostBinary, new: HostBinary) -> list[Entry]:
    """The cubin entries of `new` that `stock` does not have, in the new file's order (an
    entry the stock file has twice and the new file three times counts as kept: aot never
    copies a stock entry)."""
    known = _stock_cubins(stock)
    sizes = {size for size, _digest in known}
    added = []
    for entry in new.entries:
        if entry.kind != "elf":
            continue
        if entry.stored_size in sizes and (entry.stored_size, hashlib.blake2b(
                _stored(new, entry), digest_size=20).digest()) in known:
            continue
        added.append(entry)
    return added


def read_added(stock: Path, new: Path, keep: Keep | None = None) -> tuple[AddedCubin, ...]:
    """Every cubin `new` gained over `stock`, with its kernels; `keep` gets each one's bytes
    (decompressed, held within the run's inflate budget).  CorruptBinaryError (or
    InputRefused) when either file cannot be read."""
    with HostBinary.open(stock) as before, HostBinary.open(new) as after:
        found = []
        for number, entry in enumerate(added_entries(before, after), 1):
            with inflating(entry.size):
                payload = after.payload(entry)
                cubin = AddedCubin(number, entry, cubin_kernels(
                    payload, f"{new}: entry {entry.index} ({entry.sm})"))
                if keep is not None:
                    keep(cubin, payload)
                del payload
            found.append(cubin)
    return tuple(found)
