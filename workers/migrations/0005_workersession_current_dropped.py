# workersession_current (worker_id WHERE state IN ('online', 'draining')) duplicated
# the unique workersession_one_current: same column, same condition, so every read
# it served the unique index serves the same way. Each heartbeat updates the row
# without HOT (heartbeat_at is indexed) and so wrote an entry into both (issue #12).

from __future__ import annotations

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("workers", "0004_workersession_fewer_indexes"),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name="workersession",
            name="workersession_current",
        ),
    ]
