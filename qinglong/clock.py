"""One clock for lease arithmetic: the database's on PostgreSQL.

Many web nodes and dispatchers compare `expires_at` against "now"; taking now
from the one database keeps them consistent whatever their own clocks say
(docs/adr/0001 step 1). SQLite is a single node, so the process clock is the clock.
"""

from __future__ import annotations

from datetime import UTC, datetime

from django.db import connection
from django.utils import timezone


def db_now() -> datetime:
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT statement_timestamp()")
            row = cursor.fetchone()
        assert row is not None
        value: datetime = row[0]
        return value.astimezone(UTC)
    return timezone.now()


class DatabaseClock:
    """The `Clock` port of `dispatch.core` over `db_now()`."""

    def now(self) -> datetime:
        return db_now()
