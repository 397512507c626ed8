"""Why a Run waits, and whether it can be placed at all (issue 11, docs/adr/0012).

`GET /api/v1/runs/{id}` answers `waiting` for a queued Run: the first rule
that holds it back, in operator words, computed on demand in a fixed number
of statements. `POST /api/v1/runs` (one or a list) answers `unplaceable_now`
and its reason when no enrolled Worker has the Task's executor type and
required labels; the Run is queued all the same.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from dispatch.adapters.waiting import placement_unmatched, run_waiting
from dispatch.cycles import dispatch_set_paused
from qinglong import testing
from qinglong.clock import db_now
from runs.models import Attempt, Run, RunState
from runs.services import project_create
from workers.models import Worker, WorkerAdminState
from workers.tests.api_helpers import API, operator_headers, post_json

pytestmark = pytest.mark.django_db

GPU = {"required_labels": {"gpu": "a100", "zone": "eu"}}


@pytest.fixture
def op() -> dict[str, Any]:
    return operator_headers()


def waiting(client: Client, op: dict[str, Any], run: Run) -> dict[str, Any] | None:
    response = client.get(f"{API}/runs/{run.pk}", **op)
    assert response.status_code == 200
    answer: dict[str, Any] | None = response.json()["waiting"]
    return answer


def fill(session: Any, count: int) -> None:
    """Take `count` of the Session's slots with claims of an unrelated Task."""
    task = testing.make_task()
    for _ in range(count):
        outcome, _, _ = testing.claim(testing.pending_attempt(testing.make_run(task)), session)
        assert outcome.status == "won"


# ------------------------------------------------------------- the reasons


def test_no_online_worker_names_what_none_has(client: Client, op: dict[str, Any]) -> None:
    run = testing.make_run(placement=GPU)
    answer = waiting(client, op, run)
    assert answer is not None
    assert answer["reason"] == "no_matching_worker"
    assert answer["missing_executor_type"] == "process"
    assert answer["missing_labels"] == {"gpu": "a100", "zone": "eu"}
    assert "executor type process" in answer["message"]
    assert "gpu=a100, zone=eu" in answer["message"]

    testing.open_session(labels={"zone": "eu", "gpu": "t4"})
    answer = waiting(client, op, run)
    assert answer is not None
    assert (answer["missing_executor_type"], answer["missing_labels"]) == (None, {"gpu": "a100"})
    assert answer["message"] == "No online Worker has label gpu=a100."


def test_requirements_spread_over_workers_are_no_match_either(
    client: Client, op: dict[str, Any]
) -> None:
    run = testing.make_run(placement=GPU)
    testing.open_session(labels={"gpu": "a100"})
    testing.open_session(labels={"zone": "eu"})
    answer = waiting(client, op, run)
    assert answer is not None
    assert answer["reason"] == "no_matching_worker"
    assert (answer["missing_executor_type"], answer["missing_labels"]) == (None, {})
    assert "No single online Worker has all of" in answer["message"]


def test_matching_workers_all_full_then_eligible(client: Client, op: dict[str, Any]) -> None:
    run = testing.make_run(placement=GPU)
    session = testing.open_session(slots=1, labels={"gpu": "a100", "zone": "eu"}).session
    fill(session, 1)
    answer = waiting(client, op, run)
    assert answer is not None
    assert (answer["reason"], answer["matching_workers"]) == ("workers_full", 1)
    assert (
        "All 1 online Workers with executor type process and labels gpu=a100" in (answer["message"])
    )
    testing.open_session(labels={"gpu": "a100", "zone": "eu"})
    answer = waiting(client, op, run)
    assert answer is not None
    assert (answer["reason"], answer["matching_workers"]) == ("eligible", 2)


def test_a_project_at_its_limit_says_n_of_m(client: Client, op: dict[str, Any]) -> None:
    project = project_create(slug="limited", name="Limited", max_concurrent_runs=1)
    task = testing.make_task(project)
    first, second = testing.make_run(task), testing.make_run(task)
    session = testing.open_session(slots=4).session
    testing.claim(testing.pending_attempt(first), session)
    answer = waiting(client, op, second)
    assert answer is not None
    assert (answer["reason"], answer["active"], answer["limit"]) == ("project_limit", 1, 1)
    assert answer["message"] == "Project limited is at its limit: 1 of 1 Runs running."
    assert waiting(client, op, first) is None  # dispatching: not waiting


def test_a_task_at_its_limit_says_n_of_m(client: Client, op: dict[str, Any]) -> None:
    task = testing.make_task(max_concurrent_runs=2)
    runs = [testing.make_run(task) for _ in range(3)]
    session = testing.open_session(slots=4).session
    for run in runs[:2]:
        testing.claim(testing.pending_attempt(run), session)
    answer = waiting(client, op, runs[2])
    assert answer is not None
    assert (answer["reason"], answer["active"], answer["limit"]) == ("task_limit", 2, 2)


def test_a_backoff_says_until_when_and_why(client: Client, op: dict[str, Any]) -> None:
    run = testing.make_run()
    testing.open_session()
    until = db_now() + timedelta(seconds=90)
    Attempt.objects.filter(run=run).update(not_before=until, not_before_reason="retry_backoff")
    answer = waiting(client, op, run)
    assert answer is not None
    assert (answer["reason"], answer["backoff"]) == ("backoff", "retry_backoff")
    assert answer["until"] is not None and answer["until"].endswith("Z")
    assert "retry policy" in answer["message"]


