"""Time the dynamic-symbol reader (the verify step's ABI check reads every torch library with
it) against pyelftools' per-symbol iteration, the reader it replaced, on the real
`torch/lib` of PyPI's torch aarch64 wheel; checks both give the same symbols.

Run: python benchmarks/dynsym_speed.py [--torch 2.11.0] [--repeat 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import zipfile
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from devkit.helpers import CACHE, median_timed, pyelftools_dynsym, pypi_download  # noqa: E402
from sm121_build.cuda.dynsym import dynamic_symbols  # noqa: E402

LIBRARIES = ("libc10.so", "libtorch_cpu.so", "libtorch_cuda.so", "libtorch_python.so")


def new_reader(path: Path) -> tuple[set[str], set[str]]:
    found = dynamic_symbols(path)
    return set(found.undefined), set(found.exported)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--torch", default="2.11.0")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    wheel = pypi_download(f"torch=={args.torch}", CACHE / "torch",
                          platform="manylinux_2_28_aarch64")
    total_ref = total_new = 0.0
    with tempfile.TemporaryDirectory(prefix="bench-dynsym-") as tmp, zipfile.ZipFile(wheel) as zf:
        print(f"{'library':<22} {'symbols':>8} {'pyelftools':>11} {'new':>8} {'ratio':>7}")
        for name in LIBRARIES:
            path = Path(zf.extract(f"torch/lib/{name}", tmp))
            if new_reader(path) != pyelftools_dynsym(path):
                print(f"error: {name}: the readers disagree", file=sys.stderr)
                return 1
            count = sum(map(len, new_reader(path)))
            ref = median_timed(partial(pyelftools_dynsym, path), args.repeat)[0]
            new = median_timed(partial(new_reader, path), args.repeat)[0]
            total_ref, total_new = total_ref + ref, total_new + new
            print(f"{name:<22} {count:>8} {ref:>10.3f}s {new:>7.3f}s {ref / new:>6.1f}x")
    print(f"{'all four':<22} {'':>8} {total_ref:>10.3f}s {total_new:>7.3f}s "
          f"{total_ref / total_new:>6.1f}x   (torch {args.torch}, median of {args.repeat})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
