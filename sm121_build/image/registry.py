"""A registry's OCI distribution API, for what the engine cannot do: read and write the
signature manifests (`image/cosign.py`) beside a kernels image.  Images themselves are still
pushed and pulled by the engine.

Plain HTTP for a loopback registry (as the engine does), HTTPS with verification for any
other.  Credentials: the `auths` of ~/.docker/config.json (or $DOCKER_CONFIG), with the
registry's token flow; credential helpers are not asked.  Every request waits at most
SM121_REGISTRY_TIMEOUT for an answer.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import requests

from sm121_build.core.errors import RegistryUnavailable, Sm121Error
from sm121_build.core.inputs import read_input
from sm121_build.core.limits import REGISTRY_VARIABLE, Limits

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
# what a pushed image's manifest may be: the digest is of the bytes the registry serves
IMAGE_MANIFESTS = ", ".join([OCI_MANIFEST, "application/vnd.oci.image.index.v1+json",
                             "application/vnd.docker.distribution.manifest.v2+json",
                             "application/vnd.docker.distribution.manifest.list.v2+json"])
MAX_MANIFEST = 4 << 20
MAX_BLOB = 1 << 20  # a signature's payload or envelope


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


def _credentials(host: str) -> tuple[str, str] | None:
    folder = Path(os.environ.get("DOCKER_CONFIG") or Path.home() / ".docker")
    try:
        auths = json.loads(read_input(folder / "config.json", 1 << 20,
                                      "Docker's config.json")).get("auths") or {}
        encoded = (auths.get(host) or auths.get(f"https://{host}") or {}).get("auth")
        if not encoded:
            return None
        user, _, password = base64.b64decode(encoded).decode().partition(":")
    except (OSError, ValueError, AttributeError, UnicodeDecodeError, RecursionError,
            Sm121Error):
        return None
    return user, password


class BlobRefused(Sm121Error):
    """A registry's answer that is not what was asked for: larger than it may be, or not
    what its digest names (the registry's fault or malice, not an outage)."""


@dataclass
class Registry:
    """One repository of one registry."""

    repo: str  # host[:port]/name
    limits: Limits = field(default_factory=Limits.from_environment)
    _token: str = ""
    _basic: tuple[str, str] | None = None

    @property
    def base(self) -> str:
        host, name = split_repository(self.repo)
        return f"{'http' if _loopback(host) else 'https'}://{host}/v2/{name}"

    def _request(self, method: str, url: str, headers: dict[str, str] | None = None,
                 data: bytes | None = None, stream: bool = False) -> requests.Response:
        sent = dict(headers or {})
        if self._token:
            sent["Authorization"] = f"Bearer {self._token}"
        try:
            response = requests.request(method, url, headers=sent, data=data, auth=self._basic,
                                        timeout=self.limits.registry_s, allow_redirects=True,
                                        stream=stream)
            if response.status_code == 401 and not (self._token or self._basic):
                challenge = response.headers.get("WWW-Authenticate", "")
                response.close()
                if self._login(challenge):
                    return self._request(method, url, headers, data, stream)
        except requests.exceptions.Timeout:
            raise RegistryUnavailable(f"{self.repo}: no answer in {self.limits.registry_s:g} s "
                                      f"(set {REGISTRY_VARIABLE} to wait longer)") from None
        except requests.exceptions.RequestException as exc:
            raise RegistryUnavailable(f"{self.repo}: {type(exc).__name__}") from None
        return response

    def _login(self, challenge: str) -> bool:
        host, name = split_repository(self.repo)
        creds = _credentials(host)
        if challenge.lower().startswith("basic"):
            self._basic = creds
            return creds is not None
        params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
        realm = params.pop("realm", "")
        if not realm.startswith("https://") and not _loopback(host):
            return False
        params["scope"] = f"repository:{name}:pull,push"
        response = requests.get(realm, params=params, auth=creds,
                                timeout=self.limits.registry_s)
        if response.status_code != 200:
            return False
        answer = response.json()
        self._token = str(answer.get("token") or answer.get("access_token") or "")
        return bool(self._token)

    def manifest(self, reference: str) -> bytes | None:
        """The OCI manifest `reference` names (exactly its bytes), or None when there is
        none."""
        response = self._request("GET", f"{self.base}/manifests/{reference}",
                                 {"Accept": OCI_MANIFEST}, stream=True)
        if response.status_code == 404:
            response.close()
            return None
        self._ok(response, f"read {reference}")
        return self._body(response, MAX_MANIFEST, f"{self.repo}:{reference}: a manifest")

    def digest(self, reference: str) -> str:
        """The manifest digest `reference` (a tag) names now: sha256 of the exact bytes."""
        response = self._request("GET", f"{self.base}/manifests/{reference}",
                                 {"Accept": IMAGE_MANIFESTS}, stream=True)
        self._ok(response, f"read {reference}")
        return digest_of(self._body(response, MAX_MANIFEST,
                                    f"{self.repo}:{reference}: a manifest"))

    def blob(self, digest: str, limit: int = MAX_BLOB) -> bytes:
        """A blob's bytes, read no further than `limit` (`BlobRefused` past it, or when the
        bytes are not what the digest names)."""
        response = self._request("GET", f"{self.base}/blobs/{digest}", stream=True)
        self._ok(response, f"read {digest}")
        body = self._body(response, limit, f"{self.repo}: blob {digest}")
        if digest_of(body) != digest:
            raise BlobRefused(f"{self.repo}: blob {digest} is not what its digest names")
        return body

    def _body(self, response: requests.Response, limit: int, what: str) -> bytes:
        """A streamed answer's body, read in windows and never past `limit` bytes."""
        with response:
            declared = response.headers.get("Content-Length", "")
            if declared.isdigit() and int(declared) > limit:
                raise BlobRefused(f"{what} of {declared} bytes, above the {limit} it may be")
            parts: list[bytes] = []
            got = 0
            try:
                for chunk in response.iter_content(64 << 10):
                    got += len(chunk)
                    if got > limit:
                        raise BlobRefused(f"{what} above the {limit} bytes it may be")
                    parts.append(chunk)
            except requests.exceptions.RequestException as exc:
                raise RegistryUnavailable(f"{what}: {type(exc).__name__}") from None
            return b"".join(parts)

    def put_blob(self, data: bytes) -> str:
        digest = digest_of(data)
        started = self._request("POST", f"{self.base}/blobs/uploads/")
        self._ok(started, "start an upload", 202)
        where = started.headers.get("Location", "")
        if where.startswith("/"):
            where = self.base.split("/v2/")[0] + where
        where += ("&" if "?" in where else "?") + f"digest={digest}"
        self._ok(self._request("PUT", where, {"Content-Type": "application/octet-stream"},
                               data), "upload a blob", 201)
        return digest

    def put_manifest(self, tag: str, data: bytes) -> None:
        self._ok(self._request("PUT", f"{self.base}/manifests/{tag}",
                               {"Content-Type": OCI_MANIFEST}, data), f"write {tag}", 201)

    def _ok(self, response: requests.Response, what: str, status: int = 200) -> None:
        if response.status_code != status:
            raise RegistryUnavailable(f"{self.repo}: cannot {what} (HTTP "
                                      f"{response.status_code})")
