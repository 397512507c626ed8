"""TaskRevision immutability and Run pinning."""

from __future__ import annotations

import pytest

from qinglong.testing import definition, make_run, make_task
from runs.models import ImmutableRevision, TaskRevision
from runs.services import attempt_spec, task_update

pytestmark = pytest.mark.django_db


def test_editing_a_task_creates_the_next_revision():
    task = make_task()
    first = task.current_revision
    second = task_update(task=task, definition=definition(command=["echo", "v2"]))
    task.refresh_from_db()
    assert (first.revision, second.revision) == (1, 2)
    assert task.current_revision == second
    assert TaskRevision.objects.filter(task=task).count() == 2
    assert first.command == ["echo", "hello"]  # the old revision is untouched
    assert TaskRevision.objects.get(pk=first.pk).command == ["echo", "hello"]


def test_existing_run_keeps_its_revision_after_an_edit():
    task = make_task()
    run = make_run(task)
    task_update(task=task, definition=definition(command=["echo", "v2"]))
    run.refresh_from_db()
    assert run.task_revision.revision == 1
    spec = attempt_spec(attempt=run.attempts.get(), run=run, revision=run.task_revision)
    assert spec["command"] == ["echo", "hello"]
    assert make_run(task).task_revision.revision == 2


def test_a_revision_cannot_be_changed_in_place():
    revision = make_task().current_revision
    revision.command = ["rm", "-rf", "/"]
    with pytest.raises(ImmutableRevision):
        revision.save()
    with pytest.raises(ImmutableRevision):
        TaskRevision.objects.filter(pk=revision.pk).update(command=["x"])
    assert TaskRevision.objects.get(pk=revision.pk).command == ["echo", "hello"]
