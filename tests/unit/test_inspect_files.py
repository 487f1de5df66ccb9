"""inspect finds vLLM from the image config, whatever the Python version or prefix.

The engine's per-path reads are replaced by `devkit.dirfiles.DirectoryFiles` over a real
folder (real symlinks and tar streams); the same code runs against a real engine in
tests/integration/test_image_reader.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from devkit.dirfiles import DirectoryFiles, make_tree
from sm121_build.core.errors import Sm121Error
from sm121_build.image.api import ImageInfo
from sm121_build.image.facts import facts_from_files, python_sites

VERSION_PY = b"__version__ = version = '0.17.0'\n__commit_id__ = commit_id = 'gb31e9326a'\n"
CUDA_H = b"#pragma once\n#define CUDA_VERSION 12090\n"


def _info(env: list[str], entrypoint: list[str] | None = None,
          cmd: list[str] | None = None) -> ImageInfo:
    return ImageInfo(ref="test/img:1", id="sha256:" + "1" * 64, repo_digests=(), os="linux",
                     architecture="arm64", variant="", labels={}, layers=("sha256:a",),
                     env=tuple(env), runtime=(json.dumps(entrypoint), json.dumps(cmd), '""',
                                              '""', "null"))


def _record(*names: str) -> bytes:
    return "".join(f"{n},sha256=x,1\n" for n in names).encode()


def test_venv_found_through_the_entrypoint_shebang(tmp_path: Path) -> None:
    site = "opt/venv/lib/python3.12/site-packages"
    root = make_tree(tmp_path, {
        "opt/venv/bin/python3": "python3.12",
        "opt/venv/bin/python3.12": "/usr/bin/python3.12",
        "usr/bin/python3.12": b"\x7fELF",
        "opt/venv/bin/vllm": b"#!/opt/venv/bin/python3\nimport sys\n",
        f"{site}/vllm/_version.py": VERSION_PY,
        f"{site}/vllm/_C.abi3.so": b"\x7fELF",
        f"{site}/vllm-0.17.0.dist-info/RECORD": _record(
            "vllm/_C.abi3.so", "vllm/_moe_C.abi3.so", "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
            "vllm/third_party/other/_x.so", "vllm/__init__.py", "../../../bin/vllm"),
        f"{site}/torch/version.py": b"__version__ = '2.9.0+cu130'\ngit_version = 'x'\n",
        f"{site}/nvidia/cu13/include/cublas_v2.h": b"",
        f"{site}/nvidia/cu13/lib/libnvrtc.so.13": b"\x7fELF",
        "usr/local/cuda-12.9/bin/nvcc": b"\x7fELF",
        "usr/local/cuda-12.9/targets/sbsa-linux/include/cuda.h": CUDA_H,
        "usr/local/cuda": "cuda-12.9",
    })
    info = _info(["PATH=/opt/venv/bin:/usr/local/cuda/bin:/usr/bin:/bin"], ["vllm", "serve"])
    files = DirectoryFiles(root)
    facts = facts_from_files(info, files)
    vllm = facts.vllm
    assert vllm is not None
    assert (vllm.version, vllm.commit_id) == ("0.17.0", "gb31e9326a")
    assert (vllm.site_packages, vllm.python) == (f"/{site}", "3.12")
    # from RECORD: the package's own and those external projects install in their folder
    assert vllm.extensions == ("_C.abi3.so", "_moe_C.abi3.so",
                               "vllm_flash_attn/_vllm_fa2_C.abi3.so")
    assert vllm.torch_version == "2.9.0+cu130"
    assert vllm.cuda_include == f"/{site}/nvidia/cu13/include"
    assert vllm.cuda_lib == f"/{site}/nvidia/cu13/lib"
    assert vllm.nvrtc_needs_link is True
    assert (vllm.cuda_home, vllm.cuda_version) == ("/usr/local/cuda", "12.9")
    assert len(files.stats) < 60  # read from the config, not probed


def test_debian_dist_packages_listed_by_streaming_without_a_record(tmp_path: Path) -> None:
    site = "usr/local/lib/python3.11/dist-packages"
    root = make_tree(tmp_path, {
        "usr/bin/python3": "python3.11",
        "usr/bin/python3.11": b"\x7fELF",
        f"{site}/vllm/_version.py": VERSION_PY,
        f"{site}/vllm/_C.abi3.so": b"\x7fELF",
        f"{site}/vllm/_moe_C.abi3.so": b"\x7fELF",
        f"{site}/vllm/cumem_allocator.abi3.so": b"\x7fELF",
        f"{site}/vllm/sub/_x.abi3.so": b"\x7fELF",
        f"{site}/nvidia/cu13/lib/libnvrtc.so.13": b"\x7fELF",
        f"{site}/nvidia/cu13/lib/libnvrtc.so": "libnvrtc.so.13",
    })
    facts = facts_from_files(_info(["PATH=/usr/local/bin:/usr/bin:/bin"], None,
                                   ["python3", "-c", "import vllm"]), DirectoryFiles(root))
    assert facts.vllm is not None
    assert facts.vllm.site_packages == f"/{site}"
    assert facts.vllm.extensions == ("_C.abi3.so", "_moe_C.abi3.so", "cumem_allocator.abi3.so")
    assert facts.vllm.nvrtc_needs_link is False
    assert (facts.vllm.cuda_home, facts.vllm.cuda_include) == (None, None)


def test_conda_interpreter_without_a_python3_link(tmp_path: Path) -> None:
    site = "opt/conda/lib/python3.10/site-packages"
    root = make_tree(tmp_path, {
        "opt/conda/bin/python3": b"\x7fELF",
        "opt/conda/bin/python3.10": b"\x7fELF",
        f"{site}/vllm/_version.py": VERSION_PY,
    })
    facts = facts_from_files(_info(["PATH=/opt/conda/bin:/usr/bin"]), DirectoryFiles(root))
    assert facts.vllm is not None and facts.vllm.site_packages == f"/{site}"
    assert facts.vllm.python == "3.10"


def test_pythonpath_comes_first(tmp_path: Path) -> None:
    root = make_tree(tmp_path, {"app/lib/vllm/_version.py": VERSION_PY})
    facts = facts_from_files(_info(["PYTHONPATH=/app/lib", "PATH=/usr/bin"]),
                             DirectoryFiles(root))
    assert facts.vllm is not None and facts.vllm.site_packages == "/app/lib"


def test_no_config_falls_back_to_the_usual_prefixes(tmp_path: Path) -> None:
    site = "usr/local/lib/python3.9/site-packages"
    root = make_tree(tmp_path, {f"{site}/vllm/_version.py": VERSION_PY})
    files = DirectoryFiles(root)
    assert f"/{site}" in python_sites(_info([]), files)
    facts = facts_from_files(_info([]), files)
    assert facts.vllm is not None and facts.vllm.site_packages == f"/{site}"


def test_vllm_installed_twice_is_an_error(tmp_path: Path) -> None:
    root = make_tree(tmp_path, {
        "usr/bin/python3": "python3.12",
        "usr/local/lib/python3.12/dist-packages/vllm/_version.py": VERSION_PY,
        "usr/lib/python3/dist-packages/vllm/_version.py": VERSION_PY,
    })
    with pytest.raises(Sm121Error, match=r"vLLM installed twice \(/usr/lib/python3/dist-packages"
                                         r", /usr/local/lib/python3.12/dist-packages\)"):
        facts_from_files(_info(["PATH=/usr/bin"]), DirectoryFiles(root))


def test_one_package_seen_through_a_linked_prefix_is_not_twice(tmp_path: Path) -> None:
    root = make_tree(tmp_path, {
        "usr/bin/python3": "python3.12",
        "usr/local/lib/python3.12/dist-packages/vllm/_version.py": VERSION_PY,
        "usr/lib/python3.12/site-packages": "/usr/local/lib/python3.12/dist-packages",
    })
    facts = facts_from_files(_info(["PATH=/usr/bin"]), DirectoryFiles(root))
    assert facts.vllm is not None


def test_no_vllm_and_unreadable_version(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "a", {"usr/bin/python3": "python3.12", "etc/hostname": b"x"})
    assert facts_from_files(_info(["PATH=/usr/bin"]), DirectoryFiles(root)).vllm is None
    broken = make_tree(tmp_path / "b", {
        "usr/bin/python3": "python3.12",
        "usr/local/lib/python3.12/dist-packages/vllm/_version.py": b"x = 1\n"})
    with pytest.raises(Sm121Error, match="version is unreadable"):
        facts_from_files(_info(["PATH=/usr/bin"]), DirectoryFiles(broken))


@pytest.mark.parametrize("text", ['{"ref": "x", "id": "sha', "", '{"vllm": null}',
                                  '{"ref": 1, "vllm": {"version": "0.1"}}', "[1, 2]"])
def test_a_damaged_or_old_facts_cache_is_read_again(tmp_path: Path, text: str) -> None:
    """A truncated or old-format cache file is not an error: the image is read again."""
    from sm121_build.image.facts import _load_facts

    cached = tmp_path / "facts.json"
    cached.write_text(text)
    info = ImageInfo("img:1", "sha256:" + "a" * 64, (), "linux", "arm64", "", {}, ())
    assert _load_facts(cached, info) is None
