"""Time the patch decision (`sm121-build patch --explain`'s work) on a real vLLM sdist: cmake
run as the `cmake` package's own binary and found once, against the reference of the same
run, cmake run through the package's Python launcher and looked up on every evaluation (as
before this change).

Run: python benchmarks/guard_eval.py [--version 0.19.1] [--repeat 5] [--archs 12.1]
Prints median wall times, the ratio, and checks that both give the same rule results.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from sm121_build.cuda.compat import ArchList

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from devkit.helpers import CACHE, median_timed, pypi_download  # noqa: E402
from sm121_build.source import guards  # noqa: E402
from sm121_build.source.guard_rules import PatchFor, RuleResult, apply_all  # noqa: E402


def _launcher_each_time() -> str:
    """The reference: the venv's Python launcher, its version checked on every call."""
    launcher = str(Path(sys.executable).parent / "cmake")
    subprocess.run([launcher, "--version"], capture_output=True, check=True)
    return launcher


def _cmake_tree(version: str, dest: Path) -> Path:
    sdist = pypi_download(f"vllm=={version}", CACHE / "sdists", sdist=True)
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and (
            m.name.endswith("/CMakeLists.txt") or "/cmake/" in m.name
            or m.name.endswith("/PKG-INFO") or m.name.endswith("vllm/_version.py"))
            and m.name.count("/") <= 3]
        tar.extractall(dest, members=members, filter="data")
    return next(dest.iterdir())


def _summary(results: list[RuleResult]) -> list[tuple[str, str, str]]:
    return [(r.name, r.outcome, r.detail) for r in results]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--version", default="0.19.1")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--archs", default="12.1")
    parser.add_argument("--cuda", default="13.0",
                        help="vLLM 0.19.1 with CUDA 13.0: the FP4 rule rewrites calls")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-guards-") as tmp:
        tree = _cmake_tree(args.version, Path(tmp))

        def decide() -> list[RuleResult]:
            want = PatchFor(args.version, ArchList.parse(args.archs), args.cuda)
            return apply_all(tree, want, check=True)

        binary = guards.find_cmake
        guards.find_cmake = _launcher_each_time  # type: ignore[assignment]
        reference, ref_results = median_timed(decide, args.repeat)
        guards.find_cmake = binary
        print(f"cmake: {binary()}")
        new, new_results = median_timed(decide, args.repeat)
    if _summary(ref_results) != _summary(new_results):
        print("error: the two ways gave different results", file=sys.stderr)
        return 1
    for name, outcome, detail in _summary(new_results):
        print(f"  {name}: {outcome} ({detail})")
    print(f"vLLM {args.version}, archs {args.archs}, CUDA {args.cuda}, median of {args.repeat}")
    print(f"  launcher, looked up each time (reference): {reference:.3f} s")
    print(f"  package binary, found once:                {new:.3f} s")
    print(f"  ratio reference / new:                     {reference / new:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
