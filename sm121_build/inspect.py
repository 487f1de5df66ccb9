"""Inspect a base image: digest, platform, the installed vLLM and the paths a build needs.

Everything is read from the image's saved filesystem; no container is started, so an ARM64
image can be inspected on x86.  Results are cached per image ID.
"""

from __future__ import annotations

import ast
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field
from email.parser import HeaderParser
from pathlib import Path
from typing import TYPE_CHECKING

from . import layers
from .errors import Sm121Error

if TYPE_CHECKING:  # the Docker SDK is imported only where an engine is used
    from .engine import Engine, ImageInfo

_VERSION_PY = re.compile(r"^(?P<site>.*/(?:site|dist)-packages)/vllm/_version\.py$")
_DIST_INFO = re.compile(r"^(?P<site>.*/(?:site|dist)-packages)/vllm-[^/]+\.dist-info/METADATA$")
_TORCH_DIST = re.compile(r"^(?P<site>.*/(?:site|dist)-packages)/torch-(?P<v>[^/-]+)\.dist-info/")
_PYTHON = re.compile(r"/python(\d+\.\d+)/")
_NVCC = re.compile(r"^(?P<home>(?:usr/local|opt)/cuda[^/]*)/bin/nvcc$")
_CUDA_H = re.compile(r"^(?P<home>(?:usr/local|opt)/cuda[^/]*)/(?:targets/[^/]+/)?include/cuda\.h$")
_CUDA_VERSION = re.compile(r"^#define\s+CUDA_VERSION\s+(\d+)", re.MULTILINE)
CACHE_FORMAT = 4


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sm121-build"


@dataclass(frozen=True)
class VllmInstall:
    """vLLM as installed in an image (paths absolute, inside the image)."""

    version: str
    commit_id: str | None
    site_packages: str
    python: str
    extensions: tuple[str, ...]
    cuda_include: str | None
    cuda_lib: str | None
    cuda_home: str | None
    nvrtc_needs_link: bool
    torch_version: str | None
    cuda_version: str | None = None  # the toolkit of `cuda_home`, e.g. "13.0" (from cuda.h)

    @property
    def package_dir(self) -> str:
        return f"{self.site_packages}/vllm"


@dataclass(frozen=True)
class ImageFacts:
    ref: str
    id: str
    digest_ref: str
    platform: str
    labels: dict[str, str] = field(default_factory=dict)
    vllm: VllmInstall | None = None

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def read_version_file(text: str) -> tuple[str | None, str | None]:
    """(__version__, __commit_id__) from a setuptools-scm `_version.py`, without running it."""
    version = commit = None
    try:
        tree = ast.parse(text)
    except SyntaxError:
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


def wanted(path: str) -> bool:
    """The files `facts_from_filesystem` reads."""
    return bool(_VERSION_PY.match(path) or _DIST_INFO.match(path) or _CUDA_H.match(path))


def cuda_h_version(text: str) -> str | None:
    """"13.0" from a cuda.h's `#define CUDA_VERSION 13000`."""
    match = _CUDA_VERSION.search(text)
    if not match:
        return None
    number = int(match.group(1))
    return f"{number // 1000}.{number % 1000 // 10}"


def cuda_version(fs: layers.Filesystem, home: str) -> str | None:
    """The toolkit version of `home` (inside an image) from its cuda.h."""
    for path in sorted(p for p in fs.extracted if (m := _CUDA_H.match(p)) and m["home"] == home):
        file = fs.root / path
        if file.is_file() and (version := cuda_h_version(file.read_text(errors="replace"))):
            return version
    return None


def facts_from_filesystem(info: ImageInfo, fs: layers.Filesystem) -> ImageFacts:
    sites = sorted({m.group("site") for p in fs.files if (m := _VERSION_PY.match(p))})
    base = ImageFacts(info.ref, info.id, info.digest_ref, info.platform, info.labels)
    if not sites:
        return base
    site = sites[0]
    version, commit = read_version_file((fs.root / f"{site}/vllm/_version.py").read_text())
    if version is None:
        metadata = [p for p in fs.extracted if _DIST_INFO.match(p) and p.startswith(site)]
        if metadata:
            version = HeaderParser().parsestr((fs.root / metadata[0]).read_text())["Version"]
    if version is None:
        raise Sm121Error(f"{info.ref}: vllm found at /{site}/vllm but its version is unreadable")
    python = _PYTHON.search("/" + site + "/")
    extensions = tuple(sorted(
        p.rsplit("/", 1)[1] for p in fs.files
        if p.startswith(f"{site}/vllm/") and p.count("/") == site.count("/") + 2
        and p.endswith(".so")))
    cu = f"{site}/nvidia/cu13"
    has_cu_include = any(p.startswith(f"{cu}/include/") for p in fs.files)
    has_cu_lib = any(p.startswith(f"{cu}/lib/") for p in fs.files)
    nvrtc = {p.rsplit("/", 1)[1] for p in fs.files if p.startswith(f"{cu}/lib/libnvrtc.so")}
    homes = sorted({m.group("home") for p in fs.files if (m := _NVCC.match(p))})
    torch = next((m.group("v") for p in fs.files if (m := _TORCH_DIST.match(p))
                  and m.group("site") == site), None)
    install = VllmInstall(
        version=version,
        commit_id=commit,
        site_packages="/" + site,
        python=python.group(1) if python else "",
        extensions=extensions,
        cuda_include=f"/{cu}/include" if has_cu_include else None,
        cuda_lib=f"/{cu}/lib" if has_cu_lib else None,
        cuda_home="/" + homes[0] if homes else None,
        nvrtc_needs_link=bool(nvrtc) and "libnvrtc.so" not in nvrtc,
        torch_version=torch,
        cuda_version=cuda_version(fs, homes[0]) if homes else None,
    )
    return ImageFacts(info.ref, info.id, info.digest_ref, info.platform, info.labels, install)


def inspect_image(engine: Engine, ref: str, use_cache: bool = True) -> ImageFacts:
    info = engine.image(ref)
    cached = cache_dir() / "facts" / f"{info.id.replace(':', '-')}.v{CACHE_FORMAT}.json"
    if use_cache and cached.exists():
        return _load_facts(cached, info)
    with tempfile.TemporaryDirectory(prefix="sm121-inspect-") as tmp:
        archive = Path(tmp) / "image.tar"
        engine.save(info.id, archive)
        fs = layers.extract_files(archive, Path(tmp) / "rootfs", wanted, info.platform)
        facts = facts_from_filesystem(info, fs)
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(facts.to_json(), indent=2))
    return facts


def _load_facts(path: Path, info: ImageInfo) -> ImageFacts:
    raw = json.loads(path.read_text())
    vllm = raw.pop("vllm")
    raw.update(ref=info.ref, digest_ref=info.digest_ref, labels=info.labels)
    if vllm:
        vllm["extensions"] = tuple(vllm["extensions"])
    return ImageFacts(**raw, vllm=VllmInstall(**vllm) if vllm else None)


def require_vllm(facts: ImageFacts) -> VllmInstall:
    if facts.vllm is None:
        raise Sm121Error(
            f"image {facts.ref} has no vLLM installed (no site-packages/vllm/_version.py); "
            "pass a vLLM image such as vllm/vllm-openai:cu130-nightly")
    return facts.vllm
