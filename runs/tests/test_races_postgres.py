"""Lost races with two real PostgreSQL connections (one per thread).

Each test lets two writers hit the same rows at once; exactly one wins and the
other gets the lost-race outcome (or waits on the row lock and then sees the
winner's commit), and the rows end in a state one writer alone could produce.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

from leases.ack import AckPhase, lease_ack
from leases.end import lease_revoke
from leases.errors import LeaseError, LostRace, Outcome
from leases.models import LeaseState, RunLease
from leases.tests.racing import race
from leases.transitions import attempt_transition
from qinglong.testing import claim, definition, make_run, make_task, open_session, pending_attempt
from runs.models import Attempt, AttemptEvent, AttemptState, Run, TaskRevision
from runs.services import task_update
from workers.models import WorkerSession
from workers.services import SessionRejected, session_heartbeat, session_mark_offline_if_stale

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def test_attempt_cas_second_connection_commits_first_then_we_lose():
    attempt = pending_attempt(make_run())
    stale = Attempt.objects.get(pk=attempt.pk)
    done = threading.Event()

    def other_writer() -> None:
        try:
            with transaction.atomic():
                fresh = Attempt.objects.get(pk=attempt.pk)
                attempt_transition(fresh, AttemptState.CANCELLED, reason="other")
        finally:
            connections.close_all()
            done.set()

    threading.Thread(target=other_writer).start()
    assert done.wait(10)
    with pytest.raises(LostRace), transaction.atomic():
        attempt_transition(stale, "claimed", reason="us")
    assert Attempt.objects.get(pk=attempt.pk).state == "cancelled"
    assert list(AttemptEvent.objects.filter(attempt=attempt).values_list("reason", flat=True)) == [
        "other"
    ]


def test_attempt_cas_waits_for_a_held_row_lock_then_loses():
    attempt = pending_attempt(make_run())
    stale = Attempt.objects.get(pk=attempt.pk)
    locked = threading.Event()
    release = threading.Event()

    def holder() -> None:
        try:
            with transaction.atomic():
                fresh = Attempt.objects.select_for_update().get(pk=attempt.pk)
                locked.set()
                release.wait(10)
                attempt_transition(fresh, AttemptState.CANCELLED, reason="holder")
        finally:
            connections.close_all()

    t = threading.Thread(target=holder)
    t.start()
    assert locked.wait(10)
    threading.Timer(0.3, release.set).start()
    with pytest.raises(LostRace), transaction.atomic():
        attempt_transition(stale, "claimed", reason="us")  # blocks on the lock, then 0 rows
    t.join(10)
    assert Attempt.objects.get(pk=attempt.pk).state == "cancelled"


def _started():
    opened = open_session()
    run = make_run(max_attempts=2)
    attempt = pending_attempt(run)
    _outcome, offer_id, token = claim(attempt, opened.session)
    lease = RunLease.objects.get(offer_id=offer_id)
    for phase in (AckPhase.STARTING, AckPhase.RUNNING):
        lease_ack(
            session=opened.session,
            offer_id=offer_id,
            phase=phase,
            lease_token=token,
            spec_sha256=lease.spec_digest,
            executor_handle="pid:1",
        )
    return opened.session, run, attempt, lease, token


def test_two_identical_terminal_acks_apply_once():
    session, run, attempt, lease, token = _started()

    def ack() -> Any:
        return lease_ack(
            session=session,
            offer_id=lease.offer_id,
            phase=AckPhase.SUCCEEDED,
            lease_token=token,
            spec_sha256=lease.spec_digest,
            exit_code=0,
        )

    results = race(ack, ack)
    assert sorted(r.outcome for r in results) == [Outcome.APPLIED, Outcome.UNCHANGED]
    assert AttemptEvent.objects.filter(attempt=attempt, to_state="succeeded").count() == 1
    assert Run.objects.get(pk=run.pk).state == "succeeded"


def test_revoke_racing_a_completion_never_overwrites_it():
    session, run, attempt, lease, token = _started()

    def complete() -> Any:
        return lease_ack(
            session=session,
            offer_id=lease.offer_id,
            phase=AckPhase.SUCCEEDED,
            lease_token=token,
            spec_sha256=lease.spec_digest,
            exit_code=0,
        )

    def revoke() -> Any:
        return lease_revoke(lease.pk, reason="operator")

    ack_result, revoke_result = race(complete, revoke)
    final = Attempt.objects.get(pk=attempt.pk)
    if isinstance(ack_result, LeaseError):
        # The revoke won: the Attempt was lost and retried; the ACK changed nothing.
        assert revoke_result is Outcome.APPLIED
        assert final.state == "lost"
        assert RunLease.objects.get(pk=lease.pk).state == LeaseState.REVOKED
    else:
        # The completion won: the revoke found a released lease and did nothing.
        assert revoke_result is Outcome.UNCHANGED
        assert final.state == "succeeded"
        assert RunLease.objects.get(pk=lease.pk).state == LeaseState.RELEASED
        assert Run.objects.get(pk=run.pk).state == "succeeded"


def test_heartbeat_racing_the_offline_sweeper_has_one_winner():
    opened = open_session()
    session = opened.session
    WorkerSession.objects.filter(pk=session.pk).update(
        heartbeat_at=timezone.now() - timedelta(hours=1)
    )
    session.refresh_from_db()

    def beat() -> Any:
        fresh = WorkerSession.objects.select_related("worker").get(pk=session.pk)
        return session_heartbeat(session=fresh, draining=False)

    def sweep() -> Any:
        return session_mark_offline_if_stale(session_pk=session.pk)

    beat_result, swept = race(beat, sweep)
    state = WorkerSession.objects.get(pk=session.pk).state
    if swept is True:
        assert isinstance(beat_result, SessionRejected)
        assert state == "offline"
    else:
        assert swept is False
        assert not isinstance(beat_result, Exception)
        assert state == "online"


def test_concurrent_task_edits_take_distinct_revisions():
    task = make_task()

    def edit(n: int) -> Callable[[], Any]:
        return lambda: task_update(
            task=type(task).objects.get(pk=task.pk), definition=definition(command=["echo", str(n)])
        )

    results = race(edit(1), edit(2))
    assert all(isinstance(r, TaskRevision) for r in results), results
    assert sorted(r.revision for r in results) == [2, 3]
    assert TaskRevision.objects.filter(task=task).count() == 3


def test_connection_is_postgres():
    # Guards against the pass silently running these on another backend.
    assert connection.vendor == "postgresql"


def test_racing_pulls_reusing_a_pull_id_never_mix_tokens():
    from workers.api.pull import PullIdConflict, worker_pull

    session = open_session(slots=4).session
    for _ in range(4):
        make_run()
    pull_id = uuid.uuid4()

    def pull(token: str) -> Callable[[], Any]:
        def call() -> Any:
            fresh = WorkerSession.objects.select_related("worker").get(pk=session.pk)
            return worker_pull(session=fresh, pull_id=pull_id, lease_token=token, max_offers=2)

        return call

    results = race(pull("a" * 43), pull("b" * 43))
    digests = set(RunLease.objects.filter(pull_id=pull_id).values_list("token_digest", flat=True))
    assert len(digests) == 1  # every lease of the pull id carries one token
    assert RunLease.objects.filter(pull_id=pull_id).count() >= 1
    assert all(not isinstance(r, Exception) or isinstance(r, PullIdConflict) for r in results)
