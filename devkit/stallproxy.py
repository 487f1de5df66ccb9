"""FAKE at the registry boundary: a TCP relay in front of the loopback registry that passes
every request through until one asks for a blob, and then holds that connection open without
an answer, as a registry whose transfer stalls on a slow link would.  `stalled` is set when
that happens, so a test can press Ctrl-C in the middle of a pull.  Everything before the
stall is the real registry's answer."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress


class StallProxy:
    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.stalled = threading.Event()
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(16)
        self.open: list[socket.socket] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.getsockname()[1]}"

    def serve(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            self.open += [client, upstream]
            threading.Thread(target=self._requests, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._relay, args=(upstream, client), daemon=True).start()

    def _requests(self, client: socket.socket, upstream: socket.socket) -> None:
        with suppress(OSError):
            while data := client.recv(65536):
                if b"/blobs/" in data.split(b"\r\n", 1)[0]:
                    self.stalled.set()  # hold it: no answer, the connection stays open
                    return
                upstream.sendall(data)

    @staticmethod
    def _relay(source: socket.socket, dest: socket.socket) -> None:
        with suppress(OSError):
            while data := source.recv(65536):
                dest.sendall(data)

    def close(self) -> None:
        self.server.close()
        for sock in self.open:
            with suppress(OSError):
                sock.close()


@contextmanager
def stalling(upstream: str) -> Iterator[StallProxy]:
    proxy = StallProxy(upstream)
    threading.Thread(target=proxy.serve, daemon=True).start()
    try:
        yield proxy
    finally:
        proxy.close()
