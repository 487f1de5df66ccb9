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
GUARD_FILES = ("CMakeLists.txt", "cmake/external_projects/qutlass.cmake")
MIN_CMAKE = (3, 26)


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
    found = []
    for rel in GUARD_FILES:
        path = source / rel
        if not path.exists():
            continue
        stack: list[str] = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0].strip()
            if re.match(r"if\s*\(", code):
                stack.append(re.sub(r"\s+", " ", code[code.index("(") + 1:].rstrip(")")))
            elif re.match(r"elseif\s*\(", code) and stack:
                stack[-1] = "elseif " + code[code.index("(") + 1:].rstrip(")")
            elif re.match(r"else\s*\(", code) and stack:
                stack[-1] = f"else of {stack[-1]}"
            elif re.match(r"endif\s*\(", code) and stack:
                stack.pop()
            for match in GUARD_CALL.finditer(code):
                found.append((rel, number, match.group("var"), match.group("list"),
                              stack[-1] if stack else ""))
    return found


def evaluate(source: Path, archs: str) -> list[Guard]:
    """Run each guard through the source's own cuda_archs_loose_intersection."""
    utils = source / "cmake" / "utils.cmake"
    if not utils.exists():
        raise Sm121Error(f"{source}: no cmake/utils.cmake; is this a vLLM source tree?")
    calls = find_guards(source)
    if not calls:
        return []
    script = [f'include("{utils.as_posix()}")', f'set(CUDA_ARCHS "{archs}")']
    for index, (_f, _l, _var, arch_list, _b) in enumerate(calls):
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
    for out_line in result.stdout.splitlines():
        if "SM121GUARD|" in out_line:
            key, _, value = out_line.split("SM121GUARD|", 1)[1].partition("|")
            results[int(key)] = tuple(a for a in value.split(";") if a)
    return [Guard(f, number, var, arch_list, branch, results.get(i, ()))
            for i, (f, number, var, arch_list, branch) in enumerate(calls)]


def cmake_arch_list(arch: str) -> str:
    """TORCH_CUDA_ARCH_LIST style (`12.1`, `12.1a`, `9.0 12.1`) to CMake's `12.1;9.0`."""
    items = [a for a in re.split(r"[;\s,]+", arch.strip()) if a]
    for item in items:
        if not re.fullmatch(r"\d{1,2}\.\d[af]?(\+PTX)?", item):
            raise Sm121Error(f"unknown arch {item!r} in {arch!r}: expected e.g. 12.1 or 12.1a")
    return ";".join(i.replace("+PTX", "") for i in items)
