"""The build tools a stock image has, and what the builder stage has to bring.

vLLM's wheel needs `ninja` at run time but not `cmake`, so whether an official image carries
cmake depends on the Dockerfile that made it.  The builder stage compiles with the image's
own nvcc and host C++ compiler (they must match its torch and CUDA); cmake and ninja are
plain tools, so a missing or too old one is brought into the builder stage only, never into
the final image: this machine's own cmake/ninja (the tool's PyPI dependencies) copied into
the build context when they run on the image's platform, else `pip install` in the builder.

Everything here is read from the image's files (no container runs): PATH, the cmake prefix's
`share/cmake-X.Y`, the compiler's versioned name, nvcc's `crt/host_config.h` (the newest GCC
it accepts), and where cuBLAS's headers are.
"""

from __future__ import annotations

import os
import platform
import posixpath
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from sm121_build.core.errors import Sm121Error, ToolchainError
from sm121_build.core.inputs import read_head, read_input
from sm121_build.core.vllm import MIN_CMAKE
from sm121_build.cuda.elf import MAGIC as ELF_MAGIC
from sm121_build.image.api import ImageFiles

CXX_NAMES = ("c++", "g++")
_GCC_MAJOR = re.compile(r"g\+\+-(\d+)$")
_GCC_LIMIT = re.compile(r"#if\s+__GNUC__\s*>\s*(\d+)")
_SITE_PYTHON = re.compile(r"/lib/python(\d+\.\d+)/")
# `[^)]{0,256}`, not `[^)]*`: a call's arguments are short, and an unbounded run makes the
# search quadratic in a file of `find_package(Python ` with no `)` (4 MiB: hours)
_DEVELOPMENT = re.compile(r"find_package\s*\(\s*Python3?\b[^)]{0,256}?\bDevelopment",
                          re.IGNORECASE)
# cmake installs its modules under <prefix>/share/cmake-X.Y; versions probed, newest first.
CMAKE_SERIES = tuple(f"{major}.{minor}" for major, top in ((4, 9), (3, 40))
                     for minor in range(top, -1, -1) if (major, minor) >= (3, 10))
# Where cuBLAS/cuSPARSE headers come from: the toolkit, or the pip CUDA libraries torch uses.
BLAS_HEADER = "cublas_v2.h"
PIP_CUDA_INCLUDES = ("nvidia/cu13/include", "nvidia/cublas/include")
# Image architecture -> the machine names Python reports for it.
_MACHINES = {"amd64": ("x86_64", "amd64"), "arm64": ("aarch64", "arm64")}
# The builder stage installs what it lacks into this prefix (never the final image).
TOOLS_PREFIX = "/sm121/tools"


@dataclass(frozen=True)
class BuildTools:
    """What the image offers a build (paths inside the image; None when absent)."""

    cmake: str | None = None
    cmake_version: str | None = None  # "3.31"; None when cmake is absent or unknown
    ninja: str | None = None
    cxx: str | None = None
    cxx_major: int | None = None  # the GCC major version, from the compiler's name
    cxx_newest: int | None = None  # the newest GCC nvcc accepts (its crt/host_config.h)
    nvcc: str | None = None
    blas_include: str | None = None  # a folder with cublas_v2.h
    python_version: str | None = None  # "3.12": of the interpreter that holds vLLM
    python_include: str | None = None  # a folder with that Python's Python.h

    @property
    def cmake_ok(self) -> bool:
        if not self.cmake or not self.cmake_version:
            return False
        major, minor = (int(p) for p in self.cmake_version.split("."))
        return (major, minor) >= MIN_CMAKE

    @property
    def to_bring(self) -> tuple[str, ...]:
        """The tools the builder stage has to add: cmake and/or ninja."""
        return tuple(name for name, ok in (("cmake", self.cmake_ok), ("ninja", bool(self.ninja)))
                     if not ok)

    def blocking(self, ref: str) -> str | None:
        """Why no build can start in this image (what the builder cannot bring), if so."""
        if not self.nvcc:
            return (f"image {ref} has no nvcc (CUDA_HOME, PATH and /usr/local/cuda* searched): "
                    "the builder compiles with the image's own CUDA toolkit; use a -devel style "
                    "image, or one whose Dockerfile installs the toolkit's compiler (vLLM's "
                    "newer images add it with apt `cuda-nvcc-<version>`)")
        if not self.cxx:
            return (f"image {ref} has no host C++ compiler (c++ or g++ on PATH): nvcc needs one; "
                    "vLLM's images get it from apt `build-essential` (g++), which the builder "
                    "cannot add without changing the compiler torch was built with")
        if self.cxx_major and self.cxx_newest and self.cxx_major > self.cxx_newest:
            return (f"image {ref} has g++ {self.cxx_major} ({self.cxx}) but its nvcc accepts "
                    f"GCC {self.cxx_newest} at most (crt/host_config.h)")
        return None

    def describe(self) -> str:
        cmake = (f"cmake {self.cmake_version}" if self.cmake_ok else
                 f"cmake {self.cmake_version} (too old)" if self.cmake else "no cmake")
        cxx = (f"g++ {self.cxx_major}" if self.cxx_major else "c++") if self.cxx else "no c++"
        if self.cxx and self.cxx_newest:
            cxx += f" (nvcc takes <= {self.cxx_newest})"
        parts = [cmake, "ninja" if self.ninja else "no ninja", cxx,
                 "nvcc" if self.nvcc else "no nvcc",
                 f"cuBLAS headers in {self.blas_include}" if self.blas_include
                 else "no cuBLAS headers"]
        if self.python_version:
            parts.append(f"Python {self.python_version} headers in {self.python_include}"
                         if self.python_include else
                         f"no Python {self.python_version} headers")
        return ", ".join(parts)


