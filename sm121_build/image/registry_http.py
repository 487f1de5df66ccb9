"""The one door for HTTP: every request this tool makes to a registry (token, manifest, blob,
upload) goes through `HttpDoor.call`, and nothing else in the package opens a network
connection (the engine's socket aside: `image/engine.py`; a scan test holds it so).

What a call promises, whatever the server does:

- **A deadline per call, not per read.**  The whole call — connecting, the TLS handshake,
  the status line and headers, every redirect and the body — ends within one deadline
  (`SM121_REGISTRY_TIMEOUT`).  Each read on the connection's socket waits only for what
  is left of it, so a server that sends one byte a second is cut at the deadline, not
  kept alive by each byte.  The floor on the rate follows: an answer is read whole within
  the deadline or not at all (at the largest answer, 4 MiB in 60 s, about 70 KB/s).
- **Bodies streamed and bounded for every method and status.**  An answer's body is read
  in windows and never past the bound the caller gives (an error answer's body: 64 KiB);
  a `Content-Length` above it is refused before a byte of the body is read.
- **One line for every failure**: `RegistryUnavailable` (no answer, no whole answer in
  time, a connection that broke: the registry's outage) or `BlobRefused` (an answer
  larger than it may be: the registry's fault or malice).
"""

from __future__ import annotations

import contextvars
import socket
import ssl
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import requests
import requests.adapters
import requests.auth
import urllib3.connection
import urllib3.connectionpool

from sm121_build.core.errors import RegistryUnavailable, Sm121Error
from sm121_build.core.limits import REGISTRY_VARIABLE

MAX_ERROR_BODY = 64 << 10  # what an answer that is not the one asked for may hold
_WINDOW = 64 << 10

# The monotonic time the current call must end by (one call at a time per thread).
_DEADLINE: contextvars.ContextVar[float] = contextvars.ContextVar("registry_deadline",
                                                                 default=0.0)


class BlobRefused(Sm121Error):
    """A registry's answer that is not what was asked for: larger than it may be, or not
    what its digest names (the registry's fault or malice, not an outage)."""


def _left() -> float:
    """Seconds left of the current call's deadline; a timeout when none is."""
    deadline = _DEADLINE.get()
    left = deadline - time.monotonic() if deadline else 0.0
    if left <= 0:
        raise TimeoutError("the registry call's deadline passed")
    return left


class _DeadlineSocket(socket.socket):
    """A plain socket whose every read waits only for what is left of the call's deadline."""

    __slots__ = ()

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        self.settimeout(_left())
        return super().recv_into(buffer, nbytes, flags)

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        self.settimeout(_left())
        return super().recv(bufsize, flags)


class _DeadlineTls(ssl.SSLSocket):
    """The same for a TLS socket (its reads: `recv_into`, `recv`, `read`)."""

    def recv_into(self, buffer: Any, nbytes: int | None = None, flags: int = 0) -> int:
        self.settimeout(_left())
        return super().recv_into(buffer, nbytes, flags)

    def recv(self, buflen: int = 1024, flags: int = 0) -> bytes:
        self.settimeout(_left())
        return super().recv(buflen, flags)

    def read(self, len: int = 1024, buffer: Any = None) -> Any:
        self.settimeout(_left())
        return super().read(len, buffer)


def _bind_deadline(sock: object) -> None:
    """Make a freshly connected socket keep the call's deadline on every read (a socket of
    another kind, as a proxy tunnel's TLS-in-TLS, keeps the per-read timeout)."""
    if type(sock) is socket.socket:
        sock.__class__ = _DeadlineSocket
    elif type(sock) is ssl.SSLSocket:
        sock.__class__ = _DeadlineTls


class _HttpConnection(urllib3.connection.HTTPConnection):
    def connect(self) -> None:
        super().connect()
        _bind_deadline(self.sock)


class _HttpsConnection(urllib3.connection.HTTPSConnection):
    def connect(self) -> None:
        super().connect()
        _bind_deadline(self.sock)


class _HttpPool(urllib3.connectionpool.HTTPConnectionPool):
    ConnectionCls = _HttpConnection


class _HttpsPool(urllib3.connectionpool.HTTPSConnectionPool):
    ConnectionCls = _HttpsConnection


class _DeadlineAdapter(requests.adapters.HTTPAdapter):
    """requests' adapter, its connections made by the classes above (direct or by proxy)."""

    _POOLS: Mapping[str, type[urllib3.connectionpool.HTTPConnectionPool]] = {
        "http": _HttpPool, "https": _HttpsPool}

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = dict(self._POOLS)

    def proxy_manager_for(self, proxy: str, **kwargs: Any) -> Any:
        manager = super().proxy_manager_for(proxy, **kwargs)
        manager.pool_classes_by_scheme = dict(self._POOLS)
        return manager


@dataclass(frozen=True)
class Answer:
    """A registry's whole answer: its status, headers (the last hop's) and bounded body."""

    status: int
    headers: Mapping[str, str]
    body: bytes


@dataclass(frozen=True)
class Request:
    """One request: what is asked, of what, and how much of an answer may come back."""

    method: str
    url: str
    limit: int  # the most bytes the body of a wanted answer may hold
    what: str  # says what is asked, in messages
    headers: Mapping[str, str] | None = None
    data: bytes | None = None
    params: Mapping[str, str] | None = None
    auth: tuple[str, str] | None = None


