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
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

from sm121_build.errors import Sm121Error
from sm121_build.shipped import package_data
from sm121_build.source.cmake_lang import CMakeSyntaxError, commands
from sm121_build.source.pin import Checkout, GitRef, check_git_tree, fetch_source, update_submodules


@dataclass(frozen=True)
class Project:
    name: str
    cmake: str
    env: str
    targets: tuple[str, ...]
    install_dir: str
    submodules: tuple[str, ...]
    check: tuple[str, ...]


@dataclass(frozen=True)
class ProjectPin:
    """Where a vLLM tree says to fetch a project from."""

    project: Project
    repository: str
    commit: str
    declared_in: str  # file:line


@cache
def projects() -> tuple[Project, ...]:
    raw = yaml.safe_load(package_data("external_projects.yaml"))
    return tuple(Project(name, p["cmake"], p["env"], tuple(p["targets"]), p["install_dir"],
                         tuple(p.get("submodules", ())), tuple(p["check"]))
                 for name, p in raw.items())


def project_of_target(target: str) -> Project | None:
    return next((p for p in projects() if target in p.targets), None)


def project_named(name: str) -> Project | None:
    return next((p for p in projects() if p.name == name), None)


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
        found = commands(path.read_text(errors="replace"))
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


def _ref(pin: ProjectPin) -> GitRef:
    return GitRef("commit" if re.fullmatch(r"[0-9a-f]{7,40}", pin.commit) else "tag",
                  pin.commit)


def projects_for(targets: Iterable[str], fa_source: Path | None) -> list[Project]:
    """The external projects whose extensions are built; each must have a rule that builds it
    for sm_12x (flash-attention 3 has none: sm_90a code)."""
    from sm121_build.source.patch import fixable_targets

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


def copy_into(pin: ProjectPin, local: Path | None, dest: Path,
              allow_other_commit: bool = False) -> Checkout:
    """`bring` the project, then copy its tree (without .git) to `dest` for the build."""
    got = bring(pin, local, allow_other_commit)
    shutil.copytree(got.path, dest, ignore=shutil.ignore_patterns(".git"))
    return got


def bring(pin: ProjectPin, local: Path | None, allow_other_commit: bool = False) -> Checkout:
    """The project at the pinned commit: a local checkout (checked) or fetched into the cache
    with the submodules its build needs."""
    if local is not None:
        require_project_tree(local, pin.project.name)
        return check_git_tree(local, _ref(pin), allow_other_commit,
                              f"the {pin.project.name} commit {pin.declared_in} pins",
                              "--fa-source")
    path, commit = fetch_source(_ref(pin), pin.repository, name=pin.project.name)
    update_submodules(path, pin.project.submodules)
    return Checkout(path, commit, "", "")
