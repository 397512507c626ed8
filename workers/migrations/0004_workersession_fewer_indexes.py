# Fewer indexes on workers_workersession (issue #12): two were redundant:
#   - worker_id: served by workersession_unique_generation (worker_id, generation)
#     and, for current Sessions, workersession_one_current / workersession_current;
#   - token_digest varchar_pattern_ops (the "_like" index PostgreSQL adds for
#     unique=True): a digest is only matched exactly, which the unique index serves.
# token_digest stays unique: its unique constraint is renamed
# workersession_token_digest_unique in place (no index build), now declared in
# Meta.constraints.
#
# The index is dropped by its name, never through a plain AlterField(db_index=False):
# on PostgreSQL that also drops the partial unique index workersession_one_current
# (a Meta.constraints entry on worker_id). qinglong/tests/test_schema.py checks it stays.

from __future__ import annotations

from typing import Any

from django.db import migrations, models

TABLE = "workers_workersession"
# The name Django gave the foreign key's index (the same on every database).
FK_COLUMN, FK_INDEX = "worker_id", "workers_workersession_worker_id_9eb34791"
UNIQUE_COLUMN, UNIQUE_NAME = "token_digest", "workersession_token_digest_unique"
LIKE_INDEX = "workers_workersession_token_digest_f6d67fb8_like"


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
        ("workers", "0003_session_end_reason_and_retention"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="workersession",
                    name="worker",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=models.deletion.PROTECT,
                        related_name="sessions",
                        to="workers.worker",
                    ),
                ),
                migrations.AlterField(
                    model_name="workersession",
                    name="token_digest",
                    field=models.CharField(max_length=64),
                ),
                migrations.AddConstraint(
                    model_name="workersession",
                    constraint=models.UniqueConstraint(fields=("token_digest",), name=UNIQUE_NAME),
                ),
            ],
            database_operations=[
                migrations.RunSQL(
                    f'DROP INDEX IF EXISTS "{FK_INDEX}"',
                    f'CREATE INDEX "{FK_INDEX}" ON "{TABLE}" ("{FK_COLUMN}")',
                ),
                migrations.RunPython(forward, backward),
            ],
        ),
    ]
