"""Build only the injected vLLM extensions (CMake + Ninja), inside the builder stage or locally.

Standard library only: this file is copied into the Docker build context and run with the
image's own python3.  Outside Docker: `python -m sm121_build.jobs.payload.build_extensions
--source SRC --out OUT --target _C --target _moe_C` with TORCH_CUDA_ARCH_LIST, CUDA_HOME, CPATH,
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
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the script runs on the image's own Python
    from collections.abc import Callable

# vLLM's CMake fetches these from GitHub at configure time unless pointed at a folder.
# --offline points each unset one at an empty folder.  FlashMLA, triton_kernels and
# flash-attn are separate targets; QuTLASS is compiled into _C when its arch guard matches
# (0.17.0 with CUDA 13: as 12.0a; 0.19.1 at 12.1a): set QUTLASS_SRC_DIR to keep its kernels,
# otherwise empty stand-in sources let _C build without them, and the build says so.
EXTERNAL_PROJECTS = ("FLASH_MLA_SRC_DIR", "QUTLASS_SRC_DIR", "TRITON_KERNELS_SRC_DIR",
                     "VLLM_FLASH_ATTN_SRC_DIR")
# Files vLLM's CMake reads from an external project at configure time, even when the
# project's own targets are not built: the offline stand-ins hold them, empty.
STAND_IN_FILES = {
    "FLASH_MLA_SRC_DIR": ("flash_mla/flash_mla_interface.py",),
    # FlashKDA (vLLM 0.28+): its target is defined whenever its guard matches a 12.x list
    "FLASH_KDA_SRC_DIR": ("csrc/flash_kda.cpp", "csrc/smxx/fwd_launch.cu"),
    "QUTLASS_SRC_DIR": tuple(f"qutlass/csrc/{name}" for name in (
        "bindings.cpp", "gemm.cu", "gemm_ada.cu", "fused_quantize_mx.cu",
        "fused_quantize_nv.cu", "fused_quantize_mx_sm100.cu", "fused_quantize_nv_sm100.cu")),
}
CUTLASS_HEADER = "include/cutlass/cutlass.h"

PTXAS_FP4 = re.compile(r"Instruction 'cvt with \.e2m1x2' not supported on \.target '(sm_\d+)'")
# The first line that names a cause, in the order a reader would look for it.
CAUSES = (
    ("a compiler was killed (out of memory? lower --jobs)",
     re.compile(r"(Killed signal terminated program \S+|nvcc error\s*:.*killed.*)")),
    ("ptxas", re.compile(r"(ptxas (?:fatal|error)\s*:.*)")),
    ("compiler", re.compile(r"(\S+\.(?:cu|cuh|cpp|cc|cxx|c|h|hpp|hh)(?:\(\d+\)|:\d+(?::\d+)?):"
                            r"?\s+(?:fatal )?error\b.*)")),
    ("linker", re.compile(r"((?:/usr/bin/)?ld(?:\.\w+)?: .*"
                          r"(?:undefined reference|cannot find).*)")),
    ("CMake", re.compile(r"(CMake Error.*)")),
    ("compiler", re.compile(r"((?:At end of source|\S+): (?:fatal )?error: .*)")),
)
NVCC_FILE = re.compile(r'errors? detected in the compilation of "([^"]+)"')


class ScriptError(Exception):
    """A build input this script cannot use; main() prints it and returns 1."""


def _run(args: list[str], log: Path, env: dict[str, str],
         output: Callable[[str], object] = sys.stdout.write) -> int:
    """Run one step, streaming its output (to stdout, or to `output`: `local`'s progress
    line) and appending it to the log."""
    print("+ " + " ".join(args), flush=True)
    with open(log, "a", encoding="utf-8") as out:
        out.write("+ " + " ".join(args) + "\n")
        process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, errors="replace", env=env)
        assert process.stdout is not None
        for line in process.stdout:
            out.write(line)
            output(line)
        return process.wait()


def _explain_failure(log: Path) -> str:
    """One line naming the cause: ptxas's FP4 rejection, a killed compiler, the first
    compiler/ptxas/linker error, or CMake's own error (with the line that follows it)."""
    text = log.read_text(encoding="utf-8", errors="replace")
    match = PTXAS_FP4.search(text)
    if match:
        return (f"ptxas rejected an FP4 instruction for the plain target {match.group(1)}: "
                "an FP4 arch guard was not patched (see `sm121-build patch --explain SRC`)")
    lines = text.splitlines()
    for label, pattern in CAUSES:
        for index, line in enumerate(lines):
            found = pattern.search(line)
            if not found:
                continue
            cause = found.group(1).strip()
            if label == "CMake":
                following = next((n.strip() for n in lines[index + 1:index + 4] if n.strip()), "")
                return f"CMake: {cause} {following}".strip()
            if label == "compiler" and (where := NVCC_FILE.search(text)) and \
                    where.group(1) not in cause:
                cause += f" (in {where.group(1)})"
            return cause if label == "ptxas" else f"{label}: {cause}"
    return "the build failed; see the log above"


