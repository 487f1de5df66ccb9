"""The audit against cuobjdump on whole real vLLM wheels: every `.so`, in one run.

Run: python benchmarks/audit_wheels.py [--repeat 5]

For PyPI's vLLM 0.33.0 x86_64 and 0.28.0 aarch64 wheels (cached under .cache/wheels), with
their `.so` members extracted once to a folder (extraction timed too: a cuobjdump user must
do it), the median wall time of `--repeat` runs of:

  listing   `sm121-build audit --format cuobjdump`  vs  `cuobjdump -lelf -lptx` on each .so
  kernels   `sm121-build audit --json` (per-kernel verdicts)  vs  `cuobjdump -res-usage`
            on each .so (which also decompresses every cubin and lists every function)

on the folder (the readers alone) and on the wheel file (ours reads the wheel; the reference
is extraction + cuobjdump, and the last column is cuobjdump alone, as if the files had been
extracted for free).  The CLI runs as a subprocess each time (Python's start and
imports counted).  Checks, before timing: the listing equals cuobjdump's, line for line,
and the wheel's JSON equals the folder's.  Ratios > 1: the audit is faster.
Goals (issue #30): kernels >= 1x `-res-usage`, listing >= 2x `-lelf -lptx`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from devkit.helpers import CACHE, cuobjdump, median_timed, pypi_download  # noqa: E402

WHEELS = (("0.33.0", "manylinux_2_28_x86_64"), ("0.28.0", "manylinux_2_28_aarch64"))


def extract(wheel: Path, dest: Path) -> list[Path]:
    """The `.so` members, with Python's zipfile (what `unzip` does, in one thread)."""
    out = []
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.namelist():
            if member.endswith(".so"):
                out.append(Path(archive.extract(member, dest)))
    return sorted(out)


def each(tool: str, flags: list[str], files: list[Path]) -> list[str]:
    lines = []
    for path in files:
        done = subprocess.run([tool, *flags, str(path)], capture_output=True, text=True,
                              check=False)
        lines.append(done.stdout)
    return lines


def audit(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "sm121_build", "audit", *args],
                          capture_output=True, text=True, check=True, cwd=ROOT).stdout


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    tool = cuobjdump()
    cores = len(os.sched_getaffinity(0))
    print(f"median of {args.repeat} runs, {cores} cores; ratio = reference / audit")
    print(f"{'wheel':<34}{'what':<9}{'input':<8}{'reference':>11}{'audit':>9}{'ratio':>8}"
          f"{'cuobjdump alone':>17}")
    worst = {"listing": float("inf"), "kernels": float("inf")}
    for version, platform in WHEELS:
        wheel = pypi_download(f"vllm=={version}", CACHE / "wheels", platform=platform)
        with tempfile.TemporaryDirectory(prefix="sm121-bench-") as tmp:
            folder = Path(tmp) / "x"
            t_unzip, files = median_timed(partial(extract, wheel, folder), 1)
            # correctness first: cuobjdump's own listing, file by file
            listed = audit("--format", "cuobjdump", str(folder))
            theirs = [f"# {p.relative_to(folder).as_posix()}\n{out.rstrip()}"
                      for p, out in zip(files, each(tool, ["-lelf", "-lptx"], files),
                                        strict=True) if out.strip()]
            if listed.rstrip() != "\n".join(theirs):
                print(f"{wheel.name}: the listing differs from cuobjdump's", file=sys.stderr)
                return 1
            if json.loads(audit("--json", str(folder))) != json.loads(audit("--json",
                                                                             str(wheel))):
                print(f"{wheel.name}: the wheel's audit differs from the folder's",
                      file=sys.stderr)
                return 1
            for what, flags, ours in (("listing", ["-lelf", "-lptx"], ["--format", "cuobjdump"]),
                                      ("kernels", ["-res-usage"], ["--json"])):
                t_ref = median_timed(partial(each, tool, flags, files), args.repeat)[0]
                for label, target, reference in (("folder", folder, t_ref),
                                                  ("wheel", wheel, t_unzip + t_ref)):
                    t_ours = median_timed(partial(audit, *ours, str(target)), args.repeat)[0]
                    ratio = reference / t_ours
                    worst[what] = min(worst[what], ratio)
                    # the wheel against cuobjdump without the extraction it needs: the
                    # strictest reading of the goal, printed beside the fair one
                    print(f"{wheel.name[:33]:<34}{what:<9}{label:<8}{reference:>10.2f}s"
                          f"{t_ours:>8.2f}s{ratio:>7.2f}x{t_ref / t_ours:>16.2f}x")
            print(f"{'':<34}(extracting the .so members: {t_unzip:.2f} s, "
                  f"{sum(p.stat().st_size for p in files) / 1e6:.0f} MB)")
    print(f"slowest: listing {worst['listing']:.2f}x cuobjdump -lelf -lptx (goal >= 2), "
          f"kernels {worst['kernels']:.2f}x cuobjdump -res-usage (goal >= 1)")
    return 0 if worst["listing"] >= 2 and worst["kernels"] >= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
