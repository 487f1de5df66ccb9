"""Make `sm121_build/data/ptxas_costs.json`, aot's table of measured ptxas costs, from a run
of `benchmarks/device/ptxas_costs_measure.py` on PTX that `benchmarks/aot_costs_extract.py`
wrote.

Run: python benchmarks/aot_costs_table.py MANIFEST.json ALL.jsonl --measured-on TEXT
                                          [--out sm121_build/data/ptxas_costs.json]

One row per distinct PTX: its CPU-seconds (user+sys of that ptxas alone, `wait4`), keyed by
the digest of the PTX text and of each stored entry that holds it.  The rates per kind of
PTX (`cuda/ptxas_cost.ptx_kind`: flash, cutlass, other; unknown for a plan that does not
read the text) are the measured seconds over the megabytes of PTX of that kind.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sm121_build.cuda.ptxas_cost import ptx_kind  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("manifest", type=Path)
    parser.add_argument("runs", type=Path)
    parser.add_argument("--ptx-dir", type=Path, help="the PTX files (their kind); default: "
                        "the manifest's folder /ptx")
    parser.add_argument("--measured-on", required=True)
    parser.add_argument("--out", type=Path, default=ROOT / "sm121_build" / "data" /
                        "ptxas_costs.json")
    args = parser.parse_args()
    ptx_dir = args.ptx_dir or args.manifest.parent / "ptx"
    runs = {r["digest"]: r for r in map(json.loads, args.runs.read_text().splitlines())
            if r.get("rc") == 0}
    rows: dict[str, dict[str, object]] = {}
    seconds: dict[str, float] = defaultdict(float)
    megabytes: dict[str, float] = defaultdict(float)
    for module in json.loads(args.manifest.read_text()):
        digest = module["ptx_sha256"]
        if digest not in runs:
            continue
        if digest not in rows:
            kind = ptx_kind((ptx_dir / f"{digest}.ptx").read_bytes())
            cpu = round(float(runs[digest]["cpu_seconds"]), 2)
            rows[digest] = {"ptx": digest, "stored": [], "cpu_seconds": cpu,
                            "ptx_bytes": module["ptx_bytes"], "kind": kind, "from": []}
            for each in (kind, "unknown"):
                seconds[each] += cpu
                megabytes[each] += module["ptx_bytes"] / 1e6
        row = rows[digest]
        stored, where = row["stored"], row["from"]
        assert isinstance(stored, list) and isinstance(where, list)
        if module["stored_sha256"] not in stored:
            stored.append(module["stored_sha256"])
        where.append(f"{module['platform']} {module['file'].rsplit('/', 1)[-1]} "
                     f"#{module['container']}")
    table = {"measured_on": args.measured_on,
             "rates": {k: round(seconds[k] / megabytes[k], 3) for k in sorted(seconds)},
             "modules": sorted(rows.values(), key=lambda r: -int(r["ptx_bytes"]))}  # type: ignore[call-overload]
    args.out.write_text(json.dumps(table, indent=0) + "\n")
    print(f"{len(rows)} modules; rates {table['rates']}; wrote {args.out}")


if __name__ == "__main__":
    main()
