"""FAKE at the engine boundary: a unix-socket relay in front of the real Docker socket that
"loses the engine" on cue: once a request whose first line holds `cut_at` goes through, it
closes every connection and refuses new ones, as a daemon that died (or a restarted Docker
Desktop) would.  Everything before the cut is the real engine's answer."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from devkit.relay import PASS, STOP, Relay


class EngineProxy(Relay):
    def __init__(self, upstream: str, cut_at: bytes) -> None:
        self.upstream = upstream
        self.cut_at = cut_at
        self.folder = Path(tempfile.mkdtemp(prefix="sm121-engine-proxy-"))
        self.path = self.folder / "docker.sock"
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(self.path))
        super().__init__(server)
        self.cut = self.refusing

    @property
    def host(self) -> str:
        return f"unix://{self.path}"

    def connect_upstream(self) -> socket.socket:
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        upstream.connect(self.upstream)
        return upstream

    def on_request(self, first_line: bytes) -> str:
        if self.cut_at in first_line:
            self.cut.set()
            self.close_all()
            return STOP
        return PASS

    def close(self) -> None:
        self.cut.set()
        super().close()
        self.path.unlink(missing_ok=True)
        os.rmdir(self.folder)


@contextmanager
def engine_proxy(cut_at: bytes, upstream: str = "/var/run/docker.sock") -> Iterator[EngineProxy]:
    proxy = EngineProxy(upstream, cut_at)
    threading.Thread(target=proxy.serve, daemon=True).start()
    try:
        yield proxy
    finally:
        proxy.close()
