"""The one place that talks to the container engine (through the Docker SDK).

Everything else asks this module for images, single files and directory streams of an
image, builds, tags and labels; no other module imports `docker`.

How an image's files are read (measured on this project's 2-core test machine, Docker 20.10,
a 4.3 GB image): `docker save` of the whole image took 46 s (~93 MB/s, and its size in temp
disk); creating a container (never started) took 0.02 s, a HEAD on its archive endpoint (the
stat of one path) 5 ms, `get_archive` of a 30 MB file 0.15 s and of a 1 GB file 3 s
(~350 MB/s), with nothing written to disk.  Streaming the save output instead of writing it
saves the disk but not the time: every layer is still read.  So an image is read through
`ImageReader`: one created container per image, stat and single-file reads of exactly the
paths a step needs, a directory streamed as tar only where a listing is unavoidable, and the
container removed on every exit (Ctrl-C included).  Creating a container runs nothing, so an
ARM64 image is read on x86 all the same.
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import shutil
import tarfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any, cast

import docker
import docker.auth
import docker.errors
import docker.types
import docker.utils.config
import requests.adapters
import requests.exceptions
import urllib3.exceptions
from requests.models import PreparedRequest, Response

from sm121_build.core.children import LINE_WIDTH, Lines, Program, run
from sm121_build.core.console import cut, note
from sm121_build.core.errors import (
    BuildFailed,
    DockerConfigRefused,
    EngineRefused,
    EngineUnavailable,
    ManifestUnknown,
    NoGpu,
    RegistryUnavailable,
    Sm121Error,
)
from sm121_build.core.inputs import InputRefused, open_file, read_input
from sm121_build.core.interrupts import answer_within
from sm121_build.core.leftovers import LEFT_BEHIND
from sm121_build.core.limits import ENGINE_VARIABLE, REGISTRY_VARIABLE, Limits
from sm121_build.core.pull_progress import PullProgress
from sm121_build.image.api import (
    PIN_REPO,
    RUNTIME_FIELDS,
    ConfinedJob,
    ConfinedResult,
    GpuJob,
    HistoryStep,
    ImageInfo,
    PathLookups,
    PathStat,
    StatusLine,
)
from sm121_build.image.credential_helper import helper_for, helper_login
from sm121_build.image.refs import split_ref, validate_image_ref
from sm121_build.image.spill import write_stream

BUILDKIT_CLIENT_CANDIDATES = ("/usr/bin/docker", "docker")
READER_LABEL = "io.github.sm121-build.reader"
_LOST = (docker.errors.APIError, requests.exceptions.RequestException)
# how the engine words a registry's "no such manifest" (distribution's MANIFEST_UNKNOWN,
# NAME_UNKNOWN, Docker Hub's "not found")
_UNKNOWN_MANIFEST = re.compile(r"not found|manifest unknown|unknown manifest|does not exist",
                               re.I)
# what a streamed read raises when its socket timed out (urllib3 is not wrapped by the SDK there)
_NO_ANSWER = (requests.exceptions.RequestException, urllib3.exceptions.HTTPError, OSError)
# a legacy (API) build may compile one file for an hour without a line of output
BUILD_SILENCE_S = 3600.0
# the longest a BuildKit build (the docker CLI) may run: a source build on a Spark takes 20-90 min
BUILD_S = 86_400.0
# how an engine words "I have nothing to hand a container a GPU with": no device driver for
# the request (no NVIDIA Container Toolkit), or the toolkit's hook failing (no driver loaded)
_NO_GPU_SUPPORT = re.compile(r"could not select device driver|nvidia-container-cli|"
                             r"unknown or invalid runtime name|no devices? (?:were )?found",
                             re.I)
__all__ = ["Engine", "HistoryStep", "ImageInfo", "ImageReader", "PathStat", "failure_cause"]


class _Answering(requests.adapters.BaseAdapter):
    """The transport of every request to the engine: each waits for an answer as long as
    its caller asks, the client's time limit when it names none (the SDK's pull, a HEAD of an
    archive: else no limit at all), and once the run is interrupted no longer than the
    clean-up's time left (`interrupts.answer_within`), so an engine that stopped answering
    cannot hold an interrupted run's clean-up for SM121_ENGINE_TIMEOUT: what it could not
    remove stays in LEFT_BEHIND and is named in the interrupted line."""

    def __init__(self, inner: requests.adapters.BaseAdapter,
                 default: Callable[[], float]) -> None:
        super().__init__()
        self.inner = inner
        self.default = default

    def send(self, request: PreparedRequest, *args: Any, **kwargs: Any) -> Response:
        """`inner`'s send (requests passes every option by name), its wait bounded."""
        timeout = kwargs.get("timeout")
        if not isinstance(timeout, tuple):
            kwargs["timeout"] = answer_within(self.default() if timeout is None else timeout)
        return self.inner.send(request, *args, **kwargs)

    def close(self) -> None:
        self.inner.close()


MAX_DOCKER_CONFIG = 1 << 20
# the parts of config.json the SDK reads, and what each must be: an object of objects (auths,
# proxies: the SDK calls .get/.items on each) or an object of strings (HttpHeaders)
_CONFIG_SHAPE = {"auths": dict, "proxies": dict, "HttpHeaders": str}


