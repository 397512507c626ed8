"""The Worker protocol end to end over HTTP (README "Worker API")."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from leases.models import LeaseState, RunLease
from qinglong.testing import make_run, make_worker
from runs.models import Attempt, Run
from workers.models import SessionState, WorkerSession
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


def _states(run: Run) -> tuple[str, str]:
    run.refresh_from_db()
    attempt = Attempt.objects.filter(run=run).order_by("-number").first()
    assert attempt is not None
    return run.state, attempt.state


def test_open_session_returns_a_token_once_and_fences_the_previous_one(client: Client) -> None:
    _worker, credential = make_worker(slots=3, labels={"zone": "a"})
    body = {"executor_types": ["process"], "labels": {"zone": "a"}, "slots": 2}
    first = post_json(client, f"{WORKER_API}/sessions", body, bearer(credential))
    assert first.status_code == 201, first.content
    data = first.json()
    assert set(data) == {
        "session_id",
        "generation",
        "session_token",
        "heartbeat_interval_s",
        "session_timeout_s",
        "lease_ttl_s",
    }
    assert data["generation"] == 1
    assert data["session_timeout_s"] == settings.QINGLONG_SESSION_TIMEOUT_S
    second = post_json(client, f"{WORKER_API}/sessions", body, bearer(credential))
    assert second.json()["generation"] == 2
    old = post_json(client, f"{WORKER_API}/heartbeat", {}, bearer(data["session_token"]))
    assert old.status_code == 401
    assert error_code(old) == "session_replaced"
    session = WorkerSession.objects.get(session_id=second.json()["session_id"])
    assert session.labels == {"zone": "a"}  # the enrolled labels
    assert session.slots == 2


def test_whole_protocol_from_claim_to_success(client: Client) -> None:
    run = make_run()
    worker = WorkerClient.open(client, slots=2)

    first, _, token = worker.pull()
    assert first.status_code == 200, first.content
    body = first.json()
    assert body["status"] == "offered" and body["truncated"] is False
    [offer] = body["offers"]
    assert offer["source"] == "new_claim"
    assert offer["lease"]["token"] == token
    assert offer["run_id"] == str(run.pk)
    assert _states(run) == ("dispatching", "claimed")

    # Delivered again before `starting`: the same lease, spec and token authority.
    again, _, _ = worker.pull()
    [same] = again.json()["offers"]
    assert same["offer_id"] == offer["offer_id"]
    assert same["spec_sha256"] == offer["spec_sha256"]
    assert same["source"] == "lease_recovery"
    assert same["lease"]["token"] is None  # another pull id: the Worker keeps its own
    assert _states(run) == ("dispatching", "claimed")

    starting = worker.ack(offer, "starting", token)
    assert starting.status_code == 200, starting.content
    assert starting.json() == {
        "offer_id": offer["offer_id"],
        "attempt_state": "starting",
        "run_state": "running",
        "cancel_requested": False,
    }
    assert _states(run) == ("running", "starting")

    # After `starting` the spec is never sent again.
    after, _, _ = worker.pull()
    assert after.status_code == 200
    assert after.json()["offers"] == []

    running = worker.ack(offer, "running", token, executor_handle="pid:42")
    assert running.json()["attempt_state"] == "running"
    assert _states(run) == ("running", "running")

    done = worker.ack(offer, "succeeded", token, exit_code=0)
    assert done.status_code == 200
    assert done.json()["attempt_state"] == "succeeded"
    assert done.json()["run_state"] == "succeeded"
    assert _states(run) == ("succeeded", "succeeded")
    assert RunLease.objects.get(offer_id=offer["offer_id"]).state == LeaseState.RELEASED

    # A repeat of the same phase is idempotent.
    repeat = worker.ack(offer, "succeeded", token, exit_code=0)
    assert repeat.status_code == 200
    assert repeat.json()["attempt_state"] == "succeeded"


def test_lost_response_repeat_rebuilds_the_same_offer_with_the_token(client: Client) -> None:
    make_run()
    worker = WorkerClient.open(client)
    first, pull_id, token = worker.pull()
    [offer] = first.json()["offers"]

    replay, _, _ = worker.pull(pull_id=pull_id, lease_token=token)
    assert replay.status_code == 200
    [again] = replay.json()["offers"]
    assert again["offer_id"] == offer["offer_id"]
    assert again["spec_sha256"] == offer["spec_sha256"]
    assert again["spec"] == offer["spec"]
    assert again["lease"]["token"] == token

    before = state_snapshot()
    conflict, _, _ = worker.pull(pull_id=pull_id)
    assert conflict.status_code == 409
    assert error_code(conflict) == "pull_id_conflict"
    assert state_snapshot() == before
    assert worker.ack(offer, "starting", token).status_code == 200


def test_new_session_fences_the_old_one_and_its_lease_is_never_delivered_again(
    client: Client,
) -> None:
    run = make_run()
    worker, credential = make_worker(slots=2)
    old = WorkerClient.open(client, worker=worker)
    first, _, old_token = old.pull()
    [old_offer] = first.json()["offers"]
    assert _states(run) == ("dispatching", "claimed")

    opened = post_json(
        client,
        f"{WORKER_API}/sessions",
        {"executor_types": ["process"], "slots": 2},
        bearer(credential),
    )
    assert opened.status_code == 201
    new = WorkerClient(client, opened.json()["session_token"], worker)

    # The claimed lease ended with the old Session: the Attempt is claimable again.
    assert RunLease.objects.get(offer_id=old_offer["offer_id"]).state == LeaseState.REVOKED
    assert _states(run) == ("queued", "pending")

    for response in (
        old.heartbeat(),
        old.pull()[0],
        old.ack(old_offer, "starting", old_token),
    ):
        assert response.status_code == 401
        assert error_code(response) == "session_replaced"

    second, _, new_token = new.pull()
    [new_offer] = second.json()["offers"]
    assert new_offer["offer_id"] != old_offer["offer_id"]
    assert new_offer["attempt_id"] == old_offer["attempt_id"]
    assert new_offer["lease"]["generation"] == old_offer["lease"]["generation"] + 1
    assert new_offer["session_generation"] == old_offer["session_generation"] + 1

    # The old offer cannot be ACKed from the new Session either (nor with the old token).
    before = state_snapshot()
    refused = new.ack(old_offer, "starting", old_token)
    assert refused.status_code == 403
    assert error_code(refused) == "lease_forbidden"
    assert state_snapshot() == before
    assert new.ack(new_offer, "starting", new_token).status_code == 200


def test_operator_cancel_reaches_the_worker_and_the_terminal_ack_ends_it_cancelled(
    client: Client,
) -> None:
    run = make_run()
    worker = WorkerClient.open(client)
    [offer] = worker.pull()[0].json()["offers"]
    token = offer["lease"]["token"]
    for phase in ("starting", "running"):
        assert worker.ack(offer, phase, token, **PHASE_EXTRA[phase]).status_code == 200

    op = operator_headers()
    cancelled = post_json(client, f"{API}/runs/{run.pk}/cancel", {}, op)
    assert cancelled.status_code == 200
    assert cancelled.json()["cancel_requested"] is True
    assert cancelled.json()["state"] == "running"
    # Idempotent.
    assert post_json(client, f"{API}/runs/{run.pk}/cancel", {}, op).status_code == 200

    beat = worker.heartbeat()
    assert beat.status_code == 200
    assert beat.json()["cancel"] == [offer["offer_id"]]

    repeat = worker.ack(offer, "running", token, executor_handle="pid:42")
    assert repeat.json()["cancel_requested"] is True

    final = worker.ack(offer, "failed", token, exit_code=143)
    assert final.status_code == 200
    assert final.json()["run_state"] == "cancelled"
    assert _states(run) == ("cancelled", "failed")
    assert worker.heartbeat().json()["cancel"] == []


def test_cancel_before_starting_revokes_the_lease_and_starting_is_refused(
    client: Client,
) -> None:
    run = make_run()
    worker = WorkerClient.open(client)
    [offer] = worker.pull()[0].json()["offers"]
    response = post_json(client, f"{API}/runs/{run.pk}/cancel", {}, operator_headers())
    assert response.json()["state"] == "cancelled"
    refused = worker.ack(offer, "starting", offer["lease"]["token"])
    assert refused.status_code == 409
    assert error_code(refused) == "lease_revoked"
    assert _states(run) == ("cancelled", "cancelled")


def test_pull_offers_at_most_the_free_slots(client: Client) -> None:
    for _ in range(3):
        make_run()
    worker = WorkerClient.open(client, slots=2)
    response, _, token = worker.pull(max_offers=16)
    offers = response.json()["offers"]
    assert len(offers) == 2
    for offer in offers:
        assert worker.ack(offer, "starting", token).status_code == 200
    full, _, _ = worker.pull(max_offers=16)
    assert full.json() == {
        "offers": [],
        "status": "no_match",
        "reason": "no_free_slots",
        "truncated": False,
    }


def test_a_pull_reads_its_pull_id_and_free_slots_in_one_statement(client: Client) -> None:
    for _ in range(2):
        make_run()
    worker = WorkerClient.open(client, slots=1)
    response, pull_id, token = worker.pull()
    [offer] = response.json()["offers"]
    assert worker.ack(offer, "starting", token).status_code == 200
    with CaptureQueriesContext(connection) as queries:
        full, _, _ = worker.pull()
    assert full.json()["reason"] == "no_free_slots"
    # The Session (authentication), then the pull id's leases and the started
    # count together (issue #12); nothing else before the cycle would run.
    assert len(queries) == 2, [str(q["sql"])[:60] for q in queries]
    # The same statement still refuses a pull id replayed with another token.
    conflict, _, _ = worker.pull(pull_id=pull_id)
    assert conflict.status_code == 409
    assert error_code(conflict) == "pull_id_conflict"


def _plans(*markers: str) -> int:
    """Executions of this connection's prepared statements holding every marker."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement, generic_plans + custom_plans FROM pg_prepared_statements")
        return sum(n for text, n in cursor.fetchall() if all(m in text for m in markers))


