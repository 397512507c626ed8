"""Lost races of issue 10's transition paths, with real concurrent PostgreSQL connections.

docs/adr/0005: a heartbeat's `not_held` ending against a starting and a
terminal ACK, a reconcile report against the claim of the retry it lifts,
the over-delivery revoke (back to the queue, or `undeliverable`) against a
starting ACK, and the offline sweep against a heartbeat that lists what it
holds. Each race ends in a state one writer alone could have produced.
"""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.db.models import F
from django.test.utils import override_settings

from dispatch.core.ports import ClaimStatus
from leases.ack import AckPhase, lease_ack
from leases.claim import lease_claim
from leases.end import leases_revoke_over_delivered
from leases.errors import LeaseConflict, Outcome
from leases.models import ExecutionOutcome, LeaseState, RunLease
from leases.reconcile import ExecutionReport, ReconcileStatus, leases_reconcile
from leases.tests.racing import race
from qinglong import testing
from qinglong.clock import db_now
from runs.models import Attempt, AttemptState, RunState
from workers.models import SessionState, WorkerSession
from workers.services import (
    SessionRejected,
    session_heartbeat,
    session_mark_offline_if_stale,
)

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

ROUNDS = 6
every_beat = override_settings(QINGLONG_HEARTBEAT_MIN_INTERVAL_S=0)


def _claimed(max_attempts: int = 1) -> tuple[WorkerSession, RunLease, str]:
    session = testing.open_session(slots=4).session
    attempt = testing.pending_attempt(testing.make_run(max_attempts=max_attempts))
    outcome, offer_id, token = testing.claim(attempt, session)
    assert outcome.status is ClaimStatus.WON
    return session, RunLease.objects.get(offer_id=offer_id), token


def _ack(session: WorkerSession, lease: RunLease, token: str, phase: AckPhase, **extra: Any) -> str:
    try:
        lease_ack(
            session=WorkerSession.objects.select_related("worker").get(pk=session.pk),
            offer_id=lease.offer_id,
            phase=phase,
            lease_token=token,
            spec_sha256=lease.spec_digest,
            **extra,
        )
    except LeaseConflict as err:
        return err.code
    return "applied"


def _beat(session: WorkerSession, held: list[str]) -> Any:
    fresh = WorkerSession.objects.select_related("worker").get(pk=session.pk)
    try:
        return session_heartbeat(session=fresh, draining=False, held=held)
    except SessionRejected as err:
        return err


def _age_start(lease: RunLease, seconds: float = 11) -> None:
    Attempt.objects.filter(pk=lease.attempt_id).update(
        started_at=F("started_at") - timedelta(seconds=seconds)
    )


@every_beat
def test_a_heartbeat_that_does_not_list_an_offer_never_ends_its_starting_ack() -> None:
    # The agent's list may be put together while the starting ACK is on the
    # wire: whichever commits first, the ACK stands and nothing is lost.
    for _ in range(ROUNDS):
        session, lease, token = _claimed()
        acked, beat = race(
            functools.partial(_ack, session, lease, token, AckPhase.STARTING),
            functools.partial(_beat, session, []),
        )
        assert acked == "applied", acked
        assert beat.recorded and beat.not_held == 0, beat
        lease.refresh_from_db()
        assert (lease.state, lease.attempt.state) == (LeaseState.ACTIVE, AttemptState.STARTING)


@every_beat
def test_not_held_and_a_terminal_ack_never_both_win() -> None:
    wins = {"ack": 0, "not_held": 0}
    for _ in range(ROUNDS):
        session, lease, token = _claimed(max_attempts=2)
        for phase, extra in ((AckPhase.STARTING, {}), (AckPhase.RUNNING, {"executor_handle": "x"})):
            assert _ack(session, lease, token, phase, **extra) == "applied"
        _age_start(lease)
        acked, beat = race(
            functools.partial(_ack, session, lease, token, AckPhase.SUCCEEDED, exit_code=0),
            functools.partial(_beat, session, []),
        )
        lease.refresh_from_db()
        attempt = lease.attempt
        assert not isinstance(beat, Exception), beat
        if acked == "applied":
            wins["ack"] += 1
            assert beat.not_held == 0
            assert (lease.state, attempt.state) == (LeaseState.RELEASED, AttemptState.SUCCEEDED)
            assert attempt.run.state == RunState.SUCCEEDED
        else:
            wins["not_held"] += 1
            assert acked in {"lease_revoked", "lease_conflict", "illegal_phase"}, acked
            assert beat.not_held == 1
            assert (lease.state, lease.end_reason) == (LeaseState.REVOKED, "not_held")
            assert attempt.state == AttemptState.LOST
            # Exactly one retry, claimable at once (the agent said it holds none).
            retry = Attempt.objects.get(run_id=attempt.run_id, number=2)
            assert (retry.state, retry.not_before) == (AttemptState.PENDING, None)
    print("terminal ACK / not_held winners:", wins)
    assert sum(wins.values()) == ROUNDS


def _lost_with_grace() -> tuple[RunLease, str, WorkerSession, Attempt]:
    """A running Attempt whose Session was replaced: lost, its retry waiting."""
    session, lease, token = _claimed(max_attempts=2)
    for phase, extra in ((AckPhase.STARTING, {}), (AckPhase.RUNNING, {"executor_handle": "x"})):
        assert _ack(session, lease, token, phase, **extra) == "applied"
    replacement = testing.open_session(session.worker).session
    lease.refresh_from_db()
    assert (lease.state, lease.end_reason) == (LeaseState.REVOKED, "worker_restarted")
    retry = Attempt.objects.get(run_id=lease.run_id, number=2)
    assert retry.not_before is not None and retry.not_before > db_now()
    return lease, token, replacement, retry


