"""Time the fatbin reader against `cuobjdump -lelf -lptx` on real vLLM .so files.

Run: python benchmarks/audit_speed.py [--version 0.17.0] [--repeat 5]
Prints, per file, median wall times and the ratio, and checks the listings are identical.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from devkit.helpers import CACHE, cuobjdump, pypi_download  # noqa: E402
from sm121_build.verify.audit_inputs import binaries  # noqa: E402
from sm121_build.verify.fatbin import HostBinary, cuobjdump_listing  # noqa: E402

FILES = ("vllm/_C.abi3.so", "vllm/_moe_C.abi3.so", "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so")


def _median(fn: object, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--version", default="0.17.0")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    wheel = pypi_download(f"vllm=={args.version}", CACHE / "vllm")
    tool = cuobjdump()
    worst = float("inf")
    print(f"vLLM {args.version} aarch64 wheel; median of {args.repeat} warm runs")
    print(f"{'file':<44}{'size':>9}{'cuobjdump':>12}{'reader':>10}{'CLI':>10}"
          f"{'reader x':>10}{'CLI x':>8}  same")
    with binaries(str(wheel), include=FILES) as found:
        for binary in found:
            path = binary.path
            ref = subprocess.run([tool, "-lelf", "-lptx", str(path)], capture_output=True,
                                 text=True, check=True).stdout.splitlines()

            def read(path: Path = path) -> list[str]:
                with HostBinary.open(path) as opened:
                    return cuobjdump_listing(path, opened.entries)

            same = read() == ref
            t_ref = _median(lambda path=path: subprocess.run(
                [tool, "-lelf", "-lptx", str(path)], capture_output=True, check=True),
                args.repeat)
            t_ours = _median(read, args.repeat)
            t_cli = _median(lambda path=path: subprocess.run(
                [sys.executable, "-m", "sm121_build", "audit", "--format", "cuobjdump",
                 str(path)], capture_output=True, check=True, cwd=ROOT), args.repeat)
            worst = min(worst, t_ref / t_ours)
            print(f"{binary.name:<44}{path.stat().st_size / 1e6:>7.0f}MB{t_ref * 1e3:>10.1f}ms"
                  f"{t_ours * 1e3:>8.1f}ms{t_cli * 1e3:>8.1f}ms{t_ref / t_ours:>9.0f}x"
                  f"{t_ref / t_cli:>7.1f}x  {same}")
            if not same:
                print("  LISTINGS DIFFER", file=sys.stderr)
                return 1
    print(f"slowest reader ratio: {worst:.0f}x faster than cuobjdump (goal: >= 20x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
