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
DER, base64.  A second signature is appended to the same manifest, as cosign does; the same
key signing the same image again adds nothing, a statement replaces this key's earlier one
of its kind, and a list is never written longer than a reader takes (`MAX_SIGNATURES`).

Why this and not a library: PyPI has no cosign; sigstore-python signs files and Python
packages keylessly (Fulcio, Rekor), with no registry code and no key-file signing; skopeo's
Debian build has sigstore disabled.  `cryptography` is the one dependency this adds.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import Prehashed

from sm121_build.core.errors import RegistryUnavailable, Sm121Error
from sm121_build.core.inputs import InputRefused, read_input
from sm121_build.core.strict_json import strict_loads
from sm121_build.image.registry import OCI_MANIFEST, BlobRefused, Registry, digest_of

SIMPLE_SIGNING = "application/vnd.dev.cosign.simplesigning.v1+json"
DSSE_ENVELOPE = "application/vnd.dsse.envelope.v1+json"
IN_TOTO = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v0.1"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
SIGNATURE_ANNOTATION = "dev.cosignproject.cosign/signature"
COSIGN_TYPE = "cosign container image signature"
MAX_SIGNATURES = 64  # the newest layers of a `.sig`/`.att` list a reader takes (a writer
# writes no more)
MAX_ENVELOPE_SIGNATURES = 16  # signatures of one DSSE envelope a reader checks
MAX_SIGNATURE_TEXT = 512  # base64 of a DER ECDSA P-256 signature is at most 96 characters
WRITE_TRIES = 3
SETTLE_S = 0.2  # before a list just written is read back
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
        """Whether `signature` (base64 DER) is this key's over `data`."""
        return self.signed_digest(hashlib.sha256(data).digest(), signature)

    def signed_digest(self, hashed: bytes, signature: str) -> bool:
        """Whether `signature` (base64 DER) is this key's over the data whose SHA-256 is
        `hashed` (one hash for many signatures over the same bytes)."""
        if not signature or len(signature) > MAX_SIGNATURE_TEXT:
            return False
        try:
            self.key.verify(base64.b64decode(signature, validate=True), hashed,
                            ec.ECDSA(Prehashed(hashes.SHA256())))
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
    if not isinstance(layers, list):
        raise Untrusted(f"{registry.repo}:{signature_tag(digest, suffix)} is not a signature "
                        "manifest")
    # the newest `MAX_SIGNATURES` (cosign appends): a longer list (another tool's, or one
    # made long to cost a reader) is read no further back, and never refused whole
    return [layer for layer in layers[-MAX_SIGNATURES:] if isinstance(layer, dict)]


@dataclass(frozen=True)
class _Entry:
    """One layer to add to a `.sig`/`.att` list, and which layers already there it makes
    needless (the same signature by the same key) or replaces (an older statement of the
    same kind by the same key)."""

    layer: dict[str, object]
    suffix: str
    key: SigningKey
    kind: str  # a statement's predicate type; "" for a signature


def _ours(registry: Registry, layer: dict[str, object], entry: _Entry) -> bool:
    """Whether `layer` is one `entry`'s key signed, of the kind `entry` adds (a signature,
    or a statement of its predicate type).  A layer that cannot be read is not."""
    annotations = layer.get("annotations")
    blob = layer.get("digest")
    if not isinstance(annotations, dict) or not isinstance(blob, str):
        return False
    trust = entry.key.public(Path("(this key)"))
    try:
        body = registry.blob(blob)
    except Sm121Error:
        return False
    if entry.suffix == "sig":
        signature = annotations.get(SIGNATURE_ANNOTATION)
        return isinstance(signature, str) and trust.signed(body, signature)
    if annotations.get("predicateType") != entry.kind:
        return False
    read = _envelope(body)
    return read is not None and _verifies(trust, read)


