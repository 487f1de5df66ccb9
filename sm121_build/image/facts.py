"""Inspect a base image: digest, platform, the installed vLLM and the paths a build needs.

Facts are read from the image's own files through the engine's per-path reads
(`engine.ImageReader`: a created, never started container), never from a whole-image export:
a ~20 GB stock image is inspected in about a second.  No container runs, so an ARM64 image is
inspected on x86.  Where vLLM lives is derived from the image config before anything is
probed: PYTHONPATH, the interpreters on PATH (their version from the `python3` link or the
`python3.X` names), the ENTRYPOINT's script and its shebang; then the usual prefixes.  The
vLLM package's files are listed from its wheel RECORD; only without one is the package
directory streamed (headers read, nothing written).  Results are cached per image ID.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import posixpath
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

from sm121_build.core.console import Progress
from sm121_build.core.errors import Sm121Error
from sm121_build.core.inputs import InputRefused, read_input
from sm121_build.core.paths import cache_dir, state_dir, store_bytes, store_cache
from sm121_build.core.vllm import read_version_file
from sm121_build.image.api import ImageEngine, ImageFiles, ImageInfo
from sm121_build.image.build_tools import BuildTools, find_build_tools

_PYTHON = re.compile(r"/python(\d+\.\d+)/")
_PYTHON_NAME = re.compile(r"(?:^|/)python(\d+\.\d+)$")
_CUDA_VERSION = re.compile(r"^#define\s+CUDA_VERSION\s+(\d+)", re.MULTILINE)
_TORCH_VERSION = re.compile(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", re.MULTILINE)
_SHEBANG = re.compile(rb"^#!\s*(\S+)(?:[ \t]+(\S+))?")
# Python minor versions probed when the image names none (newest first).
PYTHON_VERSIONS = tuple(f"3.{minor}" for minor in range(14, 7, -1))
# Where images keep Python when the config does not say (probed last).
COMMON_PREFIXES = ("/usr/local", "/usr", "/opt/conda", "/opt/venv", "/venv", "/opt/python")
CUDA_TARGETS = ("sbsa-linux", "aarch64-linux", "x86_64-linux")
CUDA_HOMES = ("/usr/local/cuda", *(f"/usr/local/cuda-{major}.{minor}"
                                   for major in (13, 12) for minor in range(9, -1, -1)))
CACHE_FORMAT = 9  # 8: the image config's created date; 9: Python headers


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
    tools: BuildTools | None = None  # what the builder stage finds (build_tools.py)

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
    created: str = ""  # the image config's `created`, "" when unknown

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def cuda_h_version(text: str) -> str | None:
    """"13.0" from a cuda.h's `#define CUDA_VERSION 13000`."""
    match = _CUDA_VERSION.search(text)
    if not match:
        return None
    number = int(match.group(1))
    return f"{number // 1000}.{number % 1000 // 10}"


def _env(info: ImageInfo) -> dict[str, str]:
    return dict(item.partition("=")[::2] for item in info.env)


def _path_dirs(env: dict[str, str]) -> list[str]:
    """The absolute folders of the image's PATH, without trailing slashes."""
    return [d.rstrip("/") for d in env.get("PATH", "").split(":") if d.startswith("/")]


def _entrypoint(info: ImageInfo) -> list[str]:
    words: list[str] = []
    for raw in info.runtime[:2]:  # Entrypoint, Cmd (as JSON)
        value = json.loads(raw) if raw else None
        if isinstance(value, list):
            words += [str(v) for v in value]
        elif isinstance(value, str):
            words += value.split()
    return words


def _interpreter_sites(files: ImageFiles, interpreter: str) -> list[str]:
    """Site directories of one interpreter path (`/opt/venv/bin/python3`)."""
    found = files.stat(interpreter)
    if found is None:
        return []
    versions: tuple[str, ...]
    link = _PYTHON_NAME.search(found.link_target) if found.is_symlink else None
    own = _PYTHON_NAME.search(interpreter)
    if own:
        versions = (own.group(1),)
    elif link:
        versions = (link.group(1),)
    else:
        bindir = posixpath.dirname(interpreter)
        versions = tuple(v for v in PYTHON_VERSIONS if files.stat(f"{bindir}/python{v}"))
    prefix = posixpath.dirname(posixpath.dirname(interpreter))
    sites = []
    for version in versions:
        sites += [f"{prefix}/lib/python{version}/site-packages",
                  f"{prefix}/lib/python{version}/dist-packages"]
        if prefix in ("/usr", "/"):
            sites += [f"/usr/local/lib/python{version}/dist-packages",
                      f"/usr/local/lib/python{version}/site-packages",
                      "/usr/lib/python3/dist-packages"]
    return sites


