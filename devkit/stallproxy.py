"""FAKE at the registry boundary: a TCP relay in front of the loopback registry that passes
every request through until one asks for a blob, and then holds that connection open without
an answer, as a registry whose transfer stalls on a slow link would.  `stalled` is set when
that happens, so a test can press Ctrl-C in the middle of a pull.  Everything before the
stall is the real registry's answer."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from devkit.relay import HOLD, PASS, Relay


class StallProxy(Relay):
    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.stalled = threading.Event()
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        super().__init__(server)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.getsockname()[1]}"

    def connect_upstream(self) -> socket.socket:
        return socket.create_connection(self.upstream)

    def on_request(self, first_line: bytes) -> str:
        if b"/blobs/" in first_line:
            self.stalled.set()  # hold it: no answer, the connection stays open
            return HOLD
        return PASS


@contextmanager
def stalling(upstream: str) -> Iterator[StallProxy]:
    proxy = StallProxy(upstream)
    threading.Thread(target=proxy.serve, daemon=True).start()
    try:
        yield proxy
    finally:
        proxy.close()
