"""The migrated PostgreSQL schema holds what the models declare, and no more indexes
than the reads need (issue #12: every index of a row takes an entry on each of its
transitions, none of which is a HOT update).

- Every name in a model's Meta.constraints and Meta.indexes exists. A plain
  AlterField(db_index=False) on PostgreSQL drops every single-column btree index
  on the column that is not in Meta.indexes — so also a partial unique index of
  Meta.constraints on it (runlease_one_active, attempt_one_active_per_run,
  workersession_one_current). The migrations of issue #12 drop indexes by name.
- Every foreign key column leads an index (for the ON DELETE check or SET NULL
  of the row it points at, and for reads by it), but the ones listed below.
- The hot tables carry no varchar_pattern_ops ("_like") index: their keys are
  matched exactly.
"""

from __future__ import annotations

import pytest
from django.apps import apps
from django.db import connection, models

pytestmark = [pytest.mark.postgres, pytest.mark.django_db]

PROJECT_APPS = ("runs", "leases", "workers", "dispatch", "schedules", "notifications", "output")

# Foreign keys without an index of their own, and why that is enough.
UNINDEXED_FOREIGN_KEYS = {
    # A revision is never deleted (immutable, no delete in admin or API); the one
    # read by it, the fair candidate read, walks run_queue_group.
    ("runs_run", "task_revision_id"),
    # A Worker is never deleted (disabled instead); its leases are read only
    # among the active ones (the console's slot counts: runlease_active).
    ("dispatch_runlease", "worker_id"),
}


def _models() -> list[type[models.Model]]:
    return [
        model
        for label in PROJECT_APPS
        for model in apps.get_app_config(label).get_models()
        if model._meta.managed and not model._meta.proxy
    ]


def _leading_columns() -> set[tuple[str, str]]:
    """(table, first column) of every index that a lookup by that column alone can
    use: a full index, or a partial one on `column IS NOT NULL` (which any
    `column = x` or `column IN (…)` implies)."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT c.relname, a.attname, pg_get_expr(i.indpred, i.indrelid)
              FROM pg_index i
              JOIN pg_class c ON c.oid = i.indrelid
              JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = current_schema()
              JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
            """
        )
        rows = cursor.fetchall()
    return {
        (table, column)
        for table, column, predicate in rows
        if predicate is None or predicate == f"({column} IS NOT NULL)"
    }


def test_every_declared_constraint_and_index_exists() -> None:
    missing = []
    with connection.cursor() as cursor:
        for model in _models():
            table = model._meta.db_table
            present = set(connection.introspection.get_constraints(cursor, table))
            declared = [c.name for c in model._meta.constraints] + [
                i.name for i in model._meta.indexes
            ]
            missing += [f"{table}.{name}" for name in declared if name not in present]
    assert missing == []


def test_every_foreign_key_leads_an_index() -> None:
    leading = _leading_columns()
    unindexed = {
        (model._meta.db_table, field.column)
        for model in _models()
        for field in model._meta.concrete_fields
        if isinstance(field, models.ForeignKey)
    } - leading
    assert unindexed == UNINDEXED_FOREIGN_KEYS


def test_hot_tables_have_no_pattern_ops_index() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexname FROM pg_indexes WHERE schemaname = current_schema()"
            " AND tablename = ANY(%s) AND indexdef LIKE %s",
            [
                ["dispatch_runlease", "runs_run", "runs_attempt", "workers_workersession"],
                "%pattern_ops%",
            ],
        )
        assert cursor.fetchall() == []
