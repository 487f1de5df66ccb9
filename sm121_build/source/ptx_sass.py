"""The sass-from-ptx rule (patches/sass-from-ptx.yaml): SASS for the GPU from the same PTX.

A rule of kind `macro-insert` names a CMake file, a macro in it and a text to insert before
the macro's `endmacro()`.  The macro is found with the CMake reader (any spacing or case, no
version strings); the text is rendered for the GPU and the build's narrowed arch list, and
after inserting, the tree's own macro is run through `cmake -P` (with `set_gencode_flag_for_srcs`
overridden to print what it is given): a PTX-only list must gain exactly the SASS flag, a list
the GPU loads natively nothing.  A tree that already holds the text is left alone.
"""

from __future__ import annotations

import hashlib
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sm121_build.core.errors import PatchDrift, Sm121Error
from sm121_build.core.outputs import replace_bytes
from sm121_build.cuda.compat import ArchList, Target
from sm121_build.source.cmake_lang import (
    CMakeSyntaxError,
    commands,
    read_source,
    real_file,
    source_text_bytes,
)
from sm121_build.source.cmake_run import CMakeScript, current_runner
from sm121_build.source.guards import cmake_error

KIND = "macro-insert"
ENTRY = re.compile(r"^(\d+)\.(\d+)([af]?)$")


@dataclass(frozen=True)
class MacroRule:
    name: str
    projects: tuple[str, ...]
    file: str
    macro: str
    text: str
    targets: tuple[str, ...]
    digest: str

    @property
    def marker(self) -> str:
        """The text's first line: a tree holding it already has the rule applied."""
        return self.text.strip().splitlines()[0].split("{", 1)[0].strip()


@dataclass(frozen=True)
class MacroResult:
    name: str
    outcome: str  # "applied" | "not needed" | "not applicable"
    detail: str
    diff: str = ""


def is_macro_rule(raw: Any) -> bool:
    return isinstance(raw, dict) and raw.get("kind") == KIND


def parse_rule(raw: dict[str, Any], text: str) -> MacroRule:
    unknown = set(raw) - {"name", "kind", "projects", "file", "macro", "text", "targets"}
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(sorted(unknown))}")
    for key in ("name", "file", "macro", "text"):
        if not isinstance(raw.get(key), str) or not raw[key].strip():
            raise ValueError(f"{key} must be a non-empty string")
    projects = raw.get("projects")
    if not isinstance(projects, list) or not projects or \
            not all(isinstance(p, str) for p in projects):
        raise ValueError("projects must be a non-empty list of strings")
    if "{sass}" not in raw["text"] or "{native}" not in raw["text"]:
        raise ValueError("text must use {sass} and {native}")
    targets = raw.get("targets") or []
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ValueError("targets must be a list of strings")
    return MacroRule(raw["name"], tuple(projects), raw["file"], raw["macro"], raw["text"],
                     tuple(targets), hashlib.sha256(text.encode()).hexdigest())


def native_regex(gpu: Target) -> str:
    """A CMake regex (as written in a quoted argument) of the arch-list entries the GPU loads
    natively: plain and family entries of its major up to its minor, and its own `a` entry."""
    minors = "".join(str(m) for m in range(gpu.minor + 1))
    return rf"^{gpu.major}\\.[{minors}]f?$|^{gpu.major}\\.{gpu.minor}a$"


def sass_arch(effective: ArchList, gpu: Target) -> str:
    """The SASS target: the lowest 12.x entry of the build's narrowed arch list the GPU
    loads (`12.0` under vLLM's CUDA 13 list: sm_120, which sm_121 loads), else the GPU's own."""
    found = []
    for entry in effective.cmake_items:
        match = ENTRY.match(entry)
        if match and int(match.group(1)) == gpu.major and int(match.group(2)) <= gpu.minor:
            found.append(int(match.group(2)))
    minor = min(found) if found else gpu.minor
    return f"{gpu.major}{minor}"


def render_text(rule: MacroRule, gpu: Target, sass: str) -> str:
    """The text for this GPU, indented as a macro body."""
    text = rule.text.replace("{native}", native_regex(gpu)).replace("{sass}", sass)
    return "".join(f"  {line}\n" if line.strip() else "\n" for line in text.splitlines())


