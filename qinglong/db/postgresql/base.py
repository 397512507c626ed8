"""Django's PostgreSQL backend, whose health check skips a connection used moments ago.

With `CONN_HEALTH_CHECKS` on (settings, persistent connections), Django pings
a kept connection (`SELECT 1`, a round trip) before the first statement of
every request, so that one the server dropped since (a restart, an idle
timeout, `pg_terminate_backend`) is replaced instead of failing the request.
A Worker request is a few short statements: the ping was one more round
trip on the web process and one more statement on the backend, every
request (issue #12, bench/README "The fixed cost of a Worker request").

Here the ping is skipped when this connection was last handed out less than
`RECENT_USE_S` ago and no error has marked it since (`errors_occurred`; a
commit or rollback that succeeds clears it, proving the connection). Django
already pings a connection with an error before reusing it, at the start
and at the end of every request, and drops it when that fails; the check
left to skip is the one of an idle connection whose server might have gone
away meanwhile — the longer it idled, the likelier. A connection still in
use less than a second ago is almost always alive.

Inside the window, a connection the server has just dropped fails the
request's first statement: the API answers 503 `database_unavailable` with
`Retry-After` (`qinglong.api_errors`; an agent retries), the error marks the
connection, Django's end-of-request check finds it dead and closes it, and
the next request connects anew. So at most one request per kept connection
(one per web thread) fails, only when the server dropped the connection
within a second of its last use; past the window every connection is pinged
as before. Nothing else changes: connections are made, aged out
(`CONN_MAX_AGE`) and closed exactly as by Django's backend.

`timestamptz` values are read by psycopg's C loader when the connection's
time zone is UTC (`UtcTimestamptzLoader`): Django registers a loader of its
own, a Python subclass of psycopg's pure-Python loader (a regular expression
and a `datetime` built in Python, then `replace(tzinfo=…)`), about 3 us a
value against 0.2 — some fifty values in a `POST acks` of 8 (issue #12).
The value is the same `datetime`, with `datetime.timezone.utc` as Django's.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

from django.db.backends.postgresql import base
from psycopg.abc import AdaptContext
from psycopg.adapt import Loader

__all__ = ["DatabaseWrapper"]

# Seconds since a connection was last handed out (with no error since) within
# which its health check is skipped. A busy web thread serves a request every
# few milliseconds, so nearly every ping goes; an idle one is pinged as before.
RECENT_USE_S = 1.0

# The clock (tests move it instead of sleeping).
_clock = time.monotonic


def _c_timestamptz_loader() -> Any:
    """psycopg's C `timestamptz` loader (psycopg[binary]); None without it,
    and Django's loader stays."""
    try:
        from psycopg_binary import _psycopg
    except ImportError:  # pragma: no cover  (the pinned requirement installs it)
        return None
    return getattr(_psycopg, "TimestamptzLoader", None)


_CTimestamptzLoader: Any = _c_timestamptz_loader()


class UtcTimestamptzLoader(Loader):
    """psycopg's C `timestamptz` loader under the name Django looks for.

    The C loader answers in the connection's time zone, UTC here (Django sets
    the session's), so `datetime.timezone.utc`, as Django's own loader
    (`replace(tzinfo=timezone)`) does. The C class cannot be subclassed: each
    instance hands out the C loader's bound `load` as its own. `timezone` is
    what Django's `create_cursor` compares before registering its own loader
    on a cursor.
    """

    timezone = datetime.UTC

    def __init__(self, oid: int, context: AdaptContext | None = None) -> None:
        super().__init__(oid, context)
        assert _CTimestamptzLoader is not None
        self.load = _CTimestamptzLoader(oid, context).load  # type: ignore[method-assign]

    def load(self, data: Any) -> Any:  # replaced per instance (above)
        raise NotImplementedError


class DatabaseWrapper(base.DatabaseWrapper):
    """Django's wrapper (its operations, features, creation, introspection and
    schema editor unchanged) with the health check above."""

    # When this connection was last handed out for a statement or transaction
    # (monotonic seconds); far in the past until it is.
    _last_used: float = float("-inf")

    def connect(self) -> None:
        super().connect()
        self._last_used = _clock()

    def get_new_connection(self, conn_params: Any) -> Any:
        connection = super().get_new_connection(conn_params)
        # Django's `timezone` is `datetime.timezone.utc` exactly when its
        # session time zone is UTC (USE_TZ, TIME_ZONE UTC or unset).
        if _CTimestamptzLoader is not None and self.timezone is datetime.UTC:
            connection.adapters.register_loader("timestamptz", UtcTimestamptzLoader)
        return connection

    def close_if_health_check_failed(self) -> None:
        # Django calls this before every cursor and transaction; it pings once
        # per request (until `close_if_unusable_or_obsolete` resets the flag).
        # (Django's attributes, which django-stubs does not all declare.)
        django: Any = self
        now = _clock()
        if (
            django.connection is not None
            and django.health_check_enabled
            and not django.health_check_done
            and not django.errors_occurred
            and now - self._last_used < RECENT_USE_S
        ):
            django.health_check_done = True
        else:
            super().close_if_health_check_failed()
        self._last_used = now
