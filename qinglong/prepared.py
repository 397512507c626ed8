"""Hot statements parsed and planned once per connection on PostgreSQL (issue #12).

Django's psycopg backend binds parameters on the client (the values are
quoted into the SQL text) and turns prepared statements off, so PostgreSQL
parses and plans every statement anew. For the few hand-written statements
that run on every pull and ACK, that planning cost the server more CPU than
running them (measured with `EXPLAIN (ANALYZE, SUMMARY)`: an ACK's lock
statement 0.25 ms to plan, 0.08 ms to run; the pull snapshot 0.6 ms and
0.07 ms).

`prepared_cursor()` is a Django cursor (the same wrapper as
`connection.cursor()`: query logging and `CaptureQueriesContext`, execute
wrappers, error translation) over a server-binding psycopg cursor that
executes with `prepare=True`: psycopg prepares each distinct SQL text once
per connection (the protocol's named statements, kept in its LRU cache of
`prepared_max` per connection; a new connection starts empty) and sends the
parameters separately. Same SQL (`%s` placeholders), same results; the
parameters are typed by psycopg instead of quoted, so a statement written for
it casts a parameter whose type PostgreSQL cannot infer from where it stands
(e.g. `INSERT … SELECT %s::integer`).

A connection pooler in front of PostgreSQL must keep a server connection per
client connection (session pooling) or support protocol-level prepared
statements (PgBouncer >= 1.21, `max_prepared_statements`). Elsewhere (SQLite)
this is `connection.cursor()`.
"""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections

__all__ = ["array_element", "array_text", "int8_params", "prepared_cursor", "state_literal"]

# Django opens psycopg connections with `prepare_threshold=None`, which turns
# off even an explicit `prepare=True`. A threshold no statement reaches
# prepares exactly what asks to be (Django's own cursors bind on the client
# and never prepare anything).
_ONLY_WHEN_ASKED = 2**31 - 1
_CLASSES: list[tuple[type[Any], type[Any]]] = []


def _classes() -> tuple[type[Any], type[Any]]:
    """The psycopg cursor and Django's query-logging wrapper for it (made once)."""
    if not _CLASSES:
        # Imported here: the module exists only with psycopg installed.
        # (ServerBindingCursor is not in the stubs.)
        from django.db.backends.postgresql.base import (  # type: ignore[attr-defined]
            CursorDebugWrapper,
            ServerBindingCursor,
        )

        class PreparingCursor(ServerBindingCursor):  # type: ignore[misc]
            def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
                kwargs["prepare"] = True
                return super().execute(query, params, **kwargs)

        class PreparedDebugWrapper(CursorDebugWrapper):
            """Logs the statement with its values, as Django's own cursors do (the
            psycopg cursor keeps no text of a prepared statement to read back)."""

            def debug_sql(
                self,
                sql: Any = None,
                params: Any = None,
                use_last_executed_query: bool = False,
                many: bool = False,
            ) -> Any:
                if use_last_executed_query and sql is not None and not many:
                    # Unquotable values: the text with its placeholders is logged.
                    with contextlib.suppress(Exception):
                        sql = self.db.ops.compose_sql(sql, params)
                    use_last_executed_query = False
                return super().debug_sql(sql, params, use_last_executed_query, many)

        _CLASSES.append((PreparingCursor, PreparedDebugWrapper))
    return _CLASSES[0]


_STATE = re.compile(r"[a-z_]+")


def state_literal(value: str) -> str:
    """A state constant as an SQL literal, for the text of a prepared statement.

    A code constant, never a request value. A literal, not a parameter: the
    plan PostgreSQL keeps for a prepared statement (a generic plan, after a
    few executions) can use a partial index only when the index's condition
    (`state = 'active'`, `state = 'queued'`) is in the text itself.
    """
    if not _STATE.fullmatch(str(value)):
        raise ValueError(f"not a state constant: {value!r}")
    return f"'{value}'"


def int8_params(params: Sequence[Any]) -> list[Any]:
    """`params` with every integer (and every list of integers) sent as bigint.

    psycopg types a Python int by its value — smallint, integer or bigint; a
    list by its largest element — and keys the statements it prepares by
    their text *and* their parameters' types. Ids that cross 32,767 or 2**31
    (or a page that mixes such ids) would make the same text a new prepared
    statement, parsed and planned anew, once per type combination. As bigint
    a text has one. A statement passing them casts where the type matters
    (`%s::integer[]`); PostgreSQL compares integers of every width with one
    another and writes a bigint into an integer column by assignment. Booleans
    stay booleans. Elsewhere (SQLite) `params` as they are.
    """
    if connections[DEFAULT_DB_ALIAS].vendor != "postgresql":
        return list(params)
    from psycopg.types.numeric import Int8

    def typed(value: Any) -> Any:
        if type(value) is int:
            return Int8(value)
        if (
            type(value) is list
            and value
            and all(type(item) is int or item is None for item in value)
            and any(item is not None for item in value)
        ):
            return [None if item is None else Int8(item) for item in value]
        return value

    return [typed(value) for value in params]


def array_element(value: object) -> str | None:
    """One element of a PostgreSQL array's text form; None for a type not
    written here (the caller then refuses it or lets psycopg dump it).

    Exactly: an int (not a bool) as its decimal text, a bool as `t`/`f`, a
    UUID as it prints, an aware datetime in ISO 8601 with its offset, None as
    `NULL`; text always quoted, its only escapes a backslash and a double
    quote (so braces, commas, spaces, `NULL` and the empty string stay text).
    A naive datetime, a float or anything else: None.
    """
    kind = type(value)
    if kind is int:
        return str(value)
    if isinstance(value, str):
        # A StrEnum member (a state): its text, not its repr.
        text = str.__str__(value)
        if "\\" in text or '"' in text:
            text = text.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{text}"'
    if value is None:
        return "NULL"
    if isinstance(value, datetime) and kind is datetime and value.tzinfo is not None:
        return value.isoformat()
    if kind is bool:
        return "t" if value else "f"
    if kind is uuid.UUID:
        return str(value)
    return None


def array_text(values: Sequence[object]) -> str | None:
    """`values` as a PostgreSQL array's text form, `{…}`, for a statement to
    cast to the column's array type (`%s::bigint[]`); None when an element is
    of a type `array_element` does not write.

    psycopg sends the text as a value of unknown type, so a statement's
    parameter types never change, and runs no dumper per element (about
    three times this for a list; issue #12). The one writer of this form:
    `leases.locks` (a page's keys) and `leases.writes` (a wave's columns).
    """
    elements = []
    for value in values:
        element = array_element(value)
        if element is None:
            return None
        elements.append(element)
    return "{" + ",".join(elements) + "}"


def prepared_cursor() -> Any:
    """A cursor whose statements PostgreSQL prepares once per connection (see above)."""
    # The wrapper itself, looked up once: every attribute read through the
    # `connection` proxy is a thread-local lookup of its own.
    db = connections[DEFAULT_DB_ALIAS]
    if db.vendor != "postgresql":
        return db.cursor()
    # What `connection.cursor()` does, with another psycopg cursor class.
    db.close_if_health_check_failed()
    db.ensure_connection()
    raw = db.connection
    if raw.prepare_threshold is None:
        raw.prepare_threshold = _ONLY_WHEN_ASKED
    cursor_class, debug_class = _classes()
    with db.wrap_database_errors:
        cursor = cursor_class(raw)
    db.validate_thread_sharing()
    if db.queries_logged:
        return debug_class(cursor, db)
    return db.make_cursor(cursor)
