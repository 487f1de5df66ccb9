"""aot's wall clock against its floor, plain against split, and its cost estimates against
what ptxas took: on real vLLM files.

Run: python benchmarks/aot_speed.py FILE.so... [--cores N] [--modes plain,split]
                                     [--write-table data.json --measured-on TEXT]

Each mode is one `aot` of the files (no cache, a fresh --out), in this process, with `--jobs
N`:

  plain   every module on one thread, costliest first (the schedule before issue #49)
  split   the schedule of `cuda/ptxas_schedule`: a module that would set the wall gets
          ptxas's --split-compile threads

Printed per mode: wall, ptxas CPU-s (each process's own, `wait4`), the peak memory of all
ptxas processes at once (sampled from /proc every 0.2 s), and the floor: the larger of
CPU-s ÷ cores and the slowest module's CPU-s (measured in the plain run) — the ratio
wall ÷ floor says how close the schedule comes.  Then per file and per module: the
estimate (`ptxas_cost`: the shipped table where it knows the module, else size × the rate
for its kind; and size × rate alone, as for a module never measured) against the CPU-s
measured, with the error.  `--write-table` writes the measured CPU-s as a cost table (the
shipped `sm121_build/data/ptxas_costs.json` is made this way, its rates fitted here).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from aot_schedule import Sampler  # noqa: E402

from sm121_build.cuda.compat import parse_target  # noqa: E402
from sm121_build.cuda.ptxas import find_toolchain  # noqa: E402
from sm121_build.cuda.ptxas_cost import cost_table  # noqa: E402
from sm121_build.jobs.aot_work.aot_files import AotRequest, AotResult, run_aot  # noqa: E402


def run_mode(files: list[Path], cores: int, split: bool, target: str) -> tuple[AotResult, int]:
    with tempfile.TemporaryDirectory(prefix="aot-speed-") as tmp:
        out = Path(tmp) / "out"
        request = AotRequest(tuple(files), out, parse_target(target), find_toolchain(None),
                             cores, 3600.0, None, split=split)
        with Sampler() as memory:
            outcome = run_aot(request)
        shutil.rmtree(out, ignore_errors=True)
    if outcome.failed:
        raise SystemExit(f"aot failed: {outcome.failed[:3]}")
    return outcome, memory.peak


def fitted_rates(rows: list[dict[str, object]]) -> dict[str, float]:
    """CPU-s per MB of PTX per kind (the sum of seconds over the sum of MB: the big modules
    weigh most), `unknown` over all."""
    seconds: dict[str, float] = defaultdict(float)
    sizes: dict[str, float] = defaultdict(float)
    for row in rows:
        for kind in (str(row["kind"]), "unknown"):
            seconds[kind] += float(row["cpu_seconds"])  # type: ignore[arg-type]
            sizes[kind] += int(row["ptx_bytes"]) / 1e6  # type: ignore[call-overload]
    return {k: round(seconds[k] / sizes[k], 3) for k in sorted(seconds) if sizes[k] > 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--modes", default="plain,split")
    parser.add_argument("--target", default="sm_121")
    parser.add_argument("--write-table", type=Path)
    parser.add_argument("--measured-on", default="")
    parser.add_argument("--json", type=Path, help="write every number printed here")
    args = parser.parse_args()
    modes = args.modes.split(",")
    results: dict[str, tuple[AotResult, int]] = {}
    for mode in modes:
        print(f"== {mode}: aot of {len(args.files)} file(s) on {args.cores} core(s)",
              flush=True)
        results[mode] = run_mode(args.files, args.cores, mode == "split", args.target)
    reference = results.get("plain", results[modes[0]])[0]
    slowest = max(m.cpu_seconds for m in reference.modules)
    print(f"\n{'mode':6} {'wall s':>8} {'CPU-s':>8} {'peak GB':>8} {'floor s':>8} "
          f"{'wall/floor':>10} {'vs plain':>8}")
    for mode, (outcome, peak) in results.items():
        floor = max(outcome.cpu_seconds / args.cores, slowest / (16 if mode == "split" else 1))
        base = results["plain"][0].wall_seconds if "plain" in results else outcome.wall_seconds
        print(f"{mode:6} {outcome.wall_seconds:8.1f} {outcome.cpu_seconds:8.1f} "
              f"{peak / 1e9:8.2f} {floor:8.1f} {outcome.wall_seconds / floor:10.2f} "
              f"{base / outcome.wall_seconds:7.2f}x")
    print(f"floor: max(CPU-s / {args.cores} cores, the slowest module {slowest:.1f} CPU-s "
          "plain, or / 16 threads split)")
    table = cost_table()
    rows = []
    for module in reference.modules:
        rate = table.rates.get(module.kind, table.rates["unknown"])
        rows.append({"file": module.file.rsplit("/", 1)[-1], "container": module.container,
                     "ptx_bytes": module.ptx_bytes, "kind": module.kind,
                     "stored": module.digests[0], "ptx": module.digests[1],
                     "predicted": round(module.predicted, 1),
                     "by_rate": round(module.ptx_bytes / 1e6 * rate, 1),
                     "cpu_seconds": round(module.cpu_seconds, 2)})
    print(f"\nestimates (table measured on: {table.measured_on or 'none'}) against this "
          "run's CPU-s, per file:")
    print(f"{'file':34} {'modules':>7} {'PTX MB':>8} {'CPU-s':>8} {'table':>8} {'err':>6} "
          f"{'by rate':>8} {'err':>6}")
    per_file: dict[str, list[dict[str, object]]] = defaultdict(list)
    for row in rows:
        per_file[str(row["file"])].append(row)
    for name, group in per_file.items():
        cpu = sum(float(r["cpu_seconds"]) for r in group)  # type: ignore[arg-type]
        table_s = sum(float(r["predicted"]) for r in group)  # type: ignore[arg-type]
        rate_s = sum(float(r["by_rate"]) for r in group)  # type: ignore[arg-type]
        print(f"{name[:34]:34} {len(group):7} "
              f"{sum(int(r['ptx_bytes']) for r in group) / 1e6:8.1f} "  # type: ignore[call-overload]
              f"{cpu:8.1f} {table_s:8.1f} {100 * (table_s - cpu) / cpu:+5.0f}% "
              f"{rate_s:8.1f} {100 * (rate_s - cpu) / cpu:+5.0f}%")
    print("\nper module (costliest first):")
    for row in sorted(rows, key=lambda r: -float(r["cpu_seconds"])):  # type: ignore[arg-type]
        cpu = float(row["cpu_seconds"])  # type: ignore[arg-type]
        print(f"  {str(row['file'])[:30]:30} #{row['container']:<4} {row['kind']:8} "
              f"{int(row['ptx_bytes']) / 1e6:7.2f} MB {cpu:8.1f} CPU-s, table "  # type: ignore[call-overload]
              f"{row['predicted']}, by rate {row['by_rate']}")
    if args.json:
        args.json.write_text(json.dumps({
            "cores": args.cores,
            "modes": {m: {"wall": o.wall_seconds, "cpu": o.cpu_seconds, "peak": p}
                      for m, (o, p) in results.items()},
            "modules": rows}, indent=1))
    if args.write_table:
        args.write_table.write_text(json.dumps({
            "measured_on": args.measured_on,
            "rates": fitted_rates(rows),
            "modules": [{"stored": r["stored"], "ptx": r["ptx"],
                         "cpu_seconds": r["cpu_seconds"], "ptx_bytes": r["ptx_bytes"],
                         "from": f"{r['file']} #{r['container']}"} for r in rows]},
            indent=1) + "\n")
        print(f"\nwrote {args.write_table}")


if __name__ == "__main__":
    main()