def check_docker_config() -> None:
    """Docker's config.json as the Docker SDK would find it (DOCKER_CONFIG's, else
    ~/.docker/config.json, else ~/.dockercfg), checked through the files-in door before the
    SDK opens it with a plain blocking open() and no bound: a FIFO, a device, a link to
    /dev/zero, a file over 1 MiB, or JSON of a shape the SDK crashes on (not an object; an
    `auths`, `proxies` or `HttpHeaders` of another type) is a `DockerConfigRefused`, one
    line.  Text that is not JSON at all the SDK itself ignores, so it is let through."""
    path = docker.utils.config.find_config_file()
    if not path:
        return
    try:
        raw = read_input(path, MAX_DOCKER_CONFIG, "Docker's config.json")
    except InputRefused as exc:
        raise DockerConfigRefused(f"{exc} (the Docker SDK reads it to reach the engine)") \
            from None
    try:
        config = json.loads(raw)
    except (ValueError, RecursionError):
        return
    if not _sdk_readable(config):
        raise DockerConfigRefused(f"{path}: Docker's config.json is not of the shape the "
                                  "Docker SDK reads")


def _sdk_readable(config: object) -> bool:
    """Whether the SDK can read `config`: an object whose `auths`/`proxies` are objects of
    objects (each auth's fields strings), `HttpHeaders` an object of strings, `credsStore` a
    string and `credHelpers` an object of strings (the SDK runs `docker-credential-` + it),
    and whose logins the SDK's own parser decodes (each `auth` base64 of `user:password`,
    in `auths` or in the old auth-only shape: its decoding raises as it makes the client)."""
    if not isinstance(config, dict):
        return False
    for key, inner in _CONFIG_SHAPE.items():
        part = config.get(key, {})
        if not isinstance(part, dict) or not all(isinstance(v, inner) for v in part.values()):
            return False
    helpers = config.get("credHelpers") or {}
    if not isinstance(config.get("credsStore") or "", str) or not isinstance(helpers, dict) \
            or not all(isinstance(v, str) for v in helpers.values()):
        return False
    if not all(isinstance(value, str) for entry in config.get("auths", {}).values()
               for value in entry.values()) or \
            not all(isinstance(value, (str, type(None)))
                    for entry in config.get("proxies", {}).values() for value in entry.values()):
        return False
    try:  # (a copy: the SDK's parser takes its sections out of what it is given)
        docker.auth.load_config(config_dict=json.loads(json.dumps(config)))
    except (ValueError, TypeError, AttributeError, RecursionError,
            docker.errors.DockerException):
        return False  # (binascii.Error and UnicodeError are ValueErrors)
    return True


def _client(timeout: float) -> docker.DockerClient:
    """The SDK's client for the engine DOCKER_HOST names, once Docker's config.json (which
    the SDK reads itself) has passed `check_docker_config`."""
    check_docker_config()
    return docker.from_env(timeout=timeout)


# the engine's words for a push of a tag it does not have (its own failure, not the registry's)
_NOT_HERE = re.compile(r"does not exist locally|no such image|tag does not exist", re.I)
# a layer's states that say nothing has moved: the engine waiting for, or retrying, the registry
_STANDING = re.compile(r"^(Retrying in|Waiting$|Preparing$)")
_now = time.monotonic  # the clock of the progress rule (a test's own stands in)


def _progressed(event: object, seen: dict[tuple[str, str], int]) -> bool:
    """Whether a push's or pull's event shows progress: more bytes of a layer in a state
    than before (`progressDetail.current`), or a layer reaching a state it was not in
    (`Pushed`, `Layer already exists`); a retry's countdown, a wait and bytes sent again
    after a retry are none.  `seen` keeps the most bytes per (layer, state)."""
    if not isinstance(event, dict):
        return False
    state, layer = event.get("status"), event.get("id")
    if not isinstance(state, str) or _STANDING.match(state):
        return False
    key = (str(layer), state)
    detail = event.get("progressDetail")
    current = detail.get("current") if isinstance(detail, dict) else None
    count = current if isinstance(current, int) and not isinstance(current, bool) else 0
    if key in seen and count <= seen[key]:
        return False
    seen[key] = count
    return True


def _making_progress(events: Iterable[Any], limit_s: float, what: str) -> Iterator[Any]:
    """`events` as they come, until one arrives more than `limit_s` after the last that
    showed progress: then `RegistryUnavailable` (a stream that stops altogether is ended by
    the per-answer limit of `Engine._waiting`)."""
    seen: dict[tuple[str, str], int] = {}
    last = _now()
    for event in events:
        now = _now()
        if _progressed(event, seen):
            last = now
        elif now - last > limit_s:
            raise RegistryUnavailable(
                f"cannot {what}: no progress in {limit_s:g} s (the registry drips, stalls or "
                f"is retried; set {REGISTRY_VARIABLE} to wait longer)")
        yield event


def version_and_info(timeout: int = 10) -> tuple[dict[str, Any], dict[str, Any]]:
    """`docker version` and `docker info` of the engine DOCKER_HOST names (for doctor); the
    SDK's own errors propagate, and a config.json the SDK must not read is a
    `DockerConfigRefused`."""
    client = _client(timeout)
    try:
        return dict(client.version()), dict(client.info())
    finally:
        client.close()


