# dispatch_runlease.worker_id loses its index (issue #12): no read asks for a
# Worker's leases but among its active ones (the console's slot counts, served by
# runlease_active), and a Worker is never deleted, so the PROTECT check never runs;
# yet every lease row version (4 per Run) took an entry in it.
# Dropped by name, as in 0003 (a plain AlterField(db_index=False) would also drop
# any partial unique index on the column).

from __future__ import annotations

from django.db import migrations, models

TABLE, COLUMN, INDEX = "dispatch_runlease", "worker_id", "dispatch_runlease_worker_id_a4be415c"


class Migration(migrations.Migration):
    dependencies = [
        ("leases", "0003_runlease_fewer_indexes"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="runlease",
                    name="worker",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=models.deletion.PROTECT,
                        related_name="leases",
                        to="workers.worker",
                    ),
                ),
            ],
            database_operations=[
                migrations.RunSQL(
                    f'DROP INDEX IF EXISTS "{INDEX}"',
                    f'CREATE INDEX "{INDEX}" ON "{TABLE}" ("{COLUMN}")',
                ),
            ],
        ),
    ]