def missing_tools(cmake: str, path: str | None = None) -> list[str]:
    """Build tools this environment lacks (each with how the recipe gets it)."""
    missing = []
    if not shutil.which(cmake, path=path):
        missing.append(f"{cmake} (pip install cmake)")
    if not shutil.which("ninja", path=path):
        missing.append("ninja (pip install ninja)")
    return missing


def cutlass_settings(path: Path, unpack_to: Path,
                     python_path: str | None = None) -> tuple[dict[str, str], list[str]]:
    """(environment, CMake definitions) that make vLLM use a local CUTLASS.

    Takes a CUTLASS source tree, or PyPI's `nvidia-cutlass` wheel (file or unpacked), which
    ships the same headers under cutlass_library/source/ and the cutlass_library package
    that vLLM's kernel generators import.
    """
    if path.is_file() and path.suffix == ".whl":
        import zipfile

        with zipfile.ZipFile(path) as wheel:
            wheel.extractall(unpack_to)
        path = unpack_to
    if (path / CUTLASS_HEADER).exists():  # a CUTLASS checkout: its own CMakeLists runs
        return {"VLLM_CUTLASS_SRC_DIR": str(path)}, []
    source = path / "cutlass_library" / "source"
    if not (source / CUTLASS_HEADER).exists():
        raise ScriptError(f"{path} is neither a CUTLASS checkout nor an nvidia-cutlass wheel "
                          "(no include/cutlass/cutlass.h)")
    joined = os.pathsep.join(p for p in (str(path), python_path) if p)
    return ({"VLLM_CUTLASS_SRC_DIR": str(source), "PYTHONPATH": joined},
            [f"CUTLASS_DIR={source}", f"CUTLASS_INCLUDE_DIR={source / 'include'}",
             f"CUTLASS_TOOLS_UTIL_INCLUDE_DIR={source / 'tools' / 'util' / 'include'}"])


_SRC_DIR_ENV = re.compile(r"\$ENV\{(\w+_SRC_DIR)\}")
# The one external project that must be real (its headers are compiled into _C): --cutlass.
NEEDS_REAL = frozenset({"VLLM_CUTLASS_SRC_DIR"})


def external_projects(source: Path | None) -> tuple[str, ...]:
    """Every `*_SRC_DIR` the source's CMake reads from the environment (releases add
    projects: DeepGEMM, FMHA for sm100, ...), plus the ones known from older releases."""
    found = list(EXTERNAL_PROJECTS)
    if source is not None:
        files = [source / "CMakeLists.txt", *sorted((source / "cmake").rglob("*.cmake"))]
        for path in files:
            if path.is_file():
                found += _SRC_DIR_ENV.findall(path.read_text(errors="replace"))
    return tuple(name for name in dict.fromkeys(found) if name not in NEEDS_REAL)


_SOURCE_REF = re.compile(r"\$\{(?!CMAKE_|PROJECT_)\w+_SOURCE_DIR\}/"
                         r"([\w./+-]+\.(?:cu|cuh|cpp|cc|cxx|c|h|hpp|py))")