def _said(exc: docker.errors.APIError) -> str:
    """What the engine said of a refusal (often a registry's answer it relays, of any
    length), cut as every value from outside is in a line."""
    return cut(str(exc.explanation or exc))


class _Held(docker.auth.AuthConfig):  # type: ignore[misc]  # (the SDK is untyped)
    """config.json's `auths` as the SDK is left them: never empty to it, so it never reads
    config.json again (that read brings back the helpers, which it would then run itself,
    for a pull or push without a login and for every legacy build)."""

    @property
    def is_empty(self) -> bool:
        return False


class Engine:
    """A connected Docker engine."""

    def __init__(self, client: docker.DockerClient, limits: Limits | None = None) -> None:
        self.client = client
        self.limits = limits or Limits.from_environment()
        api = client.api
        for prefix, adapter in list(api.adapters.items()):
            api.mount(prefix, _Answering(adapter, lambda: float(api.timeout)))
        # Docker's config.json as the SDK read it; the SDK keeps its logins alone, so it
        # never runs a credential helper itself (no deadline, no group of its own): a pull's
        # or push's login is asked through the children door (`_login`)
        self.logins: docker.auth.AuthConfig | None = getattr(api, "_auth_configs", None)
        if self.logins is not None:
            api._auth_configs = _Held({"auths": dict(self.logins.auths)})

    @classmethod
    def connect(cls) -> Engine:
        """The engine DOCKER_HOST names, answering a ping within SM121_ENGINE_TIMEOUT; every
        later call waits that long for an answer (registry calls: SM121_REGISTRY_TIMEOUT)."""
        limits = Limits.from_environment()
        host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        try:
            client = _client(limits.engine_s)
            client.ping()
        except (docker.errors.DockerException, *_NO_ANSWER) as exc:
            if _timed_out(exc):
                raise EngineUnavailable(
                    f"the Docker engine at {host} gave no answer in {limits.engine_s:g} s "
                    f"(set {ENGINE_VARIABLE} to wait longer)") from None
            raise EngineUnavailable(
                f"cannot reach the Docker engine at {host}: start it (e.g. `dockerd &` or "
                f"`systemctl start docker`) or set DOCKER_HOST ({type(exc).__name__})") from None
        return cls(client, limits)

    @contextmanager
    def _waiting(self, seconds: float) -> Iterator[None]:
        """Calls made inside wait `seconds` for each answer (a stream: for each chunk)."""
        saved = self.client.api.timeout
        self.client.api.timeout = seconds
        try:
            yield
        finally:
            self.client.api.timeout = saved

    def _registry_failed(self, verb: str, ref: str, exc: BaseException) -> Sm121Error:
        """The error a failed registry call through the engine is: no answer in time (the
        registry's, exit 7) or the engine connection lost (exit 4)."""
        if _timed_out(exc):
            return RegistryUnavailable(
                f"cannot {verb} {ref}: no answer in {self.limits.registry_s:g} s (set "
                f"{REGISTRY_VARIABLE} to wait longer)")
        return EngineUnavailable(f"cannot {verb} {ref}: engine connection lost ({exc})")

    def image(self, ref: str) -> ImageInfo:
        validate_image_ref(ref)
        try:
            image = self.client.images.get(ref)
        except docker.errors.ImageNotFound:
            raise Sm121Error(
                f"image {ref} not found in the local Docker engine: `docker pull {ref}` "
                "or `docker load` it first") from None
        except docker.errors.APIError as exc:
            raise EngineRefused(f"engine refused to inspect {ref}: {_said(exc)}") from None
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
            runtime=tuple(json.dumps(config.get(key)) for key, _name in RUNTIME_FIELDS),
            created=str(attrs.get("Created") or ""),
        )

    def _login(self, name: str, verb: str) -> dict[str, str] | None:
        """The login for `name`'s registry: from the helper config.json names for it (run
        through the children door, `credential_helper.helper_login`), else from its
        `auths`; None (no login sent) where it holds none."""
        if self.logins is None:
            return None
        try:
            registry, _repository = docker.auth.resolve_repository_name(name)
        except docker.errors.DockerException:
            return None  # (a name the engine itself then refuses, in its own words)
        helper = helper_for(self.logins, registry)
        if helper is None:
            login = self.logins.resolve_authconfig(registry)  # its auths: no program runs
            return dict(login) if isinstance(login, dict) and login else None
        return helper_login(helper, registry, verb, self.limits.registry_s) or None

    def pull(self, ref: str, status: StatusLine | None = None) -> str:
        """Pull `ref` (a repository reference: cmd_build refuses image IDs up front) from its
        registry, as `docker pull`; returns the local image ID."""
        name, tag, digest = split_ref(ref)
        progress = PullProgress(ref, time.monotonic())
        shown = 0.0
        try:
            login = self._login(name, "pull")
            with self._waiting(self.limits.registry_s):
                events = self.client.api.pull(name, tag=digest or tag or "latest",
                                              stream=True, decode=True, auth_config=login)
            for event in events:
                if "error" in event:
                    raise Sm121Error(f"cannot pull {ref}: {event['error']}")
                progress.feed(event)
                now = time.monotonic()
                if status and now - shown >= 0.2:  # bytes, rate, time left
                    shown = now
                    status(progress.text(now))
        except docker.errors.APIError as exc:
            raise Sm121Error(f"cannot pull {ref}: "
                             f"{_said(exc)}") from None
        except _NO_ANSWER as exc:
            raise self._registry_failed("pull", ref, exc) from None
        if status:
            status(progress.summary(time.monotonic()))  # the last word: what came, how fast
        return self.image(ref).id

    def resolve_digest(self, ref: str) -> str:
        """The manifest digest a registry gives `ref` now (`sha256:...`), asked through the
        engine (its login, mirrors and insecure-registry settings): what a later pull by
        digest gets, however the tag moves meanwhile."""
        try:
            with self._waiting(self.limits.registry_s):
                data = self.client.api.inspect_distribution(ref)
        except docker.errors.APIError as exc:
            said = f"cannot resolve {ref}: {_said(exc)}"
            # the engine relays the registry's answer as text: told apart here, once
            if exc.status_code == 404 or _UNKNOWN_MANIFEST.search(str(exc.explanation or "")):
                raise ManifestUnknown(said) from None
            raise Sm121Error(said) from None
        except _NO_ANSWER as exc:
            raise self._registry_failed("resolve", ref, exc) from None
        digest = str((data.get("Descriptor") or {}).get("digest") or "")
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
            raise Sm121Error(f"cannot resolve {ref}: the registry gave no digest")
        return digest

    def push(self, ref: str) -> None:
        """Push a local tag to its registry, as `docker push` (the engine's credentials).
        The engine keeps its event stream alive while it retries a registry that drips or
        refuses, so each event arriving in time is not enough: a push whose events show no
        progress (`_progressed`) for SM121_REGISTRY_TIMEOUT ends, and the registry's
        refusal the engine relays (an `error` event) is the registry's failure, exit 7."""
        name, tag, _digest = split_ref(ref)
        events: Any = None
        try:
            login = self._login(name, "push")
            with self._waiting(self.limits.registry_s):
                events = self.client.api.push(name, tag=tag or "latest", stream=True,
                                              decode=True, auth_config=login)
            for event in _making_progress(events, self.limits.registry_s, f"push {ref}"):
                if not isinstance(event, dict) or "error" not in event:
                    continue
                said = cut(str(event["error"]))
                if _NOT_HERE.search(said):  # the engine's own: no such local tag
                    raise Sm121Error(f"cannot push {ref}: {said}")
                raise RegistryUnavailable(f"cannot push {ref}: the registry refused or "
                                          f"failed: {said}")
        except docker.errors.APIError as exc:
            raise Sm121Error(f"cannot push {ref}: {_said(exc)}") from None
        except _NO_ANSWER as exc:
            raise self._registry_failed("push", ref, exc) from None
        finally:
            close = getattr(events, "close", None)
            if callable(close):  # a push given up: the stream closed, so the engine stops
                with suppress(*_NO_ANSWER):
                    close()

    def image_id(self, ref: str) -> str | None:
        """The local image ID `ref` names, or None when there is none."""
        try:
            return str(self.client.images.get(ref).id)
        except docker.errors.ImageNotFound:
            return None

    def tags_of(self, image_id: str) -> tuple[str, ...]:
        try:
            return tuple(self.client.images.get(image_id).tags)
        except docker.errors.ImageNotFound:
            return ()

    def untag(self, tag: str) -> None:
        """Remove one tag (never the image under another tag; never by force)."""
        with suppress(docker.errors.ImageNotFound):
            self.client.images.remove(tag, force=False, noprune=True)

    def remove_unused(self, image_id: str) -> str | None:
        """Remove an untagged image nothing builds on; returns why not when it stays."""
        try:
            self.client.images.remove(image_id, force=False, noprune=False)
        except docker.errors.ImageNotFound:
            return None
        except docker.errors.APIError as exc:
            return _said(exc)
        return None

    def in_use(self, image_id: str) -> str | None:
        """An image whose parent it is (the legacy builder's children), or a container of it,
        even a stopped one: either makes a removal without force fail."""
        try:
            for image in self.client.api.images(all=True):
                if image.get("ParentId") == image_id:
                    return f"image {str(image['Id']).split(':')[-1][:12]} builds on it"
            for container in self.client.api.containers(all=True):
                if container.get("ImageID") == image_id:
                    return f"container {str(container.get('Id', ''))[:12]} uses it"
        except docker.errors.APIError as exc:
            return f"engine refused to list its users ({_said(exc)})"
        return None

    def exists(self, ref: str) -> bool:
        try:
            self.client.images.get(ref)
        except docker.errors.ImageNotFound:
            return False
        return True

    def find_by_label(self, key: str, value: str) -> list[ImageInfo]:
        images = self.client.images.list(filters={"label": f"{key}={value}"})
        return [self.image(img.id) for img in images]

    @contextmanager
    def reader(self, image_id: str,
               on_read: Callable[[int], None] | None = None) -> Iterator[ImageReader]:
        """The image's files through a created, never started container, removed on exit."""
        name = f"sm121-build-read-{os.getpid()}-{secrets.token_hex(4)}"
        with self._removed_after(name):
            try:
                container = self.client.api.create_container(
                    image_id, command=["/sm121-build-never-started"],
                    entrypoint=["/sm121-build-never-started"], network_disabled=True,
                    name=name, labels={READER_LABEL: str(os.getpid())})
            except docker.errors.ImageNotFound:
                raise Sm121Error(f"image {image_id} was removed from the engine while it was "
                                 "being read") from None
            except docker.errors.APIError as exc:
                raise EngineRefused(f"engine refused to open {image_id} for reading: "
                                    f"{_said(exc)}") from None
            yield ImageReader(self.client, container["Id"], image_id, on_read)

    @contextmanager
    def _removed_after(self, name: str) -> Iterator[None]:
        """A container this run makes, by its name: in LEFT_BEHIND (the error line if the
        engine goes away) from before it is asked for, so an interrupt that lands while the
        engine creates it (the ID not yet known here) still removes it by name; removed on
        every exit (a container that was never made: nothing to remove)."""
        LEFT_BEHIND.add(f"container {name}")
        try:
            yield
        finally:
            with suppress(*_LOST):
                self._remove_named(name)
                LEFT_BEHIND.discard(f"container {name}")

    def _remove_named(self, name: str) -> None:
        """Remove the container `name`; not there yet, once more a moment later (the engine
        may still be creating it, asked just before an interrupt): then there is none."""
        for attempt in range(2):
            try:
                self.client.api.remove_container(name, force=True, v=True)
                return
            except docker.errors.NotFound:
                if attempt == 0:
                    time.sleep(0.25)

    def run_confined(self, image_id: str, job: ConfinedJob) -> ConfinedResult:
        """Run `job.argv` in a throwaway container of `image_id` that can do nothing but
        compute: no network, a read-only root, not root, no capabilities, no new
        privileges, one CPU, `job.memory` bytes, 64 processes, a small `job.scratch`, a bounded
        log.
        It is killed after `job.seconds` and removed on every exit."""
        name = f"sm121-build-confined-{os.getpid()}-{secrets.token_hex(4)}"
        with self._removed_after(name):
            return self._wait_for(self._create_confined(image_id, job, name), job)

    def _sealed(self, **more: Any) -> Any:
        """The host config every container this tool runs a program in shares: no network,
        a read-only root, no capabilities, no new privileges, a 1 MiB log; `more` adds its
        own limits, devices and mounts."""
        return self.client.api.create_host_config(
            network_mode="none", read_only=True, cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            log_config={"Type": "json-file", "Config": {"max-size": "1m", "max-file": "1"}},
            **more)

    def _create_confined(self, image_id: str, job: ConfinedJob, name: str) -> str:
        """The confined container of `run_confined`, created (not started): its ID."""
        try:
            container = self.client.api.create_container(
                image_id, entrypoint=list(job.argv[:1]), command=list(job.argv[1:]),
                environment=dict(job.env), name=name, user="65534:65534",
                network_disabled=True, labels={READER_LABEL: "confined"},
                host_config=self._sealed(
                    mem_limit=job.memory, memswap_limit=job.memory, nano_cpus=1_000_000_000,
                    pids_limit=64,
                    # a folder the image does not have: over an existing one (`/tmp` of a
                    # FROM scratch image) Docker 20.10 leaves the mount unwritable to uid 65534
                    mounts=[docker.types.Mount(job.scratch, "", type="tmpfs",
                                               tmpfs_size=16 << 20, tmpfs_mode=0o1777)]))
        except docker.errors.APIError as exc:
            raise EngineRefused(f"engine refused to create a container of {image_id}: "
                                f"{_said(exc)}") from None
        return str(container["Id"])

    def run_with_gpu(self, image_id: str, job: GpuJob) -> ConfinedResult:
        """Run `job.argv` in a throwaway container of `image_id` given every GPU of this
        machine through the engine's device request (`docker run --gpus all`): no network,
        a read-only root, no capabilities, no new privileges, as `job.user`, the binds its
        only folders from outside, a bounded log.  Killed after `job.seconds` and removed on
        every exit.  An engine that cannot hand a container a GPU is NoGpu, in one line."""
        name = f"sm121-build-gpu-{os.getpid()}-{secrets.token_hex(4)}"
        with self._removed_after(name):
            try:
                # the program is the entrypoint: the image's own (`vllm serve`) never runs
                created = self.client.api.create_container(
                    image_id, entrypoint=list(job.argv[:1]), command=list(job.argv[1:]),
                    environment=dict(job.env), name=name, user=job.user,
                    network_disabled=True, labels={READER_LABEL: "gpu"},
                    host_config=self._sealed(
                        pids_limit=4096, device_requests=self.gpu_devices(),
                        mounts=[docker.types.Mount(b.inside, str(b.host), type="bind",
                                                   read_only=not b.writable)
                                for b in job.binds]))
            except docker.errors.APIError as exc:
                raise _gpu_refusal(exc) or EngineRefused(
                    f"engine refused to create a container of {image_id}: "
                    f"{_said(exc)}") from None
            try:
                return self._wait_for(str(created["Id"]), job)
            except EngineRefused as exc:
                raise _gpu_refusal(exc.__cause__) or exc from None

    def gpu_devices(self) -> list[docker.types.DeviceRequest]:
        """The device request of `docker run --gpus all`: every GPU, through whatever
        the engine has for them (the NVIDIA Container Toolkit, on a DGX Spark)."""
        return [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])]

    def _wait_for(self, container: str, job: ConfinedJob | GpuJob) -> ConfinedResult:
        """Start the container and wait for it, at most `job.seconds`."""
        try:
            self.client.api.start(container)
            try:
                # (wait's own timeout: None there would override the client's)
                status = self.client.api.wait(container, timeout=job.seconds)
            except _NO_ANSWER as exc:
                if not _timed_out(exc):
                    raise EngineUnavailable(f"engine connection lost while {job.what} ran: "
                                            f"{exc}") from None
                return ConfinedResult(None, "", "")
            out = self.client.api.logs(container, stdout=True, stderr=False)
            err = self.client.api.logs(container, stdout=False, stderr=True)
            return ConfinedResult(int(status.get("StatusCode", -1)),
                                  out.decode(errors="replace"), err.decode(errors="replace"))
        except docker.errors.APIError as exc:
            raise EngineRefused(f"engine refused to run {job.what}: {_said(exc)}") from exc

    def history(self, image_id: str) -> list[HistoryStep]:
        """The image's build steps, newest first (`docker history`)."""
        try:
            return [HistoryStep(str(h.get("CreatedBy") or ""), int(h.get("Size") or 0))
                    for h in self.client.api.history(image_id)]
        except docker.errors.APIError as exc:
            raise EngineRefused(f"engine refused the history of {image_id}: "
                                f"{_said(exc)}") from None

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
        repo = f"{PIN_REPO}/{image_id.split(':')[-1][:12]}"
        tag = f"{os.getpid()}-{secrets.token_hex(3)}"
        image.tag(repo, tag)
        LEFT_BEHIND.add(f"tag {repo}:{tag}")
        try:
            yield f"{repo}:{tag}"
        finally:
            if had_tags:
                with suppress(*_LOST):
                    self.client.images.remove(f"{repo}:{tag}", noprune=True)
                    LEFT_BEHIND.discard(f"tag {repo}:{tag}")
            else:
                LEFT_BEHIND.discard(f"tag {repo}:{tag}")
                kept_pin(f"{repo}:{tag}")

    def image_ids(self) -> set[str]:
        """Every image ID in the engine, intermediate ones included."""
        return {str(image["Id"]) for image in self.client.api.images(all=True)}

    def remove_created(self, image_id: str, before: set[str]) -> None:
        """Remove an image this run created: never one that existed before it (a build cache
        hit returns the ID of an image the user may have tagged), and never by force, so an
        image that something else references or tags stays."""
        if image_id in before:
            return
        try:
            self.client.images.remove(image_id, force=False, noprune=False)
        except docker.errors.APIError:
            return  # the engine said no: something else references or tags it
        except _NO_ANSWER:  # no answer (an interrupted run's clean-up: at most seconds)
            LEFT_BEHIND.add(f"image {image_id}")

    def build(self, context: Path, dockerfile: Path, log: Path,
                  status: StatusLine | None = None) -> str:
        """Build an untagged image; returns its ID.  BuildKit (CLI) when available, else the
        legacy builder through the API (no cache mounts then)."""
        client_path = self.buildkit_client()
        if client_path:
            iidfile = context / ".sm121-iid"
            env = {**os.environ, "DOCKER_BUILDKIT": "1", "BUILDKIT_PROGRESS": "plain"}
            args = [client_path, "build", "--progress", "plain", "-f", str(dockerfile),
                    "--iidfile", str(iidfile), str(context)]
            lines = Lines(lambda line: _stream_to(log, line, status))
            try:
                done = run(Program(tuple(args), BUILD_S, "docker build", env=env, merge=True),
                           lines)
            except OSError as exc:
                raise BuildFailed(f"docker build does not run: {exc}") from None
            lines.close()
            if done.timed_out:
                raise BuildFailed(f"docker build ran past its {BUILD_S:.0f} s limit; "
                                  f"full log: {log}")
            if done.returncode != 0 or not iidfile.exists():
                raise BuildFailed(f"docker build failed: {failure_cause(log)}; full log: {log}")
            return _built_id(iidfile.read_text().strip(), log)
        image_id = ""
        # the engine's chunks are cut into lines as the CLI's output is (a chunk's text
        # may hold many lines, part of one, or one that never ends)
        lines = Lines(lambda line: _stream_to(log, line, status))
        try:
            with self._waiting(max(BUILD_SILENCE_S, self.limits.engine_s)):
                chunks = self.client.api.build(path=str(context), dockerfile=str(dockerfile),
                                               rm=True, forcerm=True, decode=True)
            for chunk in chunks:
                if not isinstance(chunk, dict):
                    continue  # (no chunk the engine sends: nothing of it is read)
                if isinstance(said := chunk.get("stream"), str):
                    lines(said.encode("utf-8", "replace"))
                if "error" in chunk:
                    lines.close()  # a line the engine left open, then its error on its own
                    said = str(chunk["error"])
                    lines(f"{said}\n".encode("utf-8", "replace"))
                    raise BuildFailed(f"docker build failed: {failure_cause(log, said)}; "
                                      f"full log: {log}")
                if isinstance(aux := chunk.get("aux"), dict) and "ID" in aux:
                    image_id = _built_id(aux["ID"], log)
        except docker.errors.APIError as exc:
            raise BuildFailed(f"docker build failed: {_said(exc)}; "
                              f"full log: {log}") from None
        finally:
            lines.close()
        if not image_id:
            raise BuildFailed(f"docker build produced no image; full log: {log}")
        return image_id

    def buildkit_client(self) -> str | None:
        """A docker CLI that can run BuildKit builds (`DOCKER_BUILDKIT=1`), if one exists;
        none when the user turned BuildKit off (`DOCKER_BUILDKIT=0`, as the docker CLI reads
        it): the legacy builder then."""
        if os.environ.get("DOCKER_BUILDKIT", "").strip().lower() in ("0", "false"):
            return None
        return find_buildkit_client(shutil.which, _build_help)


