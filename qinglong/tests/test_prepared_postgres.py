"""qinglong.prepared: hot statements prepared once per connection (PostgreSQL)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from qinglong.prepared import array_element, array_text, prepared_cursor

pytestmark = [pytest.mark.postgres, pytest.mark.django_db]

_SQL = "SELECT %s::integer + 1, %s::text /* qinglong.prepared test */"


def _prepared(marker: str) -> list[tuple[str, int, int]]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements "
            "WHERE statement LIKE %s",
            [f"%{marker}%"],
        )
        return list(cursor.fetchall())


def test_a_statement_is_prepared_once_and_then_executed_with_its_values() -> None:
    answers = []
    for value in range(8):
        with prepared_cursor() as cursor:
            cursor.execute(_SQL, [value, f"v{value}"])
            answers.append(cursor.fetchone())
    assert answers == [(value + 1, f"v{value}") for value in range(8)]
    ((text, generic, custom),) = _prepared("qinglong.prepared test")
    assert "$1" in text and "$2" in text  # bound on the server, not quoted in
    assert generic + custom == 8


def test_django_cursors_still_prepare_nothing() -> None:
    with prepared_cursor() as cursor:  # turns preparing on for this connection
        cursor.execute(_SQL, [1, "x"])
    for _ in range(10):
        with connection.cursor() as cursor:
            cursor.execute("SELECT %s::integer /* a plain Django statement */", [1])
    assert _prepared("a plain Django statement") == []


def test_captured_queries_show_the_statement_with_its_values() -> None:
    with CaptureQueriesContext(connection) as queries, prepared_cursor() as cursor:
        cursor.execute(_SQL, [41, "it's"])
        assert cursor.fetchone() == (42, "it's")
    (query,) = queries.captured_queries
    assert query["sql"] == "SELECT 41::integer + 1, 'it''s'::text /* qinglong.prepared test */"


def test_a_failed_statement_rolls_back_like_any_other() -> None:
    from django.db import DatabaseError, transaction

    with pytest.raises(DatabaseError), transaction.atomic(), prepared_cursor() as cursor:
        cursor.execute("SELECT 1 / %s::integer /* qinglong.prepared division */", [0])
    with prepared_cursor() as cursor:
        cursor.execute("SELECT 1 / %s::integer /* qinglong.prepared division */", [1])
        assert cursor.fetchone() == (1,)


_AWKWARD = [
    'a "quoted" word',
    'back\\slash \\"',
    "{braces}",
    "a,b",
    " lead and trail ",
    "NULL",
    "null",
    "",
    "non-ASCII ä 雪 😀",
    "new\nline\tand\rreturn",
]


def test_array_text_reads_back_as_the_values_through_postgresql() -> None:
    """The one writer of an array's text form (leases.locks' keys, leases.writes'
    waves): whatever an element holds, the array reads back as the values."""
    at = datetime(2026, 12, 4, 22, 40, 1, 123456, tzinfo=UTC)
    columns: list[tuple[str, list[Any]]] = [
        ("text[]", [*_AWKWARD, None]),
        ("varchar(64)[]", [*_AWKWARD, None]),
        ("bigint[]", [0, -1, 2**40, -(2**63), 2**63 - 1, None]),
        ("uuid[]", [uuid.UUID(int=0), uuid.uuid4(), None]),
        ("boolean[]", [True, False, None]),
        (
            "timestamptz[]",
            [at, at.astimezone(timezone(timedelta(hours=-5, minutes=-30))), None],
        ),
        ("text[]", []),
    ]
    with connection.cursor() as cursor:
        for kind, values in columns:
            text = array_text(values)
            assert isinstance(text, str), (kind, values)
            cursor.execute(f"SELECT %s::{kind}", [text])
            assert cursor.fetchone()[0] == values, (kind, text)


def test_a_type_the_writer_does_not_write_exactly_is_refused_not_guessed() -> None:
    from leases.locks import _key_array
    from leases.writes import _array_text

    naive = datetime(2026, 12, 4, 22, 40)
    for odd in (naive, 1.5, b"bytes", Decimal("1"), object()):
        assert array_element(odd) is None
        assert array_text([1, odd]) is None
        with pytest.raises(TypeError):
            _key_array([1, odd])  # type: ignore[list-item]
        assert _array_text([1, odd]) == [1, odd]  # a wave's column: psycopg dumps it
    # A bool is a boolean, never `True` (what str() wrote): read back as one.
    assert _key_array([True, False, None]) == "{t,f,NULL}"
