"""What an aot'd file must be against the stock file it came from.

- every byte outside `.nv_fatbin` equals the stock's, but for the wrappers' relocation
  addends (and, where the section moved to a new segment, the ELF header's program header
  fields and the section's own header row): host code cannot have changed;
- each registered container holds its stock entries byte for byte, in their order, and
  after them only cubins;
- each container the GPU could only JIT (or not load) before, and that had PTX it can JIT,
  now has a cubin the GPU loads.
"""

from __future__ import annotations

import struct

from sm121_build.core.errors import CorruptBinaryError
from sm121_build.cuda.compat import Target, cubin_loads, ptx_loads
from sm121_build.cuda.fatbin import Entry
from sm121_build.cuda.fatbin_rewrite import Container, Layout, read_layout

ANY_DRIVER = (99, 0)  # ahead of time, no driver limits which PTX ptxas reads


def loads_natively(container: Container, target: Target) -> bool:
    return any(e.kind == "elf" and cubin_loads(e.arch, e.variant, target)
               for e in container.described)


def jit_ptx(described: tuple[Entry, ...], target: Target) -> Entry | None:
    """The PTX the driver would JIT for a container (the newest it can) when no cubin of it
    loads natively: what `aot` compiles; None when a cubin loads or no PTX can."""
    if any(e.kind == "elf" and cubin_loads(e.arch, e.variant, target) for e in described):
        return None
    candidates = [e for e in described if e.kind == "ptx"
                  and ptx_loads(e.arch, e.variant, e.version, target, ANY_DRIVER)]
    return max(candidates, key=lambda e: (e.arch, e.version), default=None)


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
        if jit_ptx(was.described, target) and not loads_natively(got, target):
            problems.append(f"{where}: container {old.container} still has no cubin "
                            f"{target} loads")
    return problems


def _outside_fatbin(stock: bytes, new: bytes, layout: Layout) -> list[str]:
    """Bytes of the stock file's extent that changed outside what the rewrite may touch."""
    allowed = [(layout.offset, layout.offset + layout.size)]
    for registration in layout.registrations:
        allowed.append((registration.addend_at, registration.addend_at + 8))
        allowed.append((registration.pointer_at, registration.pointer_at + 8))
    if len(new) != len(stock):
        allowed += [(0x20, 0x28), (0x38, 0x3A)]  # e_phoff, e_phnum
        shoff, = struct.unpack_from("<Q", stock, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", stock, 0x3A)
        for i in range(shnum):
            row = shoff + i * shentsize
            if struct.unpack_from("<QQ", stock, row + 16) == (layout.address, layout.offset):
                allowed.append((row + 16, row + 40))
    if len(new) < len(stock):
        return [f"the file shrank from {len(stock)} to {len(new)} bytes"]
    problems: list[str] = []
    at = 0
    was, now = memoryview(stock), memoryview(new)
    for start, end in [*sorted(allowed), (len(stock), len(stock))]:
        if start > at and was[at:start] != now[at:start]:
            first = next(i for i in range(at, start) if stock[i] != new[i])
            problems.append(f"byte {first:#x} outside .nv_fatbin changed")
        at = max(at, end)
    return problems
