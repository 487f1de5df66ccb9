"""Peak memory of `audit` on an ELF .so whose `.nv_fatbin` holds large, honest zstd entries.

Run: python benchmarks/inflate_peak.py [--mib 64] [--entries 2] [--kind ptx|cubin]

Builds two files in a temp folder: a `.so` whose one container holds ENTRIES zstd PTX
entries (or cubins: an ELF of one large section) of MIB MiB each (each frame honestly
states its size; ~100x compressed), and the same with no entry at all (the reference: the
interpreter, the imports, the file's map).
Each is audited with kernel names (`sm121-build audit --json`, a process of its own, its
peak RSS from `wait4`), and the peak above the reference is printed in entries: 2 or more
means every entry was held inflated at once, 1 one at a time, under 1 that entries are
read in windows.  (Issue #62: two honest 540 MB entries peaked at ~600 MB; scaled down here,
the ratio is what compares.  Cubins are held whole, and two of 64 MiB fit the run's 1 GiB
budget together: 1.5-2 entries here, one at a time at 540 MB.)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import zstandard  # noqa: E402

from devkit.hostile import CONTAINER, ENTRY, elf_with  # noqa: E402
from sm121_build.cuda.fatbin import CONTAINER_MAGIC  # noqa: E402

MiB = 1 << 20


def ptx(size: int, number: int) -> bytes:
    """PTX text of `size` bytes: a header, one `.entry` per MiB, filler that compresses
    ~100x (a letter in 128 random: within the 512x a reader allows an entry)."""
    head = b".version 8.0\n.target sm_80\n.address_size 64\n"
    letters = bytes.maketrans(bytes(range(256)), bytes(97 + b % 26 for b in range(256)))
    body = bytearray()
    kernel = 0
    while len(head) + len(body) < size:
        filler = bytearray(b"\tmov.u32 %r1, %r2;\n" * (MiB // 19))[: MiB - 64]
        filler[::128] = os.urandom(len(filler[::128])).translate(letters)
        body += b".visible .entry k%d_%d(\n)\n{\n" % (number, kernel) + filler + b"}\n"
        kernel += 1
    return (head + bytes(body))[:size]


def cubin(size: int) -> bytes:
    """A cubin of about `size` bytes: an ELF whose one large section compresses ~100x."""
    code = bytearray(size - 512)
    code[::128] = os.urandom(len(code[::128]))
    return elf_with([(".text", bytes(code))])


def entry(payload: bytes, kind: int = 1) -> bytes:
    frame = zstandard.ZstdCompressor(level=3).compress(payload)  # states its content size
    stored = len(frame) + (-len(frame) % 8)
    return ENTRY.pack(kind, 0x101, ENTRY.size, stored, len(frame), 0, 0, 8, 80, 0, 0,
                      0x11 | 0x8000, 0, len(payload)) + frame + bytes(stored - len(frame))


def library(path: Path, entries: int, size: int, kind: str) -> Path:
    """The `.so`, built by a process of its own: a child forked from a parent that held the
    payloads would count them in its own peak (Linux keeps the high-water mark of the
    memory a process had before its exec)."""
    subprocess.run([sys.executable, __file__, "--build", str(path), "--entries", str(entries),
                    "--mib", str(size // MiB), "--kind", kind], check=True)
    return path


def build(path: Path, entries: int, size: int, kind: str) -> None:
    body = b"".join(entry(ptx(size, n)) if kind == "ptx" else entry(cubin(size), 2)
                    for n in range(entries))
    container = CONTAINER.pack(CONTAINER_MAGIC, 1, CONTAINER.size, len(body)) + body
    path.write_bytes(elf_with([(".nv_fatbin", container)]))


def peak_rss(path: Path) -> int:
    """The peak resident bytes of `sm121-build audit --json PATH` (kernel names read)."""
    child = subprocess.Popen([sys.executable, "-m", "sm121_build", "audit", "--json",
                              "--target", "sm_121", "--driver", "13.0", str(path)],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _pid, status, usage = os.wait4(child.pid, 0)
    assert child.stderr is not None
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"audit {path} failed: {child.stderr.read().decode()}")
    return usage.ru_maxrss * 1024


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=64, help="each entry's inflated MiB")
    parser.add_argument("--entries", type=int, default=2)
    parser.add_argument("--kind", choices=("ptx", "cubin"), default="ptx",
                        help="PTX (read in windows) or cubins (held whole, one at a time)")
    parser.add_argument("--build", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = args.mib * MiB
    if args.build is not None:
        build(args.build, args.entries, size, args.kind)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        reference = library(Path(tmp) / "none.so", 0, size, args.kind)
        large = library(Path(tmp) / "large.so", args.entries, size, args.kind)
        print(f"{large.name}: {args.entries} zstd {args.kind} entries of {args.mib} MiB "
              f"({large.stat().st_size / MiB:.1f} MiB stored)")
        base, peak = peak_rss(reference), peak_rss(large)
    held = (peak - base) / size
    print(f"peak RSS: reference (no entry) {base / MiB:.0f} MiB, with the entries "
          f"{peak / MiB:.0f} MiB")
    print(f"held above the reference: {(peak - base) / MiB:.0f} MiB = {held:.2f} entries "
          f"(2+: all at once, 1: one at a time, <1: in windows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
