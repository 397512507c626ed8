"""Every Run/Attempt/Lease transition: the legal path, an illegal one, the lost race.

The lost race here is the compare-and-set's `updated != 1` branch reached by a
second writer committing between our read and our write; the PostgreSQL tests
in `test_races_postgres.py` do the same with two real connections.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from dispatch.core.ports import ClaimStatus
from leases.ack import AckPhase, lease_ack
from leases.end import lease_expire, lease_revoke, run_cancel
from leases.errors import (
    IllegalTransition,
    LeaseConflict,
    LeaseForbidden,
    LeaseNotFound,
    LostRace,
    Outcome,
)
from leases.models import LeaseState, RunLease
from leases.transitions import attempt_transition, lease_transition, run_transition
from qinglong.testing import claim, make_run, make_task, open_session, pending_attempt
from runs.models import Attempt, AttemptEvent, Run

pytestmark = pytest.mark.django_db


def _snapshot(attempt: Attempt) -> tuple:
    a = Attempt.objects.get(pk=attempt.pk)
    r = Run.objects.get(pk=attempt.run_id)
    leases = tuple(RunLease.objects.filter(attempt=attempt).values_list("state", "version"))
    return (
        a.state,
        a.version,
        a.lease_generation,
        r.state,
        r.version,
        leases,
        AttemptEvent.objects.filter(attempt=attempt).count(),
    )


def _ack(session, offer_id, token, phase, **kw):
    lease = RunLease.objects.get(offer_id=offer_id)
    return lease_ack(
        session=session,
        offer_id=offer_id,
        phase=phase,
        lease_token=token,
        spec_sha256=lease.spec_digest,
        **kw,
    )


@pytest.fixture
def claimed():
    opened = open_session()
    run = make_run(max_attempts=2)
    attempt = pending_attempt(run)
    outcome, offer_id, token = claim(attempt, opened.session)
    assert outcome.status is ClaimStatus.WON
    return opened.session, run, Attempt.objects.get(pk=attempt.pk), offer_id, token


# ---------------------------------------------------------------- CAS helpers


def test_attempt_transition_illegal_raises_and_leaves_row_unchanged():
    attempt = pending_attempt(make_run())
    before = _snapshot(attempt)
    with pytest.raises(IllegalTransition):
        attempt_transition(attempt, "running", reason="test")
    assert _snapshot(attempt) == before


def test_attempt_transition_lost_race_raises_and_changes_nothing():
    attempt = pending_attempt(make_run())
    stale = Attempt.objects.get(pk=attempt.pk)
    Attempt.objects.filter(pk=attempt.pk).update(version=attempt.version + 1)  # another writer
    with pytest.raises(LostRace):
        attempt_transition(stale, "claimed", reason="test")
    assert Attempt.objects.get(pk=attempt.pk).state == "pending"
    assert not AttemptEvent.objects.filter(attempt=attempt).exists()


def test_run_transition_illegal_and_lost_race():
    run = make_run()
    with pytest.raises(IllegalTransition):
        run_transition(run, "succeeded")
    stale = Run.objects.get(pk=run.pk)
    Run.objects.filter(pk=run.pk).update(version=run.version + 1)
    with pytest.raises(LostRace):
        run_transition(stale, "dispatching")
    assert Run.objects.get(pk=run.pk).state == "queued"


# ---------------------------------------------------------------------- claim


def test_claim_moves_attempt_and_run_and_inserts_one_lease(claimed):
    session, run, attempt, offer_id, token = claimed
    lease = RunLease.objects.get(attempt=attempt)
    assert (attempt.state, attempt.lease_generation) == ("claimed", 1)
    assert Run.objects.get(pk=run.pk).state == "dispatching"
    assert (lease.state, lease.session_id, lease.session_generation) == (
        "active",
        session.pk,
        session.generation,
    )
    assert lease.offer_id == offer_id
    assert token not in (lease.token_digest, lease.offer_id)  # only a digest is stored
    assert len(lease.token_digest) == 64
    assert lease.expires_at > lease.claimed_at


def test_claim_of_an_already_claimed_attempt_is_lost(claimed):
    _session, _run, attempt, _, _ = claimed
    other = open_session().session
    before = _snapshot(attempt)
    outcome, _, _ = claim(attempt, other, expected_version=attempt.version)
    assert outcome.status is ClaimStatus.ATTEMPT_LOST
    assert _snapshot(attempt) == before


def test_claim_with_a_stale_version_loses_the_race():
    session = open_session().session
    attempt = pending_attempt(make_run())
    stale_version = attempt.version
    Attempt.objects.filter(pk=attempt.pk).update(version=stale_version + 1)  # another writer
    outcome, _, _ = claim(attempt, session, expected_version=stale_version)
    assert outcome.status is ClaimStatus.ATTEMPT_LOST
    assert not RunLease.objects.filter(attempt=attempt).exists()
    assert Run.objects.get(pk=attempt.run_id).state == "queued"


def test_claim_beyond_the_sessions_free_slots_is_worker_unavailable():
    session = open_session(slots=1).session
    first, second = pending_attempt(make_run()), pending_attempt(make_run())
    assert claim(first, session)[0].status is ClaimStatus.WON
    before = _snapshot(second)
    assert claim(second, session)[0].status is ClaimStatus.WORKER_UNAVAILABLE
    assert _snapshot(second) == before


def test_claim_for_a_replaced_session_is_worker_unavailable():
    old = open_session()
    open_session(old.session.worker)  # fences `old`
    attempt = pending_attempt(make_run())
    old.session.refresh_from_db()
    assert claim(attempt, old.session)[0].status is ClaimStatus.WORKER_UNAVAILABLE
    assert not RunLease.objects.filter(attempt=attempt).exists()


def test_claim_of_a_cancelled_run_is_lost():
    session = open_session().session
    run = make_run()
    attempt = pending_attempt(run)
    run_cancel(run=run)
    assert claim(attempt, session)[0].status is ClaimStatus.ATTEMPT_LOST


# ----------------------------------------------------------------------- ACKs


def test_ack_path_starting_running_succeeded(claimed):
    session, _run, attempt, offer_id, token = claimed
    r = _ack(session, offer_id, token, AckPhase.STARTING)
    assert (r.attempt_state, r.run_state, r.outcome) == ("starting", "running", Outcome.APPLIED)
    r = _ack(session, offer_id, token, AckPhase.RUNNING, executor_handle="pid:42")
    assert r.attempt_state == "running"
    assert Attempt.objects.get(pk=attempt.pk).executor_handle == "pid:42"
    r = _ack(session, offer_id, token, AckPhase.SUCCEEDED, exit_code=0, output_tail="ok")
    assert (r.attempt_state, r.run_state) == ("succeeded", "succeeded")
    assert RunLease.objects.get(offer_id=offer_id).state == LeaseState.RELEASED


def test_ack_repeat_of_same_phase_is_idempotent(claimed):
    session, _run, attempt, offer_id, token = claimed
    _ack(session, offer_id, token, AckPhase.STARTING)
    before = _snapshot(attempt)
    again = _ack(session, offer_id, token, AckPhase.STARTING)
    assert again.outcome is Outcome.UNCHANGED
    assert _snapshot(attempt) == before


def test_ack_out_of_order_phase_is_conflict_and_changes_nothing(claimed):
    session, _run, attempt, offer_id, token = claimed
    before = _snapshot(attempt)
    with pytest.raises(LeaseConflict) as err:
        _ack(session, offer_id, token, AckPhase.SUCCEEDED, exit_code=0)
    assert err.value.code == "illegal_phase"
    assert _snapshot(attempt) == before


def test_ack_from_another_session_or_with_wrong_token_is_forbidden(claimed):
    session, _run, attempt, offer_id, token = claimed
    other = open_session().session
    before = _snapshot(attempt)
    with pytest.raises(LeaseForbidden):
        _ack(other, offer_id, token, AckPhase.STARTING)
    with pytest.raises(LeaseForbidden):
        _ack(session, offer_id, "x" * 43, AckPhase.STARTING)
    with pytest.raises(LeaseNotFound):
        lease_ack(
            session=session,
            offer_id="0" * 64,
            phase=AckPhase.STARTING,
            lease_token=token,
            spec_sha256="0" * 64,
        )
    assert _snapshot(attempt) == before


def test_ack_with_a_different_spec_digest_is_conflict(claimed):
    session, _run, attempt, offer_id, token = claimed
    with pytest.raises(LeaseConflict) as err:
        lease_ack(
            session=session,
            offer_id=offer_id,
            phase=AckPhase.STARTING,
            lease_token=token,
            spec_sha256="f" * 64,
        )
    assert err.value.code == "spec_mismatch"
    assert Attempt.objects.get(pk=attempt.pk).state == "claimed"


def test_ack_on_an_expired_lease_is_conflict(claimed):
    session, _run, attempt, offer_id, token = claimed
    RunLease.objects.filter(offer_id=offer_id).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    before = _snapshot(attempt)
    with pytest.raises(LeaseConflict) as err:
        _ack(session, offer_id, token, AckPhase.STARTING)
    assert err.value.code == "lease_expired"
    assert _snapshot(attempt) == before


def test_start_failed_retries_while_attempts_remain(claimed):
    session, run, _attempt, offer_id, token = claimed
    r = _ack(session, offer_id, token, AckPhase.START_FAILED, error_code="enoent")
    assert (r.attempt_state, r.run_state) == ("start_failed", "queued")
    second = Attempt.objects.get(run=run, number=2)
    assert second.state == "pending"
    # The second attempt fails too: max_attempts=2 is reached, the Run fails.
    _outcome, offer2, token2 = claim(second, session)
    _ack(session, offer2, token2, AckPhase.STARTING)
    _ack(session, offer2, token2, AckPhase.RUNNING, executor_handle="pid:1")
    r = _ack(session, offer2, token2, AckPhase.FAILED, exit_code=3)
    assert (r.attempt_state, r.run_state) == ("failed", "failed")
    assert Attempt.objects.filter(run=run).count() == 2


# ----------------------------------------------------------- expire & revoke


def test_expired_claimed_lease_returns_attempt_to_pending_with_next_generation(claimed):
    session, run, attempt, offer_id, _token = claimed
    lease = RunLease.objects.get(offer_id=offer_id)
    assert lease_expire(lease.pk) is Outcome.UNCHANGED  # not yet due
    RunLease.objects.filter(pk=lease.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert lease_expire(lease.pk) is Outcome.APPLIED
    attempt.refresh_from_db()
    assert (attempt.state, attempt.lease_generation) == ("pending", 1)
    assert Run.objects.get(pk=run.pk).state == "queued"
    assert RunLease.objects.get(pk=lease.pk).state == LeaseState.EXPIRED
    outcome, _, _ = claim(attempt, session)
    assert outcome.status is ClaimStatus.WON
    assert Attempt.objects.get(pk=attempt.pk).lease_generation == 2
    assert lease_expire(lease.pk) is Outcome.UNCHANGED  # ending twice changes nothing


def test_expired_started_lease_loses_attempt_and_applies_retry_policy(claimed):
    session, run, attempt, offer_id, token = claimed
    _ack(session, offer_id, token, AckPhase.STARTING)
    lease = RunLease.objects.get(offer_id=offer_id)
    RunLease.objects.filter(pk=lease.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert lease_expire(lease.pk) is Outcome.APPLIED
    assert Attempt.objects.get(pk=attempt.pk).state == "lost"
    assert Attempt.objects.get(run=run, number=2).state == "pending"
    assert Run.objects.get(pk=run.pk).state == "queued"


def test_late_ack_cannot_resurrect_an_expired_lease(claimed):
    session, _run, attempt, offer_id, token = claimed
    lease = RunLease.objects.get(offer_id=offer_id)
    RunLease.objects.filter(pk=lease.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    lease_expire(lease.pk)
    with pytest.raises(LeaseConflict) as err:
        _ack(session, offer_id, token, AckPhase.STARTING)
    assert err.value.code == "lease_expired"
    assert Attempt.objects.get(pk=attempt.pk).state == "pending"


def test_lease_ending_lost_race_changes_nothing(claimed):
    _session, _run, _attempt, offer_id, _token = claimed
    lease = RunLease.objects.get(offer_id=offer_id)
    stale = RunLease.objects.get(pk=lease.pk)
    RunLease.objects.filter(pk=lease.pk).update(version=lease.version + 1)  # another writer
    with pytest.raises(LostRace):
        lease_transition(stale, LeaseState.REVOKED, reason="test", now=timezone.now())
    assert RunLease.objects.get(pk=lease.pk).state == LeaseState.ACTIVE


def test_revoke_ignores_expiry_and_returns_the_attempt(claimed):
    _session, _run, attempt, offer_id, _token = claimed
    lease = RunLease.objects.get(offer_id=offer_id)
    assert lease_revoke(lease.pk, reason="operator") is Outcome.APPLIED
    assert RunLease.objects.get(pk=lease.pk).end_reason == "operator"
    assert Attempt.objects.get(pk=attempt.pk).state == "pending"


def test_session_replacement_ends_the_old_sessions_leases(claimed):
    session, _run, attempt, offer_id, token = claimed
    new = open_session(session.worker)
    assert new.replaced == (session.pk,)
    assert RunLease.objects.get(offer_id=offer_id).state == LeaseState.REVOKED
    assert Attempt.objects.get(pk=attempt.pk).state == "pending"
    with pytest.raises(LeaseConflict):
        _ack(session, offer_id, token, AckPhase.STARTING)


# --------------------------------------------------------------------- cancel


def test_cancel_of_a_queued_run_is_immediate_and_idempotent():
    run = make_run()
    assert run_cancel(run=run) is Outcome.APPLIED
    assert (run.state, pending_attempt_state(run)) == ("cancelled", "cancelled")
    assert run_cancel(run=run) is Outcome.UNCHANGED


def pending_attempt_state(run: Run) -> str:
    return Attempt.objects.get(run=run, number=1).state


def test_cancel_of_a_claimed_run_revokes_its_lease(claimed):
    session, run, attempt, offer_id, token = claimed
    assert run_cancel(run=run) is Outcome.APPLIED
    assert RunLease.objects.get(offer_id=offer_id).state == LeaseState.REVOKED
    assert Attempt.objects.get(pk=attempt.pk).state == "cancelled"
    with pytest.raises(LeaseConflict):
        _ack(session, offer_id, token, AckPhase.STARTING)


def test_cancel_of_a_running_run_waits_for_the_terminal_ack(claimed):
    session, run, _attempt, offer_id, token = claimed
    _ack(session, offer_id, token, AckPhase.STARTING)
    _ack(session, offer_id, token, AckPhase.RUNNING, executor_handle="pid:1")
    assert run_cancel(run=run) is Outcome.APPLIED
    run.refresh_from_db()
    assert (run.state, run.cancel_requested) == ("running", True)
    assert run_cancel(run=run) is Outcome.UNCHANGED
    r = _ack(session, offer_id, token, AckPhase.FAILED, exit_code=143)
    assert (r.attempt_state, r.run_state, r.cancel_requested) == ("failed", "cancelled", True)
    assert not Attempt.objects.filter(run=run, number=2).exists()  # no retry after cancel


def test_cancel_lost_race_is_reported():
    task = make_task()
    run = make_run(task)
    # Another writer moves the Attempt after the cancel read it: simulate by a
    # concurrent version bump between the Run lock and the Attempt CAS.
    from leases import end

    original = end.lock_active_attempt

    def stale_read(run_id):
        attempt = original(run_id)
        Attempt.objects.filter(pk=attempt.pk).update(version=attempt.version + 1)
        return attempt

    end.lock_active_attempt = stale_read
    try:
        assert run_cancel(run=run) is Outcome.LOST_RACE
    finally:
        end.lock_active_attempt = original
    assert Run.objects.get(pk=run.pk).state == "queued"
    assert not Run.objects.get(pk=run.pk).cancel_requested


def test_claim_reusing_a_pull_id_with_another_token_is_refused():
    session = open_session(slots=2).session
    first, second = pending_attempt(make_run()), pending_attempt(make_run())
    pull_id = "7d1f6c1e-8f0a-4d55-9d0c-1b2a3c4d5e6f"
    won, _, _ = claim(first, session, pull_id=pull_id, token="a" * 43)
    assert won.status is ClaimStatus.WON
    before = _snapshot(second)
    refused, _, _ = claim(second, session, pull_id=pull_id, token="b" * 43)
    assert refused.status is ClaimStatus.WORKER_UNAVAILABLE
    assert _snapshot(second) == before
    again, _, _ = claim(second, session, pull_id=pull_id, token="a" * 43)
    assert again.status is ClaimStatus.WON


def test_ack_from_a_session_fenced_after_authentication_is_refused(claimed):
    session, _run, attempt, offer_id, token = claimed
    # The replacement committed, its lease ending has not run yet: the ACK that
    # authenticated just before must not start the Attempt (no double run).
    from workers.models import WorkerSession

    WorkerSession.objects.filter(pk=session.pk).update(state="replaced")
    before = _snapshot(attempt)
    with pytest.raises(LeaseConflict) as err:
        _ack(session, offer_id, token, AckPhase.STARTING)
    assert err.value.code == "session_replaced"
    assert _snapshot(attempt) == before
