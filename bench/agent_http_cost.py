"""The reference agent's HTTP client: CPU per kept-alive request (issue 12).

`workers.agent.transport.HttpTransport` POSTs `--requests` batched ACKs (two
terminal ACKs, the shape the agent sends most) over one kept-alive connection
to a minimal server in this process (a raw socket answering every request
with the same head as gunicorn's for `POST acks`), and prints the CPU time of
the client's thread per request (`time.thread_time`: the server's threads are
not counted), `--repeat` times. No database, no Django, no network.

    .venv/bin/python bench/agent_http_cost.py
    .venv/bin/python bench/agent_http_cost.py --tree /tmp/base-worktree  # another checkout's agent
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

BODY = b'{"results": [{"offer_id": "a", "status": 200}, {"offer_id": "b", "status": 200}]}'
ANSWER = (
    b"HTTP/1.1 200 OK\r\nServer: gunicorn\r\nDate: Fri, 04 Dec 2026 21:00:00 GMT\r\n"
    b"Connection: keep-alive\r\nContent-Type: application/json\r\nVary: Accept, Cookie\r\n"
    b"Allow: POST, OPTIONS\r\nX-Frame-Options: DENY\r\nContent-Length: "
    + str(len(BODY)).encode()
    + b"\r\nX-Content-Type-Options: nosniff\r\nReferrer-Policy: same-origin\r\n"
    b"Cross-Origin-Opener-Policy: same-origin\r\n\r\n" + BODY
)


def _serve(listener: socket.socket) -> None:
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_answer_all, args=(conn,), daemon=True).start()


def _answer_all(conn: socket.socket) -> None:
    """Answer each whole request (head + Content-Length bytes) with ANSWER."""
    buffer = b""
    while True:
        data = conn.recv(65536)
        if not data:
            conn.close()
            return
        buffer += data
        while b"\r\n\r\n" in buffer:
            head, _, rest = buffer.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            if len(rest) < length:
                break
            buffer = rest[length:]
            conn.sendall(ANSWER)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--tree", default=str(Path(__file__).resolve().parents[1]), help="checkout to import from"
    )
    args = parser.parse_args()
    sys.path.insert(0, args.tree)
    from workers.agent.transport import HttpTransport

    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_serve, args=(listener,), daemon=True).start()
    transport = HttpTransport(f"http://127.0.0.1:{listener.getsockname()[1]}")
    ack = {"phase": "succeeded", "lease_token": "t" * 43, "exit_code": 0, "output_tail": ""}
    body = {"acks": [{"offer_id": "a" * 64, **ack}, {"offer_id": "b" * 64, **ack}]}
    figures = []
    for _ in range(args.repeat):
        start = time.thread_time()
        for _ in range(args.requests):
            response = transport.post("/api/v1/worker/acks", body, token="s" * 43)
        figures.append((time.thread_time() - start) / args.requests * 1e3)
        assert response.status == 200 and len(response.body["results"]) == 2
        print(f"client CPU {figures[-1]:.3f} ms per request", flush=True)
    print(
        f"client CPU ms per request: min {min(figures):.3f} median "
        f"{statistics.median(figures):.3f}; connections opened {transport.connections_opened} "
        f"({args.tree})"
    )
    transport.close()


if __name__ == "__main__":
    main()