def stand_in_sources(source: Path | None) -> dict[str, tuple[str, ...]]:
    """Per `*_SRC_DIR`: the files its project's CMake file names under the fetched tree
    (`${flashmla_SOURCE_DIR}/csrc/api/api.cpp`): CMake checks they exist even for targets
    that are never built, so each stand-in gets them, empty."""
    found: dict[str, tuple[str, ...]] = {}
    if source is None:
        return found
    for path in sorted((source / "cmake").rglob("*.cmake")):
        text = path.read_text(errors="replace")
        files = tuple(dict.fromkeys(_SOURCE_REF.findall(text)))
        for name in dict.fromkeys(_SRC_DIR_ENV.findall(text)):
            found[name] = found.get(name, ()) + files
    return found


def stand_ins(build: Path, names: Iterable[str], defined: frozenset[str] = frozenset(),
              environ: dict[str, str] | None = None,
              files: dict[str, tuple[str, ...]] | None = None) -> dict[str, str]:
    """Empty folders for the external projects named, unless their *_SRC_DIR is set (in the
    environment, or as a CMake definition: `defined`)."""
    environ = dict(os.environ) if environ is None else environ
    env = {}
    for name in names:
        if not environ.get(name) and name not in defined:
            empty = build / "offline-empty" / name.lower()
            empty.mkdir(parents=True, exist_ok=True)
            # non-empty: FetchContent refuses an empty SOURCE_DIR unless fully disconnected
            (empty / "SM121_STAND_IN").write_text("an empty stand-in: not built\n")
            for relative in (*STAND_IN_FILES.get(name, ()), *(files or {}).get(name, ())):
                if ".." in Path(relative).parts:
                    continue
                (empty / relative).parent.mkdir(parents=True, exist_ok=True)
                (empty / relative).touch()
            env[name] = str(empty)
    return env


