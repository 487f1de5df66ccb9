"""Compare two files of saved outputs (harness_fa2.py, harness_marlin.py) case by case, bit
for bit (`sm121-build prove`; the method of benchmarks/device/fa2_compare.py).

Standard library and torch only:  python3 compare_outputs.py REFERENCE.pt OTHER.pt

A JSON line per case of either file:
    {"key": "OP/CASE", "bitwise_equal": B, "max_abs_diff": D}   (D: null where not comparable)
    {"key": "OP/CASE", "missing_in": "reference" | "other"}
"""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any


def _say(data: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(data) + "\n")
    sys.stdout.flush()


def same_bits(torch: Any, a: Any, b: Any) -> bool:
    """Equal bit for bit: the same dtype, shape and bytes (so -0.0 is not 0.0, and a NaN
    equals the same NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                            b.contiguous().reshape(-1).view(torch.uint8)))


def difference(torch: Any, a: Any, b: Any) -> float | None:
    if a.shape != b.shape:
        return None
    if a.numel() == 0:
        return 0.0
    diff = (a.double() - b.double()).abs().max().item()
    return float(diff) if diff == diff else None  # NaN (a NaN in either): not comparable


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.stderr.write("usage: compare_outputs.py REFERENCE.pt OTHER.pt\n")
        return 2
    torch = importlib.import_module("torch")
    reference, other = torch.load(argv[0]), torch.load(argv[1])
    for key in sorted(set(reference) | set(other)):
        if key not in other or key not in reference:
            _say({"key": key, "missing_in": "other" if key in reference else "reference"})
            continue
        a, b = reference[key], other[key]
        _say({"key": key, "bitwise_equal": same_bits(torch, a, b),
              "max_abs_diff": difference(torch, a, b)})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
