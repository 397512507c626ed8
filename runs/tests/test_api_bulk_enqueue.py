"""`POST /api/v1/runs` with a list (issue #12): up to 1,000 Runs, all or nothing.

The single-object form answers exactly as before (`test_api_operator.py`).
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext

from qinglong.testing import make_project, make_task
from runs.api.serializers import RunCreateRequestSerializer
from runs.api.views import _plain_run_body
from runs.models import Attempt, Run
from runs.services import MAX_BULK_RUNS, run_enqueue_bulk
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


# ------------------------------------------------- the lean path (issue #12)


def test_each_answer_is_what_the_run_list_then_says(client: Client, op: dict[str, Any]) -> None:
    project = make_project("p")
    make_task(project=project, name="t")
    make_task(project=project, name="u", placement={"required_labels": {"gpu": "a100"}})
    body = [_item(), _item("u", priority=-5), _item(priority=1000)]
    results = post_json(client, f"{API}/runs", body, op).json()["results"]
    listed = {r["id"]: r for r in client.get(f"{API}/runs?limit=100", **op).json()["results"]}
    for result in results:
        summary = {key: value for key, value in result.items() if key in listed[result["id"]]}
        assert summary == listed[result["id"]]
        assert list(summary) == list(listed[result["id"]])  # the same keys in the same order
        assert set(result) - set(summary) == {"unplaceable_now", "unplaceable_reason"}
        single = post_json(client, f"{API}/runs", {"project": "p", "task": result["task"]}, op)
        unplaceable = {k: single.json()[k] for k in ("unplaceable_now", "unplaceable_reason")}
        assert {k: result[k] for k in unplaceable} == unplaceable
    assert [r["unplaceable_now"] for r in results] == [True, True, True]  # no Worker at all
    assert results[1]["unplaceable_reason"]["missing_labels"] == {"gpu": "a100"}


def test_the_runs_and_attempts_are_written_as_the_orm_writes_them() -> None:
    project = make_project("p")
    t = make_task(project=project, name="t")
    u = make_task(project=project, name="u")
    runs = run_enqueue_bulk(items=[(t, 3), (u, -2), (t, 0)])
    assert [(run.task_id, run.priority) for run in runs] == [(t.pk, 3), (u.pk, -2), (t.pk, 0)]
    assert [run.pk for run in runs] == sorted(run.pk for run in runs)
    for run in runs:
        stored = Run.objects.get(pk=run.pk)
        for field in Run._meta.concrete_fields:
            assert getattr(run, field.attname) == getattr(stored, field.attname), field.name
        assert run.task.pk == run.task_id and not run._state.adding
        assert (stored.state, stored.version, stored.cancel_requested) == ("queued", 0, False)
        assert stored.task_revision_id == stored.task.current_revision_id
        assert stored.project_id == project.pk and stored.schedule_id is None
        (attempt,) = Attempt.objects.filter(run=stored)
        assert (attempt.number, attempt.state, attempt.version, attempt.lease_generation) == (
            1,
            "pending",
            0,
            0,
        )
        assert (attempt.priority, attempt.queued_at) == (run.priority, run.queued_at)
        assert (attempt.not_before, attempt.not_before_reason, attempt.error_code) == (None, "", "")
        assert attempt.created_at is not None and stored.finished_at is None


def test_a_bulk_enqueue_inside_a_transaction_goes_with_it() -> None:
    task = make_task(project=make_project("p"), name="t")
    with pytest.raises(RuntimeError), transaction.atomic():
        runs = run_enqueue_bulk(items=[(task, 0)] * 3)
        assert Run.objects.filter(pk__in=[run.pk for run in runs]).count() == 3
        raise RuntimeError("roll back")
    assert not Run.objects.exists() and not Attempt.objects.exists()


@pytest.mark.postgres  # SQLite: the ORM's bulk_create, in batches its variable limit allows
def test_a_list_costs_the_same_statements_whatever_its_length(
    client: Client, op: dict[str, Any]
) -> None:
    project = make_project("p")
    make_task(project=project, name="t")
    make_task(project=project, name="u")
    post_json(client, f"{API}/runs", [_item()], op)  # warm-up
    counts = {}
    for length in (2, 10, MAX_BULK_RUNS):
        body = [_item("t" if i % 2 else "u", priority=i % 7) for i in range(length)]
        with CaptureQueriesContext(connection) as queries:
            response = post_json(client, f"{API}/runs", body, op)
        assert response.status_code == 201
        # Not the savepoint the test's own transaction makes the insert take.
        counts[length] = [q["sql"] for q in queries.captured_queries if "SAVEPOINT" not in q["sql"]]
    assert len(counts[2]) == len(counts[10]) == len(counts[MAX_BULK_RUNS]), counts[2]
    # The Token (with its User and permissions), the Tasks, one INSERT of the
    # Runs and their Attempts, the placement question once (both Tasks have the
    # same executor type and placement).
    assert len(counts[MAX_BULK_RUNS]) == 4, "\n".join(counts[MAX_BULK_RUNS])
    inserts = [s for s in counts[MAX_BULK_RUNS] if "INSERT INTO" in s]
    assert len(inserts) == 1 and "BEGIN" not in counts[MAX_BULK_RUNS]


_BODIES: list[Any] = [
    {"project": "p", "task": "t"},
    {"project": "p", "task": "t", "priority": 0},
    {"project": "p" * 64, "task": "t" * 100, "priority": -1000},
    {"project": "p", "task": "t", "priority": 1000},
    {"project": "p", "task": "t", "priority": 1001},
    {"project": "p", "task": "t", "priority": -1001},
    {"project": "p", "task": "t", "priority": True},
    {"project": "p", "task": "t", "priority": 1.0},
    {"project": "p", "task": "t", "priority": "1"},
    {"project": "p", "task": "t", "priority": None},
    {"project": "p" * 65, "task": "t"},
    {"project": "p", "task": "t" * 101},
    {"project": "", "task": "t"},
    {"project": " ", "task": " t "},
    {"project": "p\x00", "task": "t"},
    {"project": "p", "task": "t\ud800"},
    {"project": "é✓", "task": "t\n"},
    {"project": 5, "task": "t"},
    {"project": None, "task": "t"},
    {"project": ["p"], "task": "t"},
    {"project": "p"},
    {"task": "t"},
    {},
    {"project": "p", "task": "t", "colour": "red"},
    ["p", "t"],
    "p",
    None,
]


def test_plain_bodies_are_what_the_serializer_accepts() -> None:
    """The fast check of an enqueue body never accepts what the serializer would
    refuse or change: whatever it takes, the serializer takes the same way."""
    accepted = 0
    for body in _BODIES:
        plain = _plain_run_body(body)
        serializer = RunCreateRequestSerializer(data=body)
        if plain is not None:
            assert serializer.is_valid(), (body, serializer.errors)
            assert plain == dict(serializer.validated_data), body
            accepted += 1
        elif isinstance(body, dict) and serializer.is_valid():
            raise AssertionError(f"the serializer accepts {body!r}: the fast check should too")
    assert accepted == 6
