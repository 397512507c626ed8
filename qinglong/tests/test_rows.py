"""`qinglong.rows.ModelColumns` loads what the ORM would, on both databases."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.forms.models import model_to_dict

from qinglong import testing
from qinglong.rows import ModelColumns
from runs.models import TaskRevision
from workers.models import WorkerSession

pytestmark = pytest.mark.django_db


def _fetch(sql: str, params: list[Any]) -> tuple[Any, ...]:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    assert row is not None
    return tuple(row)


def test_a_loaded_instance_equals_the_orm_one_field_by_field() -> None:
    session = testing.open_session(labels={"zone": "a"}).session
    columns = ModelColumns(WorkerSession, "s")
    row = _fetch(
        f"SELECT {columns.select()} FROM workers_workersession s WHERE s.id = %s", [session.pk]
    )
    loaded = columns.load(row)
    expected = WorkerSession.objects.get(pk=session.pk)
    assert model_to_dict(loaded) == model_to_dict(expected)
    assert loaded.labels == {"zone": "a"}  # JSON decoded, not a string
    assert loaded.heartbeat_at == expected.heartbeat_at  # an aware datetime
    assert loaded.heartbeat_at.tzinfo is not None
    assert loaded.session_id == expected.session_id  # a UUID
    assert not loaded._state.adding  # "from the database", as a queryset's


def test_columns_left_out_are_deferred_not_defaulted() -> None:
    task = testing.make_task(max_attempts=3)
    revision = task.current_revision
    assert revision is not None
    columns = ModelColumns(TaskRevision, "v", only=["timeout_s"])
    row = _fetch(
        f"SELECT {columns.select()} FROM runs_taskrevision v WHERE v.id = %s", [revision.pk]
    )
    loaded = columns.load(row)
    assert loaded.get_deferred_fields() >= {"max_attempts", "env"}
    assert loaded.max_attempts == 3  # loaded on access, never the field's default (1)
