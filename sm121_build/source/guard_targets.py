"""Which extension targets a guard call feeds: so that a guard counts only for its own.

vLLM's CMake lists the sources of one extension, with their guards, before the command that
defines it (`define_extension_target(_C_stable_libtorch …)` after the `_C` kernels,
`_moe_C_stable_libtorch` after the MoE ones); an external project's file
(`cmake/external_projects/qutlass.cmake`) defines its own targets.  So a call in an external
project's file feeds the targets that file defines (or the project's, from
external_projects.yaml, for a project built in its own tree such as flash-attention); a call
in any other file feeds the next target defined after it in that file.  A call for which
neither holds feeds every target (None): it counts against all of them.  A project file that
defines no target (DeepGEMM builds `_C_extension` with a custom command) feeds a pseudo
target named after the file, so its guards count against no stock extension.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

from sm121_build.core.vllm import projects
from sm121_build.source.cmake_lang import CMakeSyntaxError, commands, read_source
from sm121_build.source.guards import Call

DEFINE = re.compile(r"^(?:define_\w*extension_target|python_add_library|add_library)$")
EXTERNAL_DIR = "cmake/external_projects/"


def defined_targets(text: str) -> list[tuple[int, str]]:
    """(line, name) of every extension target a CMake text defines, in order."""
    return [(cmd.line, cmd.words[0].value) for cmd in commands(text)
            if DEFINE.match(cmd.key) and cmd.words and re.fullmatch(r"\w+", cmd.words[0].value)
            and not (len(cmd.words) > 1 and cmd.words[1].value in ("INTERFACE", "IMPORTED",
                                                                  "ALIAS", "OBJECT"))]


def guard_owners(source: Path, calls: list[Call]) -> dict[str, tuple[str, ...] | None]:
    """Call location (`file:line`) -> the targets it feeds; None when that is not known."""
    defined: dict[str, list[tuple[int, str]]] = {}
    owners: dict[str, tuple[str, ...] | None] = {}
    for call in calls:
        if call.file not in defined:
            try:
                defined[call.file] = defined_targets(read_source(source / call.file))
            except (OSError, UnicodeDecodeError, CMakeSyntaxError):
                defined[call.file] = []
        found = defined[call.file]
        location = f"{call.file}:{call.line}"
        if call.file.startswith(EXTERNAL_DIR):
            names = tuple(dict.fromkeys(name for _, name in found)) or next(
                (p.targets for p in projects() if p.cmake == call.file), ())
            # a project file that defines no extension target of its own builds something
            # else (DeepGEMM's _C_extension by a custom command): its guards feed that
            owners[location] = names or (f"({PurePosixPath(call.file).stem})",)
        else:
            following = [name for line, name in found if line > call.line]
            owners[location] = (following[0],) if following else None
    return owners


def feeds(owners: dict[str, tuple[str, ...] | None], location: str, target: str) -> bool:
    """Whether the call at `location` may feed `target` (an unknown owner feeds every one)."""
    found = owners.get(location)
    return found is None or target in found
