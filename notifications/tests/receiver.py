"""A real webhook receiver for the tests: an HTTP server thread on loopback.

It verifies every request's signature with the subscription's secret (as a
receiver must) and records what arrived; the answers it gives are scripted.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from notifications.signing import SIGNATURE_HEADER, signature_verify


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    signature_ok: bool

    @property
    def json(self) -> dict[str, Any]:
        return json.loads(self.body)


@dataclass
class Receiver:
    url: str
    secret: str = ""
    answers: list[int] = field(default_factory=list)  # popped per request; then 200
    received: list[Received] = field(default_factory=list)

    def events(self) -> list[str]:
        return [r.json["event"] for r in self.received]


def serve() -> Iterator[Receiver]:
    receiver = Receiver(url="")
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            body = self.rfile.read(length)
            ok = signature_verify(
                secret=receiver.secret, header=self.headers.get(SIGNATURE_HEADER, ""), body=body
            )
            with lock:
                receiver.received.append(Received(self.path, dict(self.headers), body, ok))
                status = receiver.answers.pop(0) if receiver.answers else 200
            self.send_response(status)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}/hooks/qinglong"
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
