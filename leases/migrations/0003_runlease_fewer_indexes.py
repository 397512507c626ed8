# Fewer indexes on dispatch_runlease (issue #12): a lease row is updated without
# HOT on each transition (state and expires_at are indexed), so every index takes
# a new entry each time. Three were redundant:
#   - attempt_id: served by runlease_unique_generation (attempt_id, lease_generation)
#     and runlease_one_active (attempt_id WHERE active);
#   - session_id: served by runlease_pull (session_id, pull_id) and
#     runlease_active_session (session_id WHERE active);
#   - offer_id varchar_pattern_ops (the "_like" index PostgreSQL adds for
#     unique=True): offer ids are only matched exactly, which the unique index serves.
# offer_id stays unique: its unique constraint is renamed runlease_offer_id_unique
# in place (no index build), now declared in Meta.constraints.
#
# Each index is dropped by its name, never through a plain AlterField(db_index=False):
# on PostgreSQL that drops every single-column btree index on the column that is not
# in Meta.indexes, so also the partial unique indexes of Meta.constraints
# (runlease_one_active on attempt_id). qinglong/tests/test_schema.py checks they stay.

from __future__ import annotations

from typing import Any

from django.db import migrations, models

TABLE = "dispatch_runlease"
# The names Django gave the foreign keys' indexes (the same on every database).
FK_INDEXES = {
    "attempt_id": "dispatch_runlease_attempt_id_ce70bfb8",
    "session_id": "dispatch_runlease_session_id_7358647d",
}
UNIQUE_COLUMN, UNIQUE_NAME = "offer_id", "runlease_offer_id_unique"
LIKE_INDEX = "dispatch_runlease_offer_id_57f818b7_like"


def _drop_fk_index(column: str) -> migrations.RunSQL:
    name = FK_INDEXES[column]
    return migrations.RunSQL(
        f'DROP INDEX IF EXISTS "{name}"', f'CREATE INDEX "{name}" ON "{TABLE}" ("{column}")'
    )


# The unique constraint on the column renamed unless it already has the name.
# Its current name is looked up by the server when the statement runs, not by
# this code: `sqlmigrate` only collects the SQL, on a database that may not have
# the table yet. STRICT: exactly one such constraint, else the migration fails.
RENAME_UNIQUE = f"""DO $$
DECLARE found text;
BEGIN
  IF NOT EXISTS (
    SELECT 1 FROM pg_constraint
    WHERE conrelid = '"{TABLE}"'::regclass AND conname = '{UNIQUE_NAME}'
  ) THEN
    SELECT c.conname INTO STRICT found
    FROM pg_constraint c
    JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = c.conkey[1]
    WHERE c.conrelid = '"{TABLE}"'::regclass AND c.contype = 'u'
      AND cardinality(c.conkey) = 1 AND a.attname = '{UNIQUE_COLUMN}';
    EXECUTE 'ALTER TABLE "{TABLE}" RENAME CONSTRAINT ' || quote_ident(found)
      || ' TO "{UNIQUE_NAME}"';
  END IF;
END $$"""


def forward(apps: Any, schema_editor: Any) -> None:
    # SQLite keeps its column-level UNIQUE (the same guarantee; it has no "_like").
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(f'DROP INDEX IF EXISTS "{LIKE_INDEX}"')
    schema_editor.execute(RENAME_UNIQUE, None)


def backward(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(
        f'ALTER TABLE "{TABLE}" RENAME CONSTRAINT "{UNIQUE_NAME}" TO "{TABLE}_{UNIQUE_COLUMN}_key"'
    )
    schema_editor.execute(
        f'CREATE INDEX "{LIKE_INDEX}" ON "{TABLE}" ("{UNIQUE_COLUMN}" varchar_pattern_ops)'
    )


class Migration(migrations.Migration):
    dependencies = [
        ("leases", "0002_runlease_execution_confirmed"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="runlease",
                    name="attempt",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=models.deletion.PROTECT,
                        related_name="leases",
                        to="runs.attempt",
                    ),
                ),
                migrations.AlterField(
                    model_name="runlease",
                    name="session",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=models.deletion.PROTECT,
                        related_name="leases",
                        to="workers.workersession",
                    ),
                ),
                migrations.AlterField(
                    model_name="runlease",
                    name="offer_id",
                    field=models.CharField(max_length=64),
                ),
                migrations.AddConstraint(
                    model_name="runlease",
                    constraint=models.UniqueConstraint(fields=("offer_id",), name=UNIQUE_NAME),
                ),
            ],
            database_operations=[
                _drop_fk_index("attempt_id"),
                _drop_fk_index("session_id"),
                migrations.RunPython(forward, backward),
            ],
        ),
    ]
