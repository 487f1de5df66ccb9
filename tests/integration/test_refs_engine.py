"""Image references and tags: what the engine rejects, the tool rejects before any work.

A property test against the real engine's own acceptance: for generated names, tagging a
small loaded image with the name (the engine's `POST /images/{id}/tag`) succeeds exactly when
`validate_tag` accepts it, and the default tag derived from an accepted base is one the engine
takes.
"""

from __future__ import annotations

from collections.abc import Iterator

import docker
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from devkit.dockerenv import client_or_skip, load
from devkit.imagetar import docker_save
from devkit.testtags import RUN
from sm121_build.core.errors import Sm121Error
from sm121_build.image.refs import default_tag, validate_tag

pytestmark = [pytest.mark.docker]

SOURCE_TAG = f"{RUN}/refs:source"
PART = st.text(alphabet="abcXYZ019._-", min_size=1, max_size=12)
NAMES = st.one_of(
    st.builds(lambda host, path, tag: f"{host}{path}{tag}",
              st.sampled_from(["", "localhost/", "localhost:5000/", "Reg.io/", "reg.io:99/",
                               "UPPER/", "a_b/", "-x/"]),
              st.lists(PART, min_size=1, max_size=3).map("/".join),
              st.one_of(st.just(""), PART.map(lambda t: f":{t}"))),
    st.text(alphabet="abcA09._-/:@ ", min_size=1, max_size=40),
)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[docker.DockerClient,
                                                                      str]]:
    client = client_or_skip()
    tarball = docker_save(tmp_path_factory.mktemp("refs") / "image.tar",
                          [{"hello.txt": b"refs"}], tag=SOURCE_TAG)
    load(client, tarball)
    image = client.images.get(SOURCE_TAG)
    yield client, image.id
    for tag in client.images.get(image.id).tags:
        client.images.remove(tag, force=True)


def _engine_tags(client: docker.DockerClient, image_id: str, name: str) -> bool:
    """The engine parses the whole name itself (`repo` holds NAME[:TAG], as `docker tag`
    sends it); whatever it added is removed again."""
    try:
        client.api.tag(image_id, name)
    except (docker.errors.APIError, docker.errors.InvalidRepository):
        return False
    for tag in client.images.get(image_id).tags:
        if tag != SOURCE_TAG:
            client.api.remove_image(tag, noprune=True)
    return True


def _tool_accepts(name: str) -> bool:
    try:
        validate_tag(name)
    except Sm121Error:
        return False
    return True


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(name=NAMES)
@example(name="UPPER/case:1")
@example(name="localhost:5000/Up/x")
@example(name="reg.io/a/b:" + "t" * 128)
@example(name="reg.io/a/b:" + "t" * 129)
@example(name="r/" + "a" * 250)
@example(name="a" * 64)
@example(name="x@sha256:" + "0" * 64)
@example(name="a__b/c:d")
@example(name="a" * 237)
@example(name="a" * 238)
@example(name="localhost/" + "a" * 245)
@example(name="localhost/" + "a" * 246)
@example(name="Host:5000/x")
@example(name="Host/x")
def test_the_tool_and_the_engine_agree_on_tags(engine: tuple[docker.DockerClient, str],
                                               name: str) -> None:
    client, image_id = engine
    assert _tool_accepts(name) == _engine_tags(client, image_id, name), name


@pytest.mark.parametrize("base", ["vllm/vllm-openai:cu130-nightly", "localhost:5000/v/x",
                                  "reg.io/org/img:1",
                                  "img@sha256:" + "a" * 64])
def test_default_tags_are_taken_by_the_engine(engine: tuple[docker.DockerClient, str],
                                              base: str) -> None:
    client, image_id = engine
    derived = default_tag(base)
    assert _tool_accepts(derived) and _engine_tags(client, image_id, derived), derived


def test_the_image_id_gives_no_default_tag(engine: tuple[docker.DockerClient, str]) -> None:
    _client, image_id = engine
    with pytest.raises(Sm121Error, match="is an image ID"):
        default_tag(image_id)
