"""One request at a time on the live server, for tests with a real agent beside a browser.

With the in-memory SQLite test database, Django's live server hands every
request thread the test thread's own connection (the only way they can see
one in-memory database). Concurrent requests then share one connection and
its transaction state: a page view inside an ACK's transaction, a 503
"database unavailable" when SQLite's shared cache reports a table locked. A
real agent (heartbeats, output, ACKs) and a browser polling at once make that
likely. Serializing the application removes it; the test thread takes the
same lock for its own reads. (The embedded default itself is a file database
in WAL mode, one connection per thread: none of this applies to it.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from pytest_django.live_server_helper import LiveServer


@contextmanager
def serialized(live_server: LiveServer) -> Iterator[threading.RLock]:
    httpd = live_server.thread.httpd
    app = httpd.get_app()
    assert app is not None  # the server is running
    lock = threading.RLock()

    def one_at_a_time(
        environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        with lock:
            result = app(environ, start_response)
            try:
                return [b"".join(result)]  # the whole response, inside the lock
            finally:
                close = getattr(result, "close", None)
                if close is not None:
                    close()

    httpd.set_app(one_at_a_time)
    try:
        yield lock
    finally:
        httpd.set_app(app)
