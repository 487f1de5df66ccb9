"""Signing keys for the tests: an ECDSA P-256 key pair as PEM files, what `cosign
generate-key-pair` makes (unencrypted here), and a one-file image pushed to a registry."""

from __future__ import annotations

from pathlib import Path

import docker
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec


def key_pair(folder: Path, name: str) -> tuple[Path, Path]:
    """`folder/name.key` (PKCS#8) and `folder/name.pub` (SubjectPublicKeyInfo)."""
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = folder / f"{name}.key", folder / f"{name}.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


def push_small(client: docker.DockerClient, work: Path, ref: str, content: str) -> str:
    """A one-file image pushed as `ref` (and removed here again); returns its manifest digest
    in the registry."""
    folder = work / content
    folder.mkdir()
    (folder / "f").write_text(content)
    (folder / "Dockerfile").write_text("FROM scratch\nCOPY f /f\n")
    client.images.build(path=str(folder), rm=True, tag=ref)
    client.images.push(ref)
    digest = client.images.get_registry_data(ref).id
    client.images.remove(ref, force=True)
    return str(digest)
