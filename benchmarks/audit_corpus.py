"""The audit against cuobjdump on a corpus of real NVIDIA library files from PyPI.

Run: python benchmarks/audit_corpus.py [--repeat 3]

The `.so` files of NVIDIA's CUDA 13 wheels (cuBLAS/cuBLASLt, cuFFT, cuSPARSE, cuSPARSELt,
NCCL, NVRTC, nvJitLink, the runtime; x86_64, cached under .cache/nvidia), extracted once.
Median wall of `--repeat` runs, each a fresh process as a user runs it:

  per file   `sm121-build audit --format cuobjdump FILE`  vs  `cuobjdump -lelf -lptx FILE`
  corpus     the sum over files of each, and one `sm121-build audit` of the folder (start-up
             paid once) against the reference's sum

Ratios > 1: the audit is faster.  Goal (issue #46): >= 2x on the corpus.  The audit also
reads every allocated data section (cuFFT's `.data`, cuBLASLt's `.cask_resource`), which
cuobjdump does not: the listing compared is cuobjdump's own (.nv_fatbin).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from devkit.helpers import CACHE, cuobjdump, pypi_download  # noqa: E402

WHEELS = ("nvidia_cublas==13.10.0.20", "nvidia_cufft==12.5.0.14",
          "nvidia_cusparse==12.9.4.2", "nvidia_cusparselt_cu13==0.10.0",
          "nvidia_nccl_cu13==2.27.7", "nvidia_cuda_nvrtc==13.5.37",
          "nvidia_nvjitlink==13.5.37", "nvidia_cuda_runtime==13.5.37")


def corpus(dest: Path) -> list[Path]:
    files = []
    for spec in WHEELS:
        wheel = pypi_download(spec, CACHE / "nvidia", platform="manylinux2014_x86_64",
                              tags="x86_64")
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.namelist():
                if ".so" in member.rsplit("/", 1)[-1]:
                    files.append(Path(archive.extract(member, dest / spec.split("==")[0])))
    return sorted(files)


def timed(args: list[str], repeat: int) -> tuple[float, str]:
    times, out = [], ""
    for _ in range(repeat):
        started = time.perf_counter()
        done = subprocess.run(args, capture_output=True, text=True, check=False)
        times.append(time.perf_counter() - started)
        out = done.stdout
    return sorted(times)[len(times) // 2], out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    repeat = parser.parse_args().repeat
    ours = [sys.executable, "-m", "sm121_build", "audit", "--format", "cuobjdump"]
    with tempfile.TemporaryDirectory() as tmp:
        files = corpus(Path(tmp))
        print(f"{len(files)} files, {sum(f.stat().st_size for f in files) / 1e9:.2f} GB; "
              f"median of {repeat}; wall seconds")
        print(f"{'file':<28} {'MB':>7} {'cuobjdump':>10} {'audit':>8} {'ratio':>7}")
        total_ref = total_ours = 0.0
        for path in files:
            ref, listing = timed([cuobjdump(), "-lelf", "-lptx", str(path)], repeat)
            mine, same = timed([*ours, str(path)], repeat)
            if same.splitlines() != listing.splitlines():
                raise SystemExit(f"{path.name}: the listing differs from cuobjdump's")
            total_ref, total_ours = total_ref + ref, total_ours + mine
            print(f"{path.name:<28} {path.stat().st_size / 1e6:7.1f} {ref:10.3f} {mine:8.3f} "
                  f"{ref / mine:6.1f}x")
        folder, _ = timed([*ours, tmp], repeat)
        print(f"{'corpus, a run per file':<28} {'':>7} {total_ref:10.3f} {total_ours:8.3f} "
              f"{total_ref / total_ours:6.1f}x")
        print(f"{'corpus, one run (folder)':<28} {'':>7} {total_ref:10.3f} {folder:8.3f} "
              f"{total_ref / folder:6.1f}x   (goal >= 2x)")
        print(f"cores: {len(os.sched_getaffinity(0))}")


if __name__ == "__main__":
    main()
