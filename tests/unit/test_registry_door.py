"""The registry client is a door (issue 62): every request through `image/registry_http.py`,
its whole answer within one deadline, its body bounded for every method and status, every
field of every answer checked; signature and attestation checks linear in the bytes read;
never a list written that the reader would refuse; a list read back after it is written.

The hostile registry here is a loopback HTTP server whose answers each test scripts; the
counts it keeps (bytes sent before the client hung up) are what the tests judge, not time.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from devkit.keys import key_pair
from sm121_build.core.errors import RegistryUnavailable, Sm121Error
from sm121_build.core.limits import Limits
from sm121_build.image import cosign
from sm121_build.image.registry import Registry, digest_of
from sm121_build.image.registry_http import BlobRefused

PACKAGE = Path(__file__).resolve().parents[2] / "sm121_build"


@dataclass
class Script:
    """What the server answers: `answer(handler)` per request; what it sent, counted."""

    answer: Callable[[BaseHTTPRequestHandler], None]
    sent: list[int] = field(default_factory=list)  # bytes each answer got out
    paths: list[str] = field(default_factory=list)


SCRIPT = Script(lambda handler: None)


class _Hostile(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _any(self) -> None:
        SCRIPT.paths.append(f"{self.command} {self.path}")
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        with contextlib.suppress(OSError):  # the client hung up: the answer counted it
            SCRIPT.answer(self)

    do_GET = do_PUT = do_POST = _any

    def log_message(self, *args: object) -> None:
        return


def flood(status: int, declared: int | None = None) -> Callable[[BaseHTTPRequestHandler],
                                                                 None]:
    """An answer whose body never ends (or outgrows what it declares)."""
    def answer(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(status)
        if declared is not None:
            handler.send_header("Content-Length", str(declared))
        handler.send_header("Location", "/v2/k/blobs/uploads/u")
        handler.end_headers()
        sent = 0
        try:
            while sent < (1 << 30):
                handler.wfile.write(b"x" * (256 << 10))
                sent += 256 << 10
        finally:
            SCRIPT.sent.append(sent)
    return answer


def drip(body: bytes, in_headers: bool = False) -> Callable[[BaseHTTPRequestHandler], None]:
    """An answer sent a byte every 0.25 s (in its headers, or its body)."""
    def answer(handler: BaseHTTPRequestHandler) -> None:
        sent = 0
        try:
            head = b"HTTP/1.1 200 OK\r\n"
            handler.wfile.write(head)
            slow = b"X-Slow: " + b"a" * 400 + b"\r\n" if in_headers else b""
            fast = b"Content-Length: %d\r\n" % len(body)
            for byte in [*(slow[i:i + 1] for i in range(len(slow)))]:
                handler.wfile.write(byte)
                handler.wfile.flush()
                sent += 1
                time.sleep(0.25)
            handler.wfile.write(fast + b"\r\n")
            for i in range(len(body)):
                handler.wfile.write(body[i:i + 1])
                handler.wfile.flush()
                sent += 1
                time.sleep(0.25)
        finally:
            SCRIPT.sent.append(sent)
    return answer


def plain(status: int, body: bytes, headers: dict[str, str] | None = None) -> Callable[
        [BaseHTTPRequestHandler], None]:
    def answer(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(status)
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)
    return answer


@pytest.fixture
def hostile() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}/k"
    server.shutdown()
    server.server_close()


def counted(answers: int) -> list[int]:
    """What the server sent, once it has noticed `answers` clients hang up (it learns it
    at its next write)."""
    for _ in range(200):
        if len(SCRIPT.sent) >= answers:
            break
        time.sleep(0.05)
    return SCRIPT.sent


def registry(repo: str, seconds: float = 2.0) -> Registry:
    return Registry(repo, Limits(engine_s=120.0, registry_s=seconds))


def test_a_manifest_sent_a_byte_at_a_time_meets_the_deadline(hostile: str) -> None:
    """One byte every 0.25 s keeps a per-read timeout of 2 s alive forever; the call's
    deadline ends it: at most ~2 s of bytes are sent (not the 400 of the answer)."""
    global SCRIPT
    for in_headers in (False, True):
        SCRIPT = Script(drip(b"{" + b" " * 398 + b"}", in_headers))
        with pytest.raises(RegistryUnavailable, match=r"no whole answer to read x in 2 s"):
            registry(hostile).manifest("x")
        deadline = 20  # bytes in 2 s at 4 a second, and a margin for a slow machine
        assert counted(1)[0] <= deadline, (in_headers, SCRIPT.sent)


@pytest.mark.parametrize("declared", [None, 1 << 40])
def test_answers_that_never_end_are_cut_for_every_method(hostile: str,
                                                         declared: int | None) -> None:
    """A flood: the manifest, a blob, the answer to an upload's POST and PUT, and an error
    answer are each read no further than their bound."""
    global SCRIPT
    reg = registry(hostile, 10.0)
    calls: list[Callable[[], object]] = [lambda: reg.manifest("x"),
                                         lambda: reg.blob("sha256:" + "0" * 64),
                                         lambda: reg.put_blob(b"data"),
                                         lambda: reg.put_manifest("t", b"{}")]
    statuses = [200, 200, 202, 201]
    for call, status in zip(calls, statuses, strict=True):
        for answered in (status, 500):
            SCRIPT = Script(flood(answered, declared))
            with pytest.raises(Sm121Error) as refused:
                call()
            assert isinstance(refused.value, (BlobRefused, RegistryUnavailable))
            # the server got out what socket buffers take, never the gigabyte it offers
            assert all(sent < (64 << 20) for sent in counted(1)), (call, SCRIPT.sent)


def test_a_token_endpoint_that_floods_or_answers_any_shape(hostile: str) -> None:
    """The token flow: a realm answering forever, `[]`, a number, a token with a newline:
    each is no token (the request then fails as unauthorised, one line), never a
    traceback, and the flood is cut."""
    global SCRIPT
    host = hostile.split("/")[0]
    challenge = {"WWW-Authenticate": f'Bearer realm="http://{host}/token",service="r"'}
    for token_answer in (flood(200), plain(200, b"[]"), plain(200, b'{"token": 5}'),
                         plain(200, b'{"token": "a\\nb"}'), plain(200, b'{"token": ""}'),
                         plain(200, b"\xff\xfe"), plain(200, b"[" * 100000)):
        def answer(handler: BaseHTTPRequestHandler,
                   token_answer: Callable[[BaseHTTPRequestHandler], None] = token_answer
                   ) -> None:
            if handler.path.startswith("/token"):
                token_answer(handler)
            else:
                plain(401, b"no", challenge)(handler)
        SCRIPT = Script(answer)
        with pytest.raises(Sm121Error, match=r"HTTP 401|above the \d+ (bytes )?it may be"):
            registry(hostile, 10.0).digest("x")
        assert all(sent < (64 << 20) for sent in SCRIPT.sent)
        if token_answer is not None and SCRIPT.sent:  # the flood: cut
            assert counted(1)[0] < (64 << 20)


def test_docker_config_of_any_shape_is_no_credentials(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from sm121_build.image.registry import _credentials

    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    good = base64.b64encode(b"me:secret").decode()
    config: object
    for config in ({"auths": {"h": {"auth": 5}}}, {"auths": ["h"]}, {"auths": {"h": 5}},
                   [], 7, {"auths": {"h": {"auth": "!!not base64"}}},
                   {"auths": {"h": {"auth": base64.b64encode(b"\xff\xfe").decode()}}},
                   {"auths": {"h": {"auth": base64.b64encode(b"nocolon").decode()}}}):
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert _credentials("h") is None, config
    (tmp_path / "config.json").write_text(json.dumps({"auths": {"h": {"auth": good}}}))
    assert _credentials("h") == ("me", "secret")


def test_no_network_call_outside_the_door() -> None:
    """Only the door (and the engine's SDK client) may open a connection."""
    allowed = {"image/registry_http.py", "image/engine.py"}
    network = re.compile(r"^\s*(?:import|from)\s+(requests|urllib3|urllib\.request|http\.client"
                         r"|socket|ssl|httpx|aiohttp|docker)\b", re.MULTILINE)
    found = [f"{path.relative_to(PACKAGE)}: {match.group(1)}"
             for path in sorted(PACKAGE.rglob("*.py"))
             for match in network.finditer(path.read_text())
             if str(path.relative_to(PACKAGE)) not in allowed]
    assert found == []


def _layers_of(reg: Registry, digest: str, suffix: str) -> list[dict[str, object]]:
    raw = reg.manifest(cosign.signature_tag(digest, suffix))
    return [] if raw is None else list(json.loads(raw)["layers"])


@dataclass
class MemoryRegistry:
    """A registry in a dict, for the list-writing rules (a real one is in the integration
    tests): manifests by tag, blobs by digest."""

    manifests: dict[str, bytes] = field(default_factory=dict)
    blobs: dict[str, bytes] = field(default_factory=dict)

    def answer(self, handler: BaseHTTPRequestHandler) -> None:
        path = handler.path.split("?")[0]
        name = path.rsplit("/", 1)[-1]
        if handler.command == "POST":
            plain(202, b"", {"Location": "/v2/k/blobs/uploads/u"})(handler)
        elif handler.command == "PUT" and "/blobs/uploads/" in path:
            plain(201, b"")(handler)  # the body was kept by `_Recording`
        elif handler.command == "PUT":
            self.manifests[name] = handler.__dict__.get("body", b"")
            plain(201, b"")(handler)
        else:
            table = self.manifests if "/manifests/" in path else self.blobs
            body = table.get(name)
            plain(404, b"")(handler) if body is None else plain(200, body)(handler)


class _Recording(_Hostile):
    """Keeps each request's body (uploads and manifests) for `MemoryRegistry`."""

    store: MemoryRegistry

    def _any(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if self.command == "PUT" and "digest=" in self.path:
            self.store.blobs[digest_of(body)] = body
        self.__dict__["body"] = body
        self.store.answer(self)

    do_GET = do_PUT = do_POST = _any


@pytest.fixture
def memory() -> Iterator[tuple[str, MemoryRegistry]]:
    store = MemoryRegistry()
    handler = type("Handler", (_Recording,), {"store": store})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}/k", store
    server.shutdown()
    server.server_close()


DIGEST = "sha256:" + "ab" * 32


def test_signing_an_image_again_adds_no_signature(tmp_path: Path,
                                                  memory: tuple[str, MemoryRegistry]) -> None:
    repo, _ = memory
    key = cosign.SigningKey.load(key_pair(tmp_path, "k")[0], None)
    other = cosign.SigningKey.load(key_pair(tmp_path, "o")[0], None)
    reg = registry(repo)
    for _ in range(3):
        cosign.sign(reg, DIGEST, key)
    assert len(_layers_of(reg, DIGEST, "sig")) == 1
    cosign.sign(reg, DIGEST, other)  # another key's signature is added beside it
    assert len(_layers_of(reg, DIGEST, "sig")) == 2
    cosign.require_signed(reg, DIGEST, key.public(tmp_path / "k.pub"))


def test_a_statement_replaces_the_same_keys_older_one_and_the_newest_is_read(
        tmp_path: Path, memory: tuple[str, MemoryRegistry]) -> None:
    repo, _ = memory
    key = cosign.SigningKey.load(key_pair(tmp_path, "k")[0], None)
    reg = registry(repo)
    for run in range(3):
        cosign.attest(reg, DIGEST, key, "https://x/proof", {"run": run})
    cosign.attest(reg, DIGEST, key, "https://x/provenance", {"run": 9})
    assert len(_layers_of(reg, DIGEST, "att")) == 2
    trust = key.public(tmp_path / "k.pub")
    assert cosign.attested(reg, DIGEST, trust, "https://x/proof") == {"run": 2}


def test_a_full_list_is_never_written_longer_than_a_reader_takes(
        tmp_path: Path, memory: tuple[str, MemoryRegistry]) -> None:
    """At the cap: the oldest of this key's goes; with none of this key's, one line and
    nothing written (before: a 65th entry, then the reader refused the whole list)."""
    repo, store = memory
    key = cosign.SigningKey.load(key_pair(tmp_path, "k")[0], None)
    reg = registry(repo)
    others = [cosign.SigningKey.load(key_pair(tmp_path, f"o{i}")[0], None) for i in range(2)]
    filler = {"mediaType": cosign.SIMPLE_SIGNING, "size": 1, "digest": "sha256:" + "00" * 32,
              "annotations": {cosign.SIGNATURE_ANNOTATION: ""}}
    tag = cosign.signature_tag(DIGEST)
    store.manifests[tag] = json.dumps({"layers": [filler] * cosign.MAX_SIGNATURES}).encode()
    with pytest.raises(cosign.Untrusted, match="none of them this key's: nothing was written"):
        cosign.sign(reg, DIGEST, others[0])
    assert len(_layers_of(reg, DIGEST, "sig")) == cosign.MAX_SIGNATURES
    store.manifests[tag] = json.dumps({"layers": [filler] * (cosign.MAX_SIGNATURES - 1)}
                                      ).encode()
    cosign.sign(reg, DIGEST, key)  # the 64th
    with pytest.raises(cosign.Untrusted, match="nothing was written"):
        cosign.sign(reg, DIGEST, others[1])  # a 65th: none of its own to drop
    cosign.sign(reg, DIGEST, key)  # already signed by it: nothing to add
    assert len(_layers_of(reg, DIGEST, "sig")) == cosign.MAX_SIGNATURES
    cosign.require_signed(reg, DIGEST, key.public(tmp_path / "k.pub"))


def test_two_writers_at_once_keep_both_statements(tmp_path: Path,
                                                  memory: tuple[str, MemoryRegistry]) -> None:
    """Both read the empty list, then both write: the one whose list was replaced reads it
    back, finds its statement gone and writes again (before: both said "attached", one
    proof lost)."""
    repo, _ = memory
    keys = [cosign.SigningKey.load(key_pair(tmp_path, f"k{i}")[0], None) for i in range(2)]
    both_read = threading.Barrier(2)
    real_plan = cosign._next_list
    planned = [0]

    def plan_then_wait(*args: object) -> object:
        result = real_plan(*args)  # type: ignore[arg-type]
        planned[0] += 1
        if planned[0] <= 2:
            both_read.wait(timeout=10)
        return result

    errors: list[BaseException] = []

    def write(index: int) -> None:
        try:
            cosign.attest(registry(repo, 10.0), DIGEST, keys[index], "https://x/proof",
                          {"by": index})
        except BaseException as exc:
            errors.append(exc)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cosign, "_next_list", plan_then_wait)
        threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    assert errors == []
    reg = registry(repo)
    for index, signing in enumerate(keys):
        trust = signing.public(tmp_path / f"k{index}.pub")
        assert cosign.attested(reg, DIGEST, trust, "https://x/proof") == {"by": index}


