"""One cwd rule (issue 8, item 7): relative to the Worker's work directory.

The shared validator (dispatch.core.spec.validate_cwd) refuses an absolute cwd
or an escape on task create and edit (a 400 through the operator API) and
stores the normalized form. A revision stored before the rule with an
absolute cwd is re-validated at dispatch: its Run is skipped (fail closed, the
cycle goes on with the others) and stays queued for an operator to cancel or
re-point, never handed to a Worker and never a crash.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.core.cache import cache
from django.test import Client

from dispatch.core.ports import DispatchScope
from dispatch.core.result import CycleReason
from dispatch.cycles import dispatch_cycle
from dispatch.models import DispatchCycle
from leases.end import run_cancel
from leases.models import RunLease
from qinglong.testing import CANARY_CWD, make_project, make_run, make_task, open_session
from runs.models import RunState, Task, TaskRevision
from runs.services import run_enqueue
from workers.tests.api_helpers import API, error_code, operator_headers, post_json, put_json

pytestmark = pytest.mark.django_db

TASK = {"name": "job", "executor_type": "process", "command": ["true"], "timeout_s": 60}
ESCAPES = [
    (f"/{CANARY_CWD}", "relative path inside the Worker's work directory"),
    (f"../{CANARY_CWD}", "'..' segment"),
    (f"{CANARY_CWD}/../..", "'..' segment"),
    (f"C:/{CANARY_CWD}", "no drive letter"),
    (f"{CANARY_CWD}\\..", "'/'"),
]


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    cache.clear()
    yield
    cache.clear()


@pytest.fixture
def op() -> dict[str, Any]:
    return operator_headers()


@pytest.mark.parametrize(("cwd", "rule"), ESCAPES)
def test_creating_a_task_with_a_cwd_outside_the_work_directory_is_a_400(
    client: Client, op: dict[str, Any], cwd: str, rule: str
) -> None:
    make_project("p")
    response = post_json(client, f"{API}/projects/p/tasks", {**TASK, "cwd": cwd}, op)
    assert response.status_code == 400
    assert error_code(response) == "invalid_definition"
    message = response.json()["error"]["message"]
    assert message.startswith("cwd") and rule in message
    assert "CANARY-CWD" not in response.content.decode()
    assert not Task.objects.exists()


@pytest.mark.parametrize(("cwd", "rule"), ESCAPES[:2])
def test_editing_a_task_to_such_a_cwd_is_a_400_and_keeps_its_revision(
    client: Client, op: dict[str, Any], cwd: str, rule: str
) -> None:
    make_task(project=make_project("p"), name="job")
    edit = {k: v for k, v in TASK.items() if k != "name"} | {"cwd": cwd}
    response = put_json(client, f"{API}/projects/p/tasks/job", edit, op)
    assert response.status_code == 400
    assert rule in response.json()["error"]["message"]
    assert TaskRevision.objects.filter(task__name="job").count() == 1


def test_a_relative_cwd_is_stored_normalized(client: Client, op: dict[str, Any]) -> None:
    make_project("p")
    body = {**TASK, "cwd": "./jobs//nightly/"}
    assert post_json(client, f"{API}/projects/p/tasks", body, op).status_code == 201
    revision = TaskRevision.objects.get(task__name="job")
    assert revision.cwd == "jobs/nightly"


def _legacy_task(*, cwd: str) -> Task:
    """A Task whose current revision was stored before the cwd rule existed
    (rows are immutable, so it is written as it would have been then)."""
    task = make_task(cwd="jobs")
    current = task.current_revision
    assert current is not None
    fields = {
        name: getattr(current, name)
        for name in (
            "executor_type",
            "command",
            "env",
            "timeout_s",
            "resources",
            "placement",
            "max_attempts",
        )
    }
    old = TaskRevision.objects.create(task=task, revision=2, cwd=cwd, **fields)
    task.current_revision = old
    task.save(update_fields=["current_revision"])
    return task


def test_a_stored_revision_with_an_absolute_cwd_is_skipped_at_dispatch_not_offered() -> None:
    open_session(slots=2)
    legacy = run_enqueue(task=_legacy_task(cwd="/srv/legacy"))
    good = make_run()
    result = dispatch_cycle(scope=DispatchScope.global_())
    # The cycle went on past the bad candidate: the good Run got its lease.
    assert [offer.run_id for offer in result.offers] == [str(good.pk)]
    assert not RunLease.objects.filter(run=legacy).exists()
    legacy.refresh_from_db()
    assert legacy.state == RunState.QUEUED
    assert result.counts.claims_attempted == 1
    row = DispatchCycle.objects.order_by("-id").first()
    assert row is not None and "/srv/legacy" not in str(row.__dict__)
    # Alone, it is a recorded skip with a reason, every cycle, never a claim.
    alone = dispatch_cycle(scope=DispatchScope.global_())
    assert alone.offers == ()
    assert alone.reason == CycleReason.PLAN_MISSING
    # An operator can still end it.
    run_cancel(run=legacy, actor="test")
    legacy.refresh_from_db()
    assert legacy.state == RunState.CANCELLED