def _macro_end(text: str, macro: str) -> int | None:
    """The offset of the `endmacro(` that closes `macro(NAME`; None when there is none."""
    inside = False
    for cmd in commands(text):
        if cmd.key == "macro" and cmd.words and cmd.words[0].value.lower() == macro.lower():
            inside = True
        elif inside and cmd.key == "endmacro":
            return cmd.start
    return None


def apply_macro_rule(rule: MacroRule, tree: Path, effective: ArchList, gpu: Target,
                     check: bool = False) -> MacroResult:
    """Insert the rule's text into the tree's macro (or say why not); verified with CMake."""
    path = tree / rule.file
    if not path.is_file():
        return MacroResult(rule.name, "not applicable", f"no {rule.file}")
    try:
        original = read_source(path)
        end = _macro_end(original, rule.macro)
    except (OSError, UnicodeDecodeError, CMakeSyntaxError) as exc:
        raise Sm121Error(f"{rule.file}: cannot read it as CMake: {exc}") from None
    if end is None:
        return MacroResult(rule.name, "not applicable", f"{rule.file} defines no {rule.macro}")
    if rule.marker in original:
        return MacroResult(rule.name, "not needed", f"{rule.macro} already has it")
    sass = sass_arch(effective, gpu)
    line_start = original.rfind("\n", 0, end) + 1
    inserted = render_text(rule, gpu, sass)
    patched = original[:line_start] + inserted + original[line_start:]
    _verify(rule, original, patched, gpu, sass)
    if not check:
        real = real_file(tree, rule.file)  # through the one way out: never through a link
        replace_bytes(real, source_text_bytes(patched), stat.S_IMODE(real.stat().st_mode))
    diff = "".join(f"+{line}\n" for line in inserted.splitlines())
    line = original.count("\n", 0, line_start) + 1
    return MacroResult(rule.name, "applied", f"{rule.macro} in {rule.file}:{line} gives "
                       f"PTX-only sources sm_{sass} SASS from the same PTX", diff)


def gencode_flags(utils_text: str, cuda_archs: ArchList) -> list[str]:
    """What the given utils.cmake's set_gencode_flags_for_srcs hands nvcc for one source whose
    arch list is `cuda_archs` (`arch=compute_89,code=sm_89`, …), run with CMake where the
    command's context runs a tree's code (`cmake_run.current_runner`: a throwaway container
    by default, never this host unless asked)."""
    body = ("macro(set_gencode_flag_for_srcs)\n"
            '  cmake_parse_arguments(sm121 "" "ARCH;CODE" "SRCS" ${ARGN})\n'
            '  message(STATUS "SM121GENCODE|arch=${sm121_ARCH},code=${sm121_CODE}")\n'
            "endmacro()\n"
            f'set_gencode_flags_for_srcs(SRCS "x.cu" CUDA_ARCHS "{cuda_archs.torch}")\n')
    result = current_runner().run(CMakeScript(utils_text, body))
    if result.status is None:
        raise PatchDrift("cmake -P of set_gencode_flags_for_srcs gave no result within its "
                         "time limit (a loop in the tree's CMake?): stopped")
    if result.status != 0:
        raise PatchDrift(f"cmake -P could not run set_gencode_flags_for_srcs: "
                         f"{cmake_error(result.stderr)}")
    return [line.split("SM121GENCODE|", 1)[1].strip() for line in result.stdout.splitlines()
            if "SM121GENCODE|" in line]


def _verify(rule: MacroRule, original: str, patched: str, gpu: Target, sass: str) -> None:
    """The patched macro gives a PTX-only list exactly one SASS flag more, and a list the GPU
    loads natively nothing more, than the original does."""
    probes = {ArchList.parse("8.0+PTX"): [f"arch=compute_80,code=sm_{sass}"],
              ArchList.parse(f"8.0+PTX;{gpu.major}.0"): []}
    for archs, extra in probes.items():
        before = gencode_flags(original, archs)
        after = gencode_flags(patched, archs)
        if after != before + extra:
            raise PatchDrift(f"rule {rule.name}: {rule.macro} in {rule.file} gives "
                             f"{after} for {archs.torch!r} after the insert (expected "
                             f"{before + extra}); not building blind")