def _entry_interpreters(files: ImageFiles, words: list[str], path_dirs: list[str]) -> list[str]:
    """The interpreter the ENTRYPOINT/CMD runs: itself when it is a python, else the shebang
    of its script (`vllm serve` -> `#!/opt/venv/bin/python3`)."""
    if not words:
        return []
    first = words[0]
    candidates = [first] if first.startswith("/") else [f"{d}/{first}" for d in path_dirs]
    for candidate in candidates:
        if posixpath.basename(candidate).startswith("python"):
            if files.stat(candidate):
                return [candidate]
            continue
        head = files.read_bytes(candidate, limit=1 << 20)
        shebang = _SHEBANG.match(head[:256]) if head else None
        if shebang is None:
            continue
        program = shebang.group(1).decode(errors="replace")
        if program.endswith("/env") and shebang.group(2):
            return [f"{d}/{shebang.group(2).decode(errors='replace')}" for d in path_dirs]
        return [program]
    return []


_PLAIN_PATH = re.compile(r"/[A-Za-z0-9._+@/-]{0,1023}")


def plain_path(path: str) -> bool:
    """Whether a path from an image is a plain absolute path: ASCII letters, digits and
    `._+@/-`, no `..` (a Dockerfile takes it as words: a newline would begin another
    instruction, a space split the words).  The one rule for every such path."""
    return bool(_PLAIN_PATH.fullmatch(path)) and "/../" not in f"{path}/"


def python_sites(info: ImageInfo, files: ImageFiles) -> list[str]:
    """Candidate site directories, most specific first: PYTHONPATH, the ENTRYPOINT's
    interpreter, the interpreters on PATH; then, only when none of those holds vLLM, every
    common prefix and Python version."""
    env = _env(info)
    path_dirs = _path_dirs(env)
    sites = [p.rstrip("/") for p in env.get("PYTHONPATH", "").split(":") if p.startswith("/")]
    interpreters = _entry_interpreters(files, _entrypoint(info), path_dirs)
    interpreters += [f"{d}/python3" for d in path_dirs]
    for interpreter in dict.fromkeys(interpreters):
        sites += _interpreter_sites(files, interpreter)
    if not any(files.stat(f"{site}/vllm") for site in dict.fromkeys(sites)):
        sites += ["/usr/lib/python3/dist-packages"]
        sites += [f"{prefix}/lib/python{version}/{kind}" for prefix in COMMON_PREFIXES
                  for version in PYTHON_VERSIONS for kind in ("dist-packages", "site-packages")]
    # a site directory is a plain absolute path (no newline, space or escape: it becomes a
    # Dockerfile's COPY destination); any other candidate an image names is passed over
    return list(dict.fromkeys(s for s in (posixpath.normpath(site) for site in sites)
                              if plain_path(s)))


def find_vllm_site(info: ImageInfo, files: ImageFiles) -> str | None:
    """The one site directory holding the vLLM package; an error when there are two."""
    found: dict[str, str] = {}
    for site in python_sites(info, files):
        package = files.resolve(f"{site}/vllm")
        if package is not None and package.is_dir and (
                files.stat(f"{site}/vllm/_version.py") or files.stat(f"{site}/vllm/__init__.py")):
            found.setdefault(files.canonical(f"{site}/vllm"), site)  # one package, two paths
    sites = sorted(set(found.values()))
    if len(sites) > 1:
        raise Sm121Error(f"{info.ref} has vLLM installed twice ({', '.join(sites)}): which one "
                         "runs depends on sys.path; remove one, or build from an image with one")
    return sites[0] if sites else None


def _record_files(files: ImageFiles, site: str, version: str) -> list[str] | None:
    """Paths (relative to the site dir) the vLLM wheel installed, from its RECORD."""
    names = [version]
    with contextlib.suppress(InvalidVersion):
        names.append(str(Version(version)))
    for name in dict.fromkeys(names):
        raw = files.read_bytes(f"{site}/vllm-{name}.dist-info/RECORD")
        if raw is not None:
            rows = csv.reader(io.StringIO(raw.decode("utf-8", errors="replace")))
            return [row[0] for row in rows if row]
    return None


def _listed_files(files: ImageFiles, package: str) -> list[str]:
    """Every file under the package directory (relative to its parent): streamed headers."""
    listed = []
    with files.tar(package) as archive:
        for member in archive:
            if member.isfile() or member.issym() or member.islnk():
                listed.append(member.name)
    return listed


def _torch_version(files: ImageFiles, site: str) -> str | None:
    raw = files.read_bytes(f"{site}/torch/version.py", limit=1 << 20)
    match = _TORCH_VERSION.search(raw.decode(errors="replace")) if raw else None
    return match.group(1) if match else None


def _cuda_home(info: ImageInfo, files: ImageFiles) -> str | None:
    env = _env(info)
    homes = [env["CUDA_HOME"]] if env.get("CUDA_HOME", "").startswith("/") else []
    homes += [posixpath.dirname(d) for d in _path_dirs(env) if d.endswith("/bin")]
    for home in dict.fromkeys([*homes, *CUDA_HOMES]):
        if not plain_path(home):
            continue  # (a Dockerfile's ENV takes it as words: only a plain path is one)
        nvcc = files.resolve(f"{home}/bin/nvcc")
        if nvcc is not None and nvcc.is_file:
            return home
    return None


