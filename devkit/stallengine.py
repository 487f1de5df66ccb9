"""FAKE at the engine boundary: a Docker engine on a unix socket that answers the calls a run
begins with (the version, the ping, an image's inspect, a container's creation) and then
stalls: every later request is read and held open without an answer, as an engine that hangs
mid-run does.  `stalled` is set at the first held request, so a test can press Ctrl-C while
the run waits on it and the clean-up (removing the container it made) meets the same
silence.  No real engine is needed."""

from __future__ import annotations

import json
import socket
import socketserver
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from pathlib import Path

API = "1.41"
IMAGE = {
    "Id": "sha256:" + "ab" * 32, "RepoTags": ["some/image:latest"], "RepoDigests": [],
    "Os": "linux", "Architecture": "amd64", "Created": "2026-01-01T00:00:00Z",
    "Config": {"Env": ["PATH=/usr/bin"], "Labels": {}, "Cmd": ["vllm", "serve"]},
    "RootFS": {"Type": "layers", "Layers": ["sha256:" + "1" * 64]},
}


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        return

    def _answer(self, status: int, body: object, content: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _hold(self) -> None:
        """No answer: the connection stays open until the engine closes."""
        self.server.stalled.set()
        self.server.stop.wait()
        self.close_connection = True

    def _route(self) -> None:
        path = self.path.split("?", 1)[0]
        if path.endswith("/_ping"):
            self._answer(200, b"OK", "text/plain")
        elif path.endswith("/version"):
            self._answer(200, {"ApiVersion": API, "Version": "20.10.0", "Os": "linux",
                               "Arch": "amd64"})
        elif self.command == "GET" and path.startswith(f"/v{API}/images/") \
                and path.endswith("/json") and path != f"/v{API}/images/json" \
                and not self.server.stalled.is_set():
            self._answer(200, IMAGE)
        elif self.command == "POST" and path == f"/v{API}/containers/create" \
                and not self.server.stalled.is_set():
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            self.server.created.set()
            self._answer(201, {"Id": "c0" * 32, "Warnings": []})
        else:
            self._hold()

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = _route


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str) -> None:
        super().__init__(path, _Handler)
        self.stalled = threading.Event()
        self.created = threading.Event()
        self.stop = threading.Event()

    def get_request(self) -> tuple[socket.socket, str]:
        conn, _ = self.socket.accept()
        return conn, "engine-client"


@contextmanager
def stalling_engine() -> Iterator[_Server]:
    """A stalling engine for the block: `DOCKER_HOST=unix://{server.server_address}`."""
    folder = Path(tempfile.mkdtemp(prefix="sm121-stall-engine-"))
    server = _Server(str(folder / "docker.sock"))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop.set()
        server.shutdown()
        server.server_close()
        (folder / "docker.sock").unlink(missing_ok=True)
        folder.rmdir()


def host(server: _Server) -> str:
    """The DOCKER_HOST value that names `server`."""
    return f"unix://{server.server_address}"