def find_buildkit_client(which: Callable[[str], str | None],
                         build_help: Callable[[str], str | None]) -> str | None:
    """The first docker CLI whose `build --help` (None when it fails) offers BuildKit's
    `--secret`: what `Engine.buildkit_client` and `doctor` both ask.  The CLI reads Docker's
    config.json itself, so one `check_docker_config` refuses is a `DockerConfigRefused`
    before any CLI is run (a FIFO there would hold each `build --help` to its deadline)."""
    check_docker_config()
    for candidate in BUILDKIT_CLIENT_CANDIDATES:
        path = which(candidate)
        if path and "--secret" in (build_help(path) or ""):
            return path
    return None


def _build_help(client: str) -> str | None:
    try:
        result = run(Program((client, "build", "--help"), 30.0, "docker build --help",
                             env={**os.environ, "DOCKER_BUILDKIT": "1"}))
    except OSError:
        return None
    return result.text if result.returncode == 0 and not result.timed_out else None


def kept_pin(tag: str) -> None:
    """The base had no tag of its own: removing the pin would delete the image, so it stays,
    and the user is told."""
    note(f"the base image has no tag of its own: its pin tag {tag} stays (removing it would "
         f"delete the image); `docker rmi {tag}` once you no longer need the base")


def _gpu_refusal(exc: BaseException | None) -> NoGpu | None:
    """The engine's answer to a GPU request as NoGpu, when it says it has no GPU to give."""
    said = str(getattr(exc, "explanation", None) or exc or "")
    if not _NO_GPU_SUPPORT.search(said):
        return None
    answer = " ".join(said.split())[:300]
    return NoGpu(f"the Docker engine cannot give a container the GPU ({answer}): "
                 "`prove IMAGE` needs the NVIDIA Container Toolkit (a DGX Spark has it); "
                 "`prove --files DIR --stock DIR` proves files with this host's torch")


