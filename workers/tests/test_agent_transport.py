"""The agent's HTTP transport keeps connections alive (issue #12), safely.

Real sockets against a local `http.server` speaking HTTP/1.1; no Django.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from workers.agent import transport as transport_module
from workers.agent.protocol import TransportError
from workers.agent.transport import HttpTransport


class _KeepAlive(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Per server (set by _serve): how each answer ends.
    close_after_answer = False  # drop the connection without saying so (an idle timeout)
    body_bytes = 0  # pad the answer to this size
    seen: list[tuple[int, str]]  # (client port, path)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        request = json.loads(self.rfile.read(length))
        self.seen.append((self.client_address[1], self.path))
        payload: dict[str, Any] = {"echo": request}
        if self.body_bytes:
            payload["pad"] = "x" * self.body_bytes
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if self.close_after_answer:
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _serve(**options: Any) -> tuple[http.server.ThreadingHTTPServer, list[tuple[int, str]]]:
    seen: list[tuple[int, str]] = []
    handler = type("Handler", (_KeepAlive,), {**options, "seen": seen})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


@pytest.fixture
def served() -> Iterator[Any]:
    servers: list[http.server.ThreadingHTTPServer] = []
    transports: list[HttpTransport] = []

    def start(**options: Any) -> tuple[HttpTransport, list[tuple[int, str]]]:
        server, seen = _serve(**options)
        servers.append(server)
        transports.append(HttpTransport(f"http://127.0.0.1:{server.server_address[1]}/prefix"))
        return transports[-1], seen

    yield start
    for transport in transports:
        transport.close()
    for server in servers:
        server.shutdown()
        server.server_close()


def test_one_connection_carries_many_requests(served: Any) -> None:
    transport, seen = served()
    for index in range(5):
        response = transport.post("/api/v1/worker/pull", {"n": index}, token="t" * 43)
        assert (response.status, response.body["echo"]) == (200, {"n": index})
    assert transport.connections_opened == 1
    assert len({port for port, _ in seen}) == 1
    assert {path for _, path in seen} == {"/prefix/api/v1/worker/pull"}


def test_a_connection_the_server_closed_is_replaced_and_the_request_sent_once(
    served: Any,
) -> None:
    transport, seen = served(close_after_answer=True)
    for index in range(3):
        response = transport.post("/x", {"n": index}, token="t" * 43)
        assert response.body["echo"] == {"n": index}
    # Each reuse found the connection closed, so each request went once more
    # on a new one; the server saw every request exactly once.
    assert [path for _, path in seen] == ["/prefix/x"] * 3
    assert transport.connections_opened == 3


def test_an_idle_connection_is_not_reused_after_the_reuse_window(
    served: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    transport, seen = served()
    transport.post("/x", {}, token="t" * 43)
    monkeypatch.setattr(transport_module, "IDLE_REUSE_S", 0.0)
    transport.post("/x", {}, token="t" * 43)
    assert transport.connections_opened == 2
    assert len({port for port, _ in seen}) == 2


def test_concurrent_callers_each_get_a_connection(served: Any) -> None:
    transport, seen = served()
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            barrier.wait()
            for _ in range(5):
                assert transport.post("/x", {"a": 1}, token="t" * 43).status == 200
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert errors == []
    assert len(seen) == 20
    assert transport.connections_opened <= 4


def test_an_oversized_answer_is_not_parsed_and_its_connection_not_reused(
    served: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(transport_module, "_MAX_RESPONSE_BYTES", 1000)
    transport, _ = served(body_bytes=5000)
    response = transport.post("/x", {}, token="t" * 43)
    assert (response.status, response.body) == (200, {})
    transport.post("/x", {}, token="t" * 43)
    assert transport.connections_opened == 2


def test_nothing_listening_is_a_transport_error() -> None:
    server, _ = _serve()
    port = server.server_address[1]
    server.shutdown()
    server.server_close()
    with pytest.raises(TransportError):
        HttpTransport(f"http://127.0.0.1:{port}").post("/x", {}, token="t" * 43)


def test_an_answer_cut_off_mid_body_leaves_no_socket_open() -> None:
    # The server answers `Connection: close` (the connection hands its socket
    # to the answer), sends part of the body and resets. The request is a
    # transport error, and its socket is closed right then — not left open
    # for as long as the error (whose context holds the answer) lives, then
    # to the garbage collector in whatever thread (a ResourceWarning, seen in
    # the suite after a 413).
    import socket
    import struct
    import time
    from pathlib import Path

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer_and_reset() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(
            b"HTTP/1.1 413 Request Entity Too Large\r\nConnection: close\r\n"
            b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"error"'
        )
        time.sleep(0.2)  # the client waits in its read of the body
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()  # RST: the rest of the body never comes

    def open_fds() -> int:
        return sum(1 for _ in Path("/proc/self/fd").iterdir())

    server = threading.Thread(target=answer_and_reset)
    server.start()
    transport = HttpTransport(f"http://127.0.0.1:{port}")
    try:
        before = open_fds()
        with pytest.raises(TransportError) as failed:
            transport.post("/api/v1/worker/acks", {"acks": []}, token="t")
        server.join(10)
        assert failed.value.__context__ is not None  # the error that holds the answer
        assert open_fds() == before
    finally:
        listener.close()
