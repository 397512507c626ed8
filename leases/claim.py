"""The claim: the only path that creates a RunLease (docs/adr/0002).

One transaction locks the Run and the Attempt and checks their state and
version, checks the Project and Task quotas (`leases.quota`), locks the
Worker Session and checks that it takes claims, that the pull id carries one
token, and that it has a free slot (an over-delivered Attempt waits out its
backoff in `not_before`, which the candidate read honours, and may then go to
any Worker: docs/adr/0005); then it moves the Attempt `pending → claimed`
(lease generation + 1) and the Run `queued → dispatching`, and inserts the
lease. Any check that fails changes nothing and answers why (`ClaimStatus`),
as the kernel's `ClaimPort` asks; the in-memory fake
(`dispatch.core.fakes.FakeClaimPort`) answers the same scenarios the same way
(dispatch/tests/test_port_contract.py; the fake models the Project quota, the
Task limit is tested against the database: leases/tests/test_task_quota.py).
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.db import IntegrityError, transaction

from dispatch.core.policy import free_slots
from dispatch.core.ports import ClaimOutcome, ClaimRequest, ClaimStatus
from leases import policy
from leases.errors import LostRace
from leases.locks import lock_attempt, lock_run, lock_session
from leases.models import RunLease
from leases.quota import quota_blocker
from leases.selectors import active_lease_count, pull_id_conflicts
from leases.transitions import attempt_transition, run_transition
from qinglong.clock import db_now
from qinglong.metrics import CLAIMS, LOST_RACES
from runs.models import AttemptState, RunState

__all__ = ["DatabaseClaimPort", "lease_claim"]

logger = logging.getLogger("qinglong.dispatch")


def lease_claim(request: ClaimRequest) -> ClaimOutcome:
    """Claim an Attempt for one Worker Session: the only path that creates a lease."""
    lost = ClaimOutcome(status=ClaimStatus.ATTEMPT_LOST)
    unavailable = ClaimOutcome(status=ClaimStatus.WORKER_UNAVAILABLE)
    try:
        with transaction.atomic(durable=True):
            # Run then Attempt: their transitions commit together.
            run = lock_run(request.run_id, skip_locked=request.skip_locked)
            if run is None or run.state != RunState.QUEUED or run.cancel_requested:
                return lost
            attempt = lock_attempt(
                request.attempt_id, run_id=run.pk, skip_locked=request.skip_locked
            )
            if (
                attempt is None
                or attempt.state != AttemptState.PENDING
                or attempt.version != request.expected_version
                or attempt.lease_generation + 1 != request.lease_generation
            ):
                return lost
            # The Project's and the Task's concurrency limits (leases.quota): the
            # Project row, then the Task row, locked only when it has a limit.
            if (
                quota_blocker(
                    project=run.project,
                    task_id=run.task_id,
                    task_limit=run.task_revision.max_concurrent_runs,
                    lock=True,
                )
                is not None
            ):
                return lost
            # The Session: slot accounting must see every committed lease of
            # this Session, and a replacement must wait for this claim.
            session = lock_session(session_id=request.session_id)
            if session is None or not policy.session_takes_claims(
                session, worker_id=request.worker_id, generation=request.session_generation
            ):
                return unavailable
            if request.pull_id is not None and pull_id_conflicts(
                session_pk=session.pk, pull_id=request.pull_id, token_digest=request.token_digest
            ):
                # docs/adr/0003: one pull id, one token. Checked under the
                # Session lock, so two racing pulls reusing an id cannot both claim.
                return unavailable
            if free_slots(policy.session_capacity(session), active_lease_count(session.pk)) < 1:
                return unavailable
            now = db_now()
            attempt_transition(
                attempt,
                AttemptState.CLAIMED,
                reason="claim",
                actor=f"worker:{session.worker_id}",
                lease_generation=request.lease_generation,
            )
            run_transition(run, RunState.DISPATCHING)
            lease = RunLease.objects.create(
                attempt=attempt,
                run=run,
                worker_id=session.worker_id,
                session=session,
                session_generation=session.generation,
                lease_generation=request.lease_generation,
                offer_id=request.offer_id,
                token_digest=request.token_digest,
                spec_digest=request.spec_sha256,
                placement_score=request.placement_score,
                source=request.source,
                pull_id=request.pull_id,
                claimed_at=now,
                expires_at=now + timedelta(seconds=request.lease_ttl_s),
            )
    except (LostRace, IntegrityError):
        # Another dispatcher changed the Attempt or inserted its lease first.
        LOST_RACES.labels(operation="claim").inc()
        return lost
    logger.info(
        "lease claimed",
        extra={
            "event": "lease_claimed",
            "lease_id": lease.pk,
            "attempt_id": attempt.pk,
            "worker_id": session.worker_id,
            "lease_generation": lease.lease_generation,
        },
    )
    return ClaimOutcome(status=ClaimStatus.WON, lease_id=str(lease.pk), expires_at=lease.expires_at)


class DatabaseClaimPort:
    """The `ClaimPort` of `dispatch.core` over `lease_claim`."""

    def claim(self, request: ClaimRequest) -> ClaimOutcome:
        # Every claim a cycle makes passes here (global and pull scope).
        outcome = lease_claim(request)
        CLAIMS.labels(outcome=str(outcome.status)).inc()
        return outcome