def _timed_out(exc: BaseException) -> bool:
    """Whether `exc` (or what it wraps) is a socket read or connect that got no answer in
    time, however the SDK, requests or urllib3 phrased it."""
    seen: set[int] = set()
    todo: list[object] = [exc]
    while todo:
        item = todo.pop()
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, (requests.exceptions.Timeout, urllib3.exceptions.TimeoutError,
                             TimeoutError)):
            return True
        todo += [*item.args, item.__cause__, item.__context__]
    return False


class ImageReader(PathLookups):
    """Reads paths of one image (absolute, as inside the image) without running it."""

    def __init__(self, client: docker.DockerClient, container: str, image_id: str,
                 on_read: Callable[[int], None] | None = None) -> None:
        self.api = client.api
        self.container = container
        self.image_id = image_id
        self.on_read = on_read

    def _url(self) -> str:
        return str(self.api._url("/containers/{0}/archive", self.container))

    def stat(self, path: str) -> PathStat | None:
        """The path's stat (symlinks not followed), or None when it does not exist."""
        try:
            response = self.api.head(self._url(), params={"path": path})
        except requests.exceptions.RequestException as exc:
            raise EngineUnavailable(f"engine connection lost while reading {path}: {exc}") from None
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise EngineRefused(f"engine refused to stat {path} in {self.image_id}: "
                                f"HTTP {response.status_code}")
        raw = json.loads(base64.b64decode(response.headers["X-Docker-Container-Path-Stat"]))
        return PathStat(path, int(raw.get("size", 0)), int(raw.get("mode", 0)),
                        str(raw.get("linkTarget") or ""))

    @contextmanager
    def tar(self, path: str) -> Iterator[tarfile.TarFile]:
        """`path` (a file or a whole directory) as a tar stream read straight off the
        engine; closing it early stops the engine's work."""
        try:
            # identity: the engine would otherwise gzip the stream, ten times slower here
            response = self.api._get(self._url(), params={"path": path}, stream=True,
                                     headers={"Accept-Encoding": "identity"})
        except requests.exceptions.RequestException as exc:
            raise EngineUnavailable(f"engine connection lost while reading {path}: {exc}") from None
        try:
            if response.status_code == 404:
                raise FileNotFoundError(path)
            if response.status_code != 200:
                raise EngineRefused(f"engine refused to read {path} in {self.image_id}: "
                                    f"HTTP {response.status_code}")
            stream = cast(IO[bytes], _CountingReader(response.raw, self.on_read))
            # 1 MiB reads: tarfile's default 10 KiB record made ~60,000 reads of the HTTP
            # body per 0.6 GB, a third of the audit of vLLM's package in an image
            with tarfile.open(fileobj=stream, mode="r|", bufsize=STREAM_READ) as archive:
                yield archive
        except (tarfile.TarError, requests.exceptions.RequestException) as exc:
            raise EngineUnavailable(f"engine stream of {path} broke off: {exc}") from None
        finally:
            response.close()

    @contextmanager
    def _open_file(self, path: str, limit: int | None = None) -> Iterator[
            tuple[PathStat, tarfile.TarInfo, IO[bytes]] | None]:
        """The regular file `path` names (symlinks followed) as (stat, tar member, stream);
        None when there is none, or it is larger than `limit`."""
        found = self.resolve(path)
        if found is None or not found.is_file or (limit is not None and found.size > limit):
            yield None
            return
        with self.tar(found.path) as archive:
            for member in archive:
                handle = archive.extractfile(member) if member.isfile() else None
                if handle is not None:
                    yield found, member, handle
                    return
        yield None

    def read_bytes(self, path: str, limit: int = 64 << 20) -> bytes | None:
        """A small regular file's content (symlinks followed), or None when absent."""
        with self._open_file(path, limit) as opened:
            return opened[2].read() if opened else None

    def copy_file(self, path: str, dest: Path) -> PathStat | None:
        """Stream one regular file (symlinks followed) to `dest`; None when absent."""
        with self._open_file(path) as opened:
            if opened is None:
                return None
            found, member, handle = opened
            # the image's mode, readable by us
            write_stream(handle, dest, path, member.mode & 0o755 | 0o600)
            return found