def offline_settings(build: Path, source: Path | None = None,
                     defined: frozenset[str] = frozenset(),
                     environ: dict[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """Nothing fetched: unset external projects become empty folders."""
    env = stand_ins(build, external_projects(source), defined, environ,
                    stand_in_sources(source))
    if "QUTLASS_SRC_DIR" in env:
        print("sm121-build: --offline without QUTLASS_SRC_DIR: QuTLASS kernels are left out "
              "of _C (empty stand-in sources)", file=sys.stderr, flush=True)
    return env, ["FETCHCONTENT_FULLY_DISCONNECTED=ON"]


MISSING_SOURCE = re.compile(r"Cannot find source file:\s+(\S+)")
STAND_IN_TRIES = 8


def _configure(configure: list[str], log: Path, env: dict[str, str], build: Path,
               output: Callable[[str], object] = sys.stdout.write) -> int:
    """Configure; when CMake misses a source file inside an empty stand-in (a release whose
    external project lists files STAND_IN_FILES does not know: 0.33.0's FlashMLA), create it
    empty and configure again (those projects' targets are never built here)."""
    stand_ins = (build / "offline-empty").resolve()
    for _ in range(STAND_IN_TRIES):
        start = log.stat().st_size if log.exists() else 0
        code = _run(configure, log, env, output)
        if code == 0:
            return 0
        with open(log, encoding="utf-8", errors="replace") as handle:
            handle.seek(start)
            missing = [Path(m) for m in MISSING_SOURCE.findall(handle.read())]
        inside = [m for m in missing if m.resolve().is_relative_to(stand_ins)
                  and not m.exists()]
        if not inside or len(inside) != len(missing):
            return code
        for path in inside:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("// an empty stand-in: not built\n")
        print(f"sm121-build: {len(inside)} source file(s) of stand-in projects created "
              "empty; configuring again", flush=True)
    return code


def main(argv: list[str] | None = None, environ: dict[str, str] | None = None,
         output: Callable[[str], object] = sys.stdout.write) -> int:
    """The build; `environ` (default: this process's) is read, never changed: the compile
    steps get a copy with the script's additions.  `output` takes each line the configure
    and compile steps print (default: stdout)."""
    env = dict(os.environ if environ is None else environ)
    try:
        return _main(argv, env, output)
    except ScriptError as exc:
        print(f"sm121-build: build failed: {exc}", file=sys.stderr, flush=True)
        return 1


def _main(argv: list[str] | None, env: dict[str, str],
          output: Callable[[str], object] = sys.stdout.write) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--build-dir", type=Path)
    parser.add_argument("--target", action="append", default=[], dest="targets")
    parser.add_argument("--define", action="append", default=[], metavar="KEY=VALUE",
                        help="Extra CMake cache entry, e.g. VLLM_CUTLASS_SRC_DIR=/opt/cutlass")
    parser.add_argument("--cutlass", type=Path, metavar="PATH",
                        help="Local CUTLASS: a source tree, or the nvidia-cutlass wheel "
                        "(.whl or unpacked) from PyPI")
    parser.add_argument("--offline", action="store_true",
                        help="Fetch nothing: FETCHCONTENT_FULLY_DISCONNECTED, and the external "
                        "projects (FlashMLA, QuTLASS, triton_kernels, flash-attn) point at "
                        "empty folders unless their *_SRC_DIR is set")
    parser.add_argument("--stand-in", action="append", default=[], metavar="NAME_SRC_DIR",
                        help="An external project none of the targets needs: unless set, "
                        "point it at an empty folder instead of fetching it at configure")
    parser.add_argument("--configure-only", action="store_true",
                        help="Stop after CMake configure (then e.g. `ninja -C BUILD <object>`)")
    parser.add_argument("--cmake", default=env.get("CMAKE", "cmake"))
    parser.add_argument("--jobs", type=int, default=int(env.get("MAX_JOBS", "0") or 0))
    args = parser.parse_args(argv)
    if not args.targets and not args.configure_only:
        parser.error("name at least one --target (e.g. --target _C --target _moe_C)")

    missing = missing_tools(args.cmake, env.get("PATH"))
    if missing:
        print(f"sm121-build: build failed: not found on PATH: {', '.join(missing)}",
              file=sys.stderr, flush=True)
        return 1
    # absolute: CMake resolves relative paths against its own source and build dirs
    args.source, args.out = args.source.resolve(), args.out.resolve()
    build = (args.build_dir or args.source / "build-sm121").resolve()
    build.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "build.log"
    log.write_text("")
    configure = [args.cmake, "-G", "Ninja", "-S", str(args.source), "-B", str(build),
                 "-DCMAKE_BUILD_TYPE=Release", "-DVLLM_TARGET_DEVICE=cuda",
                 f"-DVLLM_PYTHON_EXECUTABLE={sys.executable}"]
    if env.get("CMAKE_CUDA_COMPILER"):
        configure.append(f"-DCMAKE_CUDA_COMPILER={env['CMAKE_CUDA_COMPILER']}")
    if shutil.which("ccache", path=env.get("PATH")):
        configure += ["-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache",
                      "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
    defines = list(args.define)
    defined = frozenset(d.split("=", 1)[0] for d in defines)
    env.update(stand_ins(build, args.stand_in, defined, env))
    if args.offline:
        added, extra = offline_settings(build, args.source, defined, env)
        env.update(added)
        defines = extra + defines
    if args.cutlass:
        added, extra = cutlass_settings(args.cutlass.resolve(), build / "cutlass",
                                        env.get("PYTHONPATH"))
        env.update(added)
        defines = extra + defines
    configure += [f"-D{item}" for item in defines]
    started = time.monotonic()
    if _configure(configure, log, env, build, output) != 0:
        print(f"sm121-build: cmake configure failed: {_explain_failure(log)}", file=sys.stderr)
        return 1
    if args.configure_only:
        print(f"sm121-build: configured {build}", flush=True)
        return 0
    compile_step = [args.cmake, "--build", str(build)]
    for target in args.targets:
        compile_step += ["--target", target]
    if args.jobs:
        compile_step += ["-j", str(args.jobs)]
    if _run(compile_step, log, env, output) != 0:
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
