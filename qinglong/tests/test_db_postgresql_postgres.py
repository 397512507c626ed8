"""qinglong.db.postgresql: the health check skips a connection used moments ago.

Requests go through the WSGI application as a server calls it (Django's test
client leaves the connection checks of `request_started`/`request_finished`
out), on PostgreSQL, with a backend really terminated (`pg_terminate_backend`)
from another connection. The backend's clock is moved by the tests, never
waited on.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from typing import Any, cast

import psycopg
import pytest
from django.core.handlers.wsgi import WSGIHandler
from django.db import connection

from qinglong.db.postgresql import base as backend
from qinglong.testing import open_session
from qinglong.tests.wsgi import call_json, json_environ

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    frozen = _Clock()
    monkeypatch.setattr(backend, "_clock", frozen)
    return frozen


@pytest.fixture
def pings(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Each health check's answer (Django's `is_usable`, the `SELECT 1`)."""
    answers: list[bool] = []
    original = backend.DatabaseWrapper.is_usable

    def is_usable(self: backend.DatabaseWrapper) -> bool:
        answer = bool(original(self))
        answers.append(answer)
        return answer

    monkeypatch.setattr(backend.DatabaseWrapper, "is_usable", is_usable)
    return answers


@pytest.fixture
def token() -> Iterator[str]:
    opened = open_session(slots=1)
    yield opened.token
    # The suite's flush needs a live connection whatever a test left.
    connection.close()


def _heartbeat(token: str) -> tuple[int, Any]:
    """POST heartbeat through the WSGI handler, its signals and all."""
    environ = json_environ(
        "POST",
        "/api/v1/worker/heartbeat",
        {"draining": False},
        {"HTTP_AUTHORIZATION": f"Bearer {token}"},
    )
    return call_json(WSGIHandler(), environ)


def _backend_pid() -> int:
    assert connection.connection is not None
    return int(connection.connection.info.backend_pid)


def _terminate(pid: int) -> None:
    """Ends a backend from a connection of its own, as a server restart would."""
    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    with psycopg.connect(**params, autocommit=True) as other:
        (done,) = other.execute("SELECT pg_terminate_backend(%s, 5000)", [pid]).fetchone() or (
            False,
        )
    assert done


def test_a_connection_used_moments_ago_is_not_pinged_again(
    clock: _Clock, pings: list[bool], token: str
) -> None:
    assert _heartbeat(token)[0] == 200
    pings.clear()
    clock.now += backend.RECENT_USE_S / 2
    assert _heartbeat(token)[0] == 200
    assert _heartbeat(token)[0] == 200
    assert pings == []  # Django's backend pings before each request's first statement
    clock.now += backend.RECENT_USE_S + 1
    assert _heartbeat(token)[0] == 200
    assert pings == [True]  # idle past the window: pinged as before


def test_past_the_window_a_terminated_connection_is_replaced_and_the_request_served(
    clock: _Clock, pings: list[bool], token: str
) -> None:
    assert _heartbeat(token)[0] == 200
    dead = _backend_pid()
    _terminate(dead)
    clock.now += backend.RECENT_USE_S + 1
    code, body = _heartbeat(token)
    assert code == 200, body
    assert pings == [False]  # the ping found it dead: a new connection served the request
    assert _backend_pid() != dead


def test_inside_the_window_one_request_fails_503_and_the_next_is_served(
    clock: _Clock, pings: list[bool], token: str
) -> None:
    assert _heartbeat(token)[0] == 200
    dead = _backend_pid()
    _terminate(dead)
    clock.now += backend.RECENT_USE_S / 2
    code, body = _heartbeat(token)
    # Never a 500: the retryable answer the agent already handles.
    assert code == 503
    assert body["error"]["code"] == "database_unavailable"
    # The error marked the connection; the end of that request found it dead
    # and closed it, so the very next request (same instant) connects anew.
    assert connection.connection is None
    code, body = _heartbeat(token)
    assert code == 200, body
    assert _backend_pid() != dead


def test_a_connection_marked_by_an_error_is_pinged_inside_the_window(
    clock: _Clock, pings: list[bool], token: str
) -> None:
    assert _heartbeat(token)[0] == 200
    pings.clear()
    connection.errors_occurred = True  # as an OperationalError leaves it
    assert _heartbeat(token)[0] == 200
    assert pings == [True]  # Django's own check at request start, kept


def test_timestamptz_values_are_read_as_djangos_own_loader_reads_them() -> None:
    """psycopg's C loader (`UtcTimestamptzLoader`) against Django's, on one
    connection: the same `datetime` for offsets, fractions and both ends of
    the range, in `datetime.timezone.utc`, and Django's cursors keep it."""
    from django.db.backends.postgresql.psycopg_any import (  # type: ignore[import-untyped]
        register_tzloader,
    )
    from psycopg.pq import Format

    texts = [
        "2026-12-04 21:00:00.5+05:30",
        "2026-12-04 21:00:00+00",
        "1999-12-31 23:59:59.999999-08",
        "2000-02-29 12:00:00.000001+14",
        "0001-01-02 00:00:00+00",
        "9999-12-30 23:59:59.999999+00",
    ]
    sql = "SELECT " + ", ".join(f"'{text}'::timestamptz" for text in texts) + ", NULL::timestamptz"
    oid = psycopg.adapters.types["timestamptz"].oid
    with connection.cursor() as cursor:
        raw = cast(Any, cursor).cursor  # the psycopg cursor under Django's wrapper
        assert raw.adapters.get_loader(oid, Format.TEXT) is backend.UtcTimestamptzLoader
        cursor.execute(sql)
        ours = cursor.fetchone()
        register_tzloader(connection.timezone, raw)  # Django's own, on this cursor only
        assert raw.adapters.get_loader(oid, Format.TEXT) is not backend.UtcTimestamptzLoader
        cursor.execute(sql)
        djangos = cursor.fetchone()
    assert ours == djangos, (ours, djangos)
    assert ours[-1] is None
    for value in ours[:-1]:
        assert type(value) is datetime.datetime and value.tzinfo is datetime.UTC, value
    assert ours[0] == datetime.datetime(2026, 12, 4, 15, 30, 0, 500000, tzinfo=datetime.UTC)