# The monotonic time a whole check (a list and every blob it names) must end by, when one
# is under way (`HttpDoor.budget`); 0: none.
_BUDGET: contextvars.ContextVar[float] = contextvars.ContextVar("registry_budget",
                                                               default=0.0)


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    ends = time.monotonic() + seconds
    budget = _BUDGET.get()
    token = _DEADLINE.set(min(ends, budget) if budget else ends)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


class HttpDoor:
    """A connection pool to registries whose every call ends within `seconds`."""

    def __init__(self, seconds: float, label: str) -> None:
        self.seconds = seconds
        self.label = label  # names the registry in messages
        self._session = requests.Session()
        adapter = _DeadlineAdapter()
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)

    @contextmanager
    def budget(self) -> Iterator[None]:
        """A check made of many calls (a signature list and each blob it names) ends within
        one limit in all, not one for each call: whoever can push beside an image cannot
        make its check last 64 limits.  A call begun after it is spent fails at once."""
        if _BUDGET.get():
            yield
            return
        token = _BUDGET.set(time.monotonic() + self.seconds)
        try:
            yield
        finally:
            _BUDGET.reset(token)

    def call(self, request: Request, wanted: frozenset[int] = frozenset({200})) -> Answer:
        """`request`'s answer, read whole within the deadline: a status in `wanted` with a
        body of at most `request.limit` bytes, any other with at most 64 KiB of it."""
        late = RegistryUnavailable(f"{self.label}: no whole answer to {request.what} in "
                                   f"{self.seconds:g} s (set {REGISTRY_VARIABLE} to wait "
                                   "longer)")
        spent = _BUDGET.get()
        if spent and time.monotonic() >= spent:  # a check whose one limit is spent
            raise late
        with _deadline(self.seconds):
            try:
                response = self._session.request(
                    request.method, request.url, headers=dict(request.headers or {}),
                    data=request.data, params=dict(request.params or {}), auth=_utf8(request.auth),
                    timeout=(self.seconds, self.seconds), allow_redirects=True, stream=True)
            except (requests.exceptions.Timeout, TimeoutError):
                raise late from None
            except requests.exceptions.RequestException as exc:
                if _refused(exc):
                    raise RegistryUnavailable(f"{self.label}: {request.what}: no connection "
                                              "(refused, or a host no name resolves to)"
                                              ) from None
                if _timed_out(exc):
                    raise late from None
                raise RegistryUnavailable(f"{self.label}: {request.what}: "
                                          f"{type(exc).__name__}") from None
            limit = request.limit if response.status_code in wanted else MAX_ERROR_BODY
            with response:
                body = _body(response, limit, f"{self.label}: {request.what}", late)
                return Answer(response.status_code, dict(response.headers), body)


def _utf8(auth: tuple[str, str] | None) -> requests.auth.HTTPBasicAuth | None:
    """A user and password as the bytes Basic auth carries: UTF-8, as Docker sends them
    (requests would encode a `str` as Latin-1, and raise on anything outside it); a lone
    surrogate a helper's JSON may hold is sent as `?`, a login the registry refuses."""
    return None if auth is None else requests.auth.HTTPBasicAuth(
        auth[0].encode(errors="replace"), auth[1].encode(errors="replace"))


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """A requests/urllib3 error and what it wraps (its first argument, its reason, its
    context), each once."""
    seen: set[int] = set()
    item: BaseException | None = exc
    while item is not None and id(item) not in seen:
        seen.add(id(item))
        yield item
        nested = item.args[0] if item.args and isinstance(item.args[0],
                                                          BaseException) else None
        reason = getattr(item, "reason", None)
        item = nested or (reason if isinstance(reason, BaseException) else None) or \
            item.__context__


def _refused(exc: BaseException) -> bool:
    """Whether the connection could not be made at all (refused, no such host): urllib3's
    NewConnectionError is a subclass of its connect timeout, but no wait would help."""
    return any(isinstance(item, (urllib3.exceptions.NewConnectionError,
                                 ConnectionRefusedError)) for item in _chain(exc))


def _timed_out(exc: BaseException) -> bool:
    """Whether a requests/urllib3 error is, somewhere in its chain, a timeout."""
    return any(isinstance(item, (TimeoutError, requests.exceptions.Timeout,
                                 urllib3.exceptions.TimeoutError)) for item in _chain(exc))


def _body(response: requests.Response, limit: int, what: str,
          late: RegistryUnavailable) -> bytes:
    """A streamed answer's body, read in windows and never past `limit` bytes."""
    declared = response.headers.get("Content-Length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BlobRefused(f"{what}: an answer of {int(declared)} bytes, above the {limit} "
                          "it may be")
    parts: list[bytes] = []
    got = 0
    try:
        for chunk in response.iter_content(_WINDOW):
            got += len(chunk)
            if got > limit:
                raise BlobRefused(f"{what}: an answer above the {limit} bytes it may be")
            parts.append(chunk)
    except requests.exceptions.RequestException as exc:
        if _timed_out(exc):
            raise late from None
        raise RegistryUnavailable(f"{what}: {type(exc).__name__}") from None
    except TimeoutError:
        raise late from None
    return b"".join(parts)
