"""On a machine with torch (the lent GPU machine): `compare_outputs.ulps` against values
whose distance in units in the last place is known by construction (`torch.nextafter`),
for each float dtype it handles, on the CPU and on the GPU.  Prints one JSON line per case
and exits 1 on the first that differs from what it must be.

    python3 benchmarks/device/ulp_check.py
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sm121_build" / "jobs" / "payload"))
from compare_outputs import ulps


def steps(x: torch.Tensor, n: int) -> torch.Tensor:
    """`x` moved `n` representable values up (towards +inf)."""
    for _ in range(n):
        x = torch.nextafter(x, torch.full_like(x, float("inf")))
    return x


def _bits(value: float, dtype: torch.dtype) -> int:
    """A positive float's bits as an integer: its key in the order of the floats."""
    width = torch.finfo(dtype).bits
    as_int = {16: torch.int16, 32: torch.int32, 64: torch.int64}[width]
    return int(torch.tensor([value], dtype=dtype).view(as_int).item())


def main() -> int:
    failed = 0
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            one = torch.tensor([1.0, -2.5, 0.0, 1e-3], dtype=dtype, device=device)
            cases = {
                "equal": (one, one.clone(), 0),
                "one step": (one, steps(one, 1), 1),
                "seven steps": (one, steps(one, 7), 7),
                "-0.0 and 0.0": (torch.tensor([-0.0], dtype=dtype, device=device),
                                 torch.tensor([0.0], dtype=dtype, device=device), 1),
                "smallest -x and +x": (
                    torch.tensor([0.0], dtype=dtype, device=device).nextafter(
                        torch.tensor([-1.0], dtype=dtype, device=device)),
                    steps(torch.tensor([0.0], dtype=dtype, device=device), 1), 3),
                "largest -x and +x": (
                    torch.tensor([-torch.finfo(dtype).max], dtype=dtype, device=device),
                    torch.tensor([torch.finfo(dtype).max], dtype=dtype, device=device),
                    2 * _bits(torch.finfo(dtype).max, dtype) + 1),
                "a NaN": (one, torch.tensor([float("nan"), 0, 0, 0], dtype=dtype,
                                            device=device), None),
                "another shape": (one, one[:2], None),
            }
            for name, (a, b, want) in cases.items():
                got = ulps(torch, a, b)
                # past 2**53 the distance is a float64's: equal to 16 digits, not exact
                ok = got == want or (got is not None and want is not None and want > 2**53
                                     and abs(got - want) <= want * 2**-52)
                failed += not ok
                print(json.dumps({"device": device, "dtype": str(dtype), "case": name,
                                  "ulps": got, "expected": want, "ok": ok}))
    print(json.dumps({"failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
