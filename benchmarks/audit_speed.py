"""Time the fatbin reader against `cuobjdump -lelf -lptx` on real vLLM .so files.

Run: python benchmarks/audit_speed.py [--version 0.17.0] [--repeat 5]
Prints, per file, median wall times and the ratio, and checks the listings are identical.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from devkit.helpers import CACHE, cuobjdump, median_timed, pypi_download  # noqa: E402
from sm121_build.audit.unpack import binaries  # noqa: E402
from sm121_build.cuda.fatbin import HostBinary, cuobjdump_listing  # noqa: E402

FILES = ("vllm/_C.abi3.so", "vllm/_moe_C.abi3.so", "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so")


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
            t_ref = median_timed(partial(
                subprocess.run, [tool, "-lelf", "-lptx", str(path)], capture_output=True,
                check=True), args.repeat)[0]
            t_ours = median_timed(read, args.repeat)[0]
            t_cli = median_timed(partial(
                subprocess.run, [sys.executable, "-m", "sm121_build", "audit", "--format",
                                 "cuobjdump", str(path)], capture_output=True, check=True,
                cwd=ROOT), args.repeat)[0]
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
