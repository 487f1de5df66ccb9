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
from sm121_build.core.inputs import InputRefused, read_input
from sm121_build.image.registry import OCI_MANIFEST, BlobRefused, Registry, digest_of

SIMPLE_SIGNING = "application/vnd.dev.cosign.simplesigning.v1+json"
DSSE_ENVELOPE = "application/vnd.dsse.envelope.v1+json"
IN_TOTO = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v0.1"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
SIGNATURE_ANNOTATION = "dev.cosignproject.cosign/signature"
COSIGN_TYPE = "cosign container image signature"
MAX_SIGNATURES = 64
MAX_KEY_FILE = 64 << 10  # a PEM key is a few hundred bytes


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


def signature_tag(digest: str, suffix: str = "sig") -> str:
    """`sha256-<hex>.sig` (signatures) or `.att` (attestations), beside the image."""
    return digest.replace(":", "-", 1) + "." + suffix


@dataclass(frozen=True)
class SigningKey:
    """An ECDSA P-256 private key (PKCS#8 or SEC1 PEM; a passphrase from COSIGN_PASSWORD)."""

    key: ec.EllipticCurvePrivateKey

    @classmethod
    def load(cls, path: Path, password: str | None) -> SigningKey:
        try:
            key = serialization.load_pem_private_key(
                read_input(path, MAX_KEY_FILE, "--sign-key"),
                password.encode() if password else None)
        except InputRefused:
            raise
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

    def public(self, path: Path) -> TrustKey:
        """Its public half, as a trust key (`path` names it in messages)."""
        return TrustKey(self.key.public_key(), path)


@dataclass(frozen=True)
class TrustKey:
    """The public key a kernels image must be signed with (PEM, as `cosign.pub`)."""

    key: ec.EllipticCurvePublicKey
    path: Path

    @classmethod
    def load(cls, path: Path) -> TrustKey:
        try:
            key = serialization.load_pem_public_key(
                read_input(path, MAX_KEY_FILE, "--trust-key"))
        except InputRefused:
            raise
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


def _layers(registry: Registry, digest: str, suffix: str = "sig") -> list[dict[str, object]]:
    try:
        raw = registry.manifest(signature_tag(digest, suffix))
    except BlobRefused as exc:  # the registry's malice is a refusal, not an outage
        raise Untrusted(str(exc)) from None
    if raw is None:
        return []
    try:
        layers = json.loads(raw).get("layers")
    except (ValueError, AttributeError, RecursionError):
        layers = None
    if not isinstance(layers, list) or len(layers) > MAX_SIGNATURES:
        raise Untrusted(f"{registry.repo}:{signature_tag(digest, suffix)} is not a signature "
                        "manifest")
    return [layer for layer in layers if isinstance(layer, dict)]


def _append(registry: Registry, digest: str, suffix: str, layer: dict[str, object]) -> str:
    """Add `layer` to the `.sig`/`.att` manifest beside `digest` (made when there is none),
    as cosign does: an OCI manifest with an empty-image config listing every layer."""
    layers = [*_layers(registry, digest, suffix), layer]
    config = _go_json({"architecture": "", "created": "0001-01-01T00:00:00Z",
                       "history": [{"created": "0001-01-01T00:00:00Z"} for _ in layers],
                       "os": "", "rootfs": {"type": "layers",
                                            "diff_ids": [item.get("digest") for item in layers]},
                       "config": {}})
    registry.put_blob(config)
    manifest = _go_json({"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                         "config": {"mediaType": OCI_CONFIG, "size": len(config),
                                    "digest": digest_of(config)},
                         "layers": layers})
    registry.put_manifest(signature_tag(digest, suffix), manifest)
    return f"{registry.repo}:{signature_tag(digest, suffix)}"


def sign(registry: Registry, digest: str, key: SigningKey) -> str:
    """Sign the image at `digest` in `registry`'s repository; returns the signature tag."""
    body = payload(registry.repo, digest)
    return _append(registry, digest, "sig", {
        "mediaType": SIMPLE_SIGNING, "size": len(body), "digest": registry.put_blob(body),
        "annotations": {SIGNATURE_ANNOTATION: key.sign(body)}})


