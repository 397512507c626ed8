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
(dispatch/tests/test_port_contract.py, both limits included: the fake counts
the live leases of a Project and of a Task as leases.quota does).

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
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, OperationalError, connection, transaction
from django.db.models.base import ModelState
from psycopg import errors as pg_errors

from dispatch.core.policy import free_slots
from dispatch.core.ports import PULL_CLAIM, ClaimOutcome, ClaimRequest, ClaimStatus
from leases import policy
from leases.errors import LostRace
from leases.locks import (
    BatchKey,
    BatchLimits,
    BatchRow,
    ClaimRows,
    claim_count_sql,
    lock_claim_batch,
    lock_claim_batch_limits,
    lock_claim_rows,
    lock_session,
    pull_conflict_sql,
)
from leases.models import RunLease
from leases.quota import quota_blocker
from leases.writes import ClaimCounts, ClaimWrites, Guard, Writes
from qinglong.clock import db_now
from qinglong.metrics import CLAIMS, LOST_RACES
from runs.models import AttemptState, Project, RunState
from workers.models import WorkerSession

__all__ = ["DatabaseClaimPort", "lease_claim", "lease_claim_many", "lease_grant"]

logger = logging.getLogger("qinglong.dispatch")

_LOST = ClaimOutcome(status=ClaimStatus.ATTEMPT_LOST)
_UNAVAILABLE = ClaimOutcome(status=ClaimStatus.WORKER_UNAVAILABLE)


def lease_claim(request: ClaimRequest, *, delivered: bool = False) -> ClaimOutcome:
    """Claim an Attempt for one Worker Session: the only path that creates a lease.

    `delivered`: the offer goes out with this claim (a dispatch cycle), so the
    lease is written already delivered (`_new_lease`) and needs no telemetry
    write after it.
    """
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
            lease = lease_grant(rows, session, request, now=now, delivered=delivered)
            if isinstance(lease, ClaimOutcome):
                return lease
    except (LostRace, IntegrityError):
        # Another dispatcher changed the Attempt or inserted its lease first.
        LOST_RACES.labels(operation="claim").inc()
        return _LOST
    return _won(lease)


def _won(lease: RunLease) -> ClaimOutcome:
    """A single claim's outcome, logged as its own `lease_claimed` line."""
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
    return _outcome(lease)


def _outcome(lease: RunLease) -> ClaimOutcome:
    return ClaimOutcome(status=ClaimStatus.WON, lease_id=str(lease.pk), expires_at=lease.expires_at)


def _log_won_page(leases: Sequence[RunLease]) -> None:
    """One line for the claims a page won: `lease_claimed`'s four facts of
    each, in request order, as lists of the same length (one record per page
    instead of one per claim: a record cost about 21 µs, a claim's share of
    a page's Python about 0.5 ms, issue #12). Ids and generations only: no
    lease token, no spec."""
    if not leases or not logger.isEnabledFor(logging.INFO):
        return
    logger.info(
        "leases claimed",
        extra={
            "event": "leases_claimed",
            "count": len(leases),
            "lease_ids": [lease.pk for lease in leases],
            "attempt_ids": [lease.attempt_id for lease in leases],
            "worker_ids": [lease.worker_id for lease in leases],
            "lease_generations": [lease.lease_generation for lease in leases],
        },
    )


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
    rows: ClaimRows,
    session: WorkerSession,
    request: ClaimRequest,
    *,
    now: datetime,
    delivered: bool = False,
) -> RunLease | ClaimOutcome:
    """Checks 4-5 of the claim and, when they pass, its writes: one statement on PostgreSQL.

    Runs under the Session lock, in a statement of its own, so the slot count
    and the pull-id check see every lease committed before the lock was
    granted (READ COMMITTED reads a new snapshot per statement).
    """
    columns = {
        # docs/adr/0003: one pull id, one token. Checked under the Session
        # lock, so two racing pulls reusing an id cannot both claim. (The pull
        # compares digests in constant time before its cycle; this catches the race.)
        "pull_conflict": (
            pull_conflict_sql("%s", "%s", "%s") if request.pull_id is not None else "1 = 0"
        ),
        # Slots: every active lease of the Session counts (runlease_active_session).
        "active": claim_count_sql("session", "%s"),
    }
    params: list[Any] = []
    if request.pull_id is not None:
        pull_id = RunLease._meta.get_field("pull_id").get_db_prep_value(request.pull_id, connection)
        params += [session.pk, pull_id, request.token_digest]
    params.append(session.pk)
    capacity = policy.session_capacity(session)
    guard = Guard(
        columns=columns,
        params=params,
        ok="NOT g.pull_conflict AND g.active < %s",
        ok_params=[capacity],
    )

    attempt, run = rows.attempt, rows.run
    lease = _new_lease(attempt.pk, run.pk, session, request, now=now, delivered=delivered)
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


