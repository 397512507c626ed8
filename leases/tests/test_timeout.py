"""Timeouts enforced by the control plane (leases.timeout, README "Run policies")."""

from __future__ import annotations

import functools
import threading
import time

import pytest
from django.db import connection
from django.test import override_settings

from dispatch.sweeps import sweep_timed_out_attempts
from leases.ack import AckPhase, lease_ack
from leases.errors import LeaseConflict, Outcome
from leases.models import LeaseState, RunLease
from leases.tests.racing import race
from leases.timeout import TIMED_OUT, attempt_time_out, timed_out_offer_ids
from qinglong.clock import db_now
from qinglong.testing import claim, make_run, open_session, pending_attempt
from runs.models import Attempt, AttemptState, Run, RunState
from workers.models import WorkerSession


def _start(run: Run, *, running: bool) -> tuple[WorkerSession, str, str, RunLease]:
    session = open_session().session
    outcome, offer_id, token = claim(pending_attempt(run), session)
    assert outcome.status == "won"
    lease = RunLease.objects.get(offer_id=offer_id)
    lease_ack(
        session=session,
        offer_id=offer_id,
        phase=AckPhase.STARTING,
        lease_token=token,
        spec_sha256=lease.spec_digest,
    )
    if running:
        lease_ack(
            session=session,
            offer_id=offer_id,
            phase=AckPhase.RUNNING,
            lease_token=token,
            spec_sha256=lease.spec_digest,
            executor_handle="pid:42",
        )
    return session, offer_id, token, lease


@pytest.mark.django_db
def test_the_starting_ack_pins_the_deadline() -> None:
    run = make_run(timeout_s=90)
    _start(run, running=False)
    attempt = Attempt.objects.get(run=run)
    assert attempt.started_at is not None and attempt.deadline_at is not None
    assert (attempt.deadline_at - attempt.started_at).total_seconds() == 90


@pytest.mark.django_db
@override_settings(QINGLONG_TIMEOUT_MARGIN_S=0)
def test_a_timeout_is_enforced_with_the_agent_gone() -> None:
    run = make_run(timeout_s=1, max_attempts=1)
    session, offer_id, token, lease = _start(run, running=True)
    # The agent goes silent: no heartbeat, no ACK. Its Session is still online.
    assert timed_out_offer_ids(session.pk, now=db_now()) == []
    assert sweep_timed_out_attempts().examined == 0
    time.sleep(1.05)
    assert timed_out_offer_ids(session.pk, now=db_now()) == [offer_id]
    counts = sweep_timed_out_attempts()
    assert (counts.examined, counts.applied) == (1, 1)
    attempt = Attempt.objects.get(run=run)
    assert (attempt.state, attempt.error_code) == (AttemptState.FAILED, TIMED_OUT)
    last_event = attempt.events.order_by("-id").first()
    assert last_event is not None and last_event.reason == TIMED_OUT
    lease.refresh_from_db()
    assert (lease.state, lease.end_reason) == (LeaseState.REVOKED, TIMED_OUT)
    run.refresh_from_db()
    assert run.state == RunState.FAILED  # out of attempts
    assert WorkerSession.objects.get(pk=session.pk).state == "online"
    # Nothing is left to stop by lease, and a late ACK is a 409: stop.
    assert timed_out_offer_ids(session.pk, now=db_now()) == []
    with pytest.raises(LeaseConflict):
        lease_ack(
            session=session,
            offer_id=offer_id,
            phase=AckPhase.SUCCEEDED,
            lease_token=token,
            spec_sha256=lease.spec_digest,
            exit_code=0,
        )
    assert sweep_timed_out_attempts().examined == 0


@pytest.mark.django_db
@override_settings(QINGLONG_TIMEOUT_MARGIN_S=0)
def test_a_starting_attempt_past_its_deadline_ends_lost_timed_out() -> None:
    run = make_run(timeout_s=1, max_attempts=1)
    _start(run, running=False)
    time.sleep(1.05)
    assert sweep_timed_out_attempts().applied == 1
    attempt = Attempt.objects.get(run=run)
    assert (attempt.state, attempt.error_code) == (AttemptState.LOST, TIMED_OUT)


@pytest.mark.django_db
def test_the_margin_gives_the_agent_time_to_report_first() -> None:
    run = make_run(timeout_s=1)
    session, _offer_id, _token, _lease = _start(run, running=True)
    time.sleep(1.05)
    # Past timeout_s but inside the default 30 s margin: no verdict yet.
    assert timed_out_offer_ids(session.pk, now=db_now()) == []
    assert sweep_timed_out_attempts().examined == 0


