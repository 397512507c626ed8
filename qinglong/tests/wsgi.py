"""A JSON request through a WSGI application, called as a server calls it.

Django's test client leaves out what a server's call brings (the
`request_started`/`request_finished` signals, and with them the connection
checks around each request); these helpers call the application itself. The
one builder of such a request for the tests and for the bench
(bench/_measure.py imports it; nothing here imports bench/ or Django).
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

WsgiApp = Callable[[dict[str, Any], Any], Iterable[bytes]]


def json_environ(
    method: str,
    path: str,
    body: Any,
    headers: Mapping[str, str],
    *,
    host: str = "testserver",
    port: int = 80,
) -> dict[str, Any]:
    """The WSGI environ of `method path` with `body` as JSON and the extra
    `headers` (WSGI `HTTP_*` keys), addressed to `host`:`port`."""
    raw = json.dumps(body).encode()
    return {
        "REQUEST_METHOD": method,
        "SCRIPT_NAME": "",
        "PATH_INFO": path,
        "QUERY_STRING": "",
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(len(raw)),
        "SERVER_NAME": host,
        "SERVER_PORT": str(port),
        "SERVER_PROTOCOL": "HTTP/1.1",
        "REMOTE_ADDR": "127.0.0.1",
        "HTTP_HOST": host if port == 80 else f"{host}:{port}",
        **headers,
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(raw),
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": True,
        "wsgi.run_once": False,
    }


def call_json(app: WsgiApp, environ: dict[str, Any]) -> tuple[int, Any]:
    """Calls `app` with `environ`, closes its answer as a server does, and
    returns the status code and the decoded JSON body (None when empty)."""
    status: list[str] = []

    def start_response(line: str, headers: Any, exc_info: Any = None) -> None:
        status.append(line)

    result = app(environ, start_response)
    try:
        payload = b"".join(result)
    finally:
        close = getattr(result, "close", None)
        if close is not None:
            close()
    return int(status[0].split()[0]), json.loads(payload) if payload else None
