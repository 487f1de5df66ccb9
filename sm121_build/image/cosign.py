"""Signatures of kernels images in cosign's format, so `cosign verify --key` and
containers/image's `sigstoreSigned` policy read them, with no cosign binary here.

The layout is cosign's ".sig" tag (what `cosign sign --key` writes without a transparency
log; cosign 3 with `--new-bundle-format=false`): the manifest digest D of the image gets a
tag `sha256-<hex of D>.sig` in the same repository, an OCI manifest whose layers are
"simple signing" payloads

    {"critical":{"identity":{"docker-reference":REPO},"image":{"docker-manifest-digest":D},
     "type":"cosign container image signature"},"optional":null}

(Go's compact JSON, this key order), each with its signature in the layer annotation
`dev.cosignproject.cosign/signature`: ECDSA P-256 over SHA-256 of the exact payload bytes,
DER, base64.  A second signature is appended to the same manifest, as cosign does.

Why this and not a library: PyPI has no cosign; sigstore-python signs files and Python
packages keylessly (Fulcio, Rekor), with no registry code and no key-file signing; skopeo's
Debian build has sigstore disabled.  `cryptography` is the one dependency this adds.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from sm121_build.core.errors import Sm121Error
from sm121_build.image.registry import OCI_MANIFEST, Registry, digest_of

SIMPLE_SIGNING = "application/vnd.dev.cosign.simplesigning.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
SIGNATURE_ANNOTATION = "dev.cosignproject.cosign/signature"
COSIGN_TYPE = "cosign container image signature"
MAX_SIGNATURES = 64


class Untrusted(Sm121Error):
    """A kernels image the trusted key did not sign (unsigned, another key, another image)."""

    exit_code = 3


def _go_json(value: object) -> bytes:
    """Go's encoding/json.Marshal of plain data: compact, UTF-8, `<>&` escaped."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026")):
        text = text.replace(char, escaped)
    return text.encode()


def payload(repo: str, digest: str) -> bytes:
    """The simple-signing payload cosign signs for `repo` (no tag) at `digest`."""
    return _go_json({"critical": {"identity": {"docker-reference": repo},
                                  "image": {"docker-manifest-digest": digest},
                                  "type": COSIGN_TYPE}, "optional": None})


def signature_tag(digest: str) -> str:
    return digest.replace(":", "-", 1) + ".sig"


@dataclass(frozen=True)
class SigningKey:
    """An ECDSA P-256 private key (PKCS#8 or SEC1 PEM; a passphrase from COSIGN_PASSWORD)."""

    key: ec.EllipticCurvePrivateKey

    @classmethod
    def load(cls, path: Path, password: str | None) -> SigningKey:
        try:
            key = serialization.load_pem_private_key(
                path.read_bytes(), password.encode() if password else None)
        except (OSError, ValueError, TypeError) as exc:
            raise Sm121Error(f"--sign-key {path}: not a PEM private key this tool can use "
                             f"({exc})") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != "secp256r1":
            raise Sm121Error(f"--sign-key {path}: an ECDSA P-256 key is needed (as cosign "
                             "makes): `openssl genpkey -algorithm EC -pkeyopt "
                             "ec_paramgen_curve:P-256`")
        return cls(key)

    def sign(self, data: bytes) -> str:
        return base64.b64encode(self.key.sign(data, ec.ECDSA(hashes.SHA256()))).decode()


@dataclass(frozen=True)
class TrustKey:
    """The public key a kernels image must be signed with (PEM, as `cosign.pub`)."""

    key: ec.EllipticCurvePublicKey
    path: Path

    @classmethod
    def load(cls, path: Path) -> TrustKey:
        try:
            key = serialization.load_pem_public_key(path.read_bytes())
        except (OSError, ValueError) as exc:
            raise Sm121Error(f"--trust-key {path}: not a PEM public key ({exc})") from None
        if not isinstance(key, ec.EllipticCurvePublicKey):
            raise Sm121Error(f"--trust-key {path}: an ECDSA public key is needed (cosign.pub)")
        return cls(key, path)

    def signed(self, data: bytes, signature: str) -> bool:
        try:
            self.key.verify(base64.b64decode(signature, validate=True), data,
                            ec.ECDSA(hashes.SHA256()))
        except (InvalidSignature, ValueError):
            return False
        return True


def _layers(registry: Registry, digest: str) -> list[dict[str, object]]:
    raw = registry.manifest(signature_tag(digest))
    if raw is None:
        return []
    try:
        layers = json.loads(raw).get("layers")
    except (ValueError, AttributeError):
        layers = None
    if not isinstance(layers, list) or len(layers) > MAX_SIGNATURES:
        raise Untrusted(f"{registry.repo}:{signature_tag(digest)} is not a signature manifest")
    return [layer for layer in layers if isinstance(layer, dict)]


def sign(registry: Registry, digest: str, key: SigningKey) -> str:
    """Sign the image at `digest` in `registry`'s repository; returns the signature tag."""
    body = payload(registry.repo, digest)
    blob = registry.put_blob(body)
    layers = [*_layers(registry, digest),
              {"mediaType": SIMPLE_SIGNING, "size": len(body), "digest": blob,
               "annotations": {SIGNATURE_ANNOTATION: key.sign(body)}}]
    config = _go_json({"architecture": "", "created": "0001-01-01T00:00:00Z",
                       "history": [{"created": "0001-01-01T00:00:00Z"} for _ in layers],
                       "os": "", "rootfs": {"type": "layers",
                                            "diff_ids": [layer["digest"] for layer in layers]},
                       "config": {}})
    registry.put_blob(config)
    manifest = _go_json({"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                         "config": {"mediaType": OCI_CONFIG, "size": len(config),
                                    "digest": digest_of(config)},
                         "layers": layers})
    registry.put_manifest(signature_tag(digest), manifest)
    return f"{registry.repo}:{signature_tag(digest)}"


def require_signed(registry: Registry, digest: str, trust: TrustKey) -> None:
    """Refuse (Untrusted) unless a signature beside the image at `digest` verifies with
    `trust`, for exactly that digest and this repository."""
    layers = _layers(registry, digest)
    if not layers:
        raise Untrusted(f"{registry.repo}@{digest} is not signed ({trust.path} is trusted)")
    why = f"no signature of {registry.repo}@{digest} verifies with {trust.path}"
    for layer in layers:
        annotations = layer.get("annotations")
        signature = annotations.get(SIGNATURE_ANNOTATION) if isinstance(annotations,
                                                                         dict) else None
        blob = layer.get("digest")
        if layer.get("mediaType") != SIMPLE_SIGNING or not isinstance(signature, str) or \
                not isinstance(blob, str):
            continue
        body = registry.blob(blob)
        if not trust.signed(body, signature):
            continue
        claim = _claim(body)
        if claim == (registry.repo, digest):
            return
        why = (f"the signature by {trust.path} beside {registry.repo}@{digest} is for "
               f"{claim[0]}@{claim[1]}")
    raise Untrusted(why)


def _claim(body: bytes) -> tuple[str, str]:
    """(docker-reference, docker-manifest-digest) a signed payload names."""
    try:
        critical = json.loads(body)["critical"]
        if critical["type"] != COSIGN_TYPE:
            return ("(not a cosign payload)", "")
        return (str(critical["identity"]["docker-reference"]),
                str(critical["image"]["docker-manifest-digest"]))
    except (ValueError, KeyError, TypeError):
        return ("(an unreadable payload)", "")
