"""Lock scope on PostgreSQL: what each use case locks, and what it must not.

Each test holds one use case at its critical point on a second real
connection and checks the other neither deadlocks nor loses its work.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import psycopg
import pytest
from django.conf import settings
from django.db import connection, transaction

from dispatch.core.ports import ClaimStatus
from leases import claim as ds
from leases import end
from leases.ack import AckPhase, lease_ack
from leases.end import run_cancel
from leases.errors import Outcome
from leases.locks import lock_claim_rows, lock_lease_for_ack
from leases.models import LeaseState, RunLease
from leases.tests.racing import assert_locks_in_order, conninfo, held_by_someone
from qinglong import testing
from runs.models import Project, Run, RunState
from runs.services import run_enqueue
from workers.models import WorkerSession
from workers.services import session_heartbeat, session_open

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _thread(target, name: str) -> threading.Thread:
    def run() -> None:
        try:
            target()
        finally:
            connection.close()

    thread = threading.Thread(target=run, name=name)
    thread.start()
    return thread


def test_claim_and_session_open_of_the_same_worker_do_not_deadlock(monkeypatch):
    attempt = testing.pending_attempt(testing.make_run())
    session = testing.open_session().session
    worker = session.worker
    request, _ = testing.claim_request(attempt, session)
    paused, go = threading.Event(), threading.Event()
    real_grant = ds.lease_grant

    def slow_grant(*args, **kwargs):
        # The claim holds its Session lock here, just before the lease insert.
        if threading.current_thread().name == "claimer":
            paused.set()
            go.wait(10)
        return real_grant(*args, **kwargs)

    monkeypatch.setattr(ds, "lease_grant", slow_grant)
    results: dict[str, object] = {}

    def claimer() -> None:
        try:
            results["claim"] = ds.lease_claim(request).status
        except Exception as err:
            results["claim"] = err

    def opener() -> None:
        try:
            results["open"] = session_open(
                worker=worker, executor_types=["process"], labels={}, slots=1
            ).session.generation
        except Exception as err:
            results["open"] = err

    claim_thread = _thread(claimer, "claimer")
    assert paused.wait(10)
    open_thread = _thread(opener, "opener")
    time.sleep(0.5)  # the open now waits on the claim's Session lock
    go.set()
    claim_thread.join(20)
    open_thread.join(20)
    assert results == {"claim": ClaimStatus.WON, "open": session.generation + 1}
    # The open committed after the claim: the new lease was ended with the fence.
    assert RunLease.objects.get(attempt=attempt).state == LeaseState.REVOKED


def test_holding_one_runs_lock_chain_does_not_block_claims_of_its_siblings():
    task = testing.make_task()
    run_a, run_b = testing.make_run(task), testing.make_run(task)
    session = testing.open_session().session
    request, _ = testing.claim_request(testing.pending_attempt(run_b), session, skip_locked=True)
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with transaction.atomic():
            # What an ACK or expiry of Run A holds (Run row, revision joined in).
            Run.objects.select_for_update(of=("self",)).select_related("task_revision").get(
                pk=run_a.pk
            )
            held.set()
            release.wait(10)

    hold_thread = _thread(holder, "holder")
    assert held.wait(10)
    out: dict[str, object] = {}
    claim_thread = _thread(lambda: out.update(status=ds.lease_claim(request).status), "claimer")
    claim_thread.join(10)
    release.set()
    hold_thread.join(10)
    assert out["status"] is ClaimStatus.WON


def test_a_cancel_holding_its_run_lock_does_not_block_an_enqueue_of_the_same_revision(
    monkeypatch,
):
    task = testing.make_task()
    run = testing.make_run(task)
    paused, go = threading.Event(), threading.Event()
    real_now = end.db_now

    def slow_now():
        # The cancel holds its locks here, right after taking them.
        if threading.current_thread().name == "canceller" and not go.is_set():
            paused.set()
            go.wait(10)
        return real_now()

    monkeypatch.setattr(end, "db_now", slow_now)
    out: dict[str, object] = {}

    def canceller() -> None:
        try:
            out["cancel"] = run_cancel(run=run, actor="test")
        except Exception as err:
            out["cancel"] = err

    def enqueuer() -> None:
        try:
            with transaction.atomic():
                with connection.cursor() as cursor:
                    # "Not blocked" means done well before this: a wait on the
                    # cancel's locks fails with lock_timeout instead.
                    cursor.execute("SET LOCAL lock_timeout = '500ms'")
                out["enqueued"] = run_enqueue(task=task).task_revision_id
        except Exception as err:
            out["enqueued"] = err

    cancel_thread = _thread(canceller, "canceller")
    assert paused.wait(10)
    enqueue_thread = _thread(enqueuer, "enqueuer")
    enqueue_thread.join(10)
    # The enqueue committed while the cancel still held its locks.
    assert cancel_thread.is_alive()
    go.set()
    cancel_thread.join(10)
    assert out == {"enqueued": run.task_revision_id, "cancel": Outcome.APPLIED}
    assert Run.objects.get(pk=run.pk).state == RunState.CANCELLED
    assert Run.objects.filter(task=task, state=RunState.QUEUED).count() == 1


def _running_lease():
    session = testing.open_session().session
    attempt = testing.pending_attempt(testing.make_run())
    _, offer_id, token = testing.claim(attempt, session)
    lease = RunLease.objects.get(offer_id=offer_id)
    for phase in (AckPhase.STARTING, AckPhase.RUNNING):
        lease_ack(
            session=session,
            offer_id=offer_id,
            phase=phase,
            lease_token=token,
            spec_sha256=lease.spec_digest,
            executor_handle="pid:1",
        )
    return session, RunLease.objects.get(pk=lease.pk)


def test_heartbeat_waiting_behind_a_revoke_never_renews_the_ended_lease():
    session, lease = _running_lease()
    # Due: a heartbeat inside the minimum interval would not try to renew at all.
    session.heartbeat_at -= timedelta(seconds=settings.QINGLONG_HEARTBEAT_INTERVAL_S)
    WorkerSession.objects.filter(pk=session.pk).update(heartbeat_at=session.heartbeat_at)
    held, release = threading.Event(), threading.Event()

    def revoker() -> None:
        with transaction.atomic():
            locked = RunLease.objects.select_for_update().get(pk=lease.pk)
            held.set()
            release.wait(10)
            RunLease.objects.filter(pk=locked.pk).update(
                state=LeaseState.REVOKED, version=locked.version + 1, end_reason="test"
            )

    revoke_thread = _thread(revoker, "revoker")
    assert held.wait(10)
    out: dict[str, object] = {}
    beat_thread = _thread(
        lambda: out.update(vars(session_heartbeat(session=session, draining=False))),
        "heartbeat",
    )
    time.sleep(0.5)  # the renewal now waits on the lease row
    release.set()
    revoke_thread.join(10)
    beat_thread.join(10)
    after = RunLease.objects.get(pk=lease.pk)
    assert out["renewed"] == 0
    assert out["recorded"] is True  # the heartbeat itself was recorded; only the lease was not
    assert (after.state, after.expires_at) == (LeaseState.REVOKED, lease.expires_at)


# -------------------------------------------- one-statement locks (issue #12)


def test_the_claim_locks_run_attempt_then_session_in_one_statement() -> None:
    session = testing.open_session().session
    attempt = testing.pending_attempt(testing.make_run())
    rows = [
        ("runs_run", attempt.run_id),
        ("runs_attempt", attempt.pk),
        ("workers_workersession", session.pk),
    ]
    assert_locks_in_order(
        rows,
        lambda: lock_claim_rows(
            run_id=attempt.run_id,
            attempt_id=attempt.pk,
            session_id=str(session.session_id),
            skip_locked=False,
        ),
    )


def test_with_a_project_quota_the_claim_locks_the_session_only_after_the_project() -> None:
    project = testing.make_project()
    Project.objects.filter(pk=project.pk).update(max_concurrent_runs=5)
    session = testing.open_session().session
    attempt = testing.pending_attempt(testing.make_run(testing.make_task(project)))
    request, _ = testing.claim_request(attempt, session)
    blocker = psycopg.connect(conninfo(), autocommit=False)
    blocker.execute('SELECT 1 FROM "runs_project" WHERE id = %s FOR UPDATE', [project.pk])
    out: dict[str, object] = {}
    claimer = _thread(lambda: out.update(status=ds.lease_claim(request).status), "claimer")
    time.sleep(0.5)  # waiting for the Project: Run and Attempt held, the Session not yet
    assert held_by_someone("runs_run", attempt.run_id)
    assert held_by_someone("runs_attempt", attempt.pk)
    assert not held_by_someone("workers_workersession", session.pk)
    blocker.rollback()
    blocker.close()
    claimer.join(10)
    assert out["status"] is ClaimStatus.WON


def test_an_ack_locks_run_attempt_session_then_lease_in_one_statement() -> None:
    session = testing.open_session().session
    attempt = testing.pending_attempt(testing.make_run())
    _, offer_id, _ = testing.claim(attempt, session)
    lease = RunLease.objects.get(offer_id=offer_id)
    rows = [
        ("runs_run", attempt.run_id),
        ("runs_attempt", attempt.pk),
        ("workers_workersession", session.pk),
        ("dispatch_runlease", lease.pk),
    ]
    assert_locks_in_order(
        rows, lambda: lock_lease_for_ack(offer_id=offer_id, session_pk=session.pk)
    )


def test_an_ack_naming_another_sessions_lease_locks_nothing() -> None:
    owner = testing.open_session().session
    stranger = testing.open_session().session
    attempt = testing.pending_attempt(testing.make_run())
    _, offer_id, _ = testing.claim(attempt, owner)
    with transaction.atomic():
        assert lock_lease_for_ack(offer_id=offer_id, session_pk=stranger.pk) is None
        assert not held_by_someone("runs_run", attempt.run_id)
        assert not held_by_someone("runs_attempt", attempt.pk)