def _next_list(registry: Registry, digest: str, entry: _Entry) -> list[dict[str, object]] | None:
    """The list to write beside `digest` with `entry` added, or None when it already holds
    the same (a signature of the same payload by the same key).  An older statement of the
    same kind by the same key is replaced; at the cap the oldest layer of this key's goes;
    when none is this key's, nothing is written: the reader would refuse a longer list."""
    layers = _layers(registry, digest, entry.suffix)
    ours = [layer for layer in layers if _ours(registry, layer, entry)]
    if entry.suffix == "sig" and any(layer.get("digest") == entry.layer["digest"]
                                     for layer in ours):
        return None
    kept = [layer for layer in layers if entry.suffix == "sig" or
            not any(layer is mine for mine in ours)]
    if len(kept) >= MAX_SIGNATURES:
        oldest = next((layer for layer in kept if any(layer is mine for mine in ours)), None)
        if oldest is None:
            raise Untrusted(f"{registry.repo}:{signature_tag(digest, entry.suffix)} already "
                            f"holds {len(kept)} entries, the most a reader takes, none of "
                            "them this key's: nothing was written")
        kept = [layer for layer in kept if layer is not oldest]
    return [*kept, entry.layer]


def _write_list(registry: Registry, digest: str, suffix: str,
                layers: list[dict[str, object]]) -> None:
    """The `.sig`/`.att` manifest beside `digest`, as cosign writes it: an OCI manifest
    with an empty-image config listing every layer."""
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


def _append(registry: Registry, digest: str, entry: _Entry) -> str:
    """Add `entry` to the list beside `digest` and read the list back: a registry has no
    conditional write, so a writer that read the list before this one wrote can replace it;
    the write is tried again (up to `WRITE_TRIES` times) until the list read back holds
    it, else one line says so.  A writer whose whole write lands after this one's last read
    can still replace it: the OCI API offers nothing to prevent that."""
    tag = f"{registry.repo}:{signature_tag(digest, entry.suffix)}"
    for attempt in range(WRITE_TRIES):
        layers = _next_list(registry, digest, entry)
        if layers is None:
            return tag
        _write_list(registry, digest, entry.suffix, layers)
        time.sleep(SETTLE_S * (attempt + 1))
        if any(layer.get("digest") == entry.layer["digest"]
               for layer in _layers(registry, digest, entry.suffix)):
            return tag
    raise RegistryUnavailable(f"{tag}: another writer replaced the list {WRITE_TRIES} times "
                              "as this one was written: run this again")


def sign(registry: Registry, digest: str, key: SigningKey) -> str:
    """Sign the image at `digest` in `registry`'s repository; returns the signature tag.  An
    image this key already signed is left as it is (no second signature of the same)."""
    body = payload(registry.repo, digest)
    return _append(registry, digest, _Entry({
        "mediaType": SIMPLE_SIGNING, "size": len(body), "digest": registry.put_blob(body),
        "annotations": {SIGNATURE_ANNOTATION: key.sign(body)}}, "sig", key, ""))


