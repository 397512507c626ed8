"""JSON over HTTP/1.1(S) on a plain socket: the agent's only dependency is the stdlib.

Every request carries a Bearer secret (the Worker credential or the Session
token), so the transport never lets it travel anywhere but the configured
control plane:

- redirects are never followed; a 3xx comes back as a plain non-2xx Response
  and the agent treats it as a refusal (e.g. a 3xx on `starting`: run
  nothing);
- plain `http://` is accepted only for a loopback host (the embedded default,
  `./scripts/dev`); anything else must be `https://` (TLS by `ssl`'s default
  context: the system's CAs, or the file named by `SSL_CERT_FILE`; the host
  name is checked).

The client is a small HTTP/1.1 one of its own (issue #12): the agent only
ever POSTs a JSON body and reads a JSON answer, and `http.client` spent about
twice the CPU per request on what it does not need here (its header objects,
the `email` parser for the answer's headers, two sends). One request is one
`sendall`; the answer's status line and headers are read line by line
(bounded like `http.client`'s: 64 KiB a line, 100 headers) and only
`Content-Length`, `Transfer-Encoding` and `Connection` are interpreted; an
answer with neither length nor chunks is read to its close. Anything
malformed is a `TransportError` naming what (`BadStatusLine`,
`IncompleteRead`, ...), and its connection is closed. The client refuses
what RFC 9112 lets it refuse rather than guess how the answer is framed
(reviewer R5): a header line continued on the next (obs-fold, a line that
starts with a space or a tab) is `BadHeaderLine`; a `Transfer-Encoding`
(all of its header lines together) other than exactly `chunked`, any case —
the request sends no `TE`, so chunked is the only coding a server may apply
(RFC 9110 §10.1.4) — or one beside a `Content-Length` is
`BadTransferEncoding`; the tokens of every `Connection` line count (`close`
in any of them closes); an HTTP/1.0 answer with a `Transfer-Encoding` is
read, and its connection closed (RFC 9112 §6.1).

Connections are kept alive (issue #12): a few idle connections are kept and
reused by whichever thread posts next (the heartbeat loop, the runners, the
output senders), so a pull or an ACK costs one request, not a TCP (and TLS)
handshake too. An idle connection is reused only while it is fresher than
`IDLE_REUSE_S`, below the web server's keep-alive timeout (gunicorn's default
`QL_WEB_KEEPALIVE_S` is 5 s), so the server seldom closes one under us; when
it did (the request found the connection closed before the first line of an
answer), the request goes once more on a new connection. Every Worker API
call may be repeated (an ACK of the same phase is a no-op, a pull is replayed
by its pull id, a heartbeat is idempotent, a second Session open simply
fences the first), and a request whose answer was cut off on a fresh
connection is never repeated here. Every socket operation has the
transport's timeout (`timeout_s`), and a whole request — looking the host
name up, connecting, the TLS handshake, sending, every byte of the answer,
the one resend included — has a deadline, `deadline_s`, twice the timeout by
default (one timeout for the server to answer, a long poll included, one for
the answer to arrive): a server that trickles its answer a byte at a time,
each within the timeout, still fails the request then, as a `TimeoutError`
like a silent one's (reviewer R5). The request is not sent again then: only
a reused connection that ended before the answer's first line is.

A new connection keeps that deadline before its first byte too (reviewer
S5), give or take the scheduler's slack:

- a literal IP address (the usual `127.0.0.1`) is never looked up; a host
  name is, by `getaddrinfo` (which has no timeout of its own) in a daemon
  thread that the request waits for no longer than its deadline allows. A
  resolver that does not answer fails the request then, as a
  `TimeoutError`; its lookup goes on in its thread until the resolver gives
  up, and the next connects wait for that one rather than start another
  (one lookup thread at most per transport). The addresses it answered
  serve new connections for `RESOLVED_REUSE_S` (10 s), and are forgotten
  when none of them takes a connection;
- the addresses are tried in turn, each connect within the timeout or what
  the deadline leaves, whichever is shorter: an address that does not
  answer costs one timeout, and however many there are, the connects end
  at the deadline (a `TimeoutError`);
- the TLS handshake runs non-blocking: each wait for the server within the
  timeout, the whole handshake within what the deadline leaves, so a
  server that trickles its handshake fails the request at the deadline like
  one that trickles its answer (a blocking handshake had the socket's
  timeout for all of it, on top of whatever the connect took).

A request on a reused connection does none of this.
"""