def test_an_envelope_of_many_signatures_costs_its_bytes_once(
        tmp_path: Path, memory: tuple[str, MemoryRegistry],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """~45,000 empty signatures over a 375 KB payload in one blob under 1 MiB: before,
    the PAE was rebuilt and hashed per signature (8.5 s); now an envelope of more than
    `MAX_ENVELOPE_SIGNATURES` is not read, and any envelope is hashed once."""
    repo, store = memory
    key = cosign.SigningKey.load(key_pair(tmp_path, "k")[0], None)
    statement = json.dumps({"_type": cosign.STATEMENT_TYPE, "predicateType": "p",
                            "subject": [], "predicate": {"pad": "x" * 280_000}}).encode()
    envelope = json.dumps({"payloadType": cosign.IN_TOTO,
                           "payload": base64.b64encode(statement).decode(),
                           "signatures": [{"sig": ""}] * 45_000},
                          separators=(",", ":")).encode()
    assert len(envelope) < (1 << 20)
    few = json.dumps({"payloadType": cosign.IN_TOTO,
                      "payload": base64.b64encode(statement).decode(),
                      "signatures": [{"sig": "MEUC" + "A" * 92}] * 16}).encode()
    layers = []
    for blob in [envelope] * 32 + [few] * 32:
        store.blobs[digest_of(blob)] = blob
        layers.append({"mediaType": cosign.DSSE_ENVELOPE, "digest": digest_of(blob),
                       "size": len(blob), "annotations": {"predicateType": "p"}})
    store.manifests[cosign.signature_tag(DIGEST, "att")] = json.dumps(
        {"layers": layers}).encode()
    built: list[int] = []
    checked: list[int] = []
    real_pae, real_check = cosign.pae, cosign.TrustKey.signed_digest

    def pae(kind: str, body: bytes) -> bytes:
        built.append(len(body))
        return real_pae(kind, body)

    def signed_digest(self: cosign.TrustKey, hashed: bytes, sig: str) -> bool:
        checked.append(len(sig))
        return real_check(self, hashed, sig)

    monkeypatch.setattr(cosign, "pae", pae)
    monkeypatch.setattr(cosign.TrustKey, "signed_digest", signed_digest)
    with pytest.raises(cosign.Untrusted):
        cosign.attested(registry(repo, 30.0), DIGEST, key.public(tmp_path / "k.pub"), "p")
    assert len(built) == 32  # once for each envelope that was read (the 16-signature ones)
    assert len(checked) == 32 * cosign.MAX_ENVELOPE_SIGNATURES


def test_credentials_and_uploads_go_only_over_https_or_to_loopback() -> None:
    from sm121_build.image.registry import Registry, _may_send_to

    assert _may_send_to("https://auth.example/token", "ghcr.io")
    assert _may_send_to("http://127.0.0.1:5/token", "127.0.0.1:5000")
    assert _may_send_to("http://[::1]:5/token", "127.0.0.1:5000")
    assert not _may_send_to("http://auth.example/token", "ghcr.io")
    assert not _may_send_to("http://evil.example/token", "127.0.0.1:5000")  # loopback too
    assert not _may_send_to("ftp://x/token", "ghcr.io")
    assert not _may_send_to("https:///token", "ghcr.io")
    # red team: user info before the host is not the host (credentials went to 192.0.2.2)
    for url in ("http://[::1]@192.0.2.2:8080/token", "http://127.0.0.1:@192.0.2.2/token",
                "http://localhost@evil.example/x", "https://u:p@auth.example/token",
                "http://127.0.0.1:99999/token"):
        assert not _may_send_to(url, "127.0.0.1:5000"), url
    upload = Registry("127.0.0.1:5000/k")
    with pytest.raises(RegistryUnavailable, match="no usable place"):
        upload._upload_url("http://[::1]@192.0.2.2:8080/v2/k/blobs/uploads/u")


def _cli(args: list[str], env: dict[str, str], signal_after: float | None = None
         ) -> tuple[int, str, float]:
    """The command as a user runs it; with `signal_after`, a SIGINT that long after the
    tool started.  Returns its exit, stderr and the seconds from the signal (or the start)
    to its end."""
    import os
    import signal
    import subprocess
    import sys

    from devkit.worlds import tool_started

    process = subprocess.Popen([sys.executable, "-m", "sm121_build", *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **env})
    started = time.monotonic()
    if signal_after is not None:
        tool_started(process.pid)
        time.sleep(signal_after)
        process.send_signal(signal.SIGINT)
        started = time.monotonic()
    _, err = process.communicate(timeout=120)
    return process.returncode, err, time.monotonic() - started


def test_kernels_verify_against_a_hostile_registry_is_one_line(hostile: str,
                                                               tmp_path: Path) -> None:
    """The commands that read a registry, run as a user runs them: a drip ends in one line
    and exit 7 (at the deadline, not the minutes the answer would take); 10,000 signatures
    none valid, exit 3 after reading the newest 64; a Ctrl-C while the registry stalls,
    exit 130 at once."""
    global SCRIPT
    public = key_pair(tmp_path, "k")[1]
    ref = f"{hostile}@sha256:{'ab' * 32}"
    SCRIPT = Script(drip(b"{" + b" " * 398 + b"}", in_headers=True))
    code, err, _ = _cli(["kernels", "verify", ref, "--trust-key", str(public)],
                        {"SM121_REGISTRY_TIMEOUT": "2"})
    assert code == 7 and err.count("\n") == 1 and "no whole answer" in err, err
    assert counted(1)[0] <= 20
    filler = {"mediaType": cosign.SIMPLE_SIGNING, "digest": "sha256:" + "00" * 32}
    SCRIPT = Script(plain(200, json.dumps({"layers": [filler] * 10_000}).encode()))
    code, err, _ = _cli(["kernels", "verify", ref, "--trust-key", str(public)],
                        {"SM121_REGISTRY_TIMEOUT": "5"})
    assert code == 3 and err.count("\n") == 1, err  # the newest 64 read, each skipped
    assert f"({cosign.MAX_SIGNATURES} signature(s): " in err
    SCRIPT = Script(drip(b"{" + b" " * 398 + b"}", in_headers=True))
    code, err, after = _cli(["kernels", "verify", ref, "--trust-key", str(public)],
                            {"SM121_REGISTRY_TIMEOUT": "60"}, signal_after=1.0)
    assert code == 130 and "Traceback" not in err, err
    assert after < 60 / 4, after  # ended by the signal, long before the registry's deadline


def _signed_statement(store: MemoryRegistry, key: cosign.SigningKey,
                      statement: bytes) -> dict[str, object]:
    """`statement` in a DSSE envelope `key` signed, stored as a blob; its `.att` layer."""
    envelope = json.dumps({"payloadType": cosign.IN_TOTO,
                           "payload": base64.b64encode(statement).decode(),
                           "signatures": [{"sig": key.sign(cosign.pae(cosign.IN_TOTO,
                                                                      statement))}]}).encode()
    store.blobs[digest_of(envelope)] = envelope
    return {"mediaType": cosign.DSSE_ENVELOPE, "digest": digest_of(envelope)}


def _refused_as_unsigned(store: MemoryRegistry, layers: list[dict[str, object]], repo: str,
                         trust: cosign.TrustKey) -> None:
    """With `layers` beside the image, no statement of type `p` is read about it."""
    store.manifests[cosign.signature_tag(DIGEST, "att")] = json.dumps(
        {"layers": layers}).encode()
    with pytest.raises(cosign.Untrusted):
        cosign.attested(registry(repo), DIGEST, trust, "p")


def test_a_signed_statement_with_a_key_twice_or_nan_is_not_read(
        tmp_path: Path, memory: tuple[str, MemoryRegistry]) -> None:
    """Two readers, two documents under one signature: a statement whose predicate is
    given twice (Python keeps the last, another reader the first) or holds NaN is not
    read, even when the key signed it."""
    repo, store = memory
    key = cosign.SigningKey.load(key_pair(tmp_path, "k")[0], None)
    subject = f'[{{"name":"{repo}","digest":{{"sha256":"{DIGEST[7:]}"}}}}]'
    layers = []
    for statement in (
            f'{{"predicateType":"p","subject":{subject},"predicate":{{"v":1}},'
            f'"predicate":{{"v":2}}}}',
            f'{{"predicateType":"p","subject":{subject},"predicate":{{"v":NaN}}}}'):
        layers.append(_signed_statement(store, key, statement.encode()))
    _refused_as_unsigned(store, layers, repo, key.public(tmp_path / "k.pub"))


def test_an_answer_that_is_not_the_manifest_is_never_read_as_one(hostile: str) -> None:
    """A 401, 429 or 500 whose body is JSON is the registry's refusal, not the list."""
    global SCRIPT
    for status in (401, 429, 500, 302):
        SCRIPT = Script(plain(status, json.dumps({"layers": []}).encode()))
        with pytest.raises(RegistryUnavailable, match=rf"HTTP {status}"):
            registry(hostile).manifest("x")


def test_a_list_of_dripping_blobs_is_read_within_one_limit(hostile: str,
                                                           tmp_path: Path) -> None:
    """Red team: 12 junk layers whose blobs each drip a byte at a time made a check last a
    limit for each (64 layers, 60 s: an hour).  The list and its blobs share one limit:
    the blobs after it is spent are not asked for at all."""
    global SCRIPT
    public = key_pair(tmp_path, "k")[1]
    layers = [{"mediaType": cosign.SIMPLE_SIGNING, "digest": f"sha256:{i:064x}",
               "annotations": {cosign.SIGNATURE_ANNOTATION: "AAAA"}} for i in range(12)]
    listing = json.dumps({"layers": layers}).encode()

    def answer(handler: BaseHTTPRequestHandler) -> None:
        if "/manifests/" in handler.path:
            plain(200, listing)(handler)
        else:
            drip(b"x" * 40)(handler)
    SCRIPT = Script(answer)
    with pytest.raises(cosign.Untrusted, match=r"12 signature\(s\): 12 unreadable"):
        cosign.require_signed(registry(hostile, 1.0), DIGEST, cosign.TrustKey.load(public))
    blobs_asked = sum("/blobs/" in path for path in SCRIPT.paths)
    assert blobs_asked <= 2, SCRIPT.paths  # the first drips the whole limit away


def test_a_refused_connection_is_said_as_such_not_as_a_wait(tmp_path: Path) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(RegistryUnavailable, match="no connection") as refused:
        registry(f"127.0.0.1:{port}/k").manifest("x")
    assert "SM121_REGISTRY_TIMEOUT" not in str(refused.value)


def test_a_statement_whose_subject_is_of_another_type_is_not_read(
        tmp_path: Path, memory: tuple[str, MemoryRegistry]) -> None:
    """Red team: a list where a subject's name or digest was a string made a set of
    unhashable values (a traceback), even signed by the trusted key."""
    repo, store = memory
    key = cosign.SigningKey.load(key_pair(tmp_path, "k")[0], None)
    layers = []
    for subject in ([{"name": [repo], "digest": {"sha256": DIGEST[7:]}}],
                    [{"name": repo, "digest": {"sha256": [DIGEST[7:]]}}],
                    [{"name": {"a": 1}, "digest": {"sha256": {}}}]):
        layers.append(_signed_statement(store, key, json.dumps(
            {"predicateType": "p", "subject": subject, "predicate": {}}).encode()))
    _refused_as_unsigned(store, layers, repo, key.public(tmp_path / "k.pub"))