@pytest.mark.django_db
@override_settings(QINGLONG_TIMEOUT_MARGIN_S=0)
def test_an_attempt_that_finished_in_time_is_left_alone() -> None:
    run = make_run(timeout_s=1)
    session, offer_id, token, lease = _start(run, running=True)
    lease_ack(
        session=session,
        offer_id=offer_id,
        phase=AckPhase.SUCCEEDED,
        lease_token=token,
        spec_sha256=lease.spec_digest,
        exit_code=0,
    )
    time.sleep(1.05)
    attempt = Attempt.objects.get(run=run)
    assert attempt_time_out(attempt.pk) is Outcome.UNCHANGED
    assert Attempt.objects.get(run=run).state == AttemptState.SUCCEEDED


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@override_settings(QINGLONG_TIMEOUT_MARGIN_S=0)
def test_the_timeout_sweep_racing_a_terminal_ack_applies_exactly_one() -> None:
    outcomes = set()
    for _ in range(4):
        run = make_run(timeout_s=1, max_attempts=1)
        session, offer_id, token, lease = _start(run, running=True)
        time.sleep(1.05)
        attempt = Attempt.objects.get(run=run)

        def ack(session=session, offer_id=offer_id, token=token, lease=lease):
            return lease_ack(
                session=session,
                offer_id=offer_id,
                phase=AckPhase.SUCCEEDED,
                lease_token=token,
                spec_sha256=lease.spec_digest,
                exit_code=0,
            )

        swept, acked = race(functools.partial(attempt_time_out, attempt.pk), ack)
        attempt.refresh_from_db()
        lease.refresh_from_db()
        if swept is Outcome.APPLIED:
            # The sweep won: the ACK met a revoked lease (409: stop).
            assert isinstance(acked, LeaseConflict)
            assert (attempt.state, lease.end_reason) == (AttemptState.FAILED, TIMED_OUT)
        else:
            # The ACK won: the sweep re-checked under the locks and left it.
            assert swept is Outcome.UNCHANGED and not isinstance(acked, Exception)
            assert (attempt.state, lease.end_reason) == (AttemptState.SUCCEEDED, "ack_succeeded")
        outcomes.add(swept)
        assert Attempt.objects.filter(run=run).count() == 1


@pytest.mark.django_db
@override_settings(QINGLONG_TIMEOUT_MARGIN_S=0)
def test_an_overdue_attempt_selected_then_finished_is_left_alone() -> None:
    run = make_run(timeout_s=1)
    session, offer_id, token, lease = _start(run, running=True)
    time.sleep(1.05)
    attempt = Attempt.objects.get(run=run)
    from leases.timeout import attempts_overdue

    assert attempts_overdue(now=db_now()) == [attempt.pk]  # the sweep's read
    lease_ack(  # the agent reports just after it
        session=session,
        offer_id=offer_id,
        phase=AckPhase.SUCCEEDED,
        lease_token=token,
        spec_sha256=lease.spec_digest,
        exit_code=0,
    )
    assert attempt_time_out(attempt.pk) is Outcome.UNCHANGED
    assert Attempt.objects.get(pk=attempt.pk).state == AttemptState.SUCCEEDED


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@override_settings(QINGLONG_TIMEOUT_MARGIN_S=0)
def test_two_sweeps_at_once_time_an_attempt_out_once() -> None:
    run = make_run(timeout_s=1, max_attempts=2)
    _start(run, running=True)
    time.sleep(1.05)
    attempt = Attempt.objects.get(run=run)
    barrier = threading.Barrier(2)
    results: list[object] = []

    def racer() -> None:
        try:
            barrier.wait()
            results.append(attempt_time_out(attempt.pk))
        finally:
            connection.close()

    threads = [threading.Thread(target=racer) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sorted(map(str, results)) == sorted(map(str, [Outcome.APPLIED, Outcome.UNCHANGED]))
    assert Attempt.objects.filter(run=run).count() == 2  # one retry, not two
    assert RunLease.objects.filter(run=run, end_reason=TIMED_OUT).count() == 1


@pytest.mark.django_db
@override_settings(QINGLONG_TIMEOUT_MARGIN_S=0)
def test_the_heartbeat_answer_carries_the_stop_verdict_with_or_without_held() -> None:
    from workers.services import session_heartbeat

    run = make_run(timeout_s=1)
    session, offer_id, _token, _lease = _start(run, running=True)
    assert session_heartbeat(session=session, draining=False, held=[offer_id]).stop == []
    time.sleep(1.05)
    session.refresh_from_db()
    # An older agent (no `held`) and a current one both hear it.
    assert session_heartbeat(session=session, draining=False).stop == [offer_id]
    session.refresh_from_db()
    assert session_heartbeat(session=session, draining=False, held=[offer_id]).stop == [offer_id]
    # After the sweep ended it, a current agent listing it still hears stop.
    sweep_timed_out_attempts()
    session.refresh_from_db()
    assert session_heartbeat(session=session, draining=False, held=[offer_id]).stop == [offer_id]


@pytest.mark.django_db
@override_settings(QINGLONG_TIMEOUT_MARGIN_S=0)
def test_a_running_ack_past_the_deadline_is_told_to_stop() -> None:
    run = make_run(timeout_s=1)
    session, offer_id, token, lease = _start(run, running=False)
    time.sleep(1.05)
    with pytest.raises(LeaseConflict) as refused:
        lease_ack(
            session=session,
            offer_id=offer_id,
            phase=AckPhase.RUNNING,
            lease_token=token,
            spec_sha256=lease.spec_digest,
            executor_handle="pid:7",
        )
    assert refused.value.code == TIMED_OUT
    assert Attempt.objects.get(run=run).state == AttemptState.STARTING  # nothing changed
