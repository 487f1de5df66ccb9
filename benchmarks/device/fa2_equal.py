"""Issue #63 on a lent Hopper: every case fa2_kernels.py derives from FA2's added kernels,
run on the stock file through the driver's JIT and on the aot'd file with the JIT off, every
output compared bit for bit; the stock side in PROCS processes at once, each given the cases
of its own modules (so that each module is JIT-compiled by about one process, not by all).

    python3 benchmarks/device/fa2_equal.py STOCK.so AOT.so NAMES.txt WORK [--procs 16]

Prints one JSON line a step and a summary: cases, bitwise equal, the differing ones, the
stock side's wall and CPU, the native side's wall.  Run from the repository root with the
package's dependencies on PYTHONPATH (benchmarks/device/fa2_coverage.sh's kit).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAYLOAD = ROOT / "sm121_build" / "jobs" / "payload"
sys.path.insert(0, str(ROOT))

from sm121_build.cuda.added import read_added  # noqa: E402
from sm121_build.jobs.payload import fa2_kernels  # noqa: E402

# the harness with its fixed cases left out (each process runs only the cases it is given)
RUN = ("import sys; sys.path.insert(0, sys.argv.pop(1)); import harness_fa2 as h; "
       "h.varlen = h.kvcache = lambda *a: None; sys.exit(h.main(sys.argv[1:]))")


def groups(stock: Path, new: Path, derived: fa2_kernels.Derived,
           procs: int) -> list[list[fa2_kernels.Case]]:
    """The cases in `procs` groups by module: each case goes with the added cubin of its
    first expected kernel; cubins dealt round robin by their number."""
    module = {kernel: cubin.number for cubin in read_added(stock, new)
              for kernel in cubin.kernels}
    out: list[list[fa2_kernels.Case]] = [[] for _ in range(procs)]
    for case in derived.cases:
        kernels = derived.expects.get(case.key) or []
        number = min((module[k] for k in kernels if k in module), default=0)
        out[number % procs].append(case)
    return [g for g in out if g]


def launch(so: Path, out: Path, cases: Path, jit: bool) -> subprocess.Popen[bytes]:
    env = {**os.environ, "CUDA_CACHE_DISABLE": "1"}
    if not jit:
        env["CUDA_DISABLE_PTX_JIT"] = "1"
    log = out.with_suffix(".log").open("wb")
    return subprocess.Popen([sys.executable, "-c", RUN, str(PAYLOAD), str(so), str(out),
                             "--cases", str(cases)], stdout=log, stderr=subprocess.STDOUT,
                            env=env)


def side(so: Path, work: Path, files: list[Path], jit: bool, limit: float) -> dict[str, object]:
    tag = "jit" if jit else "native"
    started = time.monotonic()
    running = [launch(so, work / f"g{i}.{tag}.pt", f, jit) for i, f in enumerate(files)]
    for process in running:
        try:
            process.wait(timeout=max(1.0, limit - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"side": tag, "wall_s": round(time.monotonic() - started, 1),
            "exits": [p.returncode for p in running],
            "children_cpu_s": round(children.ru_utime + children.ru_stime, 1)}


def compare(work: Path, count: int) -> dict[str, object]:
    rows = []
    for i in range(count):
        jit, native = work / f"g{i}.jit.pt", work / f"g{i}.native.pt"
        if not (jit.is_file() and native.is_file()):
            rows.append({"group": i, "missing": True})
            continue
        done = subprocess.run([sys.executable, str(PAYLOAD / "compare_outputs.py"), str(jit),
                               str(native)], capture_output=True, text=True, check=False)
        rows += [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    keyed = [r for r in rows if "key" in r]
    equal = [r for r in keyed if r.get("bitwise_equal")]
    return {"compared": len(keyed), "bitwise_equal": len(equal),
            "outputs": sum(int(r.get("outputs") or 0) for r in keyed),
            "groups_missing": [r["group"] for r in rows if r.get("missing")],
            "differing": [r for r in keyed if not r.get("bitwise_equal")][:10]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stock", type=Path)
    parser.add_argument("aot", type=Path)
    parser.add_argument("names", type=Path)
    parser.add_argument("work", type=Path)
    parser.add_argument("--procs", type=int, default=16)
    parser.add_argument("--limit", type=float, default=330.0, help="seconds for a side")
    args = parser.parse_args()
    import torch

    p = torch.cuda.get_device_properties(0)
    gpu = fa2_kernels.Gpu(p.major, p.minor, p.shared_memory_per_block_optin,
                          p.shared_memory_per_multiprocessor, p.multi_processor_count)
    names = args.names.read_text().split()
    fixed = fa2_kernels.fixed_cases()
    derived = fa2_kernels.derive(names, gpu, first=fixed)
    derived.cases = derived.cases[len(fixed):]
    args.work.mkdir(parents=True, exist_ok=True)
    grouped = groups(args.stock, args.aot, derived, args.procs)
    files = []
    for i, cases in enumerate(grouped):
        path = args.work / f"g{i}.cases.json"
        path.write_text(json.dumps({"cases": [{**asdict(c), "window": list(c.window)}
                                              for c in cases]}))
        files.append(path)
    print(json.dumps({"cases": len(derived.cases), "groups": [len(g) for g in grouped]}))
    print(json.dumps(side(args.stock, args.work, files, True, args.limit)), flush=True)
    print(json.dumps(side(args.aot, args.work, files, False, 120.0)), flush=True)
    print(json.dumps(compare(args.work, len(files))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
