"""Validation of the names users hand us: image references and tags."""

from __future__ import annotations

import re

from sm121_build.core.errors import Sm121Error

# The grammar of github.com/distribution/reference (reference.go), as one regex.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_DOMAIN = rf"(?:{_LABEL}(?:\.{_LABEL})*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
_NAME = rf"(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
IMAGE_REF = re.compile(rf"^(?P<name>{_NAME})(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?\Z")
IMAGE_ID = re.compile(r"^(?:sha256:)?[0-9a-f]{12,64}\Z")


# what names a file, never an image: a path's start, or a suffix of the files the tool reads
FILE_LIKE = re.compile(r"\.(so(\.\d+)*|whl|tar|tar\.gz|tgz|o|cubin|fatbin|ptx)$")


def names_a_file(text: str) -> bool:
    """Whether an argument that is no path here names a file all the same (`./x.so`,
    `/a/b`, `~/x`, `_C.abi3.so`, `vllm-….whl`): a command that takes files or an image says
    it does not exist instead of asking the engine for an image of that name."""
    return text.startswith((".", "/", "~")) or FILE_LIKE.search(text) is not None


def looks_like_image_ref(text: str) -> bool:
    if IMAGE_ID.match(text):
        return True
    match = IMAGE_REF.match(text)
    if match is None:
        return False
    # A first component is a registry only with a dot, a port or as `localhost`; otherwise it
    # is part of the repository name, which engines (Docker 20.10 to 28) require lower case.
    name = match.group("name")
    first, _, rest = name.partition("/")
    registry = bool(rest) and ("." in first or ":" in first or first == "localhost")
    if rest and not registry and first != first.lower():
        return False
    # The engine measures the normalized name: docker.io/[library/]NAME, at most 255.
    normalized = name if registry else f"docker.io/{'' if rest else 'library/'}{name}"
    return len(normalized) <= 255


def validate_image_ref(text: str) -> str:
    if not looks_like_image_ref(text):
        raise Sm121Error(
            f"{text!r} is not a valid image reference (expected NAME[:TAG][@DIGEST], "
            "e.g. vllm/vllm-openai:nightly)")
    return text


def validate_tag(text: str) -> str:
    """A name the result can be tagged with: NAME[:TAG], no digest, not an image ID."""
    if re.fullmatch(r"(?:sha256:)?[0-9a-f]{64}", text):
        raise Sm121Error(f"{text!r} looks like an image ID: a tag needs a repository name "
                         "(e.g. vllm-sm121:nightly)")
    validate_image_ref(text)
    if "@" in text:
        raise Sm121Error(f"{text!r} has a digest: a tag is NAME[:TAG]")
    return text


def normalized(text: str) -> str:
    """A reference as the engine stores it: docker.io/[library/]NAME:TAG (`latest` when no
    tag or digest is given)."""
    name, tag, digest = split_ref(text)
    if IMAGE_ID.match(text):
        return text
    first, _, rest = name.partition("/")
    if not (rest and ("." in first or ":" in first or first == "localhost")):
        name = f"docker.io/{'' if rest else 'library/'}{name}"
    return name + (f":{tag}" if tag else "" if digest else ":latest") + \
        (f"@{digest}" if digest else "")


def registry_of(text: str) -> str:
    """The registry host a reference names (`docker.io` when it names none)."""
    return normalized(text).split("/", 1)[0]


def require_not_base(tag: str, base: str) -> None:
    """--tag equal to --base would move the stock image's own tag onto the result."""
    if normalized(tag) == normalized(base):
        raise Sm121Error(f"--tag {tag} is the base image's own reference: the base's tag is "
                         "never moved (choose another --tag, e.g. the default "
                         f"{default_tag(base) if not IMAGE_ID.match(base) else 'NAME:TAG'})")


def split_ref(text: str) -> tuple[str, str | None, str | None]:
    """(name, tag, digest) of a validated reference."""
    match = IMAGE_REF.match(validate_image_ref(text))
    if match is None or (text.startswith("sha256:") and IMAGE_ID.match(text)):
        return text, None, None  # an image ID (`sha256:<hex>` would parse as NAME:TAG)
    return match.group("name"), match.group("tag"), match.group("digest")


def default_tag(base: str, suffix: str = "sm121") -> str:
    """`vllm/vllm-openai:cu130-nightly` -> `vllm/vllm-openai:cu130-nightly-sm121`."""
    if IMAGE_ID.match(base):
        raise Sm121Error(f"{base} is an image ID, which gives no name to derive the result's "
                         "tag from: name one with --tag")
    name, tag, _digest = split_ref(base)
    return f"{name}:{(tag or 'latest')}-{suffix}"


_TAG_CHARS = re.compile(r"[^\w.-]+")


def versioned_tag(tag: str, version: str, commit: str, base_id: str) -> str:
    """The immutable companion of a moving tag: `…:cu130-nightly-sm121` ->
    `…:cu130-nightly-sm121-0.11.1rc2.dev12-abcdef123456-b1a2b3c4d` (vLLM version, commit,
    and the base image's ID, so a rebuild of the same commit on a new base gets its own
    name; tag characters only, <= 128)."""
    name, current, _digest = split_ref(tag)
    suffix = (f"-{_TAG_CHARS.sub('-', version).strip('-.')}-{commit[:12]}"
              f"-b{base_id.split(':')[-1][:9]}")
    stem = (current or "latest")[:128 - len(suffix)]
    return validate_image_ref(f"{name}:{stem}{suffix}")