def _cuda_version(files: ImageFiles, home: str) -> str | None:
    for header in [f"{home}/include/cuda.h",
                   *(f"{home}/targets/{t}/include/cuda.h" for t in CUDA_TARGETS)]:
        raw = files.read_bytes(header)
        if raw is not None and (version := cuda_h_version(raw.decode(errors="replace"))):
            return version
    return None


def facts_from_files(info: ImageInfo, files: ImageFiles) -> ImageFacts:
    """Every fact of an image, from the few files that hold them."""
    base = ImageFacts(info.ref, info.id, info.digest_ref, info.platform, info.labels,
                      created=info.created)
    site = find_vllm_site(info, files)
    if site is None:
        return base
    version_py = files.read_bytes(f"{site}/vllm/_version.py")
    version, commit = read_version_file(version_py.decode(errors="replace")) if version_py \
        else (None, None)
    if version is None:
        raise Sm121Error(f"{info.ref}: vllm found at {site}/vllm but its version is unreadable "
                         "(no __version__ in vllm/_version.py)")
    record = _record_files(files, site, version)
    listed = record if record is not None else _listed_files(files, f"{site}/vllm")
    extensions = extension_files(listed)
    python = _PYTHON.search(site + "/")
    cu = f"{site}/nvidia/cu13"
    has_include = files.resolve(f"{cu}/include") is not None
    has_lib = files.resolve(f"{cu}/lib") is not None
    nvrtc_versioned = files.stat(f"{cu}/lib/libnvrtc.so.13") is not None
    home = _cuda_home(info, files)
    install = VllmInstall(
        version=version,
        commit_id=commit,
        site_packages=site,
        python=python.group(1) if python else "",
        extensions=extensions,
        cuda_include=f"{cu}/include" if has_include else None,
        cuda_lib=f"{cu}/lib" if has_lib else None,
        cuda_home=home,
        nvrtc_needs_link=nvrtc_versioned and files.stat(f"{cu}/lib/libnvrtc.so") is None,
        torch_version=_torch_version(files, site),
        cuda_version=_cuda_version(files, home) if home else None,
        tools=find_build_tools(files, _path_dirs(_env(info)), home, [site]),
    )
    return ImageFacts(info.ref, info.id, info.digest_ref, info.platform, info.labels, install,
                      info.created)


def extension_files(listed: Iterable[str]) -> tuple[str, ...]:
    """The package's extension modules, relative to vllm/: its own (`_C.abi3.so`) and those
    its external projects install (`vllm_flash_attn/_vllm_fa2_C.abi3.so`)."""
    from sm121_build.core.vllm import projects

    folders = {""} | {p.install_dir for p in projects()}
    found = set()
    for path in listed:
        norm = posixpath.normpath(path)
        if norm.startswith("vllm/") and norm.endswith(".so") and \
                posixpath.dirname(norm[len("vllm/"):]) in folders:
            found.add(norm[len("vllm/"):])
    return tuple(sorted(found))


def inspect_image(engine: ImageEngine, ref: str, use_cache: bool = True) -> ImageFacts:
    info = engine.image(ref)
    cached = cache_dir() / "facts" / f"{info.id.replace(':', '-')}.v{CACHE_FORMAT}.json"
    if use_cache and cached.exists():
        facts = _load_facts(cached, info)
        if facts is not None:
            return facts
    progress = Progress(f"reading {ref}")
    with engine.reader(info.id, progress.add) as files:
        facts = facts_from_files(info, files)
    progress.done()
    text = json.dumps(facts.to_json(), indent=2)
    # kept only once the state vouches for it: the cache may come from anywhere
    if store_bytes(_voucher(cached), hashlib.sha256(text.encode()).hexdigest().encode()):
        store_cache(cached, text)
    return facts


def _voucher(cached: Path) -> Path:
    """Where the state folder keeps the digest of a facts entry this tool wrote."""
    return state_dir() / "facts-digests" / cached.name


def _load_facts(path: Path, info: ImageInfo) -> ImageFacts | None:
    """The cached facts, or None when the file is unreadable or not what this tool wrote
    (its digest in the state folder differs, or is not there): then they are read again."""
    try:
        data = read_input(path, 16 << 20, "cached image facts")
        recorded = read_input(_voucher(path), 128, "a facts digest").decode().strip()
        if hashlib.sha256(data).hexdigest() != recorded:
            return None
        raw = json.loads(data)
        vllm = raw.pop("vllm")
        raw.update(ref=info.ref, digest_ref=info.digest_ref, labels=info.labels)
        if vllm:
            vllm["extensions"] = tuple(vllm["extensions"])
            vllm["tools"] = BuildTools(**vllm["tools"]) if vllm.get("tools") else None
        return ImageFacts(**raw, vllm=VllmInstall(**vllm) if vllm else None)
    except (InputRefused, OSError, ValueError, TypeError, KeyError, AttributeError):
        return None  # (no digest: an entry this tool did not write, or one it cannot vouch for)


def require_vllm(facts: ImageFacts) -> VllmInstall:
    if facts.vllm is None:
        raise Sm121Error(
            f"image {facts.ref} has no vLLM installed (no site-packages/vllm/_version.py); "
            "pass a vLLM image such as vllm/vllm-openai:nightly")
    return facts.vllm