def _first_file(files: ImageFiles, candidates: list[str]) -> str | None:
    for candidate in candidates:
        found = files.resolve(candidate)
        if found is not None and found.is_file:
            return candidate
    return None


def _cmake_version(files: ImageFiles, cmake: str, sites: list[str]) -> str | None:
    """X.Y from the `share/cmake-X.Y` folder beside the cmake binary, or of the pip `cmake`
    package (whose bin/cmake is a Python script)."""
    real = files.canonical(cmake)
    prefixes = [posixpath.dirname(posixpath.dirname(real))]
    head = files.read_bytes(real, limit=1 << 16)
    if head is not None and head.startswith(b"#!"):  # PyPI's entry-point script
        prefixes = [f"{site}/cmake/data" for site in sites] + prefixes
    for prefix in prefixes:
        if files.resolve(f"{prefix}/share") is None:
            continue
        for series in CMAKE_SERIES:
            found = files.resolve(f"{prefix}/share/cmake-{series}")
            if found is not None and found.is_dir:
                return series
    return None


def _gcc_major(files: ImageFiles, cxx: str) -> int | None:
    match = _GCC_MAJOR.search(posixpath.basename(files.canonical(cxx)))
    return int(match.group(1)) if match else None


def _gcc_newest(files: ImageFiles, cuda_home: str) -> int | None:
    for header in (f"{cuda_home}/include/crt/host_config.h",
                   *(f"{cuda_home}/targets/{t}/include/crt/host_config.h"
                     for t in ("sbsa-linux", "aarch64-linux", "x86_64-linux"))):
        raw = files.read_bytes(header, limit=1 << 20)
        if raw is not None and (match := _GCC_LIMIT.search(raw.decode(errors="replace"))):
            return int(match.group(1))
    return None


def python_headers(files: ImageFiles, sites: list[str]) -> tuple[str | None, str | None]:
    """(X.Y, the folder holding its Python.h) for the Python of the first site directory:
    `python3.X-dev` puts it under /usr/include, a source build under its prefix."""
    version = next((m.group(1) for site in sites if (m := _SITE_PYTHON.search(site))), None)
    if version is None:
        return None, None
    prefixes = [site.split("/lib/python", 1)[0] for site in sites if "/lib/python" in site]
    folders = [f"{prefix}/include/python{version}" for prefix in [*prefixes, "/usr/local",
                                                                   "/usr"]]
    found = _first_file(files, [f"{folder}/Python.h" for folder in dict.fromkeys(folders)])
    return version, posixpath.dirname(found) if found else None


def needs_python_headers(source: Path) -> bool:
    """Whether the pinned source's CMake asks for Python's Development component (vLLM's
    cmake/utils.cmake: `find_package(Python COMPONENTS Interpreter Development.Module …)`)."""
    for rel in ("CMakeLists.txt", "cmake/utils.cmake"):
        path = source / rel
        if path.is_file() and _DEVELOPMENT.search(
                read_input(path, 4 << 20, "source file").decode(errors="replace")):
            return True
    return False


