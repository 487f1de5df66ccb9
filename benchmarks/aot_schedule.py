"""aot's schedule on real PTX modules, plain against split, each against its floor; and the
cost estimates against what ptxas took.  For a machine the .so files cannot travel to (the
lent GPU machine takes 64 MiB a call): the PTX text of each module, as aot reads it.

Run: python benchmarks/aot_schedule.py PTX_DIR MANIFEST.json [--select x86_64:_C,_vllm_fa2_C]
                                       [--cores N] [--modes plain,split] [--json OUT]

PTX_DIR holds `<sha256 of the PTX>.ptx`; MANIFEST.json is a list of modules (`ptx_sha256`,
`stored_sha256`, `arch`, `options`, `platform`, `file`, `container`), as
`benchmarks/aot_costs_extract.py` writes them from a wheel.  Each mode runs the modules
through aot's own loop (`jobs/aot_work/aot_compile.compile_all`: the schedule of
`cuda/ptxas_schedule`, ptxas per module with each process's CPU time and peak RSS from
`wait4`), with the costs aot would estimate for them (`cuda/ptxas_cost`).

  plain   costliest first, one thread each (aot before issue #49)
  split   a module that would set the wall gets --split-compile threads

Printed per mode: wall, ptxas CPU-s, the largest peak RSS of one ptxas and the sum of the
running modules' (sampled), and the floor: max(CPU-s / cores, the slowest module's CPU-s on
one thread (plain) or over 16 threads (split)).  Then per file: measured CPU-s against the
table's estimate and the size-times-rate estimate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sm121_build.cuda.ptxas import Compile, checked_options, find_toolchain, run_ptxas  # noqa: E402
from sm121_build.cuda.ptxas_cost import cost_table, ptx_kind  # noqa: E402
from sm121_build.jobs.aot_work.aot_compile import Compiled, CompileInputs, compile_all  # noqa: E402


class Sampler:
    """The sum of the RSS of this process's ptxas children, sampled every 0.2 s."""

    def __init__(self) -> None:
        self.peak = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = str(os.getpid())
        while not self.stop.wait(0.2):
            total = 0
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                rows = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
                if rows.get("PPid", "").strip() == me and "ptxas" in rows.get("Name", ""):
                    total += int(rows.get("VmRSS", "0 kB").split()[0]) * 1024
            self.peak = max(self.peak, total)

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def _held_out_rate(modules: list[tuple[dict[str, object], bytes, object]],
                   spent: list[float], file_indices: list[int], index: int) -> float:
    """CPU-s per MB of PTX of the module's kind, fitted on the modules of other files."""
    kind = ptx_kind(modules[index][1])
    others = [i for i in range(len(modules)) if i not in file_indices]
    same = [i for i in others if ptx_kind(modules[i][1]) == kind] or others
    size = sum(len(modules[i][1]) for i in same) / 1e6
    return sum(spent[i] for i in same) / size if size else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ptx_dir", type=Path)
    parser.add_argument("manifest", type=Path)
    parser.add_argument("--select", default="", help="PLATFORM:FILE,FILE (substrings)")
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--modes", default="plain,split")
    parser.add_argument("--arch", help="ptxas's -arch for every module (sm_120, ...): the "
                        "same PTX for another GPU [default: the manifest's]")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = json.loads(args.manifest.read_text())
    if args.select:
        platform, _, files = args.select.partition(":")
        rows = [r for r in rows if r["platform"] == platform
                and any(f in r["file"] for f in files.split(","))]
    seen: set[str] = set()
    modules = []
    for row in rows:  # one module per distinct PTX, as aot's cache would have it
        if row["ptx_sha256"] in seen:
            continue
        seen.add(row["ptx_sha256"])
        ptx = (args.ptx_dir / f"{row['ptx_sha256']}.ptx").read_bytes()
        cost = cost_table().cost(len(ptx), (row["stored_sha256"], row["ptx_sha256"]),
                                 ptx_kind(ptx))
        modules.append((row, ptx, cost))
    toolchain = find_toolchain(None)
    print(f"{len(modules)} modules, {sum(len(m[1]) for m in modules) / 1e6:.1f} MB of PTX, "
          f"{toolchain}, {args.cores} cores; estimate {sum(m[2].cpu_seconds for m in modules):,.0f}"
          " CPU-s", flush=True)
    results: dict[str, dict[str, object]] = {}
    measured: dict[str, list[float]] = {}
    for mode in args.modes.split(","):
        cpu = [0.0] * len(modules)
        rss = [0] * len(modules)

        def work(index: int, threads: int, cpu: list[float] = cpu,
                 rss: list[int] = rss) -> Compiled:
            row, ptx, _cost = modules[index]
            ran = run_ptxas(toolchain, ptx, Compile(args.arch or row["arch"],
                                                    tuple(checked_options(" ".join(
                                                        row["options"]))), threads, 3600.0))
            cpu[index], rss[index] = ran.cpu_seconds, ran.peak_rss
            return Compiled(ran.cubin, b"", ran.cpu_seconds)

        inputs = CompileInputs(tuple(m[2] for m in modules), tuple(len(m[1]) for m in modules),
                    args.cores, mode == "split", 1.0, toolchain.version)
        started = time.perf_counter()
        with Sampler() as sampler:
            for index, done in compile_all(inputs, work):
                if isinstance(done, Exception):
                    raise SystemExit(f"module {index}: {done}")
        wall = time.perf_counter() - started
        measured[mode] = cpu
        results[mode] = {"wall": wall, "cpu": sum(cpu), "max_rss": max(rss),
                         "peak_sum_rss": sampler.peak}
        print(f"{mode}: {wall:.1f} s wall, {sum(cpu):.0f} CPU-s", flush=True)
    plain = measured.get("plain") or next(iter(measured.values()))
    slowest = max(plain)
    print(f"\n{'mode':6} {'wall s':>8} {'CPU-s':>8} {'1 ptxas GB':>10} {'all GB':>7} "
          f"{'floor s':>8} {'wall/floor':>10} {'vs plain':>8}")
    for mode, r in results.items():
        floor = max(float(r["cpu"]) / args.cores, slowest / (16 if mode == "split" else 1))  # type: ignore[arg-type]
        base = float(results["plain"]["wall"]) if "plain" in results else float(r["wall"])  # type: ignore[arg-type]
        print(f"{mode:6} {r['wall']:8.1f} {r['cpu']:8.0f} {int(r['max_rss']) / 1e9:10.2f} "  # type: ignore[call-overload]
              f"{int(r['peak_sum_rss']) / 1e9:7.2f} {floor:8.1f} "  # type: ignore[call-overload]
              f"{float(r['wall']) / floor:10.2f} {base / float(r['wall']):7.2f}x")  # type: ignore[arg-type]
    print(f"floor: the slowest module plain {slowest:.1f} CPU-s; all modules "
          f"{sum(plain):.0f} CPU-s / {args.cores} cores = {sum(plain) / args.cores:.1f} s")
    table = cost_table()
    per_file: dict[str, list[int]] = defaultdict(list)
    for index, (row, _ptx, _cost) in enumerate(modules):
        per_file[f"{row['platform']} {row['file'].rsplit('/', 1)[-1]}"].append(index)
    print(f"\nestimates against this run's CPU-s (plain), per file: the shipped table "
          f"({table.measured_on or 'none'}), and size x the rate of the module's kind fitted "
          "on the other files' modules alone (as for a file never measured):")
    print(f"{'file':44} {'modules':>7} {'CPU-s':>8} {'table':>8} {'err':>6} {'by rate':>8} "
          f"{'err':>6}")
    for name, indices in per_file.items():
        spent = sum(plain[i] for i in indices)
        known = sum(modules[i][2].cpu_seconds for i in indices)
        rated = sum(_held_out_rate(modules, plain, indices, i) * len(modules[i][1]) / 1e6
                    for i in indices)
        print(f"{name[:44]:44} {len(indices):7} {spent:8.1f} {known:8.1f} "
              f"{100 * (known - spent) / spent:+5.0f}% {rated:8.1f} "
              f"{100 * (rated - spent) / spent:+5.0f}%")
    if args.json:
        args.json.write_text(json.dumps({
            "cores": args.cores, "ptxas": str(toolchain), "modes": results,
            "modules": [{"ptx_sha256": m[0]["ptx_sha256"], "stored_sha256": m[0]["stored_sha256"],
                         "file": m[0]["file"], "platform": m[0]["platform"],
                         "container": m[0]["container"], "ptx_bytes": len(m[1]),
                         "kind": ptx_kind(m[1]),
                         **{f"cpu_{mode}": measured[mode][i] for mode in measured}}
                        for i, m in enumerate(modules)]}, indent=1))


if __name__ == "__main__":
    main()
