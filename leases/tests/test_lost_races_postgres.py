"""Lost races on the claim path with real concurrent PostgreSQL connections.

Each thread has its own Django connection (connections are thread-local) and
closes it when done. STYLE: "every path that claims or mutates a lease has a
lost-race test (the `updated != 1` branch)"; docs/adr/0002: locks + CAS make
many dispatchers and web nodes safe — these tests make them actually collide.
"""

from __future__ import annotations

import functools
import time
from datetime import timedelta

import pytest

from dispatch.core.ports import ClaimStatus
from leases.ack import AckPhase, lease_ack
from leases.claim import lease_claim
from leases.end import lease_expire, run_cancel
from leases.errors import LeaseConflict, Outcome
from leases.models import LeaseState, RunLease
from leases.tests.racing import HeldRows, race
from qinglong import testing
from qinglong.clock import db_now
from runs.models import Attempt, AttemptState, Run, RunState
from workers.models import SESSION_CURRENT_STATES, Worker, WorkerSession
from workers.services import session_open

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def test_two_claims_of_one_attempt_exactly_one_wins() -> None:
    for skip_locked in (False, True):
        run = testing.make_run()
        attempt = testing.pending_attempt(run)
        one, two = testing.open_session().session, testing.open_session().session
        r1, _ = testing.claim_request(attempt, one, skip_locked=skip_locked)
        r2, _ = testing.claim_request(attempt, two, skip_locked=skip_locked)
        outcomes = race(functools.partial(lease_claim, r1), functools.partial(lease_claim, r2))
        statuses = sorted(o.status for o in outcomes)
        assert statuses == sorted([ClaimStatus.WON, ClaimStatus.ATTEMPT_LOST])
        assert RunLease.objects.filter(attempt=attempt, state=LeaseState.ACTIVE).count() == 1
        attempt.refresh_from_db()
        assert (attempt.state, attempt.lease_generation) == (AttemptState.CLAIMED, 1)


def test_global_claim_skips_a_row_locked_by_another_connection() -> None:
    run = testing.make_run()
    attempt = testing.pending_attempt(run)
    session = testing.open_session().session
    request, _ = testing.claim_request(attempt, session, skip_locked=True)
    with HeldRows((Run, run.pk), (Attempt, attempt.pk)):
        started = time.monotonic()
        outcome = lease_claim(request)
        elapsed = time.monotonic() - started
    # SKIP LOCKED: the rival's row is someone else's business, not a wait.
    assert outcome.status is ClaimStatus.ATTEMPT_LOST
    assert elapsed < 2.0
    assert RunLease.objects.count() == 0
    # Once the lock is gone the same claim wins: nothing was consumed.
    assert lease_claim(request).status is ClaimStatus.WON


def test_two_claims_on_a_one_slot_session_exactly_one_wins() -> None:
    session = testing.open_session(slots=1).session
    a1 = testing.pending_attempt(testing.make_run())
    a2 = testing.pending_attempt(testing.make_run())
    r1, _ = testing.claim_request(a1, session)
    r2, _ = testing.claim_request(a2, session)
    outcomes = race(functools.partial(lease_claim, r1), functools.partial(lease_claim, r2))
    statuses = sorted(o.status for o in outcomes)
    assert statuses == sorted([ClaimStatus.WON, ClaimStatus.WORKER_UNAVAILABLE])
    assert RunLease.objects.filter(session=session, state=LeaseState.ACTIVE).count() == 1
    loser = a2 if outcomes[0].status is ClaimStatus.WON else a1
    loser.refresh_from_db()
    assert loser.state == AttemptState.PENDING


