"""What an aot'd file must be against the stock file it came from.

- every byte outside `.nv_fatbin` equals the stock's as the loader and the linkers see it
  (at its address: where the section moved to a new segment its old pages are cut out and
  later offsets shift), but for the wrappers' relocation addends, the ELF header's program
  and section header fields and the section's own header row: host code cannot have
  changed;
- each registered container holds its stock entries byte for byte, in their order, and
  after them only cubins;
- each container the GPU could only JIT (or not load) before, and that had PTX it can JIT,
  now has a cubin the GPU loads, which defines every kernel of that PTX.
"""

from __future__ import annotations

from sm121_build.core.console import shown
from sm121_build.core.errors import CorruptBinaryError
from sm121_build.cuda.binary import has_native_cubin, jit_ptx
from sm121_build.cuda.compat import Target
from sm121_build.cuda.elf import SHT_NOBITS
from sm121_build.cuda.fatbin import Entry, cubin_kernels, entry_payload, ptx_kernels
from sm121_build.cuda.fatbin_rewrite import (
    PT_LOAD,
    PT_PHDR,
    SHF_ALLOC,
    Layout,
    program_headers,
    read_layout,
    section_headers,
)


def check_aot(stock: bytes, new: bytes, target: Target, where: str) -> list[str]:
    """Problem lines; none when the file is what `aot` promises."""
    try:
        before, after = read_layout(stock, where), read_layout(new, where)
    except CorruptBinaryError as exc:
        return [str(exc)]
    problems = _outside_fatbin(stock, new, before)
    if len(before.registrations) != len(after.registrations):
        return [*problems, f"{where}: {len(after.registrations)} fatbin registrations, the "
                           f"stock file has {len(before.registrations)}"]
    for old, now in zip(before.registrations, after.registrations, strict=True):
        was, got = before.containers[old.container], after.containers[now.container]
        kept = got.entries[:len(was.entries)]
        if kept != was.entries:
            problems.append(f"{where}: container {old.container}'s stock entries changed")
            continue
        added = got.described[len(was.entries):]
        if any(e.kind != "elf" for e in added):
            problems.append(f"{where}: container {old.container} gained an entry that is "
                            "not a cubin")
        ptx = jit_ptx(was.described, target)
        if ptx and not has_native_cubin(got.described, target):
            problems.append(f"{where}: container {old.container} still has no cubin "
                            f"{target} loads")
        elif ptx and added:
            problems += _kernels_covered((stock, ptx), (new, added), where, old.container)
    return problems


def _kernels_covered(stock: tuple[bytes, Entry], new: tuple[bytes, tuple[Entry, ...]], where: str,
                     container: int) -> list[str]:
    """The added cubins define every kernel of the PTX they were compiled from: a ptxas that
    wrote some other code (a cubin of unrelated kernels) is caught here, not on the GPU."""
    try:
        wanted = set(ptx_kernels(entry_payload(stock[0], stock[1], where)))
        made: set[str] = set()
        for entry in new[1]:
            made.update(cubin_kernels(entry_payload(new[0], entry, where), where))
    except CorruptBinaryError as exc:
        return [str(exc)]
    missing = sorted(wanted - made)
    if missing:
        return [f"{where}: container {container}'s added cubin lacks {len(missing)} of the "
                f"PTX's {len(wanted)} kernel(s) (first: {shown(missing[0])})"]
    return []


def _outside_fatbin(stock: bytes, new: bytes, layout: Layout) -> list[str]:
    """What must not have changed, compared as the loader and the linkers see it (the file
    offsets after the section move when its old pages are cut out):
    - every byte any stock segment maps, at its address, but the old `.nv_fatbin` range and
      the fatbin pointers' addends and in-place values;
    - every other program header (type, flags, address, sizes, alignment);
    - every section header but its file offset (and `.nv_fatbin`'s place), every section
      that is not mapped (symbols, strings, notes), the ELF header but e_phoff/e_shoff/e_phnum.
    """
    try:
        was, now = program_headers(stock), program_headers(new)
        (_, old_sections), (_, new_sections) = section_headers(stock), section_headers(new)
    except CorruptBinaryError as exc:
        return [str(exc)]
    problems = []
    header = [(0, 0x20), (0x30, 0x38), (0x3A, 0x40)]
    if any(stock[a:b] != new[a:b] for a, b in header):
        problems.append("the ELF header changed")
    skip = [(layout.address, layout.address + layout.size)]
    fields = [(0x20, 16), (0x38, 2)]  # e_phoff, e_shoff, e_phnum (the first page is mapped)
    fields += [(r.addend_at, 8) for r in layout.registrations]
    fields += [(r.pointer_at, 8) for r in layout.registrations]
    for at, size in fields:
        address = _address_of(was, at)
        if address is not None:
            skip.append((address, address + size))
    for row in was:
        if row[0] == PT_LOAD:
            problems += _mapped_equal(stock, new, row, now, sorted(skip))
    others = [r for r in was if r[0] != PT_LOAD]
    kept = [r for r in now if r[0] != PT_LOAD]
    if [[r[0], r[1], *r[3:]] for r in others if r[0] != PT_PHDR] != \
            [[r[0], r[1], *r[3:]] for r in kept if r[0] != PT_PHDR]:
        problems.append("a program header other than PT_LOAD changed")
    if len(old_sections) != len(new_sections):
        return [*problems, "the number of sections changed"]
    fatbin = (layout.address, layout.offset, layout.size)
    for before, after in zip(old_sections, new_sections, strict=True):
        if (before[3], before[4], before[5]) == fatbin:
            continue
        if before[:4] + before[5:] != after[:4] + after[5:]:
            problems.append(f"section header {before[0]} changed")
        elif not before[2] & SHF_ALLOC and before[1] != SHT_NOBITS and \
                stock[before[4]:before[4] + before[5]] != new[after[4]:after[4] + after[5]]:
            problems.append(f"an unmapped section (name {before[0]}) changed")
    return problems


def _address_of(rows: list[list[int]], offset: int) -> int | None:
    for row in rows:
        if row[0] == PT_LOAD and row[2] <= offset < row[2] + row[5]:
            return offset - row[2] + row[3]
    return None


def _mapped_equal(stock: bytes, new: bytes, segment: list[int], now: list[list[int]],
                  skip: list[tuple[int, int]]) -> list[str]:
    """The bytes a stock segment maps from the file, compared at each address with what the
    new file maps there, but the `skip` address ranges."""
    start, end = segment[3], segment[3] + segment[5]
    runs, at = [], start
    for a, b in [*skip, (end, end)]:
        if b <= at or a >= end:
            continue
        if a > at:
            runs.append((at, a))
        at = max(at, b)
    if at < end:
        runs.append((at, end))
    was = memoryview(stock)
    for a, b in runs:
        while a < b:
            holder = next((r for r in now if r[0] == PT_LOAD and r[3] <= a < r[3] + r[5]),
                          None)
            if holder is None or holder[1] != segment[1]:
                return [f"address {a:#x} is no longer mapped from the file as it was"]
            stop = min(b, holder[3] + holder[5])
            mine = stock_at = a - segment[3] + segment[2]
            theirs = a - holder[3] + holder[2]
            if was[mine:mine + stop - a] != memoryview(new)[theirs:theirs + stop - a]:
                first = next(i for i in range(stop - a)
                             if stock[stock_at + i] != new[theirs + i])
                return [f"byte {a + first:#x} outside .nv_fatbin changed"]
            a = stop
    return []
