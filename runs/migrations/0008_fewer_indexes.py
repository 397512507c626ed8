# Fewer indexes on runs_run, runs_attempt and runs_attemptevent (issue #12): each
# transition changes an indexed state, so no update is HOT and every index of the
# row takes a new entry. Dropped, each served by another index:
#   - runs_attempt.run_id: attempt_unique_number (run_id, number);
#   - runs_attemptevent.run_id: attemptevent_run (run_id, id);
#   - runs_run.task_revision_id: no read by revision but the fair candidate read
#     (run_queue_group), and a revision is never deleted;
#   - runs_run.schedule_id: replaced by run_schedule, the same index over the Runs a
#     Schedule fired only (a Schedule's delete sets theirs to NULL through it).
#
# Each index is dropped by its name, never through a plain AlterField(db_index=False):
# on PostgreSQL that drops every single-column btree index on the column that is not
# in Meta.indexes, so also the partial unique indexes of Meta.constraints
# (attempt_one_active_per_run on run_id). qinglong/tests/test_schema.py checks they stay.

from __future__ import annotations

from django.db import migrations, models

# The names Django gave the foreign keys' indexes (the same on every database).
FK_INDEXES = [
    ("runs_attempt", "run_id", "runs_attempt_run_id_651e9d12"),
    ("runs_attemptevent", "run_id", "runs_attemptevent_run_id_5bf3e373"),
    ("runs_run", "task_revision_id", "runs_run_task_revision_id_640a2a76"),
    ("runs_run", "schedule_id", "runs_run_schedule_id_6c827442"),
]


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0007_fair_dispatch_indexes"),
        ("schedules", "0001_initial"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="run",
            index=models.Index(
                condition=models.Q(("schedule__isnull", False)),
                fields=["schedule"],
                name="run_schedule",
            ),
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="attempt",
                    name="run",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=models.deletion.PROTECT,
                        related_name="attempts",
                        to="runs.run",
                    ),
                ),
                migrations.AlterField(
                    model_name="attemptevent",
                    name="run",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=models.deletion.CASCADE,
                        related_name="events",
                        to="runs.run",
                    ),
                ),
                migrations.AlterField(
                    model_name="run",
                    name="schedule",
                    field=models.ForeignKey(
                        blank=True,
                        db_index=False,
                        null=True,
                        on_delete=models.deletion.SET_NULL,
                        related_name="runs",
                        to="schedules.schedule",
                    ),
                ),
                migrations.AlterField(
                    model_name="run",
                    name="task_revision",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=models.deletion.PROTECT,
                        related_name="runs",
                        to="runs.taskrevision",
                    ),
                ),
            ],
            database_operations=[
                migrations.RunSQL(
                    f'DROP INDEX IF EXISTS "{name}"',
                    f'CREATE INDEX "{name}" ON "{table}" ("{column}")',
                )
                for table, column, name in FK_INDEXES
            ],
        ),
    ]
