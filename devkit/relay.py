"""A socket relay for the FAKEs at the engine and registry boundaries (engineproxy.py,
stallproxy.py): every accepted connection is joined to a new one upstream and bytes flow
both ways, except that the first line of each chunk a client sends is shown to `on_request`
first, which lets it through, or stops that connection there (the subclass decides what
then happens to it)."""

from __future__ import annotations

import socket
import threading
from contextlib import suppress

PASS, STOP, HOLD = "pass", "stop", "hold"  # HOLD: stop relaying but keep both ends open


class Relay:
    def __init__(self, server: socket.socket) -> None:
        self.server = server
        self.server.listen(16)
        self.open: list[socket.socket] = []
        self.lock = threading.Lock()
        self.refusing = threading.Event()  # set: new connections are closed at once

    def connect_upstream(self) -> socket.socket:
        raise NotImplementedError

    def on_request(self, first_line: bytes) -> str:
        return PASS

    def serve(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            if self.refusing.is_set():
                client.close()
                continue
            upstream = self.connect_upstream()
            with self.lock:
                self.open += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, True),
                             daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False),
                             daemon=True).start()

    def _pipe(self, source: socket.socket, dest: socket.socket, requests: bool) -> None:
        verdict = PASS
        try:
            while data := source.recv(65536):
                if requests:
                    verdict = self.on_request(data.split(b"\r\n", 1)[0])
                    if verdict != PASS:
                        return
                dest.sendall(data)
        except OSError:
            pass
        finally:
            if verdict != HOLD:
                for end in (source, dest):
                    with suppress(OSError):
                        end.shutdown(socket.SHUT_RDWR)

    def close_all(self) -> None:
        with self.lock:
            for end in self.open:
                with suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
                end.close()

    def close(self) -> None:
        self.server.close()
        self.close_all()