STREAM_READ = 1 << 20


class _CountingReader:
    """A raw HTTP body that reports each read's size (for progress lines)."""

    def __init__(self, raw: Any, on_read: Callable[[int], None] | None) -> None:
        self.raw = raw
        self.on_read = on_read

    def read(self, size: int = -1) -> bytes:
        data: bytes = self.raw.read(size, decode_content=True)
        if self.on_read:
            self.on_read(len(data))
        return data


_BUILT_ID = re.compile(r"sha256:[0-9a-f]{64}\Z", re.ASCII)


def _built_id(value: object, log: Path) -> str:
    """The image ID a build gave, or BuildFailed: only an ID the engine gives (`sha256:` and
    64 hex digits) is tagged, removed or written to the ledger."""
    if not isinstance(value, str) or not _BUILT_ID.match(value):
        raise BuildFailed(f"docker build gave no image ID ({cut(repr(value), 80)}); "
                          f"full log: {log}")
    return value


def _stream_to(log: Path, line: str, status: StatusLine | None) -> None:
    with open(log, "a", encoding="utf-8") as out:
        out.write(line if line.endswith("\n") else line + "\n")
    if status and line.strip():
        status(line.strip())


# what a failed build's line says: a line's first `sm121-build: ` or `ptxas`, then a word
# after it, each searched once (`ptxas.*error.*` tried the rest of the line from every
# `ptxas` in it: quadratic in a line of them)
_DIAGNOSIS = re.compile(r"sm121-build: ")
_DIAGNOSED = re.compile(r"failed|produced no")
_PTXAS = re.compile(r"ptxas", re.IGNORECASE)
_PTXAS_ERROR = re.compile(r"error", re.IGNORECASE)
_ERROR = re.compile(r"((?:error|ERROR|Error)\b.*)$")