# ------------------------------------------------ a page of claims at once

# A write whose counts no longer hold decides again under the same locks;
# the counts cannot grow any more once every lock is held, so the second
# decision sticks. The bound only guards against a bug.
_DECIDE_ROUNDS = 3


def lease_claim_many(
    requests: Sequence[ClaimRequest], *, delivered: bool = False
) -> list[ClaimOutcome]:
    """Claim a page of (Attempt, Session) pairs: one outcome per request, in order.

    Each outcome is the one `lease_claim` would give the request if the
    requests before it had been claimed one after the other (a Session
    filled by an earlier request of the page is unavailable to a later one,
    a quota taken by one is taken for the next), and every won claim is
    committed.

    On PostgreSQL a page of two or more is one transaction of a constant
    number of statements (docs/adr/0011, "Set-based claims"):

    1. `leases.locks.lock_claim_batch`: every Run and Attempt (sorted by Run
       id; `SKIP LOCKED` in global scope, a pair held elsewhere is a lost
       race for that request only) and, when no limit applies, the Sessions
       (sorted by id), with the counts the claims are decided on;
    2. with a Project or Task limit, `lock_claim_batch_limits`: Projects,
       Tasks, then Sessions, each sorted, with their counts;
    3. `leases.writes.ClaimWrites.apply`: every granted claim's
       compare-and-sets, history row and lease, in one statement that first
       checks no count grew since it was read (then nothing is written and
       the page is decided again, under the same locks).

    Anything unexpected on the way (a half-written claim, a unique index a
    claim ran into) rolls the page back and claims each request on its own,
    so a lost row is a lost race for that request only. SQLite, and a page
    of one, claim one request at a time (`lease_claim`).
    """
    if len(requests) < 2 or connection.vendor != "postgresql":
        return [lease_claim(request, delivered=delivered) for request in requests]
    outcomes: list[ClaimOutcome | None] = [None] * len(requests)
    keys: list[BatchKey] = []
    for index, request in enumerate(requests):
        key = _batch_key(index, request)
        if key is None:
            outcomes[index] = _LOST
        else:
            keys.append(key)
    try:
        with transaction.atomic(durable=True):
            decided = _claim_page(requests, keys, delivered=delivered)
    except (LostRace, IntegrityError):
        LOST_RACES.labels(operation="claim").inc()
        return [lease_claim(request, delivered=delivered) for request in requests]
    except OperationalError as err:
        if not _deadlock(err):
            raise
        # PostgreSQL broke a lock cycle by aborting this page (seen under four
        # global dispatchers and two pulling Workers racing for the same
        # Sessions): the transaction is rolled back whole, nothing of it
        # stays; the page is a lost race, claimed again request by request,
        # each holding fewer locks (docs/adr/0014).
        LOST_RACES.labels(operation="claim").inc()
        logger.warning(
            "claim page aborted by a deadlock; claiming it request by request",
            extra={"event": "claim_page_deadlock", "requests": len(requests)},
        )
        return [lease_claim(request, delivered=delivered) for request in requests]
    won: list[RunLease] = []
    for index, answer in sorted(decided.items()):
        if isinstance(answer, RunLease):
            won.append(answer)
            outcomes[index] = _outcome(answer)
        else:
            outcomes[index] = answer
    _log_won_page(won)
    return [_LOST if outcome is None else outcome for outcome in outcomes]


def _deadlock(err: OperationalError) -> bool:
    """Whether PostgreSQL aborted the transaction to break a deadlock (40P01)."""
    return isinstance(err.__cause__, pg_errors.DeadlockDetected)


def _batch_key(index: int, request: ClaimRequest) -> BatchKey | None:
    """The request as the lock statement reads it; None when it names no row."""
    if not (request.run_id.isdigit() and request.attempt_id.isdigit()):
        return None
    return BatchKey(
        index=index,
        run_id=int(request.run_id),
        attempt_id=int(request.attempt_id),
        session_key=_uuid(request.session_id),
        pull_id=None if request.pull_id is None else _uuid(request.pull_id),
        token_digest=request.token_digest,
    )