def require_python_headers(tools: BuildTools | None, source: Path, ref: str) -> None:
    """Refused before any compile: a source that needs Python.h and an image without it."""
    if tools is None or tools.python_version is None or tools.python_include is not None:
        return
    if needs_python_headers(source):
        raise Sm121Error(
            f"image {ref} has no Python {tools.python_version} headers (Python.h): vLLM's "
            "configure needs them (\"Could NOT find Python (missing: Python_INCLUDE_DIRS)\"); "
            f"official images install python{tools.python_version}-dev: use such an image or "
            "add that package to yours")


def find_build_tools(files: ImageFiles, path_dirs: list[str], cuda_home: str | None,
                     sites: list[str]) -> BuildTools:
    """The image's build tools, as the builder stage (PATH as in the image) will find them."""
    cmake = _first_file(files, [f"{d}/cmake" for d in path_dirs])
    ninja = _first_file(files, [f"{d}/ninja" for d in path_dirs])
    cxx = _first_file(files, [f"{d}/{name}" for name in CXX_NAMES for d in path_dirs])
    nvcc = f"{cuda_home}/bin/nvcc" if cuda_home else None
    includes = [f"{cuda_home}/include"] if cuda_home else []
    includes += [f"{site}/{rel}" for site in sites for rel in PIP_CUDA_INCLUDES]
    blas = _first_file(files, [f"{d}/{BLAS_HEADER}" for d in includes])
    python_version, python_include = python_headers(files, sites)
    return BuildTools(
        cmake=cmake, cmake_version=_cmake_version(files, cmake, sites) if cmake else None,
        ninja=ninja, cxx=cxx, cxx_major=_gcc_major(files, cxx) if cxx else None,
        cxx_newest=_gcc_newest(files, cuda_home) if cuda_home else None, nvcc=nvcc,
        blas_include=posixpath.dirname(blas) if blas else None,
        python_version=python_version, python_include=python_include)


@dataclass(frozen=True)
class HostTools:
    """This machine's cmake and ninja (the tool's own PyPI dependencies), to copy."""

    cmake_prefix: Path  # holds bin/cmake and share/cmake-X.Y
    ninja: Path


def host_tools() -> HostTools | None:
    """This environment's cmake and ninja binaries, when both are there."""
    try:
        import cmake as cmake_package
    except ImportError:
        return None
    prefix = Path(getattr(cmake_package, "CMAKE_BIN_DIR", "")).parent
    ninja = next((p for p in (Path(sys.executable).parent / "ninja",
                              Path(shutil.which("ninja") or "/nonexistent"))
                  if p.is_file() and _is_elf(p)), None)
    if not (prefix / "bin" / "cmake").is_file() or ninja is None:
        return None
    return HostTools(prefix, ninja)


def _is_elf(path: Path) -> bool:
    return read_head(path, 4, "ninja") == ELF_MAGIC


def runs_here(image_platform: str) -> bool:
    """Whether binaries of this machine run in an image of that platform (`linux/arm64`)."""
    architecture = image_platform.partition("/")[2].partition("/")[0]
    return platform.machine().lower() in _MACHINES.get(architecture, (architecture,))


def _link_or_copy(source: str, dest: str) -> None:
    try:
        os.link(source, dest)
    except OSError:
        shutil.copy2(source, dest)


def place_host_tools(tools: HostTools, bring: tuple[str, ...], context: Path) -> None:
    """Put what the builder lacks into the build context's `tools/` (hard links if possible)."""
    out = context / "tools"
    if "cmake" in bring:
        shutil.copytree(tools.cmake_prefix, out / "cmake", copy_function=_link_or_copy,
                        ignore=shutil.ignore_patterns("doc", "man"), dirs_exist_ok=True)
    if "ninja" in bring:
        (out / "bin").mkdir(parents=True, exist_ok=True)
        _link_or_copy(str(tools.ninja), str(out / "bin" / "ninja"))


def how_to_bring(tools: BuildTools, image_platform: str) -> str:
    """`context` (this machine's binaries), `pip` (installed in the builder) or `` (none)."""
    if not tools.to_bring:
        return ""
    if runs_here(image_platform) and host_tools() is not None:
        return "context"
    return "pip"


def require_buildable(tools: BuildTools | None, ref: str) -> None:
    if tools is None:
        return
    reason = tools.blocking(ref)
    if reason:
        raise ToolchainError(reason)