def test_paused_dispatch_comes_first(client: Client, op: dict[str, Any]) -> None:
    run = testing.make_run(placement=GPU)
    dispatch_set_paused(paused=True, reason="maintenance", actor="test")
    answer = waiting(client, op, run)
    assert answer is not None
    assert answer["reason"] == "dispatch_paused"
    dispatch_set_paused(paused=False, actor="test")
    answer = waiting(client, op, run)
    assert answer is not None
    assert answer["reason"] == "no_matching_worker"


def test_a_finished_run_is_not_waiting(client: Client, op: dict[str, Any]) -> None:
    run = testing.make_run()
    Run.objects.filter(pk=run.pk).update(state=RunState.CANCELLED)
    assert waiting(client, op, run) is None


def test_the_answer_costs_the_same_whatever_is_queued_or_online() -> None:
    run = testing.make_run(placement=GPU)
    counts = []
    for extra_runs, extra_sessions in ((0, 0), (150, 12)):
        task = testing.make_task()
        for _ in range(extra_runs):
            testing.make_run(task)
        for _ in range(extra_sessions):
            testing.open_session(labels={"gpu": "a100", "zone": "eu"})
        with CaptureQueriesContext(connection) as queries:
            assert run_waiting(run.pk) is not None
        counts.append(len(queries.captured_queries))
    assert counts[0] == counts[1] <= 6


# ------------------------------------------------------------- at enqueue


def test_enqueue_flags_a_run_no_enrolled_worker_can_take(
    client: Client, op: dict[str, Any]
) -> None:
    project = testing.make_project("p")
    testing.make_task(project, name="gpu", placement=GPU)
    testing.make_task(project, name="plain")
    testing.make_worker(labels={"zone": "eu"})  # enrolled: can take plain Runs only
    created = post_json(client, f"{API}/runs", {"project": "p", "task": "gpu"}, op)
    assert created.status_code == 201
    body = created.json()
    assert body["state"] == "queued"  # accepted all the same
    assert body["unplaceable_now"] is True
    reason = body["unplaceable_reason"]
    assert reason["reason"] == "no_enrolled_worker"
    assert reason["missing_labels"] == {"gpu": "a100"}
    assert body["waiting"]["reason"] == "no_matching_worker"

    plain = post_json(client, f"{API}/runs", {"project": "p", "task": "plain"}, op).json()
    assert (plain["unplaceable_now"], plain["unplaceable_reason"]) == (False, None)


def test_an_enrolled_worker_counts_even_offline_but_not_disabled(
    client: Client, op: dict[str, Any]
) -> None:
    project = testing.make_project("p")
    task = testing.make_task(project, name="gpu", placement=GPU)
    worker, _ = testing.make_worker(labels={"gpu": "a100", "zone": "eu"})  # no Session
    assert task.current_revision is not None
    assert placement_unmatched(task.current_revision) is None
    body = post_json(client, f"{API}/runs", {"project": "p", "task": "gpu"}, op).json()
    assert body["unplaceable_now"] is False
    Worker.objects.filter(pk=worker.pk).update(admin_state=WorkerAdminState.DISABLED)
    body = post_json(client, f"{API}/runs", {"project": "p", "task": "gpu"}, op).json()
    assert body["unplaceable_now"] is True


def test_a_bulk_enqueue_flags_each_run(client: Client, op: dict[str, Any]) -> None:
    project = testing.make_project("p")
    testing.make_task(project, name="gpu", placement=GPU)
    testing.make_task(project, name="docker", executor_type="docker")
    testing.make_task(project, name="plain")
    testing.make_worker(labels={"gpu": "t4"})
    items = [{"project": "p", "task": name} for name in ("gpu", "plain", "docker", "gpu")]
    response = post_json(client, f"{API}/runs", items, op)
    assert response.status_code == 201
    results = response.json()["results"]
    assert [r["unplaceable_now"] for r in results] == [True, False, True, True]
    assert results[0]["unplaceable_reason"]["missing_labels"] == {"gpu": "a100", "zone": "eu"}
    docker = results[2]["unplaceable_reason"]
    assert (docker["missing_executor_type"], docker["missing_labels"]) == ("docker", {})
    assert docker["message"] == "No enrolled Worker has executor type docker."


def test_the_schema_documents_waiting_and_unplaceable(client: Client) -> None:
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    components = schema["components"]["schemas"]
    assert "waiting" in components["RunDetail"]["properties"]
    assert set(components["Waiting"]["properties"]) >= {"reason", "message", "until", "active"}
    enqueued = components["RunEnqueued"]["properties"]
    assert {"unplaceable_now", "unplaceable_reason", "waiting"} <= set(enqueued)
    assert "unplaceable_now" in components["RunEnqueuedSummary"]["properties"]


# ------------------------------------------------------------- nothing leaks


def test_waiting_and_unplaceable_answers_carry_no_secret(
    client: Client, op: dict[str, Any]
) -> None:
    project = testing.make_project("p")
    testing.make_task(
        project,
        name="canary",
        **{
            k: v
            for k, v in testing.canary_definition(placement=GPU).items()
            if k != "executor_type"
        },
    )
    one = post_json(client, f"{API}/runs", {"project": "p", "task": "canary"}, op)
    many = post_json(client, f"{API}/runs", [{"project": "p", "task": "canary"}], op)
    detail = client.get(f"{API}/runs/{one.json()['id']}", **op)
    for response in (one, many, detail):
        text = response.content.decode()
        for canary in (testing.CANARY_COMMAND, testing.CANARY_ENV, testing.CANARY_CWD):
            assert canary not in text