def test_a_reconcile_report_and_a_claim_of_the_retry_never_both_act_on_one_version() -> None:
    wins = {"claim": 0, "lift": 0}
    for _ in range(ROUNDS):
        lease, token, replacement, retry = _lost_with_grace()
        claimer = testing.open_session().session
        # A claim built from the retry as a candidate read saw it (version v).
        request, _ = testing.claim_request(retry, claimer)
        report = ExecutionReport(
            offer_id=lease.offer_id,
            lease_token=token,
            outcome=ExecutionOutcome.KILLED,
            exit_code=-9,
        )
        fresh = WorkerSession.objects.select_related("worker").get(pk=replacement.pk)
        claimed, reported = race(
            functools.partial(lease_claim, request),
            functools.partial(leases_reconcile, session=fresh, reports=[report]),
        )
        assert reported == [(lease.offer_id, ReconcileStatus.CONFIRMED)], reported
        retry.refresh_from_db()
        lease.refresh_from_db()
        assert lease.execution_outcome == ExecutionOutcome.KILLED
        if claimed.status is ClaimStatus.WON:
            # The claim committed first: the report found no wait to lift.
            wins["claim"] += 1
            assert retry.state == AttemptState.CLAIMED
            assert RunLease.objects.filter(attempt=retry, state=LeaseState.ACTIVE).count() == 1
        else:
            # The report lifted the wait first: the claim's version was stale.
            wins["lift"] += 1
            assert claimed.status is ClaimStatus.ATTEMPT_LOST
            assert (retry.state, retry.not_before) == (AttemptState.PENDING, None)
            assert not RunLease.objects.filter(attempt=retry).exists()
    print("claim / reconcile winners:", wins)
    assert sum(wins.values()) == ROUNDS


@pytest.mark.parametrize("rounds", [3, 1])
def test_the_over_delivery_revoke_and_a_starting_ack_never_both_win(rounds: int) -> None:
    # rounds=3: the revoke sends the Attempt back to the queue (a backoff);
    # rounds=1: it is the last round and fails the Run `undeliverable`.
    wins = {"ack": 0, "revoke": 0}
    with override_settings(
        QINGLONG_DISPATCH={**settings.QINGLONG_DISPATCH, "max_delivery_rounds": rounds}
    ):
        for _ in range(ROUNDS):
            session, lease, token = _claimed()
            RunLease.objects.filter(pk=lease.pk).update(
                delivery_count=5, last_delivered_at=db_now()
            )
            acked, revoked = race(
                functools.partial(_ack, session, lease, token, AckPhase.STARTING),
                functools.partial(
                    leases_revoke_over_delivered, max_deliveries=5, session_pk=session.pk
                ),
            )
            lease.refresh_from_db()
            attempt = lease.attempt
            if acked == "applied":
                wins["ack"] += 1
                assert revoked in ([Outcome.UNCHANGED], []), revoked
                assert (lease.state, attempt.state) == (LeaseState.ACTIVE, AttemptState.STARTING)
            else:
                wins["revoke"] += 1
                assert acked in {"lease_revoked", "lease_conflict", "illegal_phase"}, acked
                assert revoked == [Outcome.APPLIED]
                assert (lease.state, lease.end_reason) == (LeaseState.REVOKED, "max_deliveries")
                if rounds > 1:
                    assert attempt.state == AttemptState.PENDING
                    assert attempt.not_before is not None
                    assert attempt.not_before_reason == "redelivery_backoff"
                else:
                    assert (attempt.state, attempt.error_code) == (
                        AttemptState.START_FAILED,
                        "undeliverable",
                    )
                    assert attempt.run.state == RunState.FAILED
    print(f"starting ACK / over-delivery revoke winners (rounds={rounds}):", wins)
    assert sum(wins.values()) == ROUNDS


@override_settings(QINGLONG_SESSION_TIMEOUT_S=30)
def test_the_offline_sweep_and_a_heartbeat_listing_its_offer_never_both_win() -> None:
    wins = {"heartbeat": 0, "sweep": 0}
    for _ in range(ROUNDS):
        session, lease, token = _claimed(max_attempts=2)
        for phase, extra in ((AckPhase.STARTING, {}), (AckPhase.RUNNING, {"executor_handle": "x"})):
            assert _ack(session, lease, token, phase, **extra) == "applied"
        _age_start(lease)
        stale = db_now() - timedelta(seconds=31)
        WorkerSession.objects.filter(pk=session.pk).update(heartbeat_at=stale)
        before = RunLease.objects.get(pk=lease.pk).expires_at
        beat, swept = race(
            functools.partial(_beat, session, [lease.offer_id]),
            functools.partial(session_mark_offline_if_stale, session_pk=session.pk),
        )
        lease.refresh_from_db()
        attempt = lease.attempt
        state = WorkerSession.objects.get(pk=session.pk).state
        if swept:
            wins["sweep"] += 1
            assert isinstance(beat, SessionRejected) and beat.code == "session_offline", beat
            assert state == SessionState.OFFLINE
            assert (lease.state, lease.end_reason) == (LeaseState.REVOKED, "worker_lost")
            assert attempt.state == AttemptState.LOST
            retry = Attempt.objects.get(run_id=attempt.run_id, number=2)
            assert retry.not_before_reason == "lost_execution_grace"
        else:
            wins["heartbeat"] += 1
            assert not isinstance(beat, Exception) and beat.recorded, beat
            assert state == SessionState.ONLINE
            assert lease.state == LeaseState.ACTIVE and lease.expires_at > before
            assert attempt.state == AttemptState.RUNNING
    print("heartbeat / offline sweep winners:", wins)
    assert sum(wins.values()) == ROUNDS