def _diagnosis(line: str) -> str | None:
    """The build script's diagnosis in a line (after `sm121-build: `, naming a failure)."""
    found = _DIAGNOSIS.search(line)
    return line[found.end():] if found and _DIAGNOSED.search(line, found.end()) else None


def _ptxas_error(line: str) -> str | None:
    """ptxas's own error in a line (from `ptxas` on, an `error` after it)."""
    found = _PTXAS.search(line)
    return line[found.start():] if found and _PTXAS_ERROR.search(line, found.end()) else None


def _error(line: str) -> str | None:
    found = _ERROR.search(line)
    return found.group(1) if found else None


def failure_cause(log: Path, engine_said: str | None = None) -> str:
    """What a failed build's log says went wrong: the build script's diagnosis and ptxas's
    own message when there are such lines, else the last error line, else the engine's own
    error (`engine_said`: the legacy builder's, which names no "error").  The log is read once,
    a line (at most `core/children.LINE_WIDTH` bytes; the rest reads as lines of its own) at
    a time, through the files-in door: a log of any size is never held whole."""
    diagnosis = ptxas = last_error = None
    with open_file(log, "the build's log") as handle:
        while chunk := handle.readline(LINE_WIDTH):
            for line in chunk.decode("utf-8", "replace").splitlines():
                if diagnosis is None and (found := _diagnosis(line)) is not None:
                    diagnosis = found.strip()
                if ptxas is None and (found := _ptxas_error(line)) is not None:
                    ptxas = found.strip()
                if (found := _error(line)) is not None:
                    last_error = found.strip()
    parts = [part for part in (diagnosis, f"ptxas said: {ptxas}" if ptxas else None) if part]
    if not parts:
        parts = [last_error or (engine_said or "").strip() or "see the log"]
    return "; ".join(parts)[:400]
