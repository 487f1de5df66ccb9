"""A file's signature beside it (`FILE.sig`: base64 ECDSA P-256 over the file's exact bytes,
the form `cosign sign-blob --key` writes): written with a signing key, checked with a trust
key.  One place for the manifest of an artifacts folder and for a proof document."""

from __future__ import annotations

from pathlib import Path

from sm121_build.core.inputs import InputRefused, kind_of, read_input
from sm121_build.core.outputs import replace_bytes
from sm121_build.image.cosign import SigningKey, TrustKey

MAX_SIGNATURE = 4 << 10  # a signature file read: base64 of a DER signature, with room


def signature_beside(path: Path) -> Path:
    """Where a file's signature is: `FILE.sig`, beside it."""
    return path.with_name(path.name + ".sig")


def write_signature(path: Path, body: bytes, key: SigningKey) -> None:
    """`body` (the bytes written to `path`) signed by `key`, written whole beside it."""
    replace_bytes(signature_beside(path), key.sign(body).encode() + b"\n")


def has_signature(path: Path) -> bool:
    """Whether a regular file stands where `path`'s signature would be."""
    return kind_of(signature_beside(path)) == "file"


def signed_beside(path: Path, body: bytes, trust: TrustKey) -> bool:
    """Whether the signature beside `path` is `trust`'s over `body` (the file's bytes as
    read); one that is missing, not a regular file, oversized or not text is no signature."""
    where = signature_beside(path)
    if kind_of(where) != "file":
        return False
    try:
        text = read_input(where, MAX_SIGNATURE, "its signature").decode("ascii").strip()
    except (InputRefused, UnicodeDecodeError):
        return False
    return trust.signed(body, text)
