"""A registry's OCI distribution API, for what the engine cannot do: read and write the
signature manifests (`image/cosign.py`) beside a kernels image.  Images themselves are still
pushed and pulled by the engine.

Plain HTTP for a loopback registry (as the engine does), HTTPS with verification for any
other.  Credentials: those ~/.docker/config.json (or $DOCKER_CONFIG) holds for the registry,
asked only when the registry asks for a login: from the credential helper it names for it
(`credential_helper.helper_login`, through the children door; a helper's identity token is
not used), else its `auths`; with the registry's token flow.  Every request goes through the one
HTTP door (`image/registry_http.py`): its whole answer within SM121_REGISTRY_TIMEOUT, its
body bounded, every field of it checked before use.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import os
import re
import urllib.parse
from dataclasses import dataclass, field, replace
from pathlib import Path

from sm121_build.core.errors import RegistryUnavailable, Sm121Error
from sm121_build.core.inputs import read_input
from sm121_build.core.limits import Limits
from sm121_build.image.credential_helper import HELPER_S, helper_for, helper_login
from sm121_build.image.registry_http import (
    MAX_ERROR_BODY,
    Answer,
    BlobRefused,
    HttpDoor,
    Request,
)

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
# what a pushed image's manifest may be: the digest is of the bytes the registry serves
IMAGE_MANIFESTS = ", ".join([OCI_MANIFEST, "application/vnd.oci.image.index.v1+json",
                             "application/vnd.docker.distribution.manifest.v2+json",
                             "application/vnd.docker.distribution.manifest.list.v2+json"])
MAX_MANIFEST = 4 << 20
MAX_BLOB = 1 << 20  # a signature's payload or envelope
MAX_TOKEN = 16 << 10  # a bearer token, or a config.json `auth`
MAX_TOKEN_ANSWER = 64 << 10
MAX_CHALLENGE = 4 << 10  # what of a WWW-Authenticate header is read
MAX_LOCATION = 4 << 10
_CHALLENGE = re.compile(r'(\w{1,64})="([^"]{0,2048})"')
# what an HTTP header value may carry (RFC 9110's visible ASCII): a token is sent in one
_TOKEN_CHARACTERS = re.compile(r"[\x21-\x7e]+")

__all__ = ["BlobRefused", "Registry", "digest_of", "split_repository"]


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def split_repository(repo: str) -> tuple[str, str]:
    """`host[:port]/name` -> (host, name); a Docker Hub name is not supported here."""
    host, _, name = repo.partition("/")
    if not name or not ("." in host or ":" in host or host == "localhost"):
        raise Sm121Error(f"{repo}: signing needs a registry host in the repository "
                         "(e.g. ghcr.io/you/kernels)")
    return host, name


def _loopback(host: str) -> bool:
    name = host.rsplit(":", 1)[0].strip("[]") if not host.startswith("[") else \
        host[1:host.index("]")]
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _credentials(host: str, seconds: float = HELPER_S) -> tuple[str, str] | None:
    """The user and password `docker login` kept for `host`: from the credential helper
    Docker's config.json names for it (one that cannot answer within `seconds` is
    Sm121Error in one line; an identity token is no credentials here), else from its
    `auths`; or None: a file of any other shape (not JSON, `auths` not a mapping, `auth` not
    base64 of `user:password`) is no credentials, never an error."""
    folder = Path(os.environ.get("DOCKER_CONFIG") or Path.home() / ".docker")
    try:
        config = json.loads(read_input(folder / "config.json", 1 << 20,
                                       "Docker's config.json"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError, Sm121Error):
        return None
    helper = helper_for(config, host)
    if helper is not None:  # as Docker reads it: the helper's login, never `auths`'
        login = helper_login(helper, host, f"log in to {host}", seconds)
        user, password = login.get("Username", ""), login.get("Password", "")
        return (user, password) if user and password and len(user) + len(password) <= \
            MAX_TOKEN else None
    auths = config.get("auths") if isinstance(config, dict) else None
    entry = (auths.get(host) or auths.get(f"https://{host}")) if isinstance(auths, dict) \
        else None
    encoded = entry.get("auth") if isinstance(entry, dict) else None
    if not isinstance(encoded, str) or not encoded or len(encoded) > MAX_TOKEN:
        return None
    try:
        user, colon, password = base64.b64decode(encoded, validate=True).decode().partition(
            ":")
    except (ValueError, UnicodeDecodeError):
        return None
    return (user, password) if colon and user else None


def _token(body: bytes) -> str:
    """The bearer token a token endpoint's answer holds (`token`, else `access_token`), or
    "" when the answer is not that: not JSON, not an object, not a string, too long, or
    characters no HTTP header may carry."""
    try:
        answer = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return ""
    if not isinstance(answer, dict):
        return ""
    token = answer.get("token") or answer.get("access_token")
    if not isinstance(token, str) or len(token) > MAX_TOKEN or \
            not _TOKEN_CHARACTERS.fullmatch(token):
        return ""
    return token


def _may_send_to(url: str, host: str) -> bool:
    """Whether a URL a registry named (a token realm, an upload's `Location`) may be sent
    credentials and data: HTTPS, or plain HTTP on loopback when the registry itself is on
    loopback.  A URL with user info (`http://[::1]@elsewhere/`) is neither: its host is
    what follows the `@`, never what precedes it."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        return False
    if not parts.hostname or "@" in parts.netloc or len(url) > MAX_LOCATION:
        return False
    if parts.scheme == "https":
        return True
    named = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return parts.scheme == "http" and _loopback(host) and \
        _loopback(f"{named}:{port}" if port else named)


@dataclass
class Registry:
    """One repository of one registry; every request through one `HttpDoor`."""

    repo: str  # host[:port]/name
    limits: Limits = field(default_factory=Limits.from_environment)
    _token: str = ""
    _basic: tuple[str, str] | None = None
    _door: HttpDoor | None = None
    _tried: bool = False  # a login was asked for: the helper runs once, whatever answers

    @property
    def base(self) -> str:
        host, name = split_repository(self.repo)
        return f"{'http' if _loopback(host) else 'https'}://{host}/v2/{name}"

    @property
    def door(self) -> HttpDoor:
        if self._door is None:
            self._door = HttpDoor(self.limits.registry_s, self.repo)
        return self._door

    def _call(self, request: Request, wanted: frozenset[int] = frozenset({200})) -> Answer:
        """`request` with this repository's credentials, logging in once on a 401."""
        sent = dict(request.headers or {})
        if self._token:
            sent["Authorization"] = f"Bearer {self._token}"
        answer = self.door.call(replace(request, headers=sent, auth=self._basic), wanted)
        if answer.status == 401 and not self._tried and \
                self._login(answer.headers.get("WWW-Authenticate", "")):
            return self._call(request, wanted)
        return answer

    def _login(self, challenge: str) -> bool:
        """Log in once (the first 401's challenge): a registry that refuses it, or answers
        401 again, is not asked again, nor is the helper run again."""
        self._tried = True
        host, name = split_repository(self.repo)
        creds = _credentials(host, self.limits.registry_s)
        if challenge.lower().startswith("basic"):
            self._basic = creds
            return creds is not None
        params = dict(_CHALLENGE.findall(challenge[:MAX_CHALLENGE]))
        realm = params.pop("realm", "")
        if not _may_send_to(realm, host):
            return False
        params["scope"] = f"repository:{name}:pull,push"
        answer = self.door.call(Request("GET", realm, MAX_TOKEN_ANSWER, "a token",
                                        params=params, auth=creds))
        self._token = _token(answer.body) if answer.status == 200 else ""
        return bool(self._token)

    def manifest(self, reference: str) -> bytes | None:
        """The OCI manifest `reference` names (exactly its bytes), or None when there is
        none."""
        answer = self._call(Request("GET", f"{self.base}/manifests/{reference}", MAX_MANIFEST,
                                    f"read {reference}", {"Accept": OCI_MANIFEST}),
                            frozenset({200, 404}))
        if answer.status == 404:
            return None
        self._ok(answer, f"read {reference}")
        return answer.body

    def digest(self, reference: str) -> str:
        """The manifest digest `reference` (a tag) names now: sha256 of the exact bytes."""
        answer = self._call(Request("GET", f"{self.base}/manifests/{reference}", MAX_MANIFEST,
                                    f"read {reference}", {"Accept": IMAGE_MANIFESTS}))
        self._ok(answer, f"read {reference}")
        return digest_of(answer.body)

    def blob(self, digest: str, limit: int = MAX_BLOB) -> bytes:
        """A blob's bytes, read no further than `limit` (`BlobRefused` past it, or when the
        bytes are not what the digest names)."""
        answer = self._call(Request("GET", f"{self.base}/blobs/{digest}", limit,
                                    f"read {digest}"))
        self._ok(answer, f"read {digest}")
        if digest_of(answer.body) != digest:
            raise BlobRefused(f"{self.repo}: blob {digest} is not what its digest names")
        return answer.body

    def put_blob(self, data: bytes) -> str:
        digest = digest_of(data)
        started = self._call(Request("POST", f"{self.base}/blobs/uploads/", MAX_ERROR_BODY,
                                     "start an upload"), frozenset({202}))
        self._ok(started, "start an upload", 202)
        where = self._upload_url(started.headers.get("Location", ""))
        where += ("&" if "?" in where else "?") + f"digest={digest}"
        self._ok(self._call(Request("PUT", where, MAX_ERROR_BODY, "upload a blob",
                                    {"Content-Type": "application/octet-stream"}, data),
                            frozenset({201})), "upload a blob", 201)
        return digest

    def _upload_url(self, location: str) -> str:
        """Where an upload continues: the registry's `Location`, on this registry or
        another HTTP(S) address; anything else is refused."""
        if location.startswith("/") and not location.startswith("//"):
            return self.base.split("/v2/")[0] + location
        if _may_send_to(location, split_repository(self.repo)[0]):
            return location
        raise RegistryUnavailable(f"{self.repo}: cannot start an upload (the registry "
                                  "named no usable place to send it)")

    def put_manifest(self, tag: str, data: bytes) -> None:
        self._ok(self._call(Request("PUT", f"{self.base}/manifests/{tag}", MAX_ERROR_BODY,
                                    f"write {tag}", {"Content-Type": OCI_MANIFEST}, data),
                            frozenset({201})), f"write {tag}", 201)

    def _ok(self, answer: Answer, what: str, status: int = 200) -> None:
        if answer.status != status:
            raise RegistryUnavailable(f"{self.repo}: cannot {what} (HTTP {answer.status})")
