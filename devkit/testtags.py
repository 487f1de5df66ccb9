"""The one place that names the images the tests make in a Docker engine.

An engine is shared: a self-hosted runner also runs the nightly, and two test runs may meet
there.  So every image a test makes is named under RUN, a prefix decided once per pytest
process (`sm121-test-<pid>-<random>`): `image("e2e:patched")`, or `in_registry(registry,
"kernels")` for a local registry's repository.  Clean-up removes only what carries that
prefix (and the pin tags the tool left on those very images, found by image ID), never
another run's images or a real run's pins; tests/conftest.py does it when the session ends,
so nothing of a run stays in the engine.

The suite's cache is the one exception, named here alone: the Debian bases made by
debootstrap (`cached(...)`, under CACHE), which depend on nothing of a run and are reused
by the next one.  Remove them with `docker rmi` of the `sm121-test-cache/` tags.

tests/unit/test_tag_prefix.py holds every other test and devkit file to this: no image
name spelled outside this module.
"""

from __future__ import annotations

import os
import secrets

import docker
import docker.errors

from sm121_build.image.api import PIN_REPO

RUN = f"sm121-test-{os.getpid()}-{secrets.token_hex(4)}"
CACHE = "sm121-test-cache"
# Whether this process reached an engine (devkit.dockerenv.client_or_skip): the session's
# clean-up connects only then.
engine_used: list[bool] = []


def image(name: str) -> str:
    """`name` ("e2e:patched", "e2e") under this run's prefix."""
    return f"{RUN}/{name}"


def in_registry(registry: str, name: str) -> str:
    """A repository (or reference) in a local registry, under this run's prefix."""
    return f"{registry}/{RUN}/{name}"


def cached(name: str) -> str:
    """An image of the suite's cache: kept in the engine, reused by the next run."""
    return f"{CACHE}/{name}"


def _repository_path(tag: str) -> str:
    """A reference without its registry host (`127.0.0.1:5000/x/y:1` -> `x/y:1`)."""
    first, _, rest = tag.partition("/")
    is_host = rest and ("." in first or ":" in first or first == "localhost")
    return rest if is_host else tag


def is_this_runs(tag: str) -> bool:
    """Whether a tag was made by this run (its name, registry host aside, is under RUN)."""
    return _repository_path(tag).startswith(f"{RUN}/")


def remove_this_runs(client: docker.DockerClient, under: str = "") -> list[str]:
    """Remove this run's tags (only those under `image(under)` when given), and the tool's
    pin tags on an image that carries no other name than this run's (found by image ID):
    an image goes with its last tag.  Nothing another run or a user made or tagged is
    touched: an image of theirs that this run tagged keeps its own tags and pins.  Returns
    the tags removed."""
    prefix = image(under) if under else RUN + "/"
    removed = []
    for found in client.images.list():
        ours = [t for t in found.tags if is_this_runs(t) and
                _repository_path(t).startswith(prefix)]
        if not ours:
            continue
        pins = [t for t in found.tags if t.startswith(f"{PIN_REPO}/")]
        alone = all(is_this_runs(t) for t in found.tags if t not in pins)
        for tag in [*(pins if alone else []), *ours]:
            try:
                client.images.remove(tag, force=True)
            except docker.errors.NotFound:
                continue
            removed.append(tag)
    if not under:  # the whole run: its untagged images too
        removed += _untagged_of_this_run(client)
    return removed


def _untagged_of_this_run(client: docker.DockerClient) -> list[str]:
    """Images left with no tag but a repository digest of this run's (a pull by digest from
    a local registry of this run's: the engine keeps `REPO@sha256:...`, no tag), removed by
    ID; an image that also carries another name is never one of them."""
    removed = []
    for found in client.images.list():
        digests = found.attrs.get("RepoDigests") or []
        if found.tags or not digests or not all(is_this_runs(d.split("@")[0] + ":x")
                                                 for d in digests):
            continue
        try:
            client.images.remove(found.id, force=True)
        except docker.errors.APIError:  # gone meanwhile, or in use by a container
            continue
        removed.append(digests[0])
    return removed
