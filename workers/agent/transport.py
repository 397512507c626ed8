"""JSON over HTTP(S) with http.client: the agent's only dependency is the stdlib.

Every request carries a Bearer secret (the Worker credential or the Session
token), so the transport never lets it travel anywhere but the configured
control plane:

- redirects are never followed (http.client does not follow them); a 3xx
  comes back as a plain non-2xx Response and the agent treats it as a
  refusal (e.g. a 3xx on `starting`: run nothing);
- plain `http://` is accepted only for a loopback host (the embedded default,
  `./scripts/dev`); anything else must be `https://`.

Connections are kept alive (issue #12): a few idle connections are kept and
reused by whichever thread posts next (the heartbeat loop, the runners, the
output senders), so a pull or an ACK costs one request, not a TCP (and TLS)
handshake too. An idle connection is reused only while it is fresher than
`IDLE_REUSE_S`, below the web server's keep-alive timeout (gunicorn's default
`QL_WEB_KEEPALIVE_S` is 5 s), so the server seldom closes one under us; when
it did (the request found the connection closed before any answer), the
request goes once more on a new connection. Every Worker API call may be
repeated (an ACK of the same phase is a no-op, a pull is replayed by its pull
id, a heartbeat is idempotent, a second Session open simply fences the
first), and a request whose answer was cut off on a fresh connection is never
repeated here.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import ssl
import threading
import time
import urllib.parse
import weakref
from collections.abc import Mapping
from typing import Any, Final

from workers.agent.protocol import Response, TransportError

__all__ = ["IDLE_REUSE_S", "MAX_IDLE_CONNECTIONS", "HttpTransport", "is_loopback_host"]

# Bigger than any Worker API answer (a pull of a few offers); a larger body is
# not ours and is not parsed.
_MAX_RESPONSE_BYTES = 4 * 1024 * 1024
# Reuse an idle connection only this soon after its last answer (the server
# closes idle ones after its keep-alive timeout, 5 s by default).
IDLE_REUSE_S: Final = 2.0
# At most this many idle connections are kept (one per concurrent caller, roughly).
MAX_IDLE_CONNECTIONS: Final = 16
# What a reused connection the server already closed looks like: nothing was answered.
_STALE: Final = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


def is_loopback_host(host: str) -> bool:
    """localhost, 127.0.0.0/8 or ::1: traffic that never leaves the box."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class HttpTransport:
    def __init__(self, base_url: str, *, timeout_s: float = 15.0) -> None:
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("the control plane URL must be http:// or https://")
        if parts.scheme == "http" and not is_loopback_host(parts.hostname):
            # A Bearer secret in clear text over a network: refuse, don't warn.
            raise ValueError("a non-loopback control plane URL must be https://")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        self._prefix = parts.path.rstrip("/")
        self._context = ssl.create_default_context() if self._https else None
        self._idle: list[tuple[http.client.HTTPConnection, float]] = []
        self._lock = threading.Lock()
        self.connections_opened = 0  # for tests and diagnostics
        # A transport dropped without close() still closes its idle sockets.
        weakref.finalize(self, _close_all, self._idle)

    # -- connections ---------------------------------------------------------

    def _connect(self) -> http.client.HTTPConnection:
        self.connections_opened += 1
        if self._https:
            return http.client.HTTPSConnection(
                self._host, self._port, timeout=self.timeout_s, context=self._context
            )
        return http.client.HTTPConnection(self._host, self._port, timeout=self.timeout_s)

    def _take(self) -> tuple[http.client.HTTPConnection, bool]:
        """A fresh-enough idle connection (reused=True), else a new one."""
        now = time.monotonic()
        stale: list[http.client.HTTPConnection] = []
        found: http.client.HTTPConnection | None = None
        with self._lock:
            while self._idle:
                connection, last_used = self._idle.pop()  # the most recent first
                if now - last_used < IDLE_REUSE_S:
                    found = connection
                    break
                stale.append(connection)
        for connection in stale:
            connection.close()
        if found is not None:
            return found, True
        return self._connect(), False

    def _give_back(self, connection: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < MAX_IDLE_CONNECTIONS:
                self._idle.append((connection, time.monotonic()))
                return
        connection.close()

    def close(self) -> None:
        """Close every idle connection (a connection in use closes when its call ends)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for connection, _ in idle:
            connection.close()

    # -- requests --------------------------------------------------------------

    def post(self, path: str, body: Mapping[str, Any], *, token: str) -> Response:
        # UTF-8 as is: \uXXXX escapes would blow a legal 64 KiB output tail
        # past the server's body cap.
        data = json.dumps(body, ensure_ascii=False).encode("utf-8")
        headers = {
            "Authorization": f"Bearer {token}",
            "Content-Type": "application/json",
            "Accept": "application/json",
        }
        while True:
            connection, reused = self._take()
            reply: http.client.HTTPResponse | None = None
            try:
                connection.request("POST", self._prefix + path, body=data, headers=headers)
                reply = connection.getresponse()
                raw = reply.read(_MAX_RESPONSE_BYTES)
            except _STALE as err:
                _drop(connection, reply)
                if reused:
                    # The server had closed this idle connection: nothing was
                    # answered, so the request goes once more on a new one.
                    continue
                raise TransportError(type(err).__name__) from None
            except (OSError, http.client.HTTPException) as err:
                _drop(connection, reply)
                # No status: the request may or may not have arrived.
                raise TransportError(type(err).__name__) from None
            if reply.isclosed() and not reply.will_close:
                self._give_back(connection)
            else:
                # More than we read (an oversized body) or the server's
                # "Connection: close": this connection carries nothing else.
                _drop(connection, reply)
            if 300 <= reply.status < 400:
                # A redirect's body is not the control plane's answer.
                return Response(reply.status, {})
            return Response(reply.status, _parse(raw))


def _drop(connection: http.client.HTTPConnection, reply: http.client.HTTPResponse | None) -> None:
    """Close a connection that carries nothing more, and the answer read on it.

    After a `Connection: close` answer the connection has handed its socket
    to the answer: closing the connection alone leaves the socket open until
    the garbage collector finds the answer, in whatever thread that happens
    (a ResourceWarning, seen in the suite after a 413)."""
    if reply is not None:
        reply.close()
    connection.close()


def _close_all(idle: list[tuple[http.client.HTTPConnection, float]]) -> None:
    for connection, _ in idle:
        connection.close()
    idle.clear()


def _parse(raw: bytes) -> Mapping[str, Any]:
    try:
        value = json.loads(raw.decode("utf-8")) if raw else {}
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}
