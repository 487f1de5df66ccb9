"""Compare two files of saved outputs (harness_fa2.py, harness_marlin.py) case by case, bit
for bit (`sm121-build prove`; the method of benchmarks/device/fa2_compare.py).

Standard library and torch only:

    python3 compare_outputs.py REFERENCE.pt OTHER.pt [REFERENCE.pt OTHER.pt ...]

Each pair: the outputs of one part of the cases (prove runs the parts in processes of their
own); a case saved by two parts of one side is refused (exit 2: the parts do not add up).

A JSON line per case of either file, every output of the case compared (`compare`):
    {"key": "OP/CASE", "bitwise_equal": B, "max_abs_diff": D, "max_ulp": U,
     "outputs": N, "differing": [I, ...]}
    (D, U: null where not comparable; U: units in the last place of the dtype, for floats;
    N: the reference's outputs for the case; I: the positions of those that differ)
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


# a float dtype's width in bits, for its units in the last place (ULP)
_WIDTH = {"float16": 16, "bfloat16": 16, "float32": 32, "float64": 64}


def ulps(torch: Any, a: Any, b: Any) -> int | None:
    """The largest distance between two float tensors of one dtype in units in the last
    place: each value's bits as a signed integer, reordered so that the integers run in the
    order of the floats (-0.0 and 0.0 one apart), then the largest difference.  None: not
    floats of one dtype and shape, or a NaN in either."""
    width = _WIDTH.get(str(a.dtype).removeprefix("torch."))
    if width is None or a.dtype != b.dtype or a.shape != b.shape:
        return None
    if a.numel() == 0:
        return 0
    if bool(torch.isnan(a).any()) or bool(torch.isnan(b).any()):
        return None
    as_int = {16: torch.int16, 32: torch.int32, 64: torch.int64}[width]

    def ordered(x: Any) -> Any:
        bits = x.contiguous().reshape(-1).view(as_int).to(torch.int64)
        if width == 64:  # no wider integer: the sign-magnitude order, in int64
            return torch.where(bits < 0, -(bits & ((1 << 63) - 1)) - 1, bits)
        return torch.where(bits < 0, -(bits + (1 << (width - 1))) - 1, bits)

    a_key, b_key = ordered(a), ordered(b)
    # keys of one sign subtract exactly in int64; of opposite signs they may not (64-bit
    # floats): their distance is taken in float64, exact as far as it matters (2**53)
    same_sign = (a_key >= 0) == (b_key >= 0)
    distance = torch.where(same_sign, (a_key - b_key).abs().double(),
                           (a_key.double() - b_key.double()).abs())
    return int(distance.max().item())


def _parts(value: Any) -> tuple[Any, ...]:
    """A case's outputs: each tensor of a tuple or list (harness_run.outputs), or the one
    tensor a file of an older harness saved."""
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def compare(torch: Any, a: Any, b: Any) -> dict[str, Any]:
    """Every output of a case compared: equal bit for bit only when both saved as many and
    each pair is; the largest difference and ULP over them (null: not comparable, in any);
    `differing`: the positions of the outputs that are not equal (a missing one too)."""
    left, right = _parts(a), _parts(b)
    pairs = list(zip(left, right, strict=False))  # a count that differs: unequal
    equal = [same_bits(torch, x, y) for x, y in pairs]
    diffs = [difference(torch, x, y) for x, y in pairs]
    units = [ulps(torch, x, y) for x, y in pairs]
    count = len(left) == len(right)
    known_diffs = [d for d in diffs if d is not None]
    known_units = [u for u in units if u is not None]
    whole = count and len(known_diffs) == len(pairs)
    return {"bitwise_equal": count and all(equal),
            "max_abs_diff": max(known_diffs, default=0.0) if whole else None,
            "max_ulp": max(known_units, default=0)
            if count and len(known_units) == len(pairs) else None,
            "outputs": len(left),
            "differing": [i for i, same in enumerate(equal) if not same] +
                         list(range(len(pairs), max(len(left), len(right))))}


USAGE = "usage: compare_outputs.py REFERENCE.pt OTHER.pt [REFERENCE.pt OTHER.pt ...]"


def _joined(torch: Any, paths: list[str]) -> dict[str, Any] | None:
    """The cases of one side's files as one; None when two of them saved one case."""
    joined: dict[str, Any] = {}
    for path in paths:
        part = torch.load(path)
        if set(part) & set(joined):
            return None
        joined.update(part)
    return joined


def main(argv: list[str]) -> int:
    if not argv or len(argv) % 2:
        sys.stderr.write(USAGE + "\n")
        return 2
    torch = importlib.import_module("torch")
    reference, other = _joined(torch, argv[0::2]), _joined(torch, argv[1::2])
    if reference is None or other is None:
        sys.stderr.write(f"{USAGE}: a case saved by two parts of one side\n")
        return 2
    for key in sorted(set(reference) | set(other)):
        if key not in other or key not in reference:
            _say({"key": key, "missing_in": "other" if key in reference else "reference"})
            continue
        _say({"key": key, **compare(torch, reference[key], other[key])})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
