"""The images the tests make in a shared Docker engine (issue #62): every name comes from
devkit/testtags.py, under a prefix of this run's own, and clean-up removes only those (and
the tool's pins on them), never another run's images or a real run's pins.  Checked
without an engine: the test and devkit files spell no image name of their own, and the
clean-up is run against a FAKE engine's image list."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest

from devkit import testtags
from devkit.helpers import ROOT
from devkit.testtags import CACHE, RUN, cached, image, in_registry, is_this_runs
from sm121_build.image.api import PIN_REPO

# An image name the suite would spell itself: `sm121-test/...`, `sm121-test-<anything>/...`,
# or a pin of the tool's (its repository is PIN_REPO, sm121_build/image/api.py).
_SPELLED = re.compile(r"sm121-test[\w.-]*/|sm121-build-pin")


def _suite_files() -> list[Path]:
    found = [*ROOT.glob("tests/**/*.py"), *ROOT.glob("devkit/*.py"),
             *ROOT.glob("tests/data/**/Dockerfile")]
    allowed = {ROOT / "devkit" / "testtags.py", Path(__file__).resolve()}  # this one: examples
    return sorted(p for p in found if p.resolve() not in allowed)


def test_no_test_or_devkit_file_spells_an_image_name() -> None:
    """A fixed tag (`sm121-test/e2e:patched`) is shared by every run on an engine: two runs
    overwrite and remove each other's images.  Names come from devkit/testtags.py only."""
    files = _suite_files()
    assert ROOT / "tests" / "integration" / "test_e2e_docker.py" in files
    spelled = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
               for path in files
               for number, line in enumerate(path.read_text().splitlines(), 1)
               if _SPELLED.search(line)]
    assert spelled == [], "\n".join(spelled)


def test_names_are_this_runs_or_the_suites_cache() -> None:
    from devkit.dockerenv import BASE_IMAGE
    from devkit.stockimage import REPO

    assert re.fullmatch(r"sm121-test-\d+-[0-9a-f]{8}", RUN)
    assert is_this_runs(image("e2e:patched")) and is_this_runs(f"{REPO}:0.19.1-abc")
    assert is_this_runs(in_registry("127.0.0.1:5000", "kernels:1"))
    assert is_this_runs(in_registry("localhost", "kernels:1"))
    assert cached("debian-gxx:bookworm") == BASE_IMAGE and BASE_IMAGE.startswith(f"{CACHE}/")
    for other in ("sm121-test/e2e:patched", "sm121-test-1-00000000/e2e:patched",
                  "127.0.0.1:5000/sm121-test-1-00000000/kernels:1", BASE_IMAGE,
                  f"{PIN_REPO}/0123456789ab:1-aa", f"{RUN}-not/e2e:1", f"x/{RUN}/e2e:1"):
        assert not is_this_runs(other), other


@dataclass
class _Image:
    id: str
    tags: list[str]
    digests: list[str] = field(default_factory=list)

    @property
    def attrs(self) -> dict[str, Any]:
        return {"RepoDigests": self.digests}


@dataclass
class _Images:
    """The FAKE engine's image list: `list()` and `remove(tag)` as the Docker SDK has them."""

    held: list[_Image]
    removed: list[str] = field(default_factory=list)

    def list(self) -> list[_Image]:
        return [_Image(i.id, list(i.tags), list(i.digests)) for i in self.held
                if i.tags or i.digests]

    def remove(self, tag: str, force: bool = False) -> None:
        assert force
        for held in self.held:
            if tag in held.tags:
                held.tags.remove(tag)
                self.removed.append(tag)
            elif tag == held.id:  # by ID: the image, whatever names it
                held.tags, held.digests = [], []
                self.removed.append(tag)


@dataclass
class _Client:
    images: _Images


def test_clean_up_removes_only_this_runs_images_and_their_pins() -> None:
    other_run = "sm121-test-1-00000000"
    images = _Images([
        _Image("sha256:a", [image("e2e:patched"), image("e2e:users-own"),
                            f"{PIN_REPO}/a:1-aa"]),  # ours alone: its pin goes too
        _Image("sha256:b", [f"{other_run}/e2e:patched", f"{PIN_REPO}/b:2-bb"]),  # another run's
        _Image("sha256:c", [f"{PIN_REPO}/c:3-cc"]),  # a real run's kept pin
        _Image("sha256:d", [cached("debian-gxx:bookworm"), image("e2e:also-a-base"),
                            f"{PIN_REPO}/d:4-dd"]),  # the cache, tagged by us: only our tag
        _Image("sha256:e", [in_registry("127.0.0.1:5000", "kernels:nightly")]),
        _Image("sha256:f", [image("vllm-stock:0.19.1-abc")]),
        _Image("sha256:g", ["vllm/vllm-openai:nightly", "sm121-test/e2e:from-an-old-run"]),
        # pulled by digest from this run's local registry: no tag, only its repository digest
        _Image("sha256:h", [], [in_registry("127.0.0.1:5000", "vllm") + "@sha256:" + "1" * 64]),
        _Image("sha256:i", [], [f"127.0.0.1:5000/{other_run}/vllm@sha256:" + "2" * 64]),
    ])
    client = cast(Any, _Client(images))
    assert sorted(testtags.remove_this_runs(client, under="e2e")) == sorted([
        image("e2e:patched"), image("e2e:users-own"), f"{PIN_REPO}/a:1-aa",
        image("e2e:also-a-base")])
    assert sorted(testtags.remove_this_runs(client)) == sorted([
        in_registry("127.0.0.1:5000", "kernels:nightly"), image("vllm-stock:0.19.1-abc"),
        in_registry("127.0.0.1:5000", "vllm") + "@sha256:" + "1" * 64])
    assert [i.id for i in images.held if i.digests] == ["sha256:i"]  # another run's: kept
    left = {t for i in images.held for t in i.tags}
    assert left == {f"{other_run}/e2e:patched", f"{PIN_REPO}/b:2-bb", f"{PIN_REPO}/c:3-cc",
                    cached("debian-gxx:bookworm"), f"{PIN_REPO}/d:4-dd",
                    "vllm/vllm-openai:nightly", "sm121-test/e2e:from-an-old-run"}


def test_the_session_cleans_up_only_where_an_engine_was_used(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/conftest.py's session end: no engine reached, no connection tried."""
    import docker

    import tests.conftest as conftest

    def refused(**_kwargs: object) -> None:
        raise AssertionError("connected to an engine no test used")

    monkeypatch.setattr(docker, "from_env", refused)
    monkeypatch.setattr(testtags, "engine_used", [])
    conftest.pytest_sessionfinish(cast(Any, None), 0)
