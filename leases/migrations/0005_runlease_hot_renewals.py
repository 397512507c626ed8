# A lease's renewals are HOT updates on PostgreSQL (issue #12). Each Run's lease
# is renewed twice (its `starting` and `running` ACKs; a heartbeat renews every
# active lease of its Session) and each renewal changes `expires_at` and
# `version` only. With `expires_at` indexed (runlease_active_expiry) every
# renewal was a new row version with an entry in each of the table's nine
# indexes; without it, and with room left on the row's page, PostgreSQL updates
# the row in place (a heap-only tuple: no index entry, less WAL).
#   - runlease_active_expiry is dropped: its one reader, the expiry sweep
#     (dispatch.sweeps._expired_page), reads the active leases through
#     runlease_active instead (they are a few per Worker slot) and sorts them;
#   - the table's fillfactor is 80 on PostgreSQL: a new lease leaves a fifth of
#     its page for its renewals' versions (HOT needs the new version on the same
#     page). SQLite has no fillfactor: nothing to do there.

from __future__ import annotations

from typing import Any

from django.db import migrations

TABLE, FILLFACTOR = "dispatch_runlease", 80


class PostgresRunSQL(migrations.RunSQL):
    """RunSQL on PostgreSQL only (`sqlmigrate` shows it there, nothing elsewhere)."""

    def database_forwards(self, app_label: str, schema_editor: Any, *args: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            super().database_forwards(app_label, schema_editor, *args)

    def database_backwards(self, app_label: str, schema_editor: Any, *args: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            super().database_backwards(app_label, schema_editor, *args)


class Migration(migrations.Migration):
    dependencies = [
        ("leases", "0004_runlease_worker_unindexed"),
    ]

    operations = [
        migrations.RemoveIndex(model_name="runlease", name="runlease_active_expiry"),
        PostgresRunSQL(
            f'ALTER TABLE "{TABLE}" SET (fillfactor = {FILLFACTOR})',
            f'ALTER TABLE "{TABLE}" RESET (fillfactor)',
        ),
    ]