def pae(payload_type: str, body: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what a DSSE signature signs."""
    kind = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(body), body)


def attest(registry: Registry, digest: str, key: SigningKey, predicate_type: str,
           predicate: dict[str, object]) -> str:
    """Attach a signed in-toto statement about the image at `digest` (cosign's `attest`
    layout: a DSSE envelope in the `.att` manifest beside it); returns that tag."""
    statement = _go_json({"_type": STATEMENT_TYPE, "predicateType": predicate_type,
                          "subject": [{"name": registry.repo,
                                       "digest": {"sha256": digest.split(":", 1)[1]}}],
                          "predicate": predicate})
    envelope = _go_json({"payloadType": IN_TOTO,
                         "payload": base64.b64encode(statement).decode(),
                         "signatures": [{"keyid": "", "sig": key.sign(pae(IN_TOTO,
                                                                           statement))}]})
    return _append(registry, digest, "att", {
        "mediaType": DSSE_ENVELOPE, "size": len(envelope),
        "digest": registry.put_blob(envelope),
        "annotations": {SIGNATURE_ANNOTATION: "", "predicateType": predicate_type}})


def attested(registry: Registry, digest: str, trust: TrustKey,
             predicate_type: str) -> dict[str, object]:
    """The predicate of a statement of `predicate_type` about exactly this image that
    `trust` signed; Untrusted when there is none."""
    for layer in _layers(registry, digest, "att"):
        blob = layer.get("digest")
        if layer.get("mediaType") != DSSE_ENVELOPE or not isinstance(blob, str):
            continue
        try:
            envelope = json.loads(registry.blob(blob))
            statement = base64.b64decode(envelope["payload"], validate=True)
            signatures = [str(item["sig"]) for item in envelope["signatures"]]
            data = json.loads(statement)
        except (Sm121Error, ValueError, KeyError, TypeError, RecursionError):
            continue  # an unreadable attestation is skipped: another may verify
        if not isinstance(envelope, dict) or not isinstance(data, dict):
            continue
        if envelope.get("payloadType") != IN_TOTO or not any(
                trust.signed(pae(IN_TOTO, statement), sig) for sig in signatures):
            continue
        subjects = data.get("subject")
        names = {(str(item.get("name")), str(item["digest"].get("sha256")))
                 for item in (subjects if isinstance(subjects, list) else [])
                 if isinstance(item, dict) and isinstance(item.get("digest"), dict)}
        if data.get("predicateType") == predicate_type and \
                (registry.repo, digest.split(":", 1)[1]) in names and \
                isinstance(data.get("predicate"), dict):
            return dict(data["predicate"])
    raise Untrusted(f"no {predicate_type} statement about {registry.repo}@{digest} verifies "
                    f"with {trust.path}")


def require_signed(registry: Registry, digest: str, trust: TrustKey) -> None:
    """Refuse (Untrusted) unless a signature beside the image at `digest` verifies with
    `trust`, for exactly that digest and this repository.  As cosign does, each signature
    is read with a size bound and one that cannot be read (a missing or oversized blob,
    damaged JSON) or does not verify is skipped and counted: one valid signature is
    enough, so whoever can push beside the image cannot stop a consumer's run."""
    layers = _layers(registry, digest)
    if not layers:
        raise Untrusted(f"{registry.repo}@{digest} is not signed ({trust.path} is trusted)")
    why = f"no signature of {registry.repo}@{digest} verifies with {trust.path}"
    unreadable = invalid = 0
    for layer in layers:
        annotations = layer.get("annotations")
        signature = annotations.get(SIGNATURE_ANNOTATION) if isinstance(annotations,
                                                                         dict) else None
        blob = layer.get("digest")
        if layer.get("mediaType") != SIMPLE_SIGNING or not isinstance(signature, str) or \
                not isinstance(blob, str):
            invalid += 1
            continue
        try:
            body = registry.blob(blob)
        except Sm121Error:
            unreadable += 1
            continue
        if not trust.signed(body, signature):
            invalid += 1
            continue
        claim = _claim(body)
        if claim == (registry.repo, digest):
            return
        invalid += 1
        why = (f"the signature by {trust.path} beside {registry.repo}@{digest} is for "
               f"{claim[0]}@{claim[1]}")
    counted = (f"{len(layers)} signature(s): {unreadable} unreadable, {invalid} not valid")
    if why.startswith("no signature of "):  # the count beside what was looked for
        why = (f"no signature of {registry.repo}@{digest} ({counted}) verifies with "
               f"{trust.path}")
    else:
        why = f"{why} ({counted})"
    raise Untrusted(why)


def _claim(body: bytes) -> tuple[str, str]:
    """(docker-reference, docker-manifest-digest) a signed payload names."""
    try:
        critical = json.loads(body)["critical"]
        if critical["type"] != COSIGN_TYPE:
            return ("(not a cosign payload)", "")
        return (str(critical["identity"]["docker-reference"]),
                str(critical["image"]["docker-manifest-digest"]))
    except (ValueError, KeyError, TypeError, RecursionError):
        return ("(an unreadable payload)", "")
