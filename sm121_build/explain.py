"""Know the build's outcome before compiling: evaluate vLLM's arch guards with CMake itself.

Every `cuda_archs_loose_intersection(VAR "LIST" "${CUDA_ARCHS}")` call of a source tree is
evaluated with the pinned source's own function (`cmake/utils.cmake`) through `cmake -P`,
for the arch list the build will use.  Its semantics changed between releases, so no
re-implementation is attempted: CMake answers.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import Sm121Error

GUARD_CALL = re.compile(r'cuda_archs_loose_intersection\(\s*(?P<var>\w+)\s+"(?P<list>[^"]*)"'
                        r'\s+"\$\{(?P<src>\w+)\}"\s*\)')
# Guards whose kernels use FP4 conversions that ptxas rejects for plain sm_12x targets.
FP4_GUARD = re.compile(r"^(?:FP4|NVFP4|MXFP4|QUTLASS)\w*ARCHS$")
PLAIN_SM12X = re.compile(r"^12\.\d+$")
GUARD_START = re.compile(r"\bcuda_archs_loose_intersection\s*\(")
NARROWING = "CUDA_ARCHS"
GUARD_FILES = ("CMakeLists.txt", "cmake/external_projects/qutlass.cmake")
MIN_CMAKE = (3, 26)
SUPPORTED_SET = re.compile(r"^\s*set\(\s*CUDA_SUPPORTED_ARCHS\b")
DEFAULT_CUDA = "13.0"


@dataclass(frozen=True)
class Guard:
    """One guard call and what it yields for the requested archs."""

    file: str
    line: int
    variable: str
    arch_list: str
    branch: str
    result: tuple[str, ...]

    @property
    def is_fp4(self) -> bool:
        return bool(FP4_GUARD.match(self.variable))

    @property
    def plain_sm12x(self) -> tuple[str, ...]:
        return tuple(a for a in self.result if PLAIN_SM12X.match(a))

    @property
    def breaks_ptxas(self) -> bool:
        """An FP4 guard handing a plain 12.x target to ptxas: `cvt ... e2m1x2` fails."""
        return self.is_fp4 and bool(self.plain_sm12x)


def find_cmake() -> str:
    """cmake from this environment (the `cmake` PyPI package) when the system one is older."""
    candidates = [str(Path(sys.executable).parent / "cmake"), "cmake"]
    for candidate in candidates:
        try:
            out = subprocess.run([candidate, "--version"], capture_output=True, text=True,
                                 check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            continue
        match = re.search(r"version (\d+)\.(\d+)", out)
        if match and (int(match.group(1)), int(match.group(2))) >= MIN_CMAKE:
            return candidate
    raise Sm121Error(
        f"cmake >= {MIN_CMAKE[0]}.{MIN_CMAKE[1]} not found: `pip install cmake` (vLLM needs it)")


def find_guards(source: Path) -> list[tuple[str, int, str, str, str]]:
    """(file, line, variable, arch list, enclosing branch) of every guard call."""
    return _scan_guards(source)[0]


def unread_guard_calls(source: Path) -> list[str]:
    """`file:line` of each guard call GUARD_CALL cannot read (e.g. an unquoted argument):
    its result cannot be evaluated."""
    return _scan_guards(source)[1]


def _scan_guards(source: Path) -> tuple[list[tuple[str, int, str, str, str]], list[str]]:
    found = []
    unread = []
    for rel in GUARD_FILES:
        path = source / rel
        if not path.exists():
            continue
        stack: list[str] = []
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            code = line.split("#", 1)[0].strip()
            start = GUARD_START.search(code)
            if start and ")" not in code[start.end():]:
                # a call split over lines: join it up to its closing parenthesis
                for more in lines[number:number + 8]:
                    code += " " + more.split("#", 1)[0].strip()
                    if ")" in more:
                        break
            if re.match(r"if\s*\(", code):
                stack.append(re.sub(r"\s+", " ", code[code.index("(") + 1:].rstrip(")")))
            elif re.match(r"elseif\s*\(", code) and stack:
                stack[-1] = "elseif " + code[code.index("(") + 1:].rstrip(")")
            elif re.match(r"else\s*\(", code) and stack:
                stack[-1] = f"else of {stack[-1]}"
            elif re.match(r"endif\s*\(", code) and stack:
                stack.pop()
            for call in GUARD_START.finditer(code):
                match = GUARD_CALL.match(code, call.start())
                if match is None:
                    if "function(" not in code and \
                            not re.match(rf"\s*{NARROWING}\b", code[call.end():]):
                        unread.append(f"{rel}:{number}")
                elif match.group("var") != NARROWING:  # narrowing: see effective_archs
                    found.append((rel, number, match.group("var"), match.group("list"),
                                  stack[-1] if stack else ""))
    return found, unread


def supported_archs_block(source: Path) -> list[str]:
    """The top-level `if()` chain of CMakeLists.txt that sets CUDA_SUPPORTED_ARCHS.

    vLLM narrows the requested archs to that list (by CUDA version) before any guard runs:
    with CUDA 13 some releases list `12.0` but not `12.1`, so `12.1` builds as `12.0`.
    """
    path = source / "CMakeLists.txt"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    depth, start = 0, None
    for index, line in enumerate(lines):
        code = line.split("#", 1)[0].strip()
        if re.match(r"if\s*\(", code):
            if depth == 0:
                start = index
            depth += 1
        elif re.match(r"endif\s*\(", code) and depth:
            depth -= 1
            if depth == 0 and start is not None:
                block = lines[start:index + 1]
                if any(SUPPORTED_SET.match(b) for b in block):
                    return block
        elif depth == 0 and SUPPORTED_SET.match(code):
            return [line]
    return []


def effective_archs(source: Path, archs: str, cuda_version: str = DEFAULT_CUDA) -> str:
    """The CUDA_ARCHS vLLM's CMake derives from the requested archs (`;`-joined)."""
    return _run(source, archs, cuda_version, [])[1]