from __future__ import annotations

import io
import ipaddress
import json
import re
import select
import socket
import ssl
import threading
import time
import urllib.parse
import weakref
from collections.abc import Mapping
from typing import Any, Final

from workers.agent.protocol import Response, TransportError

__all__ = [
    "IDLE_REUSE_S",
    "MAX_IDLE_CONNECTIONS",
    "RESOLVED_REUSE_S",
    "HttpTransport",
    "is_loopback_host",
]

# Bigger than any Worker API answer (a pull of a few offers); a larger body is
# not ours and is not parsed.
_MAX_RESPONSE_BYTES = 4 * 1024 * 1024
# Reuse an idle connection only this soon after its last answer (the server
# closes idle ones after its keep-alive timeout, 5 s by default).
IDLE_REUSE_S: Final = 2.0
# At most this many idle connections are kept (one per concurrent caller, roughly).
MAX_IDLE_CONNECTIONS: Final = 16
# A host name's addresses serve new connections this long after its lookup
# (connections are reused, so a connect is rare; a lookup costs a thread).
RESOLVED_REUSE_S: Final = 10.0
# http.client's bounds on an answer's head.
_MAX_LINE: Final = 65536
_MAX_HEADERS: Final = 100
# What a reused connection the server already closed looks like: nothing was answered.
_STALE: Final = (ConnectionResetError, BrokenPipeError)
# No control character or space in a request target (http.client's rule).
_BAD_TARGET: Final = re.compile("[\x00-\x20\x7f]")
# A chunk size: hex digits only (RFC 9112 7.1), at most 64 bits of them.
_CHUNK_SIZE: Final = re.compile(rb"[0-9A-Fa-f]{1,16}")
_ENCODE: Final = json.JSONEncoder(ensure_ascii=False).encode


