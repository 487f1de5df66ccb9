"""Per GPU: how many of vLLM's kernels are native before and after aot, what ptxas costs,
and how long a second run takes from the aot cache.

Run: python benchmarks/gpu_matrix.py [--pair aarch64:sm_121 --pair x86_64:sm_120 ...]
                                     [--wheels DIR] [--cores N] [--json FILE]

For each (wheel platform, GPU) pair: the `_C_stable_libtorch`, `_moe_C_stable_libtorch`
and FA2 files of PyPI's vLLM 0.33.0 wheel for that platform (cached under .cache/wheels),
audited for the GPU under a CUDA 13.0 driver (native / JIT-only / no loadable code, per
kernel), then `aot` for the GPU with an empty cache (ptxas CPU-s, each process's own; wall),
the result audited again, and `aot` once more from the cache it filled (the wall of a
second run).  Printed as a table per pair, the reference (the cold run) beside the second.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sm121_build.cuda.binary import audit_binary, gpu_policy  # noqa: E402
from sm121_build.cuda.ptxas import find_toolchain  # noqa: E402
from sm121_build.jobs.aot_work.aot_files import AotRequest, run_aot  # noqa: E402

MEMBERS = ("vllm/_C_stable_libtorch.abi3.so", "vllm/_moe_C_stable_libtorch.abi3.so",
           "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so")


def wheel_for(folder: Path, platform: str) -> Path:
    found = sorted(folder.glob(f"vllm-0.33.0-*{platform}*.whl"))
    if not found:
        raise SystemExit(f"no vLLM 0.33.0 wheel for {platform} in {folder}")
    return found[0]


def counts(path: Path, gpu: str) -> dict[str, int]:
    report = audit_binary(path, path.name, gpu_policy(gpu), with_kernels=True)
    return dict(report.kernel_counts())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", action="append",
                        default=None, help="PLATFORM:GPU, e.g. x86_64:sm_120")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".cache" / "wheels")
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--members", default=",".join(MEMBERS),
                        help="the wheel's files to aot, comma separated")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    pairs = args.pair or ["aarch64:sm_121", "x86_64:sm_120"]
    toolchain = find_toolchain(None)
    rows = []
    for pair in pairs:
        platform, gpu = pair.split(":")
        with tempfile.TemporaryDirectory(prefix="gpu-matrix-") as tmp:
            work = Path(tmp)
            with zipfile.ZipFile(wheel_for(args.wheels, platform)) as wheel:
                for member in args.members.split(","):
                    (work / "stock" / Path(member).name).parent.mkdir(exist_ok=True)
                    (work / "stock" / Path(member).name).write_bytes(wheel.read(member))
            before = {p.name: counts(p, gpu) for p in sorted((work / "stock").iterdir())}
            runs: list[tuple[str, float, float]] = []
            for run in ("cold", "from cache"):
                started = time.perf_counter()
                outcome = run_aot(AotRequest((work / "stock",), work / f"out-{len(runs)}",
                                             gpu_policy(gpu).target, toolchain, args.cores,
                                             3600.0, work / "cache"))
                runs.append((run, time.perf_counter() - started, outcome.cpu_seconds))
                if outcome.failed:
                    raise SystemExit(f"aot failed: {outcome.failed[:2]}")
            out = work / "out-0"
            after = {p.name: counts(out / p.name, gpu) if (out / p.name).exists()
                     else before[p.name] for p in sorted((work / "stock").iterdir())}
        print(f"\n== vLLM 0.33.0 {platform} wheel, for {gpu} (CUDA 13.0 driver), "
              f"{toolchain}, {args.cores} cores")
        print(f"{'file':34} {'native before':>14} {'JIT-only':>9} {'none':>6} "
              f"{'native after':>13} {'JIT-only':>9}")
        for name in before:
            b, a = before[name], after[name]
            print(f"{name[:34]:34} {b['native']:8,}/{sum(b.values()):<5,} {b['jit']:9,} "
                  f"{b['none']:6,} {a['native']:8,}/{sum(a.values()):<4,} {a['jit']:9,}")
        for run, wall, cpu in runs:
            print(f"  aot {run:10}: {wall:8.1f} s wall, {cpu:8.1f} CPU-s of ptxas"
                  + (f"  ({wall / runs[0][1]:.1%} of the cold run)" if run != "cold" else ""))
        rows.append({"platform": platform, "gpu": gpu, "before": before, "after": after,
                     "runs": runs, "ptxas": str(toolchain), "cores": args.cores})
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
