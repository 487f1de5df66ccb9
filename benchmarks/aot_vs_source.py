"""The aot plan against the source plan, on REAL vLLM 0.33.0 files, as ratios of one run.

    python benchmarks/aot_vs_source.py [--fa2] [--platform manylinux_2_28_aarch64]

The aot plan is measured here: `sm121-build aot` (the tool's own command, --no-cache) on the
real `_C_stable_libtorch` and `_moe_C_stable_libtorch` of PyPI's 0.33.0 wheel (`--fa2`: and
`vllm_flash_attn/_vllm_fa2_C`, ~3,200 CPU-s), for sm_121 with this machine's ptxas: wall
time, CPU-s of ptxas and fatbinary, the peak memory of one ptxas, bytes fetched (none) and
bytes added to the files.  The source plan of the same extensions is read from the real
builds the tool ships (`sm121_build/data/ninja/*.ninja_log`, 16 jobs on the lent machine,
docs/real-build.md): its compile CPU-s are the sum of its ninja steps, its wall the last
step's end; what it fetches is at least the vLLM sdist (its size read from the cached file).
The source plan's wall is scaled to this machine by the ratio of CPU-s to cores:
`CPU-s / cores here`, an optimistic floor (a perfectly parallel build), so the ratio is a
conservative one for aot.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from devkit.helpers import CACHE, cuda_home, pypi_download  # noqa: E402

VERSION = "0.33.0"
FILES = ("vllm/_C_stable_libtorch.abi3.so", "vllm/_moe_C_stable_libtorch.abi3.so")
FA2 = "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"
NINJA = ROOT / "sm121_build" / "data" / "ninja"
RECORDINGS = {"vllm/_C_stable_libtorch.abi3.so": "_C_stable_libtorch-0.33.0-16jobs.ninja_log",
              FA2: "_vllm_fa2_C-sass-from-ptx-16jobs.ninja_log"}


def ninja_cost(log: Path) -> tuple[float, float]:
    """(CPU-s as the sum of the steps, wall s as the last step's end) of a ninja log."""
    steps = [line.split("\t") for line in log.read_text().splitlines()
             if line and not line.startswith("#")]
    return (sum(int(s[1]) - int(s[0]) for s in steps) / 1000,
            max(int(s[1]) for s in steps) / 1000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fa2", action="store_true", help="also FA2 (~3,200 CPU-s)")
    parser.add_argument("--platform", default="manylinux_2_28_aarch64")
    args = parser.parse_args()
    wheel = pypi_download(f"vllm=={VERSION}", CACHE / "wheels", platform=args.platform)
    sdist = pypi_download(f"vllm=={VERSION}", CACHE / "sdists", sdist=True)
    names = (*FILES, FA2) if args.fa2 else FILES
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="aot-bench-") as tmp:
        stock = Path(tmp) / "stock"
        with zipfile.ZipFile(wheel) as archive:
            for name in names:
                (stock / name).parent.mkdir(parents=True, exist_ok=True)
                (stock / name).write_bytes(archive.read(name))
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "sm121_build", "--progress", "quiet", "aot", str(stock),
             "--out", str(Path(tmp) / "out"), "--target", "sm_121", "--no-cache",
             "--cuda-home", str(cuda_home())], capture_output=True, text=True, check=False,
            env={**os.environ, "XDG_CACHE_HOME": str(Path(tmp) / "xdg")})
        wall = time.monotonic() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode:
            raise SystemExit(done.stderr)
        added = sum((Path(tmp) / "out" / n).stat().st_size - (stock / n).stat().st_size
                    for n in names if (Path(tmp) / "out" / n).exists())
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    peak = after.ru_maxrss * 1024  # the largest child (one ptxas)
    source_cpu = source_wall = 0.0
    for name in names:
        if name in RECORDINGS:
            c, w = ninja_cost(NINJA / RECORDINGS[name])
            source_cpu, source_wall = source_cpu + c, source_wall + w
    scaled = source_cpu / cores
    print(f"real vLLM {VERSION} ({args.platform}): {', '.join(names)}; {cores} core(s) here")
    print(done.stdout.strip())
    print(f"{'':46}{'aot (measured)':>16}{'source (recorded)':>20}{'ratio':>9}")
    rows = [("CPU-s", cpu, source_cpu),
            (f"wall s on {cores} core(s) (source: CPU-s/cores)", wall, scaled),
            ("bytes fetched", 0.0, float(sdist.stat().st_size))]
    for label, mine, theirs in rows:
        ratio = f"{mine / theirs:.3f}" if theirs else "-"
        print(f"{label:46}{mine:>16,.0f}{theirs:>20,.0f}{ratio:>9}")
    print(f"{'peak memory of one ptxas (bytes)':46}{peak:>16,}{'30-42 GiB (nvcc)':>20}")
    print(f"{'bytes added to the files':46}{added:>16,}")
    print("source: the recorded 16-job builds of docs/real-build.md "
          f"({', '.join(RECORDINGS[n] for n in names if n in RECORDINGS)}); recorded wall "
          f"{source_wall:,.0f} s on 16 cores; bytes fetched: the vLLM sdist alone "
          "(CUTLASS and flash-attention come on top)")


if __name__ == "__main__":
    main()
