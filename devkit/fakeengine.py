"""FAKE: a stand-in for the container engine (the true boundary: a Docker daemon), so the
whole pipeline runs in unit tests without one.  Named so wherever it is used.

Images are folders: a root folder, an `ImageInfo` (config, layer list) and a history.
`reader` serves the folder through `DirectoryFiles` (real files, real tar streams; symlink
following is the engine module's own).  `build` builds the *rendered* Dockerfile: it takes
the final stage's `FROM` (resolved through the tags, pins included), copies the base folder,
and carries out each `COPY` and `LABEL` of that stage as an engine would: one layer and one
history step (of the file's size) per copy, labels merged into the config.  A `COPY
--from=builder` takes its file from `compiled` (what the test says the compile step yields:
real nvcc-built files); any other COPY from the build context.  Failures and Ctrl-C can be
injected at `build`, `verify` (the reads of the new image) or `tag`.  Every call that
changes state is logged in `calls`.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from devkit.dirfiles import DirectoryFiles, make_tree
from sm121_build.core.errors import BuildFailed, Sm121Error
from sm121_build.image.api import PIN_REPO, ConfinedJob, ConfinedResult, HistoryStep, ImageInfo
from sm121_build.image.refs import validate_image_ref


@dataclass
class FakeImage:
    info: ImageInfo
    root: Path
    history: list[HistoryStep]


@dataclass
class FakeEngine:
    work: Path
    compiled: dict[str, Path] = field(default_factory=dict)  # builder output name -> file
    buildkit: bool = True
    fail_at: str | None = None  # "build", "verify" or "tag": raise BuildFailed there
    interrupt_at: str | None = None  # the same places: raise KeyboardInterrupt there
    images: dict[str, FakeImage] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)  # tag -> image ID
    calls: list[str] = field(default_factory=list)
    reads: dict[str, int] = field(default_factory=dict)  # image ID -> readers opened
    built: set[str] = field(default_factory=set)  # IDs of the images `build` made
    users: dict[str, str] = field(default_factory=dict)  # image ID -> what uses it (in_use)
    tamper: Callable[[FakeImage], None] | None = None  # alters each built image (a test's
    # stand-in for a template or builder that does more than it should)

    # -- set-up --------------------------------------------------------------------------
    def add_image(self, tag: str, root: Path, info: ImageInfo,
                  history: list[HistoryStep]) -> str:
        image_id = "sha256:" + hashlib.sha256(f"{tag}\0{root}".encode()).hexdigest()
        self.images[image_id] = FakeImage(replace(info, id=image_id), root, history)
        self.tags[tag] = image_id
        return image_id

    def _hook(self, where: str) -> None:
        if self.interrupt_at == where:
            raise KeyboardInterrupt
        if self.fail_at == where:
            raise BuildFailed(f"docker build failed: injected failure at {where}")

    def _id(self, ref: str) -> str | None:
        if ref in self.images:
            return ref
        return self.tags.get(ref if ":" in ref.rsplit("/", 1)[-1] else f"{ref}:latest")

    # -- ImageEngine ---------------------------------------------------------------------
    def image(self, ref: str) -> ImageInfo:
        validate_image_ref(ref)
        image_id = self._id(ref)
        if image_id is None:
            raise Sm121Error(f"image {ref} not found in the local Docker engine")
        return replace(self.images[image_id].info, ref=ref)

    def image_id(self, ref: str) -> str | None:
        return self._id(ref)

    def exists(self, ref: str) -> bool:
        return self._id(ref) is not None

    def pull(self, ref: str, status: Callable[[str], None] | None = None) -> str:
        raise Sm121Error(f"cannot pull {ref}: the fake engine has no registry")

    def push(self, ref: str) -> None:
        raise Sm121Error(f"cannot push {ref}: the fake engine has no registry")

    def resolve_digest(self, ref: str) -> str:
        raise Sm121Error(f"cannot resolve {ref}: the fake engine has no registry")

    def find_by_label(self, key: str, value: str) -> list[ImageInfo]:
        return [image.info for image in self.images.values()
                if image.info.labels.get(key) == value]

    @contextmanager
    def reader(self, image_id: str,
               on_read: Callable[[int], None] | None = None) -> Iterator[DirectoryFiles]:
        if image_id not in self.images:
            raise Sm121Error(f"image {image_id} was removed from the engine")
        self.reads[image_id] = self.reads.get(image_id, 0) + 1
        if image_id in self.built:
            self._hook("verify")
        yield DirectoryFiles(self.images[image_id].root)

    def history(self, image_id: str) -> list[HistoryStep]:
        return list(self.images[image_id].history)

    def run_confined(self, image_id: str, job: ConfinedJob) -> ConfinedResult:
        """The fake has no containers: the unit tests evaluate their own trees' CMake on the
        host (tests/conftest.py), the real sandbox is tested against the real engine."""
        raise AssertionError(f"FAKE engine asked to run {job.what} in a container")

    def buildkit_client(self) -> str | None:
        return "/usr/bin/docker" if self.buildkit else None

    @contextmanager
    def pinned(self, image_id: str) -> Iterator[str]:
        tag = f"{PIN_REPO}/{image_id.split(':')[-1][:12]}:fake"
        self.tags[tag] = image_id
        self.calls.append(f"pin {tag}")
        try:
            yield tag
        finally:
            del self.tags[tag]
            self.calls.append(f"unpin {tag}")

    def tag(self, image_id: str, tag: str) -> None:
        self._hook("tag")
        self.tags[tag if ":" in tag.rsplit("/", 1)[-1] else f"{tag}:latest"] = image_id
        self.calls.append(f"tag {tag}")

    def tags_of(self, image_id: str) -> tuple[str, ...]:
        return tuple(t for t, i in self.tags.items() if i == image_id)

    def untag(self, tag: str) -> None:
        self.tags.pop(tag, None)
        self.calls.append(f"untag {tag}")

    def image_ids(self) -> set[str]:
        return set(self.images)

    def remove_created(self, image_id: str, before: set[str]) -> None:
        if image_id in before or self.tags_of(image_id):
            return
        self.images.pop(image_id, None)
        self.calls.append(f"remove {image_id}")

    def in_use(self, image_id: str) -> str | None:
        return self.users.get(image_id)

    def remove_unused(self, image_id: str) -> str | None:
        if self.tags_of(image_id):
            return "image is tagged"
        if image_id in self.users:
            return self.users[image_id]
        self.images.pop(image_id, None)
        self.calls.append(f"remove {image_id}")
        return None

    def build(self, context: Path, dockerfile: Path, log: Path,
              status: Callable[[str], None] | None = None) -> str:
        self._hook("build")
        stage = _final_stage(dockerfile.read_text())
        base_id = self._id(stage[0].split(maxsplit=1)[1])
        if base_id is None:
            raise BuildFailed(f"docker build failed: no image {stage[0]}")
        base = self.images[base_id]
        root = self.work / f"image-{len(self.images)}"
        shutil.copytree(base.root, root, symlinks=True)
        layers, history = list(base.info.layers), list(base.history)
        labels = dict(base.info.labels)
        for line in stage[1:]:
            word, _, rest = line.partition(" ")
            if word == "COPY":
                *flags_and_source, dest = rest.split()
                source = flags_and_source[-1]
                from_builder = "--from=builder" in flags_and_source
                origin = self.compiled[Path(source).name] if from_builder else context / source
                data = origin.read_bytes()
                target = root / dest.lstrip("/")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.unlink(missing_ok=True)
                target.write_bytes(data)
                shutil.copymode(origin, target)  # COPY keeps the source's permission bits
                layers.append("sha256:" + hashlib.sha256(data).hexdigest())
                history.insert(0, HistoryStep(f"COPY {source} {dest} # buildkit", len(data)))
            elif word == "LABEL":
                for pair in shlex.split(rest):
                    key, _, value = pair.partition("=")
                    labels[key] = value
                history.insert(0, HistoryStep(f"LABEL {rest[:60]}", 0))
        digest = hashlib.sha256(json.dumps([layers, labels]).encode()).hexdigest()
        image_id = f"sha256:{digest}"
        if image_id not in self.images:
            self.images[image_id] = FakeImage(
                replace(base.info, id=image_id, repo_digests=(), labels=labels,
                        layers=tuple(layers)), root, history)
            self.built.add(image_id)
            if self.tamper:
                self.tamper(self.images[image_id])
        with open(log, "a", encoding="utf-8") as out:
            out.write(f"fake build of {dockerfile.name}: {image_id}\n")
        self.calls.append(f"build {image_id}")
        return image_id


def _final_stage(text: str) -> list[str]:
    """The last stage's instructions, continuation lines joined, comments dropped."""
    joined = text.replace("\\\n", " ")
    lines = [" ".join(line.split()) for line in joined.splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    start = max(i for i, line in enumerate(lines) if line.startswith("FROM "))
    return lines[start:]


SITE = "/usr/local/lib/python3.12/dist-packages"
CONFIG = ImageInfo(ref="", id="", repo_digests=(), os="linux", architecture="amd64",
                   variant="", labels={}, layers=("sha256:" + "1" * 64, "sha256:" + "2" * 64),
                   env=("PATH=/usr/local/cuda-13.0/bin:/usr/local/bin:/usr/bin:/bin",),
                   runtime=(json.dumps(["vllm", "serve"]), "null", '""', '""', "null"))


def stock_image(engine: FakeEngine, tag: str, extensions: dict[str, Path], version: str,
                commit: str, torch: str = "2.11.0+cu130",
                extra: dict[str, Path] | None = None) -> str:
    """A vLLM image as the stock ones are laid out (Python 3.12 dist-packages, a CUDA 13
    toolkit with nvcc, cmake 3.28, ninja, g++ 12, `vllm serve`, torch's `version.py`), as a
    folder; `extensions`: file under vllm/ -> a real .so to put there; `extra`: any other
    absolute path -> a real file (torch's libraries)."""
    root = engine.work / f"stock-{len(engine.images)}"
    files: dict[str, bytes | str] = {
        "/usr/bin/python3.12": b"\x7fELF",
        "/usr/bin/python3": "python3.12",
        "/usr/local/bin/vllm": b"#!/usr/bin/python3\nfrom vllm.scripts import main\n",
        "/usr/local/bin/cmake": b"\x7fELF",
        "/usr/local/share/cmake-3.28/Modules/CMake.cmake": b"",
        "/usr/local/bin/ninja": b"\x7fELF",
        "/usr/bin/g++-12": b"\x7fELF",
        "/usr/bin/g++": "g++-12",
        "/usr/local/cuda-13.0/bin/nvcc": b"\x7fELF",
        "/usr/local/cuda-13.0/include/cuda.h": b"#define CUDA_VERSION 13000\n",
        f"{SITE}/vllm/__init__.py": b"from vllm._version import __version__\n",
        f"{SITE}/vllm/_version.py":
            f"__version__ = version = {version!r}\n__commit_id__ = {commit!r}\n".encode(),
        f"{SITE}/vllm-{version}.dist-info/METADATA":
            f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n".encode(),
        f"{SITE}/torch/version.py": f"__version__ = {torch!r}\n".encode(),
    }
    files.update({f"{SITE}/vllm/{name}": path.read_bytes() for name, path in extensions.items()})
    files.update({where: path.read_bytes() for where, path in (extra or {}).items()})
    make_tree(root, files)
    history = [HistoryStep("COPY site-packages/ /usr/local/lib/python3.12/dist-packages/ "
                           "# buildkit", 1 << 20), HistoryStep("FROM debian", 1 << 26)]
    return engine.add_image(tag, root, CONFIG, history)