def pae(payload_type: str, body: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what a DSSE signature signs."""
    kind = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(body), body)


def attest(registry: Registry, digest: str, key: SigningKey, predicate_type: str,
           predicate: dict[str, object]) -> str:
    """Attach a signed in-toto statement about the image at `digest` (cosign's `attest`
    layout: a DSSE envelope in the `.att` manifest beside it); returns that tag.  It
    replaces an earlier statement of the same type by the same key."""
    statement = _go_json({"_type": STATEMENT_TYPE, "predicateType": predicate_type,
                          "subject": [{"name": registry.repo,
                                       "digest": {"sha256": digest.split(":", 1)[1]}}],
                          "predicate": predicate})
    envelope = _go_json({"payloadType": IN_TOTO,
                         "payload": base64.b64encode(statement).decode(),
                         "signatures": [{"keyid": "", "sig": key.sign(pae(IN_TOTO,
                                                                           statement))}]})
    return _append(registry, digest, _Entry({
        "mediaType": DSSE_ENVELOPE, "size": len(envelope),
        "digest": registry.put_blob(envelope),
        "annotations": {SIGNATURE_ANNOTATION: "", "predicateType": predicate_type}},
        "att", key, predicate_type))


@dataclass(frozen=True)
class _Envelope:
    """A DSSE envelope's statement bytes and signatures, read with bounds and types."""

    statement: bytes
    signatures: tuple[str, ...]


def _envelope(blob: bytes) -> _Envelope | None:
    """The envelope a blob holds, or None when it is not one this tool reads: not JSON, not
    in-toto, fields of other types, or more than `MAX_ENVELOPE_SIGNATURES` signatures (a
    list of thousands would make each check cost as much as the bytes times their count)."""
    try:
        envelope = json.loads(blob)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(envelope, dict) or envelope.get("payloadType") != IN_TOTO:
        return None
    encoded, signatures = envelope.get("payload"), envelope.get("signatures")
    if not isinstance(encoded, str) or not isinstance(signatures, list) or \
            not 0 < len(signatures) <= MAX_ENVELOPE_SIGNATURES:
        return None
    sigs = tuple(item["sig"] for item in signatures
                 if isinstance(item, dict) and isinstance(item.get("sig"), str))
    try:
        statement = base64.b64decode(encoded, validate=True)
    except ValueError:
        return None
    return _Envelope(statement, sigs)


def _verifies(trust: TrustKey, envelope: _Envelope) -> bool:
    """Whether one of the envelope's signatures is `trust`'s over its statement: the PAE
    is built and hashed once, however many signatures there are."""
    hashed = hashlib.sha256(pae(IN_TOTO, envelope.statement)).digest()
    return any(trust.signed_digest(hashed, sig) for sig in envelope.signatures)


def attested(registry: Registry, digest: str, trust: TrustKey,
             predicate_type: str) -> dict[str, object]:
    """The predicate of the newest statement of `predicate_type` about exactly this image
    that `trust` signed; Untrusted when there is none.  Each envelope costs its bytes once
    (one PAE, one hash) and at most `MAX_ENVELOPE_SIGNATURES` signature checks; the list and
    every envelope it names are read within one registry limit in all (`budget`)."""
    with registry.door.budget():
        return _attested(registry, digest, trust, predicate_type)


def _attested(registry: Registry, digest: str, trust: TrustKey,
              predicate_type: str) -> dict[str, object]:
    for layer in reversed(_layers(registry, digest, "att")):
        blob = layer.get("digest")
        if layer.get("mediaType") != DSSE_ENVELOPE or not isinstance(blob, str):
            continue
        try:
            read = _envelope(registry.blob(blob))
        except Sm121Error:
            continue  # an unreadable attestation is skipped: another may verify
        if read is None or not _verifies(trust, read):
            continue
        predicate = _predicate(read.statement, predicate_type, (registry.repo, digest))
        if predicate is not None:
            return predicate
    raise Untrusted(f"no {predicate_type} statement about {registry.repo}@{digest} verifies "
                    f"with {trust.path}")


def _predicate(statement: bytes, predicate_type: str,
               subject: tuple[str, str]) -> dict[str, object] | None:
    """A signed statement's predicate when it is of `predicate_type` about `subject`
    (repository, digest), else None."""
    try:
        data = strict_loads(statement)  # one meaning for every reader: no NaN, no key twice
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(data, dict) or data.get("predicateType") != predicate_type or \
            not isinstance(data.get("predicate"), dict):
        return None
    subjects = data.get("subject")
    wanted = (subject[0], subject[1].split(":", 1)[1])
    if not any(isinstance(item, dict) and isinstance(item.get("digest"), dict) and
               (item.get("name"), item["digest"].get("sha256")) == wanted
               for item in (subjects if isinstance(subjects, list) else [])):
        return None
    return dict(data["predicate"])


def require_signed(registry: Registry, digest: str, trust: TrustKey) -> None:
    """Refuse (Untrusted) unless a signature beside the image at `digest` verifies with
    `trust`, for exactly that digest and this repository.  As cosign does, each signature
    is read with a size bound and one that cannot be read (a missing or oversized blob,
    damaged JSON) or does not verify is skipped and counted: one valid signature is
    enough, so whoever can push beside the image cannot stop a consumer's run; the list and
    every blob it names are read within one registry limit in all (`budget`), so neither
    can they make it last a limit for each of its layers."""
    with registry.door.budget():
        _require_signed(registry, digest, trust)


def _require_signed(registry: Registry, digest: str, trust: TrustKey) -> None:
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
