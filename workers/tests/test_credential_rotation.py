"""Rotating a Worker credential fences every Session opened with it (issue 8 item 3).

Before the fix a rotated credential was refused, but its Sessions kept
heartbeating, pulling (specs and lease tokens included) and ACKing. Rotation
now fences them exactly like a replacement: `401 credential_rotated`, claimed
Attempts back to pending, started ones lost (the retry policy decides).
"""

from __future__ import annotations

import re
from io import StringIO

import pytest
from django.core.management import call_command
from django.test import Client

from leases.models import LeaseState, RunLease
from qinglong.testing import make_run, make_task, make_worker, open_session
from runs.models import Attempt, Run
from workers.models import SessionEndReason, SessionState, Worker, WorkerSession
from workers.services import (
    CredentialRotated,
    SessionRejected,
    session_authenticate,
    worker_rotate_credential,
)
from workers.tests.api_helpers import (
    PHASE_EXTRA,
    WORKER_API,
    WorkerClient,
    bearer,
    error_code,
    post_json,
)

pytestmark = pytest.mark.django_db

SECRET_TOKEN = re.compile(r"[A-Za-z0-9_\-\.]{24,}")
OPEN_BODY = {"executor_types": ["process"], "slots": 2}


def _rotate_by_command(name: str) -> str:
    out = StringIO()
    call_command("rotate_worker_credential", name, stdout=out)
    return SECRET_TOKEN.findall(out.getvalue())[-1]


def _attempt_states(run: Run) -> list[str]:
    return list(Attempt.objects.filter(run=run).order_by("number").values_list("state", flat=True))


def test_rotation_by_command_fences_the_open_session_and_its_leases(client: Client) -> None:
    worker, old_credential = make_worker(slots=2)
    task = make_task(max_attempts=2)
    claimed_run, started_run = make_run(task), make_run(task)
    old = WorkerClient.open(client, worker=worker)
    response, _, token = old.pull(max_offers=2)
    offers = {offer["run_id"]: offer for offer in response.json()["offers"]}
    assert set(offers) == {str(claimed_run.pk), str(started_run.pk)}
    started = offers[str(started_run.pk)]
    for phase in ("starting", "running"):
        assert old.ack(started, phase, token, **PHASE_EXTRA[phase]).status_code == 200

    new_credential = _rotate_by_command(worker.name)

    # The old Session token is refused everywhere, with a code that says what to do.
    for refused in (
        old.heartbeat(),
        old.pull()[0],
        old.ack(started, "succeeded", token, exit_code=0),
    ):
        assert refused.status_code == 401, refused.content
        assert error_code(refused) == "credential_rotated"
    session = WorkerSession.objects.get(worker=worker)
    assert (session.state, session.end_reason) == (
        SessionState.REPLACED,
        SessionEndReason.CREDENTIAL_ROTATED,
    )
    # Its leases ended: the claimed Attempt is pending again, the started one is
    # lost and the retry policy queued the next Attempt.
    assert set(RunLease.objects.values_list("state", "end_reason")) == {
        (LeaseState.REVOKED, "credential_rotated")
    }
    claimed_run.refresh_from_db()
    started_run.refresh_from_db()
    assert (claimed_run.state, _attempt_states(claimed_run)) == ("queued", ["pending"])
    assert (started_run.state, _attempt_states(started_run)) == ("queued", ["lost", "pending"])

    # The old credential opens nothing; the new one opens a Session that works.
    stale = post_json(client, f"{WORKER_API}/sessions", OPEN_BODY, bearer(old_credential))
    assert stale.status_code == 401
    assert error_code(stale) == "invalid_credential"
    opened = post_json(client, f"{WORKER_API}/sessions", OPEN_BODY, bearer(new_credential))
    assert opened.status_code == 201, opened.content
    new = WorkerClient(client, opened.json()["session_token"], worker)
    assert new.heartbeat().status_code == 200
    # The claimed Run is offered again at once; the started one's retry waits
    # the lost-execution grace (its process may still run, docs/adr/0005) ...
    again, _, new_token = new.pull(max_offers=2)
    (reoffered,) = again.json()["offers"]
    assert reoffered["run_id"] == str(claimed_run.pk)
    assert new.ack(reoffered, "starting", new_token).status_code == 200
    assert new.pull(max_offers=2)[0].json()["offers"] == []
    # ... until the Worker reports that process gone.
    report = {"offer_id": started["offer_id"], "lease_token": token, "outcome": "killed"}
    assert new.reconcile([report]).json()["results"][0]["status"] == "confirmed"
    later, _, _ = new.pull(max_offers=2)
    assert [offer["run_id"] for offer in later.json()["offers"]] == [str(started_run.pk)]


def test_rotation_service_fences_every_current_session_and_reports_it() -> None:
    worker, _ = make_worker()
    first = open_session(worker)
    second = open_session(worker)  # replaces the first (reason: replacement)
    credential = worker_rotate_credential(worker=worker)
    assert credential.startswith("qlw_")
    reasons = dict(WorkerSession.objects.values_list("pk", "end_reason"))
    assert reasons == {
        first.session.pk: SessionEndReason.SESSION_REPLACED,
        second.session.pk: SessionEndReason.CREDENTIAL_ROTATED,
    }
    with pytest.raises(SessionRejected) as rotated:
        session_authenticate(second.token)
    assert rotated.value.code == "credential_rotated"
    with pytest.raises(SessionRejected) as replaced:
        session_authenticate(first.token)
    assert replaced.value.code == "session_replaced"
    assert worker.credential_rotated_at is not None  # the caller's instance is refreshed


def test_an_open_authenticated_before_the_rotation_is_refused() -> None:
    worker, _ = make_worker()
    authenticated = Worker.objects.get(pk=worker.pk)  # what the credential check returned
    worker_rotate_credential(worker=worker)
    with pytest.raises(CredentialRotated):
        open_session(authenticated)
    assert not WorkerSession.objects.filter(worker=worker).exists()
    assert Worker.objects.get(pk=worker.pk).last_generation == 0


def test_rotation_of_a_worker_without_sessions_only_changes_the_credential() -> None:
    worker, old = make_worker()
    new = worker_rotate_credential(worker=worker)
    assert new != old
    assert Worker.objects.get(pk=worker.pk).credential_prefix == new[:8]
    assert not WorkerSession.objects.exists()
