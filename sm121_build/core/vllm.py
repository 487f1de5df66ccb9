"""vLLM's own vocabulary: its extension files and targets, the external projects that hold
extensions (flash-attention: shipped data), and its `_version.py`."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache

import yaml

from sm121_build.core.shipped import package_data

# vLLM's `cmake_minimum_required`: what its build needs of cmake (pip install cmake)
MIN_CMAKE = (3, 26)

# the extensions the main job builds by default (vLLM's own, with or without stable libtorch)
DEFAULT_EXTENSIONS = re.compile(r"^(_C|_moe_C)(_stable_libtorch)?\.(abi3\.)?so$")


@dataclass(frozen=True)
class Project:
    name: str
    cmake: str
    env: str
    targets: tuple[str, ...]
    install_dir: str
    submodules: tuple[str, ...]
    check: tuple[str, ...]


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


def extension_target(filename: str) -> str:
    """`_C.abi3.so` -> `_C`; `_moe_C_stable_libtorch.abi3.so` -> `_moe_C_stable_libtorch`;
    `vllm_flash_attn/_vllm_fa2_C.abi3.so` -> `_vllm_fa2_C`."""
    return re.sub(r"(\.cpython-[^.]+)?(\.abi3)?\.so$", "", filename.rsplit("/", 1)[-1])


def read_version_file(text: str) -> tuple[str | None, str | None]:
    """(__version__, __commit_id__) from a setuptools-scm `_version.py`, without running it."""
    version = commit = None
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # nested past the parser
        return None, None
    for node in tree.body:
        if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Constant):
            continue
        names = {t.id for t in node.targets if isinstance(t, ast.Name)}
        value = node.value.value
        if names & {"__version__", "version"} and isinstance(value, str):
            version = value
        if names & {"__commit_id__", "commit_id"} and isinstance(value, str):
            commit = value
    return version, commit
