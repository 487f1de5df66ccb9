"""Compare the kernels of a stock vLLM .so with those of a rebuilt one, for sm_121.

    python benchmarks/compare_kernels.py --stock vllm-0.17.0-...-aarch64.whl \
        --built OUT/kernels-_C.abi3.so.json --name _C.abi3.so

`--stock` is a wheel, a directory or a .so; `--built` is a rebuilt .so or the
`kernels-<so>.json` list that benchmarks/real_build.py writes (kernels native on sm_121).
Prints, with the project's own reader: the stock kernels per SM family, what the stock file
gives sm_121 (native / PTX JIT / nothing), and which stock sm_90 kernels have no sm_121-native
code in the rebuilt file (FP4-named ones apart: they are left out on purpose).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sm121_build.audit.unpack import binaries  # noqa: E402
from sm121_build.cuda.binary import (  # noqa: E402
    DEFAULT_POLICY,
    audit_binary,
)
from sm121_build.cuda.fatbin import HostBinary  # noqa: E402
from sm121_build.verify.checks import kernel_key, left_out_rules  # noqa: E402


def kernels_by_family(path: Path) -> dict[str, set[str]]:
    """sm_90 / sm_90a -> "sm_90", etc.: the kernels each SM's cubins define."""
    found: dict[str, set[str]] = {}
    with HostBinary.open(path) as binary:
        for entry in binary.entries:
            if entry.kind == "elf":
                found.setdefault(f"sm_{entry.arch}", set()).update(
                    kernel_key(k) for k in binary.kernels(entry))
    return found


def built_native(built: Path, name: str) -> set[str]:
    if built.suffix == ".json":
        return {kernel_key(k) for k in json.loads(built.read_text())}
    kernels = audit_binary(built, name, DEFAULT_POLICY, with_kernels=True).kernels or {}
    return {kernel_key(k) for k, v in kernels.items() if v == "native"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stock", type=Path, required=True)
    parser.add_argument("--built", type=Path, required=True)
    parser.add_argument("--name", required=True, help="the .so's file name, e.g. _C.abi3.so")
    parser.add_argument("--examples", type=int, default=5)
    args = parser.parse_args()
    with binaries(str(args.stock), include=[f"*{args.name}"]) as found:
        stock = next((b for b in found if b.name.endswith(args.name)), None)
        if stock is None:
            print(f"error: no {args.name} in {args.stock}", file=sys.stderr)
            return 2
        families = kernels_by_family(stock.path)
        verdicts = {kernel_key(k): v for k, v in (audit_binary(
            stock.path, args.name, DEFAULT_POLICY, with_kernels=True).kernels or {}).items()}
    native = built_native(args.built, args.name)
    sm90 = families.get("sm_90", set())
    lost = sm90 - native
    fp4_rule = left_out_rules()["fp4"][0]
    fp4 = {k for k in lost if fp4_rule.search(k)}
    stock_counts = Counter(verdicts.values())
    report = {
        "so": args.name,
        "stock_kernels_per_sm": {sm: len(k) for sm, k in sorted(families.items())},
        "stock_on_sm121": dict(stock_counts),
        "built_native_on_sm121": len(native),
        "stock_sm90_kernels": len(sm90),
        "stock_sm90_without_native_sm121_in_built": len(lost),
        "of_which_fp4_named": len(fp4),
        "their_verdict_in_stock": dict(Counter(verdicts.get(k, "absent") for k in lost)),
        "examples_not_fp4": sorted(lost - fp4)[: args.examples],
        "stock_native_not_native_in_built": len({k for k, v in verdicts.items()
                                                 if v == "native"} - native),
        "built_native_not_native_in_stock": len({k for k in native
                                                 if verdicts.get(k) != "native"}),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
