"""vLLM's external projects that hold extensions (flash-attention): which commit the vLLM
source pins, fetching it (or checking a local copy), and which extension targets it defines.

vLLM's CMake fetches flash-attention from GitHub at configure time (`FetchContent_Declare(
vllm-flash-attn GIT_TAG <commit>)`), or takes `VLLM_FLASH_ATTN_SRC_DIR`.  To rebuild
`_vllm_fa2_C` with its arch guard extended, the tool brings that exact commit itself, applies
the project's rules (patches/ with `project: vllm-flash-attn`) and hands the tree to the
builder as `VLLM_FLASH_ATTN_SRC_DIR`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sm121_build.core.errors import Sm121Error
from sm121_build.core.vllm import Project, project_named, project_of_target, projects
from sm121_build.source.cmake_lang import CMakeSyntaxError, commands, read_source


@dataclass(frozen=True)
class ProjectPin:
    """Where a vLLM tree says to fetch a project from."""

    project: Project
    repository: str
    commit: str
    declared_in: str  # file:line


def _missing(project: Project, path: Path) -> list[str]:
    """The files a tree lacks to be this project."""
    return [c for c in project.check if not (path / c).exists()]


def tree_project(path: Path) -> Project | None:
    """The external project a source tree is (None: not one of them, e.g. vLLM itself)."""
    return next((p for p in projects() if not _missing(p, path)
                 and not (path / "vllm" / "__init__.py").exists()
                 and not (path / "csrc" / "ops.h").exists()), None)


def declared_targets(vllm_source: Path) -> set[str]:
    """Targets the vLLM tree can build through its external projects."""
    return {t for p in projects() if (vllm_source / p.cmake).is_file() for t in p.targets}


def read_pin(vllm_source: Path, project: Project) -> ProjectPin:
    """GIT_REPOSITORY and GIT_TAG of the project's FetchContent_Declare in the vLLM tree."""
    path = vllm_source / project.cmake
    if not path.is_file():
        raise Sm121Error(f"the vLLM source has no {project.cmake}: it does not build "
                         f"{project.name}")
    try:
        found = commands(read_source(path, "replace"))
    except CMakeSyntaxError as exc:
        raise Sm121Error(f"{project.cmake}: not readable as CMake: {exc}") from None
    for cmd in found:
        words = [w.value for w in cmd.words]
        if cmd.key != "fetchcontent_declare" or words[:1] != [project.name]:
            continue
        fields = dict(zip(words[1::2], words[2::2], strict=False))
        tag, repo = fields.get("GIT_TAG"), fields.get("GIT_REPOSITORY")
        if tag and repo:
            if not re.fullmatch(r"[0-9a-f]{7,40}|[A-Za-z0-9][\w.+-]{0,127}", tag):
                raise Sm121Error(f"{project.cmake}:{cmd.line}: GIT_TAG {tag!r} is not a "
                                 "commit or tag")
            return ProjectPin(project, repo, tag, f"{project.cmake}:{cmd.line}")
    raise Sm121Error(f"{project.cmake}: no FetchContent_Declare({project.name} GIT_REPOSITORY "
                     "… GIT_TAG …) found; pass the project's source with --fa-source DIR")


def projects_for(targets: Iterable[str], fa_source: Path | None) -> list[Project]:
    """The external projects whose extensions are built; each must have a rule that builds it
    for sm_12x (flash-attention 3 has none: sm_90a code)."""
    from sm121_build.source.guard_rules import fixable_targets

    found: list[Project] = []
    fixable = fixable_targets()
    for target in targets:
        project = project_of_target(target)
        if project is None:
            continue
        if target not in fixable:
            raise Sm121Error(f"{target} ({project.name}) has no sm_12x implementation this tool "
                             f"can build: no rule in patches/ extends its guard (rebuildable "
                             f"here: {', '.join(sorted(fixable)) or 'none'})")
        if project not in found:
            found.append(project)
    if fa_source is not None and not any(p.name == "vllm-flash-attn" for p in found):
        raise Sm121Error("--fa-source is given but no flash-attention extension is built "
                         "(add --ext _vllm_fa2_C or --ext auto)")
    return found


def require_project_tree(path: Path, name: str) -> None:
    project = project_named(name)
    assert project is not None
    missing = _missing(project, path)
    if missing:
        raise Sm121Error(f"{path} is not a {name} tree (no {' or '.join(missing)})")


def stand_in_envs(built: Iterable[str]) -> list[str]:
    """The `*_SRC_DIR` of every project whose variable is not in `built`: the build points
    those at empty stand-ins instead of fetching them at configure time."""
    given = set(built)
    return [p.env for p in projects() if p.env not in given]


_TARGET = re.compile(r"define_\w*extension_target\(\s*(\w+)")


def source_targets(source: Path) -> set[str]:
    """The extension targets the tree defines, its external projects' included."""
    own: set[str] = set()
    files = [source / "CMakeLists.txt", *sorted(source.glob("cmake/external_projects/*.cmake"))]
    for path in files:
        if path.is_file():
            own |= set(_TARGET.findall(read_source(path, "replace")))
    return own | declared_targets(source)
