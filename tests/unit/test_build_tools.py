"""Which build tools an image has, read from its files (no container runs), and what the
builder stage must bring.

Image files come from `devkit.dirfiles.DirectoryFiles` over a real folder (the engine's
per-path reads are the boundary replaced); the e2e tests run the same on real images.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from devkit.dirfiles import DirectoryFiles, make_tree
from sm121_build.core.errors import Sm121Error
from sm121_build.image.build_tools import BuildTools, find_build_tools, require_buildable, runs_here
from sm121_build.jobs.payload.build_extensions import _explain_failure

SITE = "/usr/local/lib/python3.12/dist-packages"
PATH = ["/usr/local/bin", "/usr/bin", "/bin"]
HOST_CONFIG = b"#if defined(__GNUC__)\n#if __GNUC__ > 15\n#error -- unsupported GNU version!\n"
DEVEL = {
    "usr/local/cuda-13.0/bin/nvcc": b"\x7fELF",
    "usr/local/cuda-13.0/include/crt/host_config.h": HOST_CONFIG,
    "usr/bin/x86_64-linux-gnu-g++-12": b"\x7fELF",
    "usr/bin/g++-12": "x86_64-linux-gnu-g++-12",
    "usr/bin/g++": "g++-12",
    "usr/bin/c++": "/etc/alternatives/c++",
    "etc/alternatives/c++": "/usr/bin/g++",
}


def _tools(tmp_path: Path, extra: dict[str, bytes | str],
           cuda_home: str | None = "/usr/local/cuda-13.0") -> BuildTools:
    root = make_tree(tmp_path, {**DEVEL, **extra})
    return find_build_tools(DirectoryFiles(root), PATH, cuda_home, [SITE])


def test_devel_image_with_apt_cmake_too_old_and_pip_ninja(tmp_path: Path) -> None:
    tools = _tools(tmp_path, {
        "usr/bin/cmake": b"\x7fELF" + b"\0" * (1 << 17),
        "usr/share/cmake-3.25/Modules/CMakeCUDAInformation.cmake": b"",
        "usr/local/bin/ninja": b"#!/usr/bin/python3\nfrom ninja import ninja\n",
    })
    assert (tools.cmake, tools.cmake_version, tools.cmake_ok) == ("/usr/bin/cmake", "3.25", False)
    assert tools.ninja == "/usr/local/bin/ninja"
    assert (tools.cxx, tools.cxx_major, tools.cxx_newest) == ("/usr/bin/c++", 12, 15)
    assert tools.to_bring == ("cmake",)
    assert tools.blocking("img") is None
    assert tools.blas_include is None
    assert "cmake 3.25 (too old)" in tools.describe()


def test_pip_cmake_script_finds_its_package_version(tmp_path: Path) -> None:
    tools = _tools(tmp_path, {
        "usr/local/bin/cmake": b"#!/usr/bin/python3\nfrom cmake import cmake\n",
        f"{SITE}/cmake/data/bin/cmake": b"\x7fELF",
        f"{SITE}/cmake/data/share/cmake-3.31/Modules/x.cmake": b"",
        "usr/bin/ninja": b"\x7fELF",
        f"{SITE}/nvidia/cu13/include/cublas_v2.h": b"",
    })
    assert (tools.cmake_version, tools.cmake_ok, tools.to_bring) == ("3.31", True, ())
    assert tools.blas_include == f"{SITE}/nvidia/cu13/include"


def test_cmake_without_a_module_folder_is_brought(tmp_path: Path) -> None:
    tools = _tools(tmp_path, {"usr/local/bin/cmake": b"\x7fELF"})
    assert (tools.cmake, tools.cmake_version) == ("/usr/local/bin/cmake", None)
    assert tools.to_bring == ("cmake", "ninja")


@pytest.mark.parametrize(("drop", "add", "cuda_home", "message"), [
    ((), {}, None, r"has no nvcc .*cuda-nvcc"),
    (("usr/bin/g++", "usr/bin/c++"), {}, "/usr/local/cuda-13.0", r"no host C\+\+ compiler"),
    (("usr/bin/g++", "usr/bin/c++"), {"usr/bin/g++": "g++-16", "usr/bin/g++-16": b"\x7fELF"},
     "/usr/local/cuda-13.0", r"g\+\+ 16 .* accepts GCC 15 at most"),
])
def test_what_the_builder_cannot_bring_fails_up_front(
        tmp_path: Path, drop: tuple[str, ...], add: dict[str, bytes | str], cuda_home: str | None,
        message: str) -> None:
    files = {k: v for k, v in DEVEL.items() if k not in drop}
    root = make_tree(tmp_path, {**files, **add})
    tools = find_build_tools(DirectoryFiles(root), PATH, cuda_home, [SITE])
    with pytest.raises(Sm121Error, match=message):
        require_buildable(tools, "img")


def test_platform_match() -> None:
    import platform

    here = {"x86_64": "linux/amd64", "aarch64": "linux/arm64"}[platform.machine()]
    other = "linux/arm64" if here == "linux/amd64" else "linux/amd64"
    assert runs_here(here) and runs_here(here + "/v8")
    assert not runs_here(other)


@pytest.mark.parametrize(("log", "cause"), [
    ("#12 3.4 /sm121/src/csrc/ops.cu(7): error: identifier \"nope\" is undefined\n"
     "#12 3.4 1 error detected\n", 'compiler: /sm121/src/csrc/ops.cu(7): error: identifier'),
    ("csrc/x.cpp:3:5: error: expected ';' before '}' token\n", "compiler: csrc/x.cpp:3:5: error"),
    ("ptxas fatal   : Unresolved extern function 'f'\n", "ptxas fatal   : Unresolved"),
    ('#8 5.3 At end of source: error: expected a "}"\n#8 5.3 2 errors detected in the '
     'compilation of "/sm121/src/csrc/ops.cu".\n', 'compiler: At end of source: error: '
     'expected a "}" (in /sm121/src/csrc/ops.cu)'),
    ("g++: fatal error: Killed signal terminated program cc1plus\n", "a compiler was killed"),
    ("CMake Error at CMakeLists.txt:3 (find_package):\n\n  Could not find Torch\n",
     "CMake: CMake Error at CMakeLists.txt:3 (find_package): Could not find Torch"),
    ("nothing useful\n", "the build failed; see the log above"),
])
def test_build_failure_names_its_cause(tmp_path: Path, log: str, cause: str) -> None:
    path = tmp_path / "build.log"
    path.write_text("+ cmake --build /b\n[1/3] Building CUDA object\n" + log)
    assert _explain_failure(path).startswith(cause)


# --- Python's headers: vLLM's configure needs Python.h of the interpreter that holds it ------

@pytest.mark.parametrize(("where", "found"), [
    ("usr/include/python3.12/Python.h", "/usr/include/python3.12"),  # apt python3.12-dev
    ("usr/local/include/python3.12/Python.h", "/usr/local/include/python3.12"),  # built
    ("usr/include/python3.11/Python.h", None),  # another Python's
    (None, None),  # a slimmed image
])
def test_python_headers_of_the_vllm_interpreter(tmp_path: Path, where: str | None,
                                                found: str | None) -> None:
    tools = _tools(tmp_path, {where: b"/* Python.h */"} if where else {})
    assert (tools.python_version, tools.python_include) == ("3.12", found)
    assert tools.describe().endswith(f"Python 3.12 headers in {found}" if found else
                                     "no Python 3.12 headers")


def test_a_source_that_needs_python_h_is_refused_on_an_image_without_it(tmp_path: Path) -> None:
    from sm121_build.image.build_tools import require_python_headers

    tools = _tools(tmp_path / "image", {})
    source = tmp_path / "src"
    (source / "cmake").mkdir(parents=True)
    (source / "CMakeLists.txt").write_text("project(x)\n")
    require_python_headers(tools, source, "img:slim")  # the fixture's CMake needs no Python.h
    (source / "cmake" / "utils.cmake").write_text(  # vLLM 0.33.0's line
        "  find_package(Python COMPONENTS Interpreter Development.Module "
        "Development.SABIModule)\n")
    with pytest.raises(Sm121Error) as error:
        require_python_headers(tools, source, "img:slim")
    assert str(error.value) == (
        "image img:slim has no Python 3.12 headers (Python.h): vLLM's configure needs them "
        "(\"Could NOT find Python (missing: Python_INCLUDE_DIRS)\"); official images install "
        "python3.12-dev: use such an image or add that package to yours")
    with_headers = _tools(tmp_path / "devel", {"usr/include/python3.12/Python.h": b""})
    require_python_headers(with_headers, source, "img:devel")