def is_loopback_host(host: str) -> bool:
    """localhost, 127.0.0.0/8 or ::1: traffic that never leaves the box."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Protocol(Exception):
    """The answer is not HTTP/1.x as we read it (its name is the error's)."""


class _Closed(Exception):
    """The connection ended before the first byte of an answer."""


# One of getaddrinfo's answers: family, type, proto, canonname, sockaddr.
_Address = tuple[socket.AddressFamily, socket.SocketKind, int, str, Any]


class _Lookup:
    """One name lookup in a daemon thread of its own: getaddrinfo has no
    timeout, so each caller waits for it no longer than its deadline allows,
    and a lookup that outlasts them is left to end in its thread."""

    __slots__ = ("addresses", "done", "ended", "error")

    def __init__(self, host: str, port: int) -> None:
        self.done = threading.Event()
        self.addresses: list[_Address] = []
        self.error: Exception | None = None
        self.ended = 0.0
        thread = threading.Thread(
            target=self._run, args=(host, port), name="agent-name-lookup", daemon=True
        )
        try:
            thread.start()
        except RuntimeError:  # no thread to be had: this lookup fails, the next is new
            self.error = OSError("no thread for the name lookup")
            self.done.set()

    def _run(self, host: str, port: int) -> None:
        try:
            self.addresses = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
        except Exception as err:  # noqa: BLE001  # the waiters raise it
            self.error = err
        finally:
            self.ended = time.monotonic()
            self.done.set()

    def reusable(self, now: float) -> bool:
        """Answered with addresses within RESOLVED_REUSE_S."""
        return (
            self.done.is_set()
            and self.error is None
            and bool(self.addresses)
            and now - self.ended < RESOLVED_REUSE_S
        )


class _Raw(io.RawIOBase):
    """A socket's reads, each within the transport's timeout and the
    request's deadline (`socket.makefile`'s reads have the timeout alone)."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        super().__init__()
        self.sock = sock
        self.timeout_s = timeout_s
        self.deadline = 0.0  # set by `arm` for each request
        self.lowered = sock.gettimeout() != timeout_s

    def readable(self) -> bool:
        return True

    def arm(self, deadline: float) -> None:
        """A new request on this connection: its deadline, and the timeout
        for its send (the whole timeout again, unless the deadline is nearer)."""
        self.deadline = deadline
        remaining = deadline - time.monotonic()
        if remaining < self.timeout_s:
            self._lower(remaining)
        elif self.lowered:
            self.sock.settimeout(self.timeout_s)
            self.lowered = False

    def _lower(self, remaining: float) -> None:
        """The next socket operation waits no longer than the deadline allows."""
        if remaining <= 0:
            raise TimeoutError("the request's deadline passed")
        self.sock.settimeout(remaining)
        self.lowered = True

    def readinto(self, buffer: Any) -> int:
        remaining = self.deadline - time.monotonic()
        if remaining < self.timeout_s:
            self._lower(remaining)
        return self.sock.recv_into(buffer)


class _Connection:
    __slots__ = ("raw", "reader", "sock")

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self.sock = sock
        self.raw = _Raw(sock, timeout_s)
        self.reader = io.BufferedReader(self.raw)

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


class _Answer:
    __slots__ = ("body", "reusable", "status")

    def __init__(self, status: int, body: bytes | None, reusable: bool) -> None:
        self.status = status
        self.body = body  # None: more than _MAX_RESPONSE_BYTES, not read
        self.reusable = reusable


class HttpTransport:
    def __init__(
        self, base_url: str, *, timeout_s: float = 15.0, deadline_s: float | None = None
    ) -> None:
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("the control plane URL must be http:// or https://")
        if parts.scheme == "http" and not is_loopback_host(parts.hostname):
            # A Bearer secret in clear text over a network: refuse, don't warn.
            raise ValueError("a non-loopback control plane URL must be https://")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        # The longest one request lasts, however its bytes trickle in.
        self.deadline_s = 2 * timeout_s if deadline_s is None else deadline_s
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._prefix = parts.path.rstrip("/")
        self._context = ssl.create_default_context() if self._https else None
        self._host_header = _host_header(self._host, parts.port, 443 if self._https else 80)
        # A literal IP address is never looked up; a name's latest lookup
        # (in flight, or done) is shared by every connect.
        self._literal = _literal_addresses(self._host, self._port)
        self._lookup: _Lookup | None = None
        self._idle: list[tuple[_Connection, float]] = []
        self._lock = threading.Lock()
        self.connections_opened = 0  # for tests and diagnostics
        # A transport dropped without close() still closes its idle sockets.
        weakref.finalize(self, _close_all, self._idle)

    # -- connections ---------------------------------------------------------

    def _connect(self, deadline: float) -> _Connection:
        """A new connection: the name looked up, each of its addresses tried
        in turn, the TLS handshake; none of it past the request's deadline."""
        self.connections_opened += 1
        sock = self._open(deadline)
        try:
            # Each request is one send: no Nagle delay waiting for an ACK.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._context is not None:
                sock = self._handshake(self._context, sock, deadline)
        except BaseException:
            sock.close()
            raise
        return _Connection(sock, self.timeout_s)

    def _open(self, deadline: float) -> socket.socket:
        """A TCP connection to one of the host's addresses, tried in order,
        each within the timeout or what the deadline leaves, whichever is
        shorter (`socket.create_connection` gave each the whole timeout, and
        its lookup none). An address whose socket cannot even be made (an
        IPv6 answer where IPv6 is off) is passed over like one that does not
        answer. None of them answering, that lookup is forgotten."""
        lookup = None if self._literal is not None else self._resolve(deadline)
        addresses = self._literal if lookup is None else lookup.addresses
        assert addresses is not None
        error: OSError | None = None
        for family, kind, proto, _, address in addresses:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the request's deadline passed")
            sock: socket.socket | None = None
            try:
                sock = socket.socket(family, kind, proto)
                sock.settimeout(min(self.timeout_s, remaining))
                sock.connect(address)
            except OSError as err:
                if sock is not None:
                    sock.close()
                error = err
                continue
            except BaseException:
                if sock is not None:
                    sock.close()
                raise
            return sock
        if lookup is not None:
            self._forget_lookup(lookup)
        if error is None:
            raise OSError("getaddrinfo returned no address")
        try:
            raise error  # the last address's, as create_connection does
        finally:
            error = None  # no reference cycle through this frame

    def _resolve(self, deadline: float) -> _Lookup:
        """The host name's lookup, answered with addresses: the latest if it
        answered within RESOLVED_REUSE_S, else a new one (or the one in
        flight), waited for no longer than the deadline allows."""
        with self._lock:
            lookup = self._lookup
            if lookup is None or (lookup.done.is_set() and not lookup.reusable(time.monotonic())):
                lookup = self._lookup = _Lookup(self._host, self._port)
        if not lookup.done.wait(max(0.0, deadline - time.monotonic())):
            raise TimeoutError("the name lookup outlasted the request's deadline")
        if lookup.error is not None:
            # A fresh exception per waiter: the shared one would gather each
            # waiter's frames (and the request in them) in its traceback.
            failed = lookup.error
            try:
                fresh = type(failed)(*failed.args)
            except Exception:  # noqa: BLE001  (an exception type of other arguments)
                fresh = OSError(str(failed))
            raise fresh from None
        return lookup

    def _forget_lookup(self, lookup: _Lookup) -> None:
        """Its addresses took no connection: the name is looked up anew (unless
        another caller started a newer lookup meanwhile)."""
        with self._lock:
            if self._lookup is lookup:
                self._lookup = None

    def _handshake(
        self, context: ssl.SSLContext, sock: socket.socket, deadline: float
    ) -> ssl.SSLSocket:
        """The TLS handshake, non-blocking: each wait for the server within
        the timeout, the whole within the deadline (a blocking handshake has
        the socket's timeout for all of it, whatever the connect left)."""
        tls = context.wrap_socket(sock, server_hostname=self._host, do_handshake_on_connect=False)
        try:
            tls.settimeout(0.0)
            poll = select.poll()
            poll.register(tls, select.POLLIN)
            while True:
                try:
                    tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    poll.modify(tls, select.POLLIN)
                except ssl.SSLWantWriteError:
                    poll.modify(tls, select.POLLOUT)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError("the request's deadline passed")
                if not poll.poll(min(self.timeout_s, remaining) * 1000):
                    raise TimeoutError("the TLS handshake timed out")
            tls.settimeout(self.timeout_s)
        except BaseException:
            tls.close()
            raise
        return tls

    def _take(self) -> tuple[_Connection | None, bool]:
        """A fresh-enough idle connection (reused=True), else None (connect one)."""
        now = time.monotonic()
        stale: list[_Connection] = []
        found: _Connection | None = None
        with self._lock:
            while self._idle:
                connection, last_used = self._idle.pop()  # the most recent first
                if now - last_used < IDLE_REUSE_S:
                    found = connection
                    break
                stale.append(connection)
        for connection in stale:
            connection.close()
        return found, found is not None

    def _give_back(self, connection: _Connection) -> None:
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
        target = self._prefix + path
        if _BAD_TARGET.search(target):
            raise TransportError("InvalidURL")
        # UTF-8 as is: \uXXXX escapes would blow a legal 64 KiB output tail
        # past the server's body cap.
        data = _ENCODE(body).encode("utf-8")
        secret = token.encode("latin-1")
        if b"\r" in secret or b"\n" in secret:
            raise ValueError("Invalid header value")
        request = b"".join(
            (
                b"POST ",
                target.encode("ascii"),
                b" HTTP/1.1\r\nHost: ",
                self._host_header,
                b"\r\nAccept-Encoding: identity\r\nAuthorization: Bearer ",
                secret,
                b"\r\nContent-Type: application/json\r\nAccept: application/json"
                b"\r\nContent-Length: ",
                str(len(data)).encode("ascii"),
                b"\r\n\r\n",
                data,
            )
        )
        deadline = time.monotonic() + self.deadline_s
        while True:
            connection, reused = self._take()
            try:
                if connection is None:
                    connection = self._connect(deadline)
                connection.raw.arm(deadline)
                connection.sock.sendall(request)
                answer = _read_answer(connection.reader)
            except (_Closed, *_STALE) as err:
                if connection is not None:
                    connection.close()
                if reused:
                    # The server had closed this idle connection: nothing was
                    # answered, so the request goes once more on a new one.
                    continue
                name = "RemoteDisconnected" if isinstance(err, _Closed) else type(err).__name__
                raise TransportError(name) from None
            except (OSError, _Protocol, ValueError) as err:
                if connection is not None:
                    connection.close()
                # No status: the request may or may not have arrived.
                name = str(err) if isinstance(err, _Protocol) else type(err).__name__
                raise TransportError(name) from None
            if answer.reusable:
                self._give_back(connection)
            else:
                # Not read to its end (an oversized body) or the server's
                # "Connection: close": this connection carries nothing else.
                connection.close()
            if 300 <= answer.status < 400:
                # A redirect's body is not the control plane's answer.
                return Response(answer.status, {})
            return Response(answer.status, _parse(answer.body))


def _literal_addresses(host: str, port: int) -> list[_Address] | None:
    """A literal IP address's one address (parsed, never looked up), else None."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return None
    try:
        return socket.getaddrinfo(
            host, port, 0, socket.SOCK_STREAM, 0, socket.AI_NUMERICHOST | socket.AI_NUMERICSERV
        )
    except OSError:
        return None  # looked up at each connect then, and failing there as it does


def _host_header(host: str, port: int | None, default_port: int) -> bytes:
    """As http.client sends it: IPv6 in brackets, the port unless the scheme's own."""
    try:
        name = host.encode("ascii")
    except UnicodeEncodeError:
        name = host.encode("idna")
    if b":" in name:
        name = b"[" + name + b"]"
    if port is not None and port != default_port:
        name += b":%d" % port
    return name


def _read_line(reader: Any) -> bytes:
    line: bytes = reader.readline(_MAX_LINE + 1)
    if len(line) > _MAX_LINE:
        raise _Protocol("LineTooLong")
    return line


def _read_answer(reader: Any) -> _Answer:
    """One answer: its status, its body (None if over the cap) and whether the
    connection may carry another request. 1xx interim answers are skipped.

    Only an end or a reset before the answer's first byte is `_Closed` or
    `_STALE` (a reused connection the server had closed: the request goes
    once more); once a byte came, the request arrived, and a reset is a
    `_Protocol` error: the request is never sent again."""
    # Whether anything came is decided on the first byte: a reset after part
    # of the status line (`HTTP/1.1 20`) is an answer cut short, never a
    # connection the server had closed before it read the request.
    if not reader.peek(1):
        raise _Closed
    try:
        line = _read_line(reader)
        if not line.endswith(b"\n"):
            raise _Protocol("IncompleteRead")
        return _read_answer_from(reader, line)
    except _STALE as err:
        raise _Protocol(type(err).__name__) from None


def _read_answer_from(reader: Any, line: bytes) -> _Answer:
    """`_read_answer` once its first line came."""
    while True:
        version, _, rest = line.partition(b" ")
        code = rest[:3]
        if (
            version not in (b"HTTP/1.1", b"HTTP/1.0")
            or len(code) != 3
            or not code.isdigit()
            or rest[3:4] not in (b"", b" ", b"\r", b"\n")
        ):
            raise _Protocol("BadStatusLine")
        status = int(code)
        length: int | None = None
        codings: list[bytes] | None = None  # every Transfer-Encoding line's, in order
        connection: list[bytes] = []  # every Connection line's tokens
        for _ in range(_MAX_HEADERS + 1):
            header = _read_line(reader)
            if header in (b"\r\n", b"\n", b""):
                break
            if header[0] in b" \t":
                # obs-fold (RFC 9112 §5.2): a client may refuse it, and does.
                raise _Protocol("BadHeaderLine")
            name, colon, value = header.partition(b":")
            if not colon:
                continue  # http.client ignores such a line too
            name = name.strip().lower()
            if name == b"content-length":
                value = value.strip()
                if not value.isdigit() or (length is not None and int(value) != length):
                    raise _Protocol("BadContentLength")
                length = int(value)
            elif name == b"transfer-encoding":
                codings = (codings or []) + _tokens(value)
            elif name == b"connection":
                connection.extend(_tokens(value))
        else:
            raise _Protocol("TooManyHeaders")
        if not header:
            raise _Protocol("IncompleteRead")
        if 100 <= status < 200:
            line = _read_line(reader)
            if not line:
                raise _Protocol("RemoteDisconnected")
            continue
        # HTTP/1.1 keeps the connection unless told otherwise; 1.0 only if told to.
        if version == b"HTTP/1.1":
            keep = b"close" not in connection
        else:
            keep = b"keep-alive" in connection and b"close" not in connection
        if status in (204, 304):
            return _Answer(status, b"", keep)
        if codings is not None:
            if codings != [b"chunked"] or length is not None:
                # Chunked alone, never beside a length (RFC 9112 §6.1, §6.3).
                raise _Protocol("BadTransferEncoding")
            body, complete = _read_chunked(reader)
            # An HTTP/1.0 answer with a Transfer-Encoding: its framing may
            # be faulty, its connection carries nothing more (RFC 9112 §6.1).
            return _Answer(status, body, keep and complete and version == b"HTTP/1.1")
        if length is not None:
            if length > _MAX_RESPONSE_BYTES:
                return _Answer(status, None, False)
            body = reader.read(length)
            if len(body) < length:
                raise _Protocol("IncompleteRead")
            return _Answer(status, body, keep)
        # Neither a length nor chunks: the answer ends when the connection does.
        body = reader.read(_MAX_RESPONSE_BYTES + 1)
        if len(body) > _MAX_RESPONSE_BYTES:
            return _Answer(status, None, False)
        return _Answer(status, body, False)


def _tokens(value: bytes) -> list[bytes]:
    """A header value's comma-separated items, lowercased; empty ones dropped."""
    value = value.strip().lower()
    if b"," not in value:  # the usual one item
        return [value] if value else []
    return [item for item in (part.strip() for part in value.split(b",")) if item]


def _read_chunked(reader: Any) -> tuple[bytes | None, bool]:
    """The chunks' bytes and True; (None, False) once past the cap (not read on)."""
    parts: list[bytes] = []
    total = 0
    while True:
        line = _read_line(reader)
        size_text = line.split(b";", 1)[0].strip()
        # Hex digits and nothing else (RFC 9112 7.1): `int(…, 16)` also takes
        # "0x10", "1_0", "+a" and "-1", which no server sends as a size.
        if not _CHUNK_SIZE.fullmatch(size_text):
            raise _Protocol("BadChunk")
        size = int(size_text, 16)
        if size == 0:
            break
        total += size
        if total > _MAX_RESPONSE_BYTES:
            return None, False
        chunk = reader.read(size)
        if len(chunk) < size or reader.read(2) != b"\r\n":
            raise _Protocol("IncompleteRead")
        parts.append(chunk)
    while True:  # trailers, up to the blank line
        line = _read_line(reader)
        if not line:
            raise _Protocol("IncompleteRead")
        if line in (b"\r\n", b"\n"):
            break
    return b"".join(parts), True


def _close_all(idle: list[tuple[_Connection, float]]) -> None:
    for connection, _ in idle:
        connection.close()
    idle.clear()


def _parse(raw: bytes | None) -> Mapping[str, Any]:
    if not raw:
        return {}
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}
