"""FAKE at the registry boundary: a hostile OCI registry on 127.0.0.1 (stdlib http.server,
one thread a connection) that speaks just enough of the distribution API for
`image/registry.Registry` and `image/cosign` (GET/PUT manifests, GET blobs, POST/PUT
uploads, a Bearer token endpoint behind a 401 challenge), and answers as the MODE in the
request's path says.  Repository `127.0.0.1:PORT/MODE/k` is served in MODE; each holds, at
tag `v1`, an image signed (`.sig`) and attested (`.att`, a provenance naming `PROVEN_FILES`)
by the registry's own key, written by the tests' own hand (not the client's code), so a
client that verifies with `server.public_key` reaches every later request.

Modes (`MODES`): `good` (honest); `drip` (every answer valid, 1 byte a second); `flood-*` /
`floodlen-*` (a body that never ends, without / with a Content-Length, on the GET of a
manifest, of a blob, the token answer, the answers to POST and PUT of an upload);
wrong types (`token-list`: the token answer `[]`, `token-int`: `{"token": 5}`;
`layers-dict`/`-str`/`-num`, `layer-items`, `annotations`, `att-types` in the `.sig`/`.att`
manifests and envelopes); huge lists (`sig-65`, `sig-10000` layers; `att-sigs`: one envelope
under 1 MiB, ~45,000 empty signatures over a ~390 KB statement); `concurrent` (another
writer appends to a `.sig`/`.att` just before each read of it: `lost` counts the rival
layers a client's write then dropped); `redirect` (every answer a 307 to the `drip` repository
under another host name), `redirect-loop`; `status-500`, `status-429` (Retry-After an hour),
`status-401` (a 401 whatever the token).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from sm121_build.image.cosign import (
    COSIGN_TYPE,
    DSSE_ENVELOPE,
    IN_TOTO,
    OCI_CONFIG,
    SIGNATURE_ANNOTATION,
    SIMPLE_SIGNING,
    STATEMENT_TYPE,
    pae,
    signature_tag,
)
from sm121_build.image.registry import OCI_MANIFEST

FLOODS = tuple(f"{how}-{what}" for how in ("flood", "floodlen")
               for what in ("manifest", "blob", "token", "upload"))
MODES = ("good", "drip", *FLOODS, "token-list", "token-int", "layers-dict", "layers-str",
         "layers-num", "layer-items", "annotations", "att-types", "sig-65", "sig-10000",
         "att-sigs", "concurrent", "redirect", "redirect-loop", "status-500", "status-429",
         "status-401")
PROVENANCE_TYPE = "https://sm121-build.dev/provenance/v1"
PROVEN_GPU = "sm_90"  # the GPU docs/real-build/prove-sm90-h200/proof.json was proven on
FLOOD_RATE = 64 << 20  # bytes a second: a flood ends no run by exhausting this machine
CHUNK = 64 << 10
_PATH = re.compile(r"/v2/(?P<mode>[a-z0-9-]+)/k/(?P<kind>manifests|blobs)/(?P<rest>.*)")


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _json(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


class Store:
    """What the registry holds: blobs by digest; manifests by repository, tag or digest;
    and the key its own signatures are made with."""

    def __init__(self, host: str, files: dict[str, str]) -> None:
        self.host = host
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.blobs: dict[str, bytes] = {}
        self.manifests: dict[str, dict[str, bytes]] = {}
        self.lock = threading.Lock()
        self.files = files
        self.image_data = _json({"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                                 "config": self._descriptor(OCI_CONFIG, b"{}"), "layers": []})
        self.image = _digest(self.image_data)

    def sign(self, data: bytes) -> str:
        return base64.b64encode(self.key.sign(data, ec.ECDSA(hashes.SHA256()))).decode()

    def _descriptor(self, media: str, data: bytes, **annotations: str) -> dict[str, object]:
        self.blobs[_digest(data)] = data
        found: dict[str, object] = {"mediaType": media, "size": len(data),
                                    "digest": _digest(data)}
        if annotations:
            found["annotations"] = annotations
        return found

    def put_manifest(self, mode: str, tag: str, data: bytes) -> str:
        with self.lock:
            if mode not in self.manifests:
                self._seed(mode)
            held = self.manifests[mode]
            held[tag] = held[_digest(data)] = data
        return _digest(data)

    def manifest(self, mode: str, reference: str) -> bytes | None:
        with self.lock:
            if mode not in self.manifests:
                self._seed(mode)
            return self.manifests[mode].get(reference)

    def signature_layer(self, mode: str) -> dict[str, object]:
        """A valid `.sig` layer: the simple-signing payload of this repository's image."""
        body = _json({"critical": {"identity": {"docker-reference": self.repo(mode)},
                                   "image": {"docker-manifest-digest": self.image},
                                   "type": COSIGN_TYPE}, "optional": None})
        return self._descriptor(SIMPLE_SIGNING, body, **{SIGNATURE_ANNOTATION: self.sign(body)})

    def statement_layer(self, mode: str, padding: int = 0,
                        signatures: list[dict[str, str]] | None = None) -> dict[str, object]:
        """A valid `.att` layer: a provenance whose manifest lists `files` (and `padding`
        bytes more in the statement; `signatures` instead of the one valid one)."""
        predicate = {"manifest": {"gpu": PROVEN_GPU, "files": {
            name: {"sha256": sha} for name, sha in self.files.items()}}, "pad": "x" * padding}
        statement = _json({"_type": STATEMENT_TYPE, "predicateType": PROVENANCE_TYPE,
                           "subject": [{"name": self.repo(mode),
                                        "digest": {"sha256": self.image.split(":")[1]}}],
                           "predicate": predicate})
        sigs = signatures if signatures is not None else [
            {"keyid": "", "sig": self.sign(pae(IN_TOTO, statement))}]
        envelope = _json({"payloadType": IN_TOTO, "signatures": sigs,
                          "payload": base64.b64encode(statement).decode()})
        return self._descriptor(DSSE_ENVELOPE, envelope,
                                **{SIGNATURE_ANNOTATION: "", "predicateType": PROVENANCE_TYPE})

    def repo(self, mode: str) -> str:
        return f"{self.host}/{mode}/k"

    def _seed(self, mode: str) -> None:
        """The image, its `.sig` and `.att` as `mode` serves them (lock held)."""
        sig, att = [self.signature_layer(mode)], [self.statement_layer(mode)]
        odd: list[object] = [1, "x", None, [], {"digest": 5, "mediaType": SIMPLE_SIGNING},
                             {"digest": ["sha256:0"], "annotations": [1]},
                             {"mediaType": DSSE_ENVELOPE, "digest": {"a": 1}}]
        layers: dict[str, tuple[object, object]] = {
            "layers-dict": ({"a": sig[0]}, {"a": att[0]}), "layers-str": ("layers", "x"),
            "layers-num": (65, 1e308), "layer-items": ([*odd, *sig], [*odd, *att]),
            "annotations": ([{**sig[0], "annotations": a} for a in (
                "x", [1], 7, None, {SIGNATURE_ANNOTATION: 5})] + sig, att),
            "att-types": (sig, [self._odd_envelope(mode, change) for change in range(6)] + att),
            "sig-65": ([sig[0]] * 65, [att[0]] * 65),
            "sig-10000": ([{**sig[0], "size": n} for n in range(9_999)] + sig, att),
            "att-sigs": (sig, [self.statement_layer(mode, 390_000, [{"sig": ""}] * 45_000)]),
        }
        chosen = layers.get(mode, (sig, att))
        self.manifests[mode] = {"v1": self.image_data, self.image: self.image_data}
        for suffix, listed in zip(("sig", "att"), chosen, strict=True):
            data = _json({"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                          "config": self._descriptor(OCI_CONFIG, b"{}"), "layers": listed})
            self.manifests[mode][signature_tag(self.image, suffix)] = data

    def _odd_envelope(self, mode: str, change: int) -> dict[str, object]:
        """An `.att` layer whose envelope or statement has a field of a wrong type."""
        statement = _json([{"subject": {"name": 1}}, {"subject": [{"digest": {"sha256": 5}}]},
                           {"subject": "x", "predicate": []}, 5, "s", None][change])
        envelope: list[object] = [
            {"payloadType": IN_TOTO, "payload": 5, "signatures": []},
            {"payloadType": IN_TOTO, "payload": base64.b64encode(statement).decode(),
             "signatures": "abc"},
            {"payloadType": [], "payload": base64.b64encode(statement).decode(),
             "signatures": [{"sig": self.sign(pae(IN_TOTO, statement))}]},
            {"payloadType": IN_TOTO, "payload": base64.b64encode(statement).decode(),
             "signatures": [{"sig": self.sign(pae(IN_TOTO, statement))}]},
            {"payloadType": IN_TOTO, "payload": base64.b64encode(statement).decode(),
             "signatures": {"sig": 1}},
            [1, 2]]
        return self._descriptor(DSSE_ENVELOPE, _json(envelope[change]))

    def public_pem(self) -> bytes:
        return self.key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)

    def private_pem(self) -> bytes:
        return self.key.private_bytes(serialization.Encoding.PEM,
                                      serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption())


class _Handler(BaseHTTPRequestHandler):
    server: HostileRegistry
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        return

    # -- answering ---------------------------------------------------------------------
    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
              mode: str = "good", what: str = "") -> None:
        """An answer as `mode` gives `what` (manifest, blob, token, upload)."""
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if what and mode in FLOODS and mode.endswith(what):
            self._flood(mode.startswith("floodlen"))
            return
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if mode == "drip":
            self._drip(body)
        elif self.command != "HEAD":
            self.wfile.write(body)

    def _flood(self, declared: bool) -> None:
        self.close_connection = True
        if declared:
            self.send_header("Content-Length", str(1 << 40))
        self.end_headers()  # without a length: the body ends when the connection does
        chunk, started, sent = b" " * CHUNK, time.monotonic(), 0
        with suppress(OSError):
            while not self.server.stop.is_set():
                self.wfile.write(chunk)
                sent += CHUNK
                ahead = sent / FLOOD_RATE - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)

    def _drip(self, body: bytes) -> None:
        with suppress(OSError):
            for at in range(len(body)):
                if self.server.stop.wait(1.0):
                    return
                self.wfile.write(body[at:at + 1])
                self.wfile.flush()

    def _body(self) -> bytes:
        length = self.headers.get("Content-Length", "0")
        return self.rfile.read(int(length)) if length.isdigit() else b""

    # -- routing -----------------------------------------------------------------------
    def _route(self) -> None:
        if self.path.startswith("/token/"):
            self._token(self.path.split("/")[2].split("?")[0])
            return
        found = _PATH.match(self.path)
        mode = found["mode"] if found else ""
        if not found or mode not in MODES:
            self._body()
            self._send(404, _json({"errors": [{"code": "NAME_UNKNOWN"}]}))
            return
        if self._refused(mode):
            return
        if found["kind"] == "manifests":
            self._manifest(mode, found["rest"])
        elif found["rest"].startswith("uploads"):
            self._upload(mode, found["rest"])
        else:
            blob = self.server.store.blobs.get(found["rest"])
            self._send(200 if blob else 404, blob or b"", mode=mode, what="blob")

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _route

    def _refused(self, mode: str) -> bool:
        """Answered before the API: a redirect, a status, an auth challenge."""
        self._seen = self._body() if self.command in ("PUT", "POST", "PATCH") else b""
        port = self.server.server_address[1]
        if mode == "redirect":
            self._send(307, headers={"Location": f"http://localhost:{port}"
                                                 + self.path.replace("/redirect/", "/drip/", 1)})
        elif mode == "redirect-loop":
            self._send(302, headers={"Location": self.path})
        elif mode in ("status-500", "status-429"):
            self._send(int(mode[-3:]), b"{}", {"Retry-After": "3600"})
        elif (mode.startswith("token-") or mode.endswith("-token") or mode == "status-401") \
                and (mode == "status-401" or not self.headers.get("Authorization")):
            self._send(401, b"{}", {"WWW-Authenticate": f'Bearer realm="http://127.0.0.1:'
                                                        f'{port}/token/{mode}",service="x"'})
        else:
            return False
        return True

    def _token(self, mode: str) -> None:
        answer: object = {"token-list": [], "token-int": {"token": 5}}.get(mode, {"token": "t"})
        self._send(200, _json(answer), {"Content-Type": "application/json"}, mode, "token")

    def _manifest(self, mode: str, reference: str) -> None:
        store = self.server.store
        if self.command == "PUT":
            self._concurrent_check(mode, reference, self._seen)
            store.put_manifest(mode, reference, self._seen)
            self._send(201, b"", {"Docker-Content-Digest": _digest(self._seen)}, mode,
                       "upload")
            return
        data = store.manifest(mode, reference)
        if data is not None and mode == "concurrent" and reference.endswith((".sig", ".att")):
            self._rival(mode, reference, data)
            data = store.manifest(mode, reference)  # the rival's write landed first
        self._send(200 if data is not None else 404, data or b"",
                   {"Content-Type": OCI_MANIFEST}, mode, "manifest")

    def _rival(self, mode: str, reference: str, data: bytes) -> None:
        """Another writer appends its layer just before this read is answered (as two
        `attest` runs at once would): a client that writes the list back must keep it.  (A
        write that lands after a client's last read cannot be seen by it: the OCI API has no
        conditional write, so no client can keep what it never read; the tool's own writers
        read their list back and write again, `tests/unit/test_registry_door.py`.)"""
        store = self.server.store
        manifest = json.loads(data)
        rival = store._descriptor(SIMPLE_SIGNING, f"rival {time.monotonic_ns()}".encode())
        manifest["layers"] = [*manifest["layers"], rival]
        store.put_manifest(mode, reference, _json(manifest))
        with store.lock:
            self.server.rivals.setdefault(reference, set()).add(str(rival["digest"]))

    def _concurrent_check(self, mode: str, reference: str, data: bytes) -> None:
        if mode != "concurrent" or not reference.endswith((".sig", ".att")):
            return
        with suppress(ValueError, TypeError, AttributeError):
            kept = {layer.get("digest") for layer in json.loads(data).get("layers", [])
                    if isinstance(layer, dict)}
            rivals = self.server.rivals.get(reference, set())
            self.server.lost += len(rivals - kept)
            rivals &= kept

    def _upload(self, mode: str, rest: str) -> None:
        if self.command == "POST":
            self._send(202, b"", {"Location": f"/v2/{mode}/k/blobs/uploads/u1"}, mode,
                       "upload")
            return
        digest = (re.search(r"digest=(sha256(?::|%3A)[0-9a-f]{64})", rest) or [""])[0]
        self.server.store.blobs[_digest(self._seen)] = self._seen
        self._send(201, b"", {"Docker-Content-Digest": str(digest)}, mode, "upload")


class HostileRegistry(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, files: dict[str, str]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.stop = threading.Event()
        self.store = Store(self.host, files)
        self.rivals: dict[str, set[str]] = {}  # tag -> layers another writer appended
        self.lost = 0  # rival layers a client's write of a `.sig`/`.att` dropped

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that went away mid-answer (a run killed at its bound): not news."""

    def ref(self, mode: str, by_digest: bool = True) -> str:
        """The signed image of `mode`'s repository, by digest or by its tag."""
        repo = self.store.repo(mode)
        return f"{repo}@{self.store.image}" if by_digest else f"{repo}:v1"

    def keys(self, folder: Path) -> tuple[Path, Path]:
        """(private, public) PEM files of the key the registry's signatures are made with."""
        private, public = folder / "registry.key", folder / "registry.pub"
        private.write_bytes(self.store.private_pem())
        public.write_bytes(self.store.public_pem())
        return private, public


@contextmanager
def hostile_registry(files: dict[str, str] | None = None) -> Iterator[HostileRegistry]:
    """A hostile registry for the block; `files` (name -> sha256) is what its provenance
    statements list (a proof of those files can then be attached)."""
    server = HostileRegistry(files or {})
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop.set()
        server.shutdown()
        server.server_close()
        thread.join()
