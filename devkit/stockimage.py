"""The stock-like vLLM image the end-to-end tests start from, made locally.

Debian (debootstrap) + python3 + g++, nvcc 13.0 copied from the host, cmake and ninja from
the test venv's PyPI wheels, and a vLLM-shaped package (tests/data/vllm_like) whose
`_C.abi3.so` / `_moe_C.abi3.so` were built for sm_90 only, with the flash-attention-shaped
project (tests/data/fa_like) as `vllm_flash_attn/_vllm_fa2_C.abi3.so` (its guard "8.0+PTX":
sm_80 cubins and PTX, JIT-only on sm_121, as vLLM ships it).  `_version.py` carries the
commit of a local git checkout of the same fixture, so `--source CHECKOUT` pins exactly; that
checkout's vllm_flash_attn.cmake names a local git repository of fa_like and its commit.
The image is tagged by a hash of its inputs and reused while they are unchanged.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import docker
import docker.errors
import pytest

from devkit.dockerenv import BASE_IMAGE, ensure_debian_gxx
from devkit.helpers import CACHE, DATA, cuda_home, made_once
from devkit.testtags import image

VERSION = "0.19.1"
TORCH_VERSION = "2.11.0+cu130"  # torch/version.py only: the fixture .so files need none
# This run's (devkit/testtags.py): its key holds the commit of a checkout made in the run's
# temp folder, so no later run could reuse it; removed when the session ends.
REPO = image("vllm-stock")
_GIT_ENV = {"GIT_AUTHOR_NAME": "fixture", "GIT_AUTHOR_EMAIL": "fixture@example.invalid",
            "GIT_COMMITTER_NAME": "fixture", "GIT_COMMITTER_EMAIL": "fixture@example.invalid",
            "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z", "GIT_COMMITTER_DATE":
            "2026-01-01T00:00:00Z", "GIT_CONFIG_GLOBAL": os.devnull,
            "GIT_CONFIG_NOSYSTEM": "1"}


@dataclass(frozen=True)
class StockImage:
    tag: str
    checkout: Path
    commit: str
    package_dir: str = "/usr/local/lib/python3.11/dist-packages/vllm"


def _tree_hash(*roots: Path) -> str:
    digest = hashlib.sha256()
    for root in roots:
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


FA_CMAKE = "cmake/external_projects/vllm_flash_attn.cmake"
FA2 = "vllm_flash_attn/_vllm_fa2_C.abi3.so"


def _git_repo(source: Path, dest: Path, message: str) -> str:
    """A git repository of a fixture folder with a reproducible commit."""
    if source != dest:
        shutil.copytree(source, dest)
    env = {**os.environ, **_GIT_ENV}
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", message]):
        subprocess.run(["git", "-C", str(dest), *args], check=True, env=env)
    return subprocess.run(["git", "-C", str(dest), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True, env=env).stdout.strip()


def fa_repository(dest: Path) -> tuple[Path, str]:
    """The flash-attention-shaped fixture as a git repository (the stand-in for GitHub's
    vllm-project/flash-attention: a true boundary)."""
    return dest, _git_repo(DATA / "fa_like", dest, "fa-like fixture")


def fixture_checkout(dest: Path) -> tuple[Path, str]:
    """A git repository of the fixture with a reproducible commit; its flash-attention
    declaration points at a local repository of fa_like (made next to it)."""
    fa_repo, fa_commit = fa_repository(dest.parent / f"{dest.name}-flash-attention")
    shutil.copytree(DATA / "vllm_like", dest)
    declared = dest / FA_CMAKE
    declared.write_text(declared.read_text().replace("@FA_GIT_REPOSITORY@", str(fa_repo))
                        .replace("@FA_GIT_TAG@", fa_commit))
    return dest, _git_repo(dest, dest, "vllm-like fixture")


def stock_extensions() -> Path:
    """_C.abi3.so, _moe_C.abi3.so and _vllm_fa2_C.abi3.so of the fixture built for sm_90
    (cached)."""
    out = CACHE / "fixtures" / f"stock-sm90-{_tree_hash(DATA / 'vllm_like', DATA / 'fa_like')}"
    made_once(out / "_vllm_fa2_C.abi3.so", lambda: _build_stock(out))
    return out


def _build_stock(out: Path) -> None:
    home = cuda_home()
    bindir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory(prefix="sm121-stock-") as tmp:
        src = Path(shutil.copytree(DATA / "vllm_like", Path(tmp) / "src"))
        env = {**os.environ, "TORCH_CUDA_ARCH_LIST": "9.0", "CUDA_HOME": str(home),
               "CMAKE_CUDA_COMPILER": str(home / "bin" / "nvcc"), "MAX_JOBS": "2",
               "VLLM_FLASH_ATTN_SRC_DIR": str(DATA / "fa_like"),
               "PATH": f"{home / 'bin'}:{bindir}:{os.environ['PATH']}"}
        subprocess.run([sys.executable, "-m", "sm121_build.jobs.payload.build_extensions",
                        "--source", str(src), "--out", str(Path(tmp) / "out"), "--target", "_C",
                        "--target", "_moe_C", "--target", "_vllm_fa2_C",
                        "--cmake", str(bindir / "cmake")],
                       check=True, env=env, stdout=subprocess.DEVNULL)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(out, ignore_errors=True)  # what a killed fill left
        shutil.copytree(Path(tmp) / "out", out, ignore=shutil.ignore_patterns("*.log"))


def _link_tree(source: Path, dest: Path) -> None:
    """Hard links where possible (cuda is 315 MB), copies otherwise."""
    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
    shutil.copytree(source, dest, symlinks=True, copy_function=link)


def ensure_stock_image(client: docker.DockerClient, work: Path) -> StockImage:
    checkout, commit = fixture_checkout(work / "vllm-src")
    sos = stock_extensions()
    key = hashlib.sha256(f"{commit}\0{_tree_hash(sos)}\0{_tree_hash(DATA / 'stock')}\0"
                         f"{TORCH_VERSION}".encode()).hexdigest()[:12]
    tag = f"{REPO}:{VERSION}-{key}"
    try:  # by tag, not by label: images built from it inherit its labels
        client.images.get(tag)
        return StockImage(tag, checkout, commit)
    except docker.errors.ImageNotFound:
        pass
    ensure_debian_gxx(client)
    venv_site = Path(sys.executable).parent.parent / "lib" / \
        f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    with tempfile.TemporaryDirectory(prefix="sm121-stock-ctx-") as tmp:
        ctx = Path(tmp)
        shutil.copy2(DATA / "stock" / "Dockerfile", ctx / "Dockerfile")
        _link_tree(cuda_home(), ctx / "cuda")
        _link_tree(venv_site / "cmake" / "data", ctx / "cmake")
        shutil.copy2(Path(sys.executable).parent / "ninja", ctx / "ninja")
        package = ctx / "site-packages" / "vllm"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(
            "from vllm._version import __version__, __commit_id__  # noqa: F401\n")
        (package / "_version.py").write_text(
            f"__version__ = version = {VERSION!r}\n__commit_id__ = commit_id = {commit!r}\n")
        for so in ("_C.abi3.so", "_moe_C.abi3.so"):
            shutil.copy2(sos / so, package / so)
        (package / FA2).parent.mkdir()
        shutil.copy2(sos / FA2.rsplit("/", 1)[-1], package / FA2)
        torch = ctx / "site-packages" / "torch"
        torch.mkdir()
        (torch / "version.py").write_text(f"__version__ = {TORCH_VERSION!r}\n")
        meta = ctx / "site-packages" / f"vllm-{VERSION}.dist-info"
        meta.mkdir()
        (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VERSION}\n")
        client.images.build(path=str(ctx), tag=tag, rm=True, forcerm=True,
                            buildargs={"BASE": BASE_IMAGE})
    return StockImage(tag, checkout, commit)


def stock_workspace(factory: pytest.TempPathFactory,
                    name: str) -> tuple[docker.DockerClient, Path, StockImage]:
    """A module's engine, work folder (with `tmp/` for TMPDIR) and the stock-like image."""
    from devkit.dockerenv import client_or_skip

    client = client_or_skip()
    work = factory.mktemp(name)
    (work / "tmp").mkdir()
    return client, work, ensure_stock_image(client, work)