def _uuid(value: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(value)
    except ValueError:
        return None


def _claim_page(
    requests: Sequence[ClaimRequest], keys: list[BatchKey], *, delivered: bool
) -> dict[int, ClaimOutcome | RunLease]:
    """Lock, decide, write (inside the caller's transaction): by request index,
    the refusal or the written lease (absent: lost)."""
    skip_locked = all(request.skip_locked for request in requests)
    for _ in range(_DECIDE_ROUNDS):
        locked = lock_claim_batch(keys, skip_locked=skip_locked)
        if locked.now is None:  # nothing found (or everything held elsewhere)
            return {}
        # Another round reads its counts again under the locks this one took,
        # and only those: a pair `SKIP LOCKED` passed over now, then let go,
        # must not join the page, or its Session (or Project) would be locked
        # after ones already held — out of order, a deadlock (docs/adr/0014).
        keys = [key for key in keys if key.index in locked.rows]
        limits = locked.limits
        if limits is None:
            limits = lock_claim_batch_limits(keys, locked.rows, now=locked.now)
        page = _decide(
            requests,
            keys,
            locked.rows,
            limits,
            now=limits.now or locked.now,
            counted_at=locked.now,
            delivered=delivered,
        )
        written = _write_page(page)
        if written is not None:
            answers: dict[int, ClaimOutcome | RunLease] = dict(page.refused)
            # A granted claim whose compare-and-set found its row changed is
            # lost (left out); the others are written.
            for index, lease in page.granted.items():
                if lease.attempt_id in written:
                    answers[index] = written[lease.attempt_id]
            return answers
    raise LostRace("the claim counts kept changing under the locks")


@dataclass
class _Page:
    """One decision over a page: refusals, grants, and the counts they rest on."""

    refused: dict[int, ClaimOutcome]
    granted: dict[int, RunLease]
    writes: ClaimWrites
    counts: ClaimCounts


def _write_page(page: _Page) -> dict[int, RunLease] | None:
    """The page's writes (`ClaimWrites.apply`): leases by Attempt id, None to decide again.

    A function of its own so the lost-race tests can hold a page between its
    decision and its write.
    """
    return page.writes.apply(page.counts)


def _decide(
    requests: Sequence[ClaimRequest],
    keys: list[BatchKey],
    rows: dict[int, BatchRow],
    limits: BatchLimits,
    *,
    now: datetime,
    counted_at: datetime,
    delivered: bool,
) -> _Page:
    """The claim's checks for each request in order, counting the grants before it.

    `now` stamps the leases (the clock once every lock was held);
    `counted_at` is the instant the quota counts took as "live".

    The contract's order (`dispatch.core.ports.ClaimPort`): the Run and
    Attempt, the Project and Task quotas, the Session, its pull id, its slots.
    """
    refused: dict[int, ClaimOutcome] = {}
    granted: dict[int, RunLease] = {}
    writes = ClaimWrites()
    busy: Counter[int] = Counter()  # grants per Project
    live: Counter[int] = Counter()  # grants per Task
    taken: Counter[int] = Counter()  # grants per Session
    assumed: dict[int, int] = {}  # Session → the active leases it was decided on
    pulls: dict[tuple[int, uuid.UUID], str] = {}  # (Session, pull id) → token granted
    claimed: set[int] = set()  # Attempts granted
    for key in keys:
        request, row = requests[key.index], rows.get(key.index)
        # 1. The Run and its Attempt, as the dispatcher read them.
        if row is None or row.attempt.pk in claimed or not _pair_claimable(row, request):
            refused[key.index] = _LOST
            continue
        run = row.run
        # 2. Quotas: Runs of the Project busy, live leases of the Task.
        if row.project_limit and (
            limits.project_busy.get(run.project_id, 0) + busy[run.project_id] >= row.project_limit
        ):
            refused[key.index] = _LOST
            continue
        if row.task_limit and (
            limits.task_live.get(run.task_id, 0) + live[run.task_id] >= row.task_limit
        ):
            refused[key.index] = _LOST
            continue
        # 3. The Session: it must take claims, as the dispatcher saw it.
        found = None if key.session_key is None else limits.sessions.get(key.session_key)
        if found is None or not policy.session_takes_claims(
            found[0], worker_id=request.worker_id, generation=request.session_generation
        ):
            refused[key.index] = _UNAVAILABLE
            continue
        session, active = found
        # 4. One pull id, one token (docs/adr/0003), this page's grants included.
        if key.pull_id is not None and (
            key.index in limits.pull_conflicts
            or pulls.get((session.pk, key.pull_id), key.token_digest) != key.token_digest
        ):
            refused[key.index] = _UNAVAILABLE
            continue
        # 5. A free slot, this page's grants included.
        if free_slots(policy.session_capacity(session), active + taken[session.pk]) < 1:
            refused[key.index] = _UNAVAILABLE
            continue
        lease = _new_lease(
            row.attempt.pk, run.pk, session, request, now=now, delivered=delivered, bare=True
        )
        writes.claim(row.attempt, run, lease, actor=f"worker:{session.worker_id}")
        granted[key.index] = lease
        claimed.add(row.attempt.pk)
        busy[run.project_id] += 1
        live[run.task_id] += 1
        taken[session.pk] += 1
        assumed[session.pk] = active
        if key.pull_id is not None:
            pulls[(session.pk, key.pull_id)] = key.token_digest
    counts = ClaimCounts(
        sessions=list(assumed.items()),
        projects=[(pk, limits.project_busy[pk]) for pk in busy if pk in limits.project_busy],
        tasks=[(pk, limits.task_live[pk]) for pk in live if pk in limits.task_live],
        pulls=[(session_pk, pull, token) for (session_pk, pull), token in pulls.items()],
        now=counted_at,
    )
    return _Page(refused=refused, granted=granted, writes=writes, counts=counts)


def _pair_claimable(row: BatchRow, request: ClaimRequest) -> bool:
    run, attempt = row.run, row.attempt
    return (
        run.state == RunState.QUEUED
        and not run.cancel_requested
        and attempt.state == AttemptState.PENDING
        and attempt.version == request.expected_version
        and attempt.lease_generation + 1 == request.lease_generation
    )


def _new_lease(
    attempt_id: int,
    run_id: int,
    session: WorkerSession,
    request: ClaimRequest,
    *,
    now: datetime,
    delivered: bool,
    bare: bool = False,
) -> RunLease:
    """The lease a won claim inserts (not saved).

    Delivered with the claim (`delivered`, a dispatch cycle): the telemetry
    `leases.renew.leases_record_delivery` would write right after the claim
    is written with it — a global cycle's announcement restarts the
    redelivery backoff, a pull's delivery also counts once toward
    `max_deliveries` (docs/adr/0005).

    `bare`: only these fields, without `Model.__init__` (a page of claims
    writes just them, `leases.writes.ClaimWrites`; every other column takes
    its default there); a field not set is deferred, never a default.
    """
    values = {
        "attempt_id": attempt_id,
        "run_id": run_id,
        "worker_id": session.worker_id,
        "session_id": session.pk,
        "session_generation": session.generation,
        "lease_generation": request.lease_generation,
        "offer_id": request.offer_id,
        "token_digest": request.token_digest,
        "spec_digest": request.spec_sha256,
        "placement_score": request.placement_score,
        "source": request.source,
        "pull_id": request.pull_id,
        "claimed_at": now,
        "expires_at": now + timedelta(seconds=request.lease_ttl_s),
        "last_delivered_at": now if delivered else None,
        "delivery_count": 1 if delivered and request.source == PULL_CLAIM else 0,
    }
    if bare:
        lease = RunLease.__new__(RunLease)
        lease._state = ModelState()  # unsaved: adding, no database yet
        lease.__dict__.update(id=None, **values)
        return lease
    return RunLease(**values)


class DatabaseClaimPort:
    """The `ClaimPort` of `dispatch.core` over `lease_claim` and `lease_claim_many`.

    `delivered`: the offers of won claims go out with this cycle, so their
    leases are written delivered (`_new_lease`).
    """

    def __init__(self, *, delivered: bool = False) -> None:
        self.delivered = delivered

    def claim(self, request: ClaimRequest) -> ClaimOutcome:
        # Every claim a cycle makes passes here or below (global and pull scope).
        outcome = lease_claim(request, delivered=self.delivered)
        CLAIMS.labels(outcome=str(outcome.status)).inc()
        return outcome

    def claim_many(self, requests: Sequence[ClaimRequest]) -> tuple[ClaimOutcome, ...]:
        outcomes = tuple(lease_claim_many(requests, delivered=self.delivered))
        for outcome in outcomes:
            CLAIMS.labels(outcome=str(outcome.status)).inc()
        return outcomes
