"""Image references and tags, in-process (the engine's own verdicts on the same grammar are
checked by tests/integration/test_refs_engine.py)."""

from __future__ import annotations

import pytest

from sm121_build.core.errors import Sm121Error
from sm121_build.image.refs import (
    default_tag,
    looks_like_image_ref,
    split_ref,
    validate_image_ref,
    validate_tag,
    versioned_tag,
)

DIGEST = "sha256:" + "a" * 64


@pytest.mark.parametrize("ref", [
    "vllm/vllm-openai:cu130-nightly", "ubuntu", "ubuntu:24.04", "a__b/c-d.e:T_1",
    "localhost/x", "localhost:5000/x/y:z", "Reg.io/x", "reg.io:99/a/b/c", "[::1]:5000/x",
    f"img@{DIGEST}", f"img:tag@{DIGEST}", "sha256:" + "b" * 64, "0123456789ab",
    "r/" + "a" * 243, "reg.io/" + "a" * 248, "x:" + "t" * 128, "a" * 237,
    "localhost/" + "a" * 245, "localhost/a/" + "b" * 243, "Host:5000/x",
])
def test_valid_references(ref: str) -> None:
    assert looks_like_image_ref(ref) and validate_image_ref(ref) == ref


@pytest.mark.parametrize("ref", [
    "", "UPPER", "UPPER/case:1", "a/UP", "a//b", "-a", "a-", "a..b", "a:", ":t", "a:-t",
    "a:" + "t" * 129, "r/" + "a" * 244, "reg.io/" + "a" * 249, "a b", "a\nb", "a@sha256:12",
    "a:t:u", "a" * 238, "localhost/" + "a" * 246, "Host/x",
])
def test_invalid_references(ref: str) -> None:
    assert not looks_like_image_ref(ref)
    with pytest.raises(Sm121Error) as caught:
        validate_image_ref(ref)
    assert str(caught.value) == " ".join(
        f"{ref!r} is not a valid image reference (expected NAME[:TAG][@DIGEST], "
        "e.g. vllm/vllm-openai:nightly)".split())


def test_tags_have_no_digest_and_are_not_ids() -> None:
    assert validate_tag("my/img:1") == "my/img:1"
    with pytest.raises(Sm121Error, match="has a digest"):
        validate_tag(f"my/img@{DIGEST}")
    with pytest.raises(Sm121Error) as caught:
        validate_tag("c" * 64)
    assert str(caught.value) == (f"{'c' * 64!r} looks like an image ID: a tag needs a "
                                 "repository name (e.g. vllm-sm121:nightly)")
    with pytest.raises(Sm121Error, match="looks like an image ID"):
        validate_tag(DIGEST)


def test_split_and_default_tags() -> None:
    assert split_ref(f"reg.io:5000/a/b:t@{DIGEST}") == ("reg.io:5000/a/b", "t", DIGEST)
    assert split_ref("ubuntu") == ("ubuntu", None, None)
    assert split_ref(DIGEST) == (DIGEST, None, None)
    assert split_ref("sha256:v1") == ("sha256", "v1", None)  # a repository named sha256
    assert default_tag("vllm/vllm-openai:cu130-nightly") == "vllm/vllm-openai:cu130-nightly-sm121"
    assert default_tag("ubuntu") == "ubuntu:latest-sm121"
    assert default_tag(f"img@{DIGEST}", "x") == "img:latest-x"
    with pytest.raises(Sm121Error) as caught:
        default_tag("0123456789ab")
    assert str(caught.value) == ("0123456789ab is an image ID, which gives no name to derive "
                                 "the result's tag from: name one with --tag")


def test_versioned_tags_stay_valid_and_short() -> None:
    tag = versioned_tag("v/o:cu130-nightly-sm121", "0.11.1rc2.dev12+gabc", "f" * 40,
                        "sha256:" + "1234567890" * 6 + "abcd")
    assert tag == "v/o:cu130-nightly-sm121-0.11.1rc2.dev12-gabc-ffffffffffff-b123456789"
    long = versioned_tag("v/o:" + "t" * 128, "0.19.1", "e" * 40, "sha256:" + "2" * 64)
    assert len(long.split(":", 1)[1]) == 128 and long.endswith("-0.19.1-eeeeeeeeeeee-b222222222")
    assert versioned_tag("v/o", "1.0", "d" * 40, "9" * 64).startswith("v/o:latest-1.0-")
    assert versioned_tag("v/o:t", "1.0+", "d" * 40, "9" * 64) == (
        "v/o:t-1.0-dddddddddddd-b999999999")  # no '-' or '.' left dangling
