"""`POST /api/v1/runs` with a list (issue #12): up to 1,000 Runs, all or nothing.

The single-object form answers exactly as before (`test_api_operator.py`).
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from qinglong.testing import make_project, make_task
from runs.models import Attempt, Run
from runs.services import MAX_BULK_RUNS
from workers.tests.api_helpers import API, error_code, operator_headers, post_json

pytestmark = pytest.mark.django_db


@pytest.fixture
def op() -> dict[str, Any]:
    return operator_headers()


def _item(task: str = "t", **extra: Any) -> dict[str, Any]:
    return {"project": "p", "task": task, **extra}


def test_a_list_enqueues_every_run_in_order_in_one_transaction(
    client: Client, op: dict[str, Any]
) -> None:
    project = make_project("p")
    t = make_task(project=project, name="t")
    u = make_task(project=project, name="u")
    body = [_item(), _item("u", priority=7), _item(priority=-3)]
    with CaptureQueriesContext(connection) as queries:
        response = post_json(client, f"{API}/runs", body, op)
    assert response.status_code == 201, response.content
    results = response.json()["results"]
    assert [(r["task"], r["priority"], r["state"]) for r in results] == [
        ("t", 0, "queued"),
        ("u", 7, "queued"),
        ("t", -3, "queued"),
    ]
    runs = {str(run.pk): run for run in Run.objects.all()}
    assert [r["id"] for r in results] == sorted(runs, key=int)
    for result in results:
        run = runs[result["id"]]
        assert result["task_revision"] == run.task_revision.revision
        assert result["project"] == "p"
        # Attempt #1 pending, with the Run's priority and queue position.
        (attempt,) = Attempt.objects.filter(run=run)
        assert (attempt.number, attempt.state) == (1, "pending")
        assert (attempt.priority, attempt.queued_at) == (run.priority, run.queued_at)
    assert {run.task_id for run in runs.values()} == {t.pk, u.pk}
    assert len({run.queued_at for run in runs.values()}) == 1  # one instant: request order kept
    # Bounded work: the number of statements does not depend on the list's length.
    assert len(queries.captured_queries) <= 12


def test_the_first_bad_item_is_named_and_nothing_is_enqueued(
    client: Client, op: dict[str, Any]
) -> None:
    make_task(project=make_project("p"), name="t")
    cases = [
        ([_item(), _item(), _item(priority=1001)], "items[2].priority: max_value"),
        ([_item(), _item(priority="1")], "items[1].priority: invalid"),
        ([_item(), _item("nope"), _item("nope2")], "items[1].task: not_found"),
        ([_item(), "not an object"], "items[1].body: not_object"),
        ([_item(), {"project": "p"}], "items[1].task: required"),
    ]
    for body, message in cases:
        response = post_json(client, f"{API}/runs", body, op)
        assert response.status_code == 400, (body, response.content)
        assert error_code(response) == "invalid_request"
        assert message in response.json()["error"]["message"], response.json()
    unknown = post_json(client, f"{API}/runs", [_item(), _item(colour="red")], op)
    assert unknown.status_code == 400
    assert error_code(unknown) == "unknown_field"
    assert "items[1].colour" in unknown.json()["error"]["message"]
    assert not Run.objects.exists()
    assert not Attempt.objects.exists()


def test_a_list_is_one_to_a_thousand_runs(client: Client, op: dict[str, Any]) -> None:
    make_task(project=make_project("p"), name="t")
    for body in ([], [_item()] * (MAX_BULK_RUNS + 1)):
        response = post_json(client, f"{API}/runs", body, op)
        assert response.status_code == 400
        assert error_code(response) == "invalid_request"
    assert not Run.objects.exists()
    full = post_json(client, f"{API}/runs", [_item()] * MAX_BULK_RUNS, op)
    assert full.status_code == 201
    assert len(full.json()["results"]) == MAX_BULK_RUNS
    assert Run.objects.count() == Attempt.objects.count() == MAX_BULK_RUNS


def test_errors_name_fields_never_values(client: Client, op: dict[str, Any]) -> None:
    make_task(project=make_project("p"), name="t")
    secret = "CANARY-BULK-1f2e3d"
    for body in (
        [_item(), {"project": "p", "task": secret}],
        [_item(), {"project": secret, "task": "t"}],
        [_item(), {"project": "p", "task": "t", "priority": secret}],
    ):
        response = post_json(client, f"{API}/runs", body, op)
        assert response.status_code == 400
        assert secret not in response.content.decode()


def test_the_list_needs_the_same_permission_as_one_run(client: Client) -> None:
    make_task(project=make_project("p"), name="t")
    viewer = operator_headers(perms=("runs.view_run",))
    response = post_json(client, f"{API}/runs", [_item()], viewer)
    assert response.status_code == 403
    assert error_code(response) == "permission_denied"
    assert not Run.objects.exists()
