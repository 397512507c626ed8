"""The claim: the only path that creates a RunLease (docs/adr/0002, docs/adr/0011).

One transaction locks the Run and the Attempt and checks their state and
version, checks the Project and Task quotas (`leases.quota`), locks the
Worker Session and checks that it takes claims, that the pull id carries one
token, and that it has a free slot (an over-delivered Attempt waits out its
backoff in `not_before`, which the candidate read honours, and may then go to
any Worker: docs/adr/0005); then it moves the Attempt `pending → claimed`
(lease generation + 1) and the Run `queued → dispatching`, and inserts the
lease. Any check that fails changes nothing and answers why (`ClaimStatus`),
in the order the kernel's `ClaimPort` states; the in-memory fake
(`dispatch.core.fakes.FakeClaimPort`) answers the same scenarios the same way
(dispatch/tests/test_port_contract.py; the fake models the Project quota, the
Task limit is tested against the database: leases/tests/test_task_quota.py).

Two statements on PostgreSQL when no quota applies (docs/adr/0011):

1. `leases.locks.lock_claim_rows`: Run → Attempt → WorkerSession locked in
   one statement (`SKIP LOCKED` on Run and Attempt in global scope), with the
   database clock read once the locks are held;
2. `lease_grant`: the checks that must see every lease committed before the
   Session lock (slots, the pull id) and, only if they pass, every write —
   Attempt, its history row, Run, lease — as one statement (`leases.writes`).

With a Project or Task limit the Session is locked after them, as the lock
order says (`leases.quota.quota_blocker(lock=True)`, then
`leases.locks.lock_session`). SQLite runs the same SQL without row locks,
its writes one statement at a time (its `BEGIN IMMEDIATE` serializes them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, connection, transaction

from dispatch.core.policy import free_slots
from dispatch.core.ports import ClaimOutcome, ClaimRequest, ClaimStatus
from leases import policy
from leases.errors import LostRace
from leases.locks import ClaimRows, lock_claim_rows, lock_session
from leases.models import LeaseState, RunLease
from leases.quota import quota_blocker
from leases.writes import Guard, Writes
from qinglong.clock import db_now
from qinglong.metrics import CLAIMS, LOST_RACES
from runs.models import AttemptState, Project, RunState
from workers.models import WorkerSession

__all__ = ["DatabaseClaimPort", "lease_claim", "lease_grant"]

logger = logging.getLogger("qinglong.dispatch")

_LOST = ClaimOutcome(status=ClaimStatus.ATTEMPT_LOST)
_UNAVAILABLE = ClaimOutcome(status=ClaimStatus.WORKER_UNAVAILABLE)


def lease_claim(request: ClaimRequest) -> ClaimOutcome:
    """Claim an Attempt for one Worker Session: the only path that creates a lease."""
    if not (request.run_id.isdigit() and request.attempt_id.isdigit()):
        return _LOST
    try:
        with transaction.atomic(durable=True):
            rows = lock_claim_rows(
                run_id=int(request.run_id),
                attempt_id=int(request.attempt_id),
                session_id=request.session_id,
                skip_locked=request.skip_locked,
            )
            # 1. The Run and its Attempt, as the dispatcher read them.
            if rows is None or not _claimable(rows, request):
                return _LOST
            session, now = rows.session, rows.now
            if rows.project_limit or rows.task_limit:
                # 2. Quotas: Project, then Task, then the Session (the lock order).
                if _quota_blocks(rows):
                    return _LOST
                session = lock_session(session_id=request.session_id)
                now = db_now()
            # 3. The Session: it must take claims, as the dispatcher saw it.
            if session is None or not policy.session_takes_claims(
                session, worker_id=request.worker_id, generation=request.session_generation
            ):
                return _UNAVAILABLE
            lease = lease_grant(rows, session, request, now=now)  # 4, 5 and the writes
            if isinstance(lease, ClaimOutcome):
                return lease
    except (LostRace, IntegrityError):
        # Another dispatcher changed the Attempt or inserted its lease first.
        LOST_RACES.labels(operation="claim").inc()
        return _LOST
    logger.info(
        "lease claimed",
        extra={
            "event": "lease_claimed",
            "lease_id": lease.pk,
            "attempt_id": lease.attempt_id,
            "worker_id": lease.worker_id,
            "lease_generation": lease.lease_generation,
        },
    )
    return ClaimOutcome(status=ClaimStatus.WON, lease_id=str(lease.pk), expires_at=lease.expires_at)


def _claimable(rows: ClaimRows, request: ClaimRequest) -> bool:
    run, attempt = rows.run, rows.attempt
    return (
        run.state == RunState.QUEUED
        and not run.cancel_requested
        and attempt.state == AttemptState.PENDING
        and attempt.version == request.expected_version
        and attempt.lease_generation + 1 == request.lease_generation
    )


def _quota_blocks(rows: ClaimRows) -> bool:
    """The one quota rule (`leases.quota`): Project and Task limits, rows locked."""
    project = Project(pk=rows.run.project_id, max_concurrent_runs=rows.project_limit)
    blocker = quota_blocker(
        project=project, task_id=rows.run.task_id, task_limit=rows.task_limit, lock=True
    )
    return blocker is not None


@dataclass(frozen=True)
class _Checks:
    """4 and 5, read under the Session lock (`Guard`)."""

    pull_conflict: bool
    active: int


def lease_grant(
    rows: ClaimRows, session: WorkerSession, request: ClaimRequest, *, now: datetime
) -> RunLease | ClaimOutcome:
    """Checks 4-5 of the claim and, when they pass, its writes: one statement on PostgreSQL.

    Runs under the Session lock, in a statement of its own, so the slot count
    and the pull-id check see every lease committed before the lock was
    granted (READ COMMITTED reads a new snapshot per statement).
    """
    lease_table = connection.ops.quote_name(RunLease._meta.db_table)
    columns = {
        # docs/adr/0003: one pull id, one token. Checked under the Session
        # lock, so two racing pulls reusing an id cannot both claim. (The pull
        # compares digests in constant time before its cycle; this catches the race.)
        "pull_conflict": (
            f"EXISTS (SELECT 1 FROM {lease_table} WHERE session_id = %s "  # noqa: S608  (names from model metadata; values are parameters)
            "AND pull_id = %s AND token_digest <> %s)"
            if request.pull_id is not None
            else "1 = 0"
        ),
        # Slots: every active lease of the Session counts (runlease_active_session).
        "active": f"(SELECT count(*) FROM {lease_table} WHERE session_id = %s AND state = %s)",  # noqa: S608  (names from model metadata; values are parameters)
    }
    params: list[Any] = []
    if request.pull_id is not None:
        pull_id = RunLease._meta.get_field("pull_id").get_db_prep_value(request.pull_id, connection)
        params += [session.pk, pull_id, request.token_digest]
    params += [session.pk, LeaseState.ACTIVE]
    capacity = policy.session_capacity(session)
    guard = Guard(
        columns=columns,
        params=params,
        ok="NOT g.pull_conflict AND g.active < %s",
        ok_params=[capacity],
    )

    attempt, run = rows.attempt, rows.run
    lease = RunLease(
        attempt_id=attempt.pk,
        run_id=run.pk,
        worker_id=session.worker_id,
        session_id=session.pk,
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
    writes = Writes()
    writes.attempt(
        attempt,
        AttemptState.CLAIMED,
        reason="claim",
        actor=f"worker:{session.worker_id}",
        lease_generation=request.lease_generation,
    )
    writes.run(run, RunState.DISPATCHING)
    writes.lease_create(lease)
    row = writes.apply(guard=guard)
    assert row is not None
    checks = _Checks(pull_conflict=bool(row["pull_conflict"]), active=int(row["active"]))
    # The contract's order (dispatch.core.ports.ClaimPort): 4, then 5.
    if checks.pull_conflict:
        return _UNAVAILABLE
    if free_slots(capacity, checks.active) < 1:
        return _UNAVAILABLE
    return lease


class DatabaseClaimPort:
    """The `ClaimPort` of `dispatch.core` over `lease_claim`."""

    def claim(self, request: ClaimRequest) -> ClaimOutcome:
        # Every claim a cycle makes passes here (global and pull scope).
        outcome = lease_claim(request)
        CLAIMS.labels(outcome=str(outcome.status)).inc()
        return outcome
