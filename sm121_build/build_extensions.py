"""Build only the injected vLLM extensions (CMake + Ninja), inside the builder stage or locally.

Standard library only: this file is copied into the Docker build context and run with the
image's own python3.  Outside Docker: `python -m sm121_build.build_extensions --source SRC
--out OUT --target _C --target _moe_C` with TORCH_CUDA_ARCH_LIST, CUDA_HOME, CPATH,
LIBRARY_PATH set as in the Dockerfile.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

PTXAS_FP4 = re.compile(r"Instruction 'cvt with \.e2m1x2' not supported on \.target '(sm_\d+)'")


def _run(args: list[str], log: Path) -> int:
    """Run one step, streaming its output and appending it to the log."""
    print("+ " + " ".join(args), flush=True)
    with open(log, "a", encoding="utf-8") as out:
        out.write("+ " + " ".join(args) + "\n")
        process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, errors="replace")
        assert process.stdout is not None
        for line in process.stdout:
            out.write(line)
            sys.stdout.write(line)
        return process.wait()


def _explain_failure(log: Path) -> str:
    text = log.read_text(encoding="utf-8", errors="replace")
    match = PTXAS_FP4.search(text)
    if match:
        return (f"ptxas rejected an FP4 instruction for the plain target {match.group(1)}: "
                "an FP4 arch guard was not patched (see `sm121-build patch --explain SRC`)")
    return "the build failed; see the log above"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--build-dir", type=Path)
    parser.add_argument("--target", action="append", required=True, dest="targets")
    parser.add_argument("--define", action="append", default=[], metavar="KEY=VALUE",
                        help="Extra CMake cache entry, e.g. VLLM_CUTLASS_SRC_DIR=/opt/cutlass")
    parser.add_argument("--cmake", default=os.environ.get("CMAKE", "cmake"))
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("MAX_JOBS", "0") or 0))
    args = parser.parse_args(argv)

    build = args.build_dir or args.source / "build-sm121"
    build.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "build.log"
    log.write_text("")
    configure = [args.cmake, "-G", "Ninja", "-S", str(args.source), "-B", str(build),
                 "-DCMAKE_BUILD_TYPE=Release", "-DVLLM_TARGET_DEVICE=cuda",
                 f"-DVLLM_PYTHON_EXECUTABLE={sys.executable}"]
    if os.environ.get("CMAKE_CUDA_COMPILER"):
        configure.append(f"-DCMAKE_CUDA_COMPILER={os.environ['CMAKE_CUDA_COMPILER']}")
    if shutil.which("ccache"):
        configure += ["-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache",
                      "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
    configure += [f"-D{item}" for item in args.define]
    started = time.monotonic()
    if _run(configure, log) != 0:
        print(f"sm121-build: cmake configure failed: {_explain_failure(log)}", file=sys.stderr)
        return 1
    compile_step = [args.cmake, "--build", str(build)]
    for target in args.targets:
        compile_step += ["--target", target]
    if args.jobs:
        compile_step += ["-j", str(args.jobs)]
    if _run(compile_step, log) != 0:
        print(f"sm121-build: build failed: {_explain_failure(log)}", file=sys.stderr)
        return 1
    copied = []
    for target in args.targets:
        built = sorted(p for p in build.rglob(f"{target}*.so")
                       if re.fullmatch(rf"{re.escape(target)}(\.cpython-[^.]+|\.abi3)?\.so",
                                       p.name))
        if not built:
            print(f"sm121-build: target {target} produced no .so under {build}", file=sys.stderr)
            return 1
        shutil.copy2(built[0], args.out / built[0].name)
        copied.append(built[0].name)
    print(f"sm121-build: built {', '.join(copied)} in {time.monotonic() - started:.0f}s",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
