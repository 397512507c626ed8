"""Suite-wide pytest configuration.

The suite runs twice (README command 2): once on SQLite, once on PostgreSQL.
Tests marked `postgres` need real concurrent connections or processes; on the
SQLite pass they are skipped with a reason, and they run on the PostgreSQL pass.
Browser tests (marked `browser`, Playwright and Chromium) run on the SQLite pass
only and are skipped with a reason on the PostgreSQL pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A test that drives the browser is marked `browser` whether or not its
    # module says so (`-m "not browser"` then leaves them all out).
    for item in items:
        if "browser" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.browser)
    if connection.vendor == "postgresql":
        # Browser tests exercise pages, not the database engine: one pass is enough.
        skip = pytest.mark.skip(reason="browser tests run in the SQLite pass")
        marker = "browser"
    else:
        skip = pytest.mark.skip(reason="needs PostgreSQL; runs in the PostgreSQL pass")
        marker = "postgres"
    for item in items:
        # By marker, not keyword: keywords also hold folder names (qinglong/tests/browser).
        if item.get_closest_marker(marker) is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_cycle_recorder() -> object:
    """Each test starts as a process that just started would: a fresh
    DispatchCycle window (its first cycle of any outcome is a row of its own)
    and no TaskRevision read yet."""
    from dispatch.adapters.orm import fair_rotation, revisions_read  # Django is set up by now
    from dispatch.cycles import cycle_recorder

    cycle_recorder.reset()
    revisions_read.clear()  # a test database may reuse a primary key
    fair_rotation.reset()  # and the Projects' round-robin turn starts afresh
    yield
    cycle_recorder.reset()


@pytest.fixture(autouse=True, scope="session")
def _flush_by_delete_on_postgres() -> Iterator[None]:
    """Empty the tables after a `transaction=True` test with DELETE, not TRUNCATE.

    Django flushes the test database after each such test with one TRUNCATE
    of every table; on PostgreSQL that costs 0.4 to 0.5 s whatever the tables
    hold (each table gets a new file), and the PostgreSQL pass runs hundreds
    of such tests. A DELETE of each table in one transaction costs a few
    milliseconds for what a test leaves. Every foreign key Django creates on
    PostgreSQL is DEFERRABLE INITIALLY DEFERRED, so the order does not
    matter. A flush that resets sequences (none in this suite asks) keeps
    Django's TRUNCATE ... RESTART IDENTITY.
    """
    if connection.vendor != "postgresql":
        yield
        return
    from django.db.backends.postgresql.operations import DatabaseOperations

    original = DatabaseOperations.sql_flush

    def sql_flush(
        self: DatabaseOperations,
        style: Any,
        tables: Any,
        *,
        reset_sequences: bool = False,
        allow_cascade: bool = False,
    ) -> list[str]:
        if reset_sequences or not tables:
            return original(
                self, style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade
            )
        return ["SET CONSTRAINTS ALL DEFERRED"] + [
            f"DELETE FROM {self.quote_name(table)}"  # noqa: S608  (table names from the models)
            for table in tables
        ]

    DatabaseOperations.sql_flush = sql_flush  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        DatabaseOperations.sql_flush = original  # type: ignore[method-assign]
