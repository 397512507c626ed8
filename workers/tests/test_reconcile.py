"""Lost executions and the reconcile report (issue 10, finding 1, server side; docs/adr/0005).

When a Session is replaced, goes offline or is fenced while an Attempt is
started, the Attempt is `lost` with a reason an operator can read and its
retry waits `QL_LOST_EXECUTION_GRACE_S`, so it never overlaps the old process
if that still runs; a restarted Worker's reconcile report that the process is
gone lifts the wait at once.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.test import Client
from django.test.utils import override_settings

from dispatch.sweeps import sweep_stale_sessions
from leases.models import LeaseState, RunLease
from leases.tests.timeshift import rewind
from qinglong.clock import db_now
from qinglong.testing import make_run, make_worker, open_session
from runs.models import Attempt, AttemptState, Run, RunState
from workers.models import Worker, WorkerAdminState
from workers.services import worker_rotate_credential, worker_set_admin_state
from workers.tests.api_helpers import (
    API,
    PHASE_EXTRA,
    WORKER_API,
    WorkerClient,
    bearer,
    error_code,
    operator_headers,
    post_json,
    state_snapshot,
)

pytestmark = pytest.mark.django_db


def _running(worker: WorkerClient, *, max_attempts: int = 2) -> tuple[dict[str, Any], str, Run]:
    run = make_run(max_attempts=max_attempts)
    response, _, token = worker.pull(max_offers=1)
    (offer,) = response.json()["offers"]
    for phase in ("starting", "running"):
        assert worker.ack(offer, phase, token, **PHASE_EXTRA[phase]).status_code == 200
    return offer, token, run


def _restart(client: Client, worker: WorkerClient) -> WorkerClient:
    """The agent restarted: it opens a new Session, which fences the old one."""
    return WorkerClient(client, open_session(worker.worker).token, worker.worker)


def _report(offer: dict[str, Any], token: str, **extra: Any) -> dict[str, Any]:
    return {"offer_id": offer["offer_id"], "lease_token": token, "outcome": "killed", **extra}


def _retry(run: Run) -> Attempt:
    return Attempt.objects.get(run=run, number=2)


def test_a_replaced_sessions_running_attempt_is_lost_and_its_retry_waits_the_grace(
    client: Client,
) -> None:
    old = WorkerClient.open(client, slots=1)
    offer, _, run = _running(old)
    before = db_now()
    new = _restart(client, old)
    lease = RunLease.objects.get(offer_id=offer["offer_id"])
    assert (lease.state, lease.end_reason) == (LeaseState.REVOKED, "worker_restarted")
    lost = lease.attempt
    assert (lost.state, lost.error_code) == (AttemptState.LOST, "worker_restarted")
    retry = _retry(run)
    grace = timedelta(seconds=settings.QINGLONG_LOST_EXECUTION_GRACE_S)
    assert retry.state == AttemptState.PENDING
    assert retry.not_before_reason == "lost_execution_grace"
    assert retry.not_before is not None
    assert before + grace <= retry.not_before <= db_now() + grace
    # The finding: the retry used to start while the orphan still ran. Now no
    # Worker, the restarted one included, may claim it during the grace.
    bystander = WorkerClient.open(client, slots=1)
    for puller in (new, bystander):
        response, _, _ = puller.pull()
        assert response.json()["offers"] == []
    rewind(grace.total_seconds() - 1)
    assert bystander.pull()[0].json()["offers"] == []
    # Once the grace has passed it is claimable without any report.
    rewind(1)
    (offer2,) = bystander.pull()[0].json()["offers"]
    assert offer2["attempt_id"] == str(retry.pk)


def test_a_reconcile_report_makes_the_retry_claimable_at_once(client: Client) -> None:
    old = WorkerClient.open(client, slots=1)
    offer, token, run = _running(old)
    new = _restart(client, old)
    bystander = WorkerClient.open(client, slots=1)
    assert bystander.pull()[0].json()["offers"] == []
    response = new.reconcile([_report(offer, token, outcome="killed", exit_code=-9)])
    assert response.status_code == 200, response.content
    assert response.json() == {"results": [{"offer_id": offer["offer_id"], "status": "confirmed"}]}
    retry = _retry(run)
    assert (retry.not_before, retry.not_before_reason) == (None, "")
    lease = RunLease.objects.get(offer_id=offer["offer_id"])
    generation = new.worker.sessions.order_by("-generation").values_list("generation", flat=True)[0]
    assert lease.execution_confirmed_at is not None
    assert (lease.execution_outcome, lease.execution_exit_code, lease.execution_confirmed_by) == (
        "killed",
        -9,
        f"worker:{new.worker.pk} session:{generation}",
    )
    (claimed,) = bystander.pull()[0].json()["offers"]
    assert claimed["attempt_id"] == str(retry.pk)
    # Operators see who confirmed what, as text, in the Run's API record.
    detail = client.get(f"{API}/runs/{run.pk}", **operator_headers())
    assert detail.status_code == 200, detail.content
    (first, second) = detail.json()["attempts"]
    assert first["error_code"] == "worker_restarted"
    (facts,) = first["leases"]
    assert (facts["execution_outcome"], facts["execution_exit_code"]) == ("killed", -9)
    assert facts["execution_confirmed_by"].startswith(f"worker:{new.worker.pk} ")
    assert second["not_before"] is None


def test_a_report_is_idempotent_and_a_repeat_changes_nothing(client: Client) -> None:
    old = WorkerClient.open(client, slots=1)
    offer, token, _ = _running(old)
    new = _restart(client, old)
    first = new.reconcile([_report(offer, token, outcome="exited", exit_code=0)])
    assert first.json()["results"][0]["status"] == "confirmed"
    snapshot = state_snapshot()
    recorded = RunLease.objects.get(offer_id=offer["offer_id"]).execution_confirmed_at
    again = new.reconcile([_report(offer, token, outcome="killed"), _report(offer, token)])
    assert [r["status"] for r in again.json()["results"]] == ["already_confirmed"] * 2
    assert state_snapshot() == snapshot
    lease = RunLease.objects.get(offer_id=offer["offer_id"])
    assert (lease.execution_confirmed_at, lease.execution_outcome) == (recorded, "exited")


def test_unknown_ids_wrong_tokens_and_other_workers_leases_get_one_answer(
    client: Client,
) -> None:
    old = WorkerClient.open(client, slots=1)
    offer, token, run = _running(old)
    stranger = WorkerClient.open(client, slots=1)
    new = _restart(client, old)
    snapshot = state_snapshot()
    items = [
        {"offer_id": "ef" * 32, "lease_token": token, "outcome": "killed"},
        _report(offer, "A" * 43),
    ]
    mine = new.reconcile(items)
    theirs = stranger.reconcile([_report(offer, token)])
    assert mine.status_code == theirs.status_code == 200
    assert [r["status"] for r in mine.json()["results"]] == ["unknown", "unknown"]
    # Another Worker presenting the right token learns nothing either.
    assert theirs.json() == {"results": [{"offer_id": offer["offer_id"], "status": "unknown"}]}
    assert state_snapshot() == snapshot
    assert _retry(run).not_before is not None


@pytest.mark.parametrize(
    "end",
    ["offline", "credential_rotated", "worker_disabled"],
)
def test_every_loss_of_sight_holds_the_retry_back(client: Client, end: str) -> None:
    worker = WorkerClient.open(client, slots=1)
    offer, _, run = _running(worker)
    if end == "offline":
        rewind(settings.QINGLONG_SESSION_TIMEOUT_S + 1)
        assert sweep_stale_sessions().applied == 1
        reason = "worker_lost"
    elif end == "credential_rotated":
        worker_rotate_credential(worker=Worker.objects.get(pk=worker.worker.pk))
        reason = "credential_rotated"
    else:
        worker_set_admin_state(
            worker=Worker.objects.get(pk=worker.worker.pk), admin_state=WorkerAdminState.DISABLED
        )
        reason = "worker_disabled"
    lease = RunLease.objects.get(offer_id=offer["offer_id"])
    assert (lease.end_reason, lease.attempt.state, lease.attempt.error_code) == (
        reason,
        AttemptState.LOST,
        reason,
    )
    retry = _retry(run)
    assert retry.not_before is not None and retry.not_before > db_now()
    assert retry.not_before_reason == "lost_execution_grace"


def test_a_claimed_only_attempt_returns_to_pending_at_once(client: Client) -> None:
    old = WorkerClient.open(client, slots=1)
    run = make_run()
    (offer,) = old.pull()[0].json()["offers"]
    _restart(client, old)
    (attempt,) = Attempt.objects.filter(run=run)
    # Nothing ran: the same Attempt is queued again, with no wait.
    assert (attempt.state, attempt.not_before) == (AttemptState.PENDING, None)
    assert Run.objects.get(pk=run.pk).state == RunState.QUEUED
    assert RunLease.objects.get(offer_id=offer["offer_id"]).end_reason == "worker_restarted"


def test_a_report_made_while_the_lease_was_still_active_spares_the_later_retry_its_wait(
    client: Client,
) -> None:
    worker = WorkerClient.open(client, slots=1)
    offer, token, run = _running(worker)
    response = worker.reconcile([_report(offer, token, outcome="exited", exit_code=3)])
    assert response.json()["results"][0]["status"] == "confirmed"
    lease = RunLease.objects.get(offer_id=offer["offer_id"])
    assert lease.state == LeaseState.ACTIVE  # a report ends nothing by itself
    _restart(client, worker)
    retry = _retry(run)
    assert (retry.state, retry.not_before) == (AttemptState.PENDING, None)


@override_settings(QINGLONG_LOST_EXECUTION_GRACE_S=0)
def test_a_zero_grace_retries_at_once(client: Client) -> None:
    worker = WorkerClient.open(client, slots=1)
    _, _, run = _running(worker)
    _restart(client, worker)
    assert _retry(run).not_before is None


@pytest.mark.parametrize(
    "body",
    [
        {"executions": []},
        {"executions": [{}] * 65},
        {"executions": "x"},
        {},
        {"executions": [], "extra": 1},
        {"executions": [{"offer_id": "ab" * 32, "lease_token": "A" * 43}]},
        {"executions": [{"offer_id": "ab" * 32, "lease_token": "A" * 43, "outcome": "gone"}]},
        {"executions": [{"offer_id": "AB" * 32, "lease_token": "A" * 43, "outcome": "killed"}]},
        {"executions": [{"offer_id": "ab" * 32, "lease_token": "short", "outcome": "killed"}]},
        {
            "executions": [
                {"offer_id": "ab" * 32, "lease_token": "A" * 43, "outcome": "exited", "x": 1}
            ]
        },
        {
            "executions": [
                {
                    "offer_id": "ab" * 32,
                    "lease_token": "A" * 43,
                    "outcome": "exited",
                    "exit_code": "0",
                }
            ]
        },
    ],
)
def test_a_bad_report_is_a_400_that_changes_nothing(client: Client, body: dict[str, Any]) -> None:
    worker = WorkerClient.open(client, slots=1)
    _running(worker)
    snapshot = state_snapshot()
    response = post_json(client, f"{WORKER_API}/reconcile", body, bearer(worker.token))
    assert response.status_code == 400, response.content
    assert error_code(response) in {"invalid_request", "unknown_field"}
    assert state_snapshot() == snapshot


def test_reconcile_needs_a_current_session(client: Client) -> None:
    old = WorkerClient.open(client, slots=1)
    offer, token, _ = _running(old)
    _restart(client, old)
    response = old.reconcile([_report(offer, token)])
    assert response.status_code == 401
    assert error_code(response) == "session_replaced"


def test_a_worker_credential_is_not_a_session_token(client: Client) -> None:
    _, credential = make_worker()
    worker = WorkerClient.open(client, slots=1)
    offer, token, _ = _running(worker)
    snapshot = state_snapshot()
    impostor = WorkerClient(client, credential, worker.worker)
    assert impostor.reconcile([_report(offer, token)]).status_code == 401
    assert state_snapshot() == snapshot
