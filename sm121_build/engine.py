"""The one place that talks to the container engine (through the Docker SDK).

Everything else asks this module for images, saved filesystems, builds, tags and labels;
no other module imports `docker`.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors
import requests.exceptions

from .errors import Sm121Error
from .refs import validate_image_ref

BUILDKIT_CLIENT_CANDIDATES = ("/usr/bin/docker", "docker")


@dataclass(frozen=True)
class ImageInfo:
    """What the engine knows about an image, without running it."""

    ref: str
    id: str
    repo_digests: tuple[str, ...]
    os: str
    architecture: str
    variant: str
    labels: dict[str, str]
    layers: tuple[str, ...]
    env: tuple[str, ...] = field(default=())
    runtime: tuple[str, ...] = field(default=())  # entrypoint, cmd, workdir, user (as JSON)

    @property
    def platform(self) -> str:
        suffix = f"/{self.variant}" if self.variant else ""
        return f"{self.os}/{self.architecture}{suffix}"

    @property
    def digest_ref(self) -> str:
        """A reference that pins the exact image: repo@sha256 when known, else the ID."""
        return self.repo_digests[0] if self.repo_digests else self.id


class Engine:
    """A connected Docker engine."""

    def __init__(self, client: docker.DockerClient) -> None:
        self.client = client

    @classmethod
    def connect(cls) -> Engine:
        try:
            client = docker.from_env(timeout=600)
            client.ping()
        except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
            host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
            raise Sm121Error(
                f"cannot reach the Docker engine at {host}: start it (e.g. `dockerd &` or "
                f"`systemctl start docker`) or set DOCKER_HOST ({type(exc).__name__})") from None
        return cls(client)

    def image(self, ref: str) -> ImageInfo:
        validate_image_ref(ref)
        try:
            image = self.client.images.get(ref)
        except docker.errors.ImageNotFound:
            raise Sm121Error(
                f"image {ref} not found in the local Docker engine: `docker pull {ref}` "
                "or `docker load` it first") from None
        except docker.errors.APIError as exc:
            raise Sm121Error(f"engine refused to inspect {ref}: {exc.explanation}") from None
        attrs: dict[str, Any] = image.attrs
        config = attrs.get("Config") or {}
        return ImageInfo(
            ref=ref,
            id=image.id,
            repo_digests=tuple(attrs.get("RepoDigests") or ()),
            os=attrs.get("Os", ""),
            architecture=attrs.get("Architecture", ""),
            variant=attrs.get("Variant", "") or "",
            labels=dict(config.get("Labels") or {}),
            layers=tuple((attrs.get("RootFS") or {}).get("Layers") or ()),
            env=tuple(config.get("Env") or ()),
            runtime=tuple(json.dumps(config.get(key)) for key in
                          ("Entrypoint", "Cmd", "WorkingDir", "User", "ExposedPorts")),
        )

    def exists(self, ref: str) -> bool:
        try:
            self.client.images.get(ref)
        except docker.errors.ImageNotFound:
            return False
        return True

    def find_by_label(self, key: str, value: str) -> list[ImageInfo]:
        images = self.client.images.list(filters={"label": f"{key}={value}"})
        return [self.image(img.id) for img in images]

    def save(self, ref: str, dest: Path, progress: Callable[[int], None] | None = None) -> None:
        """`docker save` one image to a tarball: its filesystem, no container run."""
        info = self.image(ref)
        try:
            chunks: Iterator[bytes] = self.client.images.get(info.id).save(
                chunk_size=1 << 20, named=False)
            with open(dest, "wb") as out:
                for chunk in chunks:
                    out.write(chunk)
                    if progress:
                        progress(len(chunk))
        except docker.errors.APIError as exc:
            raise Sm121Error(f"engine could not save {ref}: {exc.explanation}") from None

    def tag(self, image_id: str, tag: str) -> None:
        name, _, version = tag.rpartition(":") if ":" in tag.split("/")[-1] else (tag, "", "latest")
        self.client.images.get(image_id).tag(name, version)

    @contextmanager
    def pinned(self, image_id: str) -> Iterator[str]:
        """A temporary local tag for exactly this image, for FROM lines.

        BuildKit resolves `FROM sha256:<id>` against a registry (which fails air-gapped),
        and a tag the user passed may move during a build; a private tag does neither.
        It is removed afterwards unless it is the image's only tag (removing that would
        delete the image).
        """
        image = self.client.images.get(image_id)
        had_tags = bool(image.tags)
        repo = f"sm121-build-pin/{image_id.split(':')[-1][:12]}"
        tag = f"{os.getpid()}-{secrets.token_hex(3)}"
        image.tag(repo, tag)
        try:
            yield f"{repo}:{tag}"
        finally:
            if had_tags:
                with suppress(docker.errors.APIError):
                    self.client.images.remove(f"{repo}:{tag}", noprune=True)

    def remove_image(self, ref: str) -> None:
        try:
            self.client.images.remove(ref, force=True, noprune=False)
        except docker.errors.ImageNotFound:
            pass
        except docker.errors.APIError:
            pass  # in use or already gone: nothing half-built is tagged either way

    def buildkit_client(self) -> str | None:
        """A docker CLI that can run BuildKit builds (`DOCKER_BUILDKIT=1`), if one exists."""
        for candidate in BUILDKIT_CLIENT_CANDIDATES:
            path = shutil.which(candidate)
            if not path:
                continue
            result = subprocess.run(
                [path, "build", "--help"], capture_output=True, text=True, check=False,
                env={**os.environ, "DOCKER_BUILDKIT": "1"})
            if result.returncode == 0 and "--secret" in result.stdout:
                return path
        return None


def _stream_to(log: Path, line: str, status: Callable[[str], None] | None) -> None:
    with open(log, "a", encoding="utf-8") as out:
        out.write(line if line.endswith("\n") else line + "\n")
    if status and line.strip():
        status(line.strip())


class BuildFailed(Sm121Error):
    """The image build failed; the log file says why."""


_DIAGNOSIS = re.compile(r"sm121-build: (.*(?:failed|produced no).*)$")
_PTXAS = re.compile(r"(ptxas.*error.*)$", re.IGNORECASE)
_ERROR = re.compile(r"((?:error|ERROR|Error)\b.*)$")


def failure_cause(log: Path) -> str:
    """What a failed build's log says went wrong: the build script's diagnosis and ptxas's
    own message when there are such lines, else the last error line."""
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()

    def first(pattern: re.Pattern[str], reverse: bool = False) -> str | None:
        for line in reversed(lines) if reverse else lines:
            if match := pattern.search(line):
                return match.group(1).strip()
        return None

    diagnosis, ptxas = first(_DIAGNOSIS), first(_PTXAS)
    parts = [part for part in (diagnosis, f"ptxas said: {ptxas}" if ptxas else None) if part]
    if not parts:
        parts = [first(_ERROR, reverse=True) or "see the log"]
    return "; ".join(parts)[:400]


def build_image(engine: Engine, context: Path, dockerfile: Path, log: Path,
                status: Callable[[str], None] | None = None) -> str:
    """Build an untagged image; returns its ID.  BuildKit (CLI) when available, else the
    legacy builder through the API (no cache mounts then)."""
    client_path = engine.buildkit_client()
    if client_path:
        iidfile = context / ".sm121-iid"
        env = {**os.environ, "DOCKER_BUILDKIT": "1", "BUILDKIT_PROGRESS": "plain"}
        args = [client_path, "build", "--progress", "plain", "-f", str(dockerfile),
                "--iidfile", str(iidfile), str(context)]
        process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, errors="replace", env=env)
        assert process.stdout is not None
        try:
            for line in process.stdout:
                _stream_to(log, line, status)
        except KeyboardInterrupt:
            process.terminate()
            process.wait()
            raise
        if process.wait() != 0 or not iidfile.exists():
            raise BuildFailed(f"docker build failed: {failure_cause(log)}; full log: {log}")
        return iidfile.read_text().strip()
    image_id = ""
    try:
        for chunk in engine.client.api.build(path=str(context), dockerfile=str(dockerfile),
                                             rm=True, forcerm=True, decode=True):
            if "stream" in chunk:
                _stream_to(log, chunk["stream"], status)
            if "error" in chunk:
                _stream_to(log, chunk["error"], status)
                raise BuildFailed(f"docker build failed: {failure_cause(log)}; full log: {log}")
            if "aux" in chunk and "ID" in chunk["aux"]:
                image_id = chunk["aux"]["ID"]
    except docker.errors.APIError as exc:
        raise BuildFailed(f"docker build failed: {exc.explanation}; full log: {log}") from None
    if not image_id:
        raise BuildFailed(f"docker build produced no image; full log: {log}")
    return image_id