def evaluate(source: Path, archs: str, cuda_version: str = DEFAULT_CUDA) -> list[Guard]:
    """Run each guard through the source's own cuda_archs_loose_intersection.

    The requested archs are first narrowed as vLLM's CMakeLists.txt does (the
    CUDA_SUPPORTED_ARCHS list for `cuda_version`), so every guard sees the CUDA_ARCHS a
    real configure would give it.
    """
    calls = find_guards(source)
    if not calls:
        return []
    results = _run(source, archs, cuda_version, [c[3] for c in calls])[0]
    return [Guard(f, number, var, arch_list, branch, results.get(i, ()))
            for i, (f, number, var, arch_list, branch) in enumerate(calls)]


def _run(source: Path, archs: str, cuda_version: str,
         lists: list[str]) -> tuple[dict[int, tuple[str, ...]], str]:
    utils = source / "cmake" / "utils.cmake"
    if not utils.exists():
        raise Sm121Error(f"{source}: no cmake/utils.cmake; is this a vLLM source tree?")
    if not re.fullmatch(r"\d+\.\d+", cuda_version):
        raise Sm121Error(f"unknown CUDA version {cuda_version!r}: expected e.g. 13.0")
    script = [f'include("{utils.as_posix()}")', f'set(CUDA_ARCHS "{archs}")']
    supported = supported_archs_block(source)
    if supported:
        script += [f'set(CMAKE_CUDA_COMPILER_VERSION "{cuda_version}")', *supported,
                   'cuda_archs_loose_intersection(CUDA_ARCHS "${CUDA_SUPPORTED_ARCHS}" '
                   '"${CUDA_ARCHS}")']
    script.append('message(STATUS "SM121ARCHS|${CUDA_ARCHS}")')
    for index, arch_list in enumerate(lists):
        script.append(f'cuda_archs_loose_intersection(OUT "{arch_list}" "${{CUDA_ARCHS}}")')
        script.append(f'message(STATUS "SM121GUARD|{index}|${{OUT}}")')
    with tempfile.TemporaryDirectory(prefix="sm121-explain-") as tmp:
        path = Path(tmp) / "explain.cmake"
        path.write_text("\n".join(script) + "\n")
        result = subprocess.run([find_cmake(), "-P", str(path)], capture_output=True, text=True,
                                check=False, cwd=tmp)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise Sm121Error(f"cmake -P could not evaluate {utils}: {last}")
    results: dict[int, tuple[str, ...]] = {}
    effective = ""
    for out_line in result.stdout.splitlines():
        if "SM121GUARD|" in out_line:
            key, _, value = out_line.split("SM121GUARD|", 1)[1].partition("|")
            results[int(key)] = tuple(a for a in value.split(";") if a)
        elif "SM121ARCHS|" in out_line:
            effective = out_line.split("SM121ARCHS|", 1)[1].strip()
    return results, effective


def cmake_arch_list(arch: str) -> str:
    """TORCH_CUDA_ARCH_LIST style (`12.1`, `12.1a`, `9.0 12.1`) to CMake's `12.1;9.0`."""
    items = [a for a in re.split(r"[;\s,]+", arch.strip()) if a]
    for item in items:
        if not re.fullmatch(r"\d{1,2}\.\d[af]?(\+PTX)?", item):
            raise Sm121Error(f"unknown arch {item!r} in {arch!r}: expected e.g. 12.1 or 12.1a")
    return ";".join(i.replace("+PTX", "") for i in items)
