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
from contextlib import contextmanager, suppress
from pathlib import Path


class EngineProxy:
    def __init__(self, upstream: str, cut_at: bytes) -> None:
        self.upstream = upstream
        self.cut_at = cut_at
        self.cut = threading.Event()
        self.folder = Path(tempfile.mkdtemp(prefix="sm121-engine-proxy-"))
        self.path = self.folder / "docker.sock"
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(self.path))
        self.server.listen(16)
        self.open: list[socket.socket] = []
        self.lock = threading.Lock()

    @property
    def host(self) -> str:
        return f"unix://{self.path}"

    def serve(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            if self.cut.is_set():
                client.close()
                continue
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.connect(self.upstream)
            with self.lock:
                self.open += [client, upstream]
            threading.Thread(target=self._relay, args=(client, upstream, True),
                             daemon=True).start()
            threading.Thread(target=self._relay, args=(upstream, client, False),
                             daemon=True).start()

    def _relay(self, source: socket.socket, dest: socket.socket, requests: bool) -> None:
        try:
            while data := source.recv(65536):
                if requests and self.cut_at in data.split(b"\r\n", 1)[0]:
                    self._cut_all()
                    return
                dest.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, dest):
                with suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)

    def _cut_all(self) -> None:
        self.cut.set()
        with self.lock:
            for end in self.open:
                with suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
                end.close()

    def close(self) -> None:
        self.server.close()
        self._cut_all()
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
