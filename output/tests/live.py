"""One request at a time on the live server, for tests with a real agent beside a browser.

With Django's in-memory SQLite test database, the live server handed every
request thread the test thread's own connection (the only way they could see
one in-memory database). Concurrent requests then shared one connection and
its transaction state: a page view inside an ACK's transaction, a 503
"database unavailable" when SQLite's shared cache reported a table locked. A
real agent (heartbeats, output, ACKs) and a browser polling at once made that
likely. Serializing the application removed it; the test thread takes the
same lock for its own reads. The SQLite pass now tests a file database like
the embedded default's (qinglong/settings_test.py: WAL, one connection per
thread, the busy timeout), where none of this applies; the serialization
stays, harmless.
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