def test_ack_starting_and_lease_expiry_never_both_win() -> None:
    wins = {"ack": 0, "expire": 0}
    for round_ in range(8):
        session = testing.open_session().session
        attempt = testing.pending_attempt(testing.make_run())
        outcome, offer_id, token = testing.claim(attempt, session)
        assert outcome.status is ClaimStatus.WON
        lease = RunLease.objects.get(offer_id=offer_id)
        # Expiry lands around the moment both racers start: either may win.
        deadline = db_now() + timedelta(milliseconds=40 + 10 * round_)
        RunLease.objects.filter(pk=lease.pk).update(expires_at=deadline)
        time.sleep(0.04)

        def ack(
            lease: RunLease = lease, token: str = token, session: WorkerSession = session
        ) -> str:
            try:
                lease_ack(
                    session=session,
                    offer_id=lease.offer_id,
                    phase=AckPhase.STARTING,
                    lease_token=token,
                    spec_sha256=lease.spec_digest,
                )
            except LeaseConflict as err:
                return err.code
            return "applied"

        def expire(lease_id: int = lease.pk, attempt_id: int = attempt.pk) -> Outcome:
            # Retry until the deadline has passed, like the sweeper would.
            for _ in range(100):
                result = lease_expire(lease_id)
                if result is not Outcome.UNCHANGED:
                    return result
                if RunLease.objects.get(pk=lease_id).state != LeaseState.ACTIVE:
                    return result
                if Attempt.objects.get(pk=attempt_id).state != AttemptState.CLAIMED:
                    return result
                time.sleep(0.005)
            return Outcome.UNCHANGED

        acked, expired = race(ack, expire)
        ack_won = acked == "applied"
        expire_won = expired is Outcome.APPLIED
        assert ack_won != expire_won, (acked, expired)
        attempt.refresh_from_db()
        lease.refresh_from_db()
        if ack_won:
            wins["ack"] += 1
            assert (attempt.state, lease.state) == (AttemptState.STARTING, LeaseState.ACTIVE)
        else:
            wins["expire"] += 1
            assert (attempt.state, lease.state) == (AttemptState.PENDING, LeaseState.EXPIRED)
    print("ack/expire race winners:", wins)
    assert sum(wins.values()) == 8


def test_cancel_racing_a_claim_always_ends_cancelled_without_an_active_lease() -> None:
    for _ in range(4):
        run = testing.make_run()
        attempt = testing.pending_attempt(run)
        session = testing.open_session().session
        request, _ = testing.claim_request(attempt, session)
        claimed, cancelled = race(
            functools.partial(lease_claim, request), functools.partial(run_cancel, run=run)
        )
        assert cancelled in (Outcome.APPLIED, Outcome.LOST_RACE)
        if cancelled is Outcome.LOST_RACE:
            # The cancel lost its CAS to the claim: an operator retry applies it.
            assert run_cancel(run=Run.objects.get(pk=run.pk)) is Outcome.APPLIED
        run.refresh_from_db()
        attempt.refresh_from_db()
        assert run.state == RunState.CANCELLED
        assert attempt.state == AttemptState.CANCELLED
        assert not RunLease.objects.filter(attempt=attempt, state=LeaseState.ACTIVE).exists()
        if claimed.status is ClaimStatus.WON:
            lease = RunLease.objects.get(attempt=attempt)
            assert (lease.state, lease.end_reason) == (LeaseState.REVOKED, "run_cancelled")


def test_concurrent_session_opens_give_distinct_generations_and_one_current() -> None:
    worker, _ = testing.make_worker(slots=2)

    def open_one() -> int:
        fresh = Worker.objects.get(pk=worker.pk)
        opened = session_open(
            worker=fresh,
            executor_types=list(fresh.executor_types),
            labels=dict(fresh.labels),
            slots=2,
        )
        return opened.session.generation

    generations = race(*([open_one] * 4))
    assert all(isinstance(g, int) for g in generations), generations
    assert sorted(generations) == [1, 2, 3, 4]
    assert (
        WorkerSession.objects.filter(worker=worker, state__in=SESSION_CURRENT_STATES).count() == 1
    )
    current = WorkerSession.objects.get(worker=worker, state__in=SESSION_CURRENT_STATES)
    assert current.generation == 4