@pytest.mark.postgres
def test_the_session_lookup_and_the_pull_guard_are_prepared_once_per_connection(
    client: Client,
) -> None:
    worker = WorkerClient.open(client)
    session_sql = ('JOIN "workers_worker" w', 's."token_digest" = $1')
    # The states are literals, never parameters: a plan kept for any parameter
    # values could not use the partial indexes on active leases (it read every
    # lease the Session ever had).
    guard_sql = ("UNION ALL SELECT 1, NULL, COUNT(*)", "= $3 AND", "'active'", "'starting'")
    before = _plans(*guard_sql), _plans(*session_sql)
    for _ in range(3):
        assert worker.pull()[0].status_code == 200
    # Bound on the server ($n) and planned once: each pull ran both again.
    assert (_plans(*guard_sql), _plans(*session_sql)) == (before[0] + 3, before[1] + 3)
    assert _plans("UNION ALL SELECT 1, NULL, COUNT(*)", "$4") == 0


def test_heartbeat_reports_draining_and_draining_sessions_get_no_new_claims(
    client: Client,
) -> None:
    make_run()
    worker = WorkerClient.open(client)
    beat = worker.heartbeat(draining=True)
    assert beat.status_code == 200
    assert beat.json()["session_state"] == SessionState.DRAINING
    assert beat.json()["server_time"].endswith("Z")
    response, _, _ = worker.pull()
    assert response.json()["offers"] == []
