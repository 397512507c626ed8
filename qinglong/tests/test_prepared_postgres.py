"""qinglong.prepared: hot statements prepared once per connection (PostgreSQL)."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from qinglong.prepared import prepared_cursor

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
