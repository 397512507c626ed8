"""How leases, Attempts and Runs end: expire, revoke, fence, cancel, finish.

- `lease_end` (`lease_expire`, `lease_revoke`): a lease that ends while its
  Attempt is `claimed` returns the Attempt to `pending` (nothing ran; the
  next claim uses lease generation + 1); while `starting`/`running` the
  Worker may have run it, so the Attempt is `lost` and the retry policy
  decides.
- `leases_end_for_session`: fencing. The active leases of a Session that is
  no longer current end with it.
- `leases_revoke_over_delivered`: a lease delivered `max_deliveries` times
  without a starting ACK is revoked; its Attempt returns to pending and
  waits one redelivery backoff, or after `max_delivery_rounds` such revokes
  ends and fails its Run `undeliverable` (docs/adr/0005).
- `leases_end_not_held`: a heartbeat that lists what its agent holds ends
  the started leases it does not list (`not_held`).
- `attempt_finish`: a terminal Attempt and the retry policy of its Run.
- `run_cancel`: an operator's cancel.

Lost executions (docs/adr/0005): a started Attempt whose lease ends is `lost`
with the ending's reason as its `error_code`. Unless the agent itself said it
holds no process (`not_held`) or already confirmed the execution gone (the
lease's reconcile report), the retry waits `QL_LOST_EXECUTION_GRACE_S` in
`not_before`, so it never overlaps a process that may still run.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Collection
from datetime import datetime, timedelta
from typing import Unpack

from django.db import IntegrityError, transaction

from dispatch.core.spec import RetryOn, RunPolicy
from leases import policy
from leases.errors import LostRace, Outcome
from leases.locks import lock_active_attempt, lock_active_lease, lock_lease_chain, lock_run
from leases.models import LeaseState, RunLease
from leases.reasons import GRACE_FREE_LOSSES, EndReason, WaitReason
from leases.selectors import leases_not_held, leases_over_delivered
from leases.transitions import (
    AttemptReport,
    attempt_transition,
    lease_transition,
    run_request_cancel,
    run_transition,
)
from qinglong.clock import db_now
from qinglong.metrics import LEASE_EXPIRIES, LOST_RACES
from runs.models import RUN_TERMINAL_STATES, Attempt, AttemptState, Run, RunState, TaskRevision

__all__ = [
    "EndKind",
    "attempt_finish",
    "lease_end",
    "lease_end_for_attempt",
    "lease_expire",
    "lease_revoke",
    "leases_end_for_session",
    "leases_end_not_held",
    "leases_revoke_over_delivered",
    "run_cancel",
]

logger = logging.getLogger("qinglong.dispatch")

_CONTROL_PLANE = "control-plane"


# --------------------------------------------------------------- retry policy


def attempt_finish(
    attempt: Attempt,
    run: Run,
    to_state: AttemptState,
    *,
    reason: str,
    actor: str = "",
    now: datetime,
    retry_not_before: datetime | None = None,
    retry_wait_reason: str = "",
    **report: Unpack[AttemptReport],
) -> None:
    """Move an Attempt to a terminal state and apply the retry policy to its Run.

    `start_failed`/`failed`/`lost` create the next Attempt while attempts <
    max_attempts and the revision's `retry_on` covers the failure (the Run
    goes back to `queued`), else the Run fails. A Run whose cancellation was
    requested ends `cancelled`, whatever the outcome. The next Attempt may be
    claimed from `retry_not_before` on, or after the revision's retry backoff
    if that is later (its `not_before`, `retry_wait_reason` saying why).
    """
    attempt_transition(attempt, to_state, reason=reason, actor=actor, finished_at=now, **report)
    if run.cancel_requested:
        run_transition(run, RunState.CANCELLED, finished_at=now)
        return
    if to_state == AttemptState.SUCCEEDED:
        run_transition(run, RunState.SUCCEEDED, finished_at=now)
        return
    if to_state == AttemptState.CANCELLED:
        run_transition(run, RunState.CANCELLED, finished_at=now)
        return
    run_policy = _run_policy(run.task_revision)
    # README "Run policies": `retry_on` says which failures get another
    # Attempt. A lost execution is the Worker's failure; a failed or
    # start_failed one, and a control-plane timeout, the script's.
    lost = to_state == AttemptState.LOST and reason != EndReason.TIMED_OUT
    if attempt.number < run.task_revision.max_attempts and run_policy.retries(lost=lost):
        backoff_s = run_policy.backoff_s(retry_number=attempt.number)
        if backoff_s:
            # The retry backoff and any grace the caller asked for: the later wins.
            backoff_until = now + timedelta(seconds=backoff_s)
            if retry_not_before is None or backoff_until > retry_not_before:
                retry_not_before, retry_wait_reason = backoff_until, WaitReason.RETRY_BACKOFF
        run_transition(run, RunState.QUEUED)
        try:
            with transaction.atomic():
                Attempt.objects.create(
                    run=run,
                    number=attempt.number + 1,
                    priority=run.priority,
                    # Keep the Run's place in the queue: a retry is not new work.
                    queued_at=run.queued_at,
                    not_before=retry_not_before,
                    not_before_reason=retry_wait_reason if retry_not_before else "",
                )
        except IntegrityError:
            raise LostRace(f"run {run.pk} already has a next attempt") from None
        return
    run_transition(run, RunState.FAILED, finished_at=now)


def _run_policy(revision: TaskRevision) -> RunPolicy:
    """The run policies pinned in the Run's revision (validated when it was saved)."""
    return RunPolicy(
        max_concurrent_runs=revision.max_concurrent_runs,
        retry_on=RetryOn(revision.retry_on),
        retry_backoff_s=revision.retry_backoff_s,
        retry_backoff_max_s=revision.retry_backoff_max_s,
    )


# --------------------------------------------------------------- lease ending


def _return_or_lose(
    attempt: Attempt, run: Run, lease: RunLease, *, reason: str, now: datetime
) -> None:
    """What an ended lease does to its Attempt (see the module docstring)."""
    if attempt.state == AttemptState.CLAIMED:
        if reason == EndReason.MAX_DELIVERIES:
            _over_delivered(attempt, run, now=now)
            return
        attempt_transition(attempt, AttemptState.PENDING, reason=reason, actor=_CONTROL_PLANE)
        run_transition(run, RunState.QUEUED)
    elif attempt.state in (AttemptState.STARTING, AttemptState.RUNNING):
        # docs/adr/0005: the process may outlive what the control plane can
        # see, so its retry waits unless the agent itself said it holds none
        # or already confirmed it gone.
        grace = policy.lost_execution_grace()
        hold = (
            reason not in GRACE_FREE_LOSSES
            and lease.execution_confirmed_at is None
            and grace > timedelta(0)
        )
        attempt_finish(
            attempt,
            run,
            AttemptState.LOST,
            reason=reason,
            actor=_CONTROL_PLANE,
            now=now,
            retry_not_before=now + grace if hold else None,
            retry_wait_reason=WaitReason.LOST_EXECUTION_GRACE,
            error_code=reason[:64],
        )


def _over_delivered(attempt: Attempt, run: Run, *, now: datetime) -> None:
    """A claimed Attempt whose lease was revoked for max_deliveries (docs/adr/0005).

    It goes back to the queue for any Worker, the same one included, after
    one redelivery backoff; the `max_delivery_rounds`-th such revoke ends it
    and fails the Run `undeliverable` instead: never silently queued. Rounds
    are counted from the Attempt's own revoked leases (the one just revoked
    included), not kept in a counter.
    """
    rounds = RunLease.objects.filter(
        attempt_id=attempt.pk, end_reason=EndReason.MAX_DELIVERIES
    ).count()
    if rounds < policy.max_delivery_rounds():
        attempt_transition(
            attempt,
            AttemptState.PENDING,
            reason=EndReason.MAX_DELIVERIES,
            actor=_CONTROL_PLANE,
            not_before=now + policy.redelivery_backoff(),
            not_before_reason=WaitReason.REDELIVERY_BACKOFF,
        )
        run_transition(run, RunState.QUEUED)
        return
    # Nothing ran (no starting ACK), and another Attempt would be offered to
    # the same Workers again: the Run fails for an operator to look at.
    attempt_transition(
        attempt,
        AttemptState.START_FAILED,
        reason=EndReason.UNDELIVERABLE,
        actor=_CONTROL_PLANE,
        finished_at=now,
        error_code=EndReason.UNDELIVERABLE,
    )
    run_transition(
        run, RunState.CANCELLED if run.cancel_requested else RunState.FAILED, finished_at=now
    )


class EndKind(enum.StrEnum):
    EXPIRE = "expire"  # only if past expires_at by the database clock
    REVOKE = "revoke"  # regardless of expiry


def lease_end(
    lease_id: int,
    *,
    kind: EndKind,
    reason: str,
    only_if_attempt_state: AttemptState | None = None,
    only_if_started_before: datetime | None = None,
) -> Outcome:
    """Expire or revoke one active lease and return/lose its Attempt.

    `only_if_attempt_state` re-checks, under the row locks, the condition a
    sweeper selected the lease by (e.g. "still claimed"), so a starting ACK that
    committed in between is never turned into a lost Attempt.
    `only_if_started_before` re-checks that the Attempt is started (starting
    or running under this lease) and was started at or before that instant.
    """
    try:
        with transaction.atomic(durable=True):
            chain = lock_lease_chain(lease_id)
            if chain is None:
                return Outcome.UNCHANGED
            run, attempt, lease = chain.run, chain.attempt, chain.lease
            if lease.state != LeaseState.ACTIVE:
                return Outcome.UNCHANGED
            if only_if_attempt_state is not None and (
                attempt.state != only_if_attempt_state
                or attempt.lease_generation != lease.lease_generation
            ):
                return Outcome.UNCHANGED
            if only_if_started_before is not None and (
                attempt.state not in (AttemptState.STARTING, AttemptState.RUNNING)
                or attempt.lease_generation != lease.lease_generation
                or attempt.started_at is None
                or attempt.started_at > only_if_started_before
            ):
                return Outcome.UNCHANGED
            now = db_now()
            if kind is EndKind.EXPIRE and policy.lease_is_live(lease, now=now):
                return Outcome.UNCHANGED
            to_state = LeaseState.EXPIRED if kind is EndKind.EXPIRE else LeaseState.REVOKED
            lease_transition(lease, to_state, reason=reason, now=now)
            if attempt.lease_generation == lease.lease_generation:
                _return_or_lose(attempt, run, lease, reason=reason, now=now)
    except LostRace:
        LOST_RACES.labels(operation="lease_end").inc()
        return Outcome.LOST_RACE
    logger.info(
        "lease ended",
        extra={"event": f"lease_{to_state}", "lease_id": lease_id, "reason": reason},
    )
    if kind is EndKind.EXPIRE:
        LEASE_EXPIRIES.inc()
    return Outcome.APPLIED


def lease_expire(lease_id: int) -> Outcome:
    return lease_end(lease_id, kind=EndKind.EXPIRE, reason=EndReason.LEASE_EXPIRED)


def lease_revoke(
    lease_id: int, *, reason: str, only_if_attempt_state: AttemptState | None = None
) -> Outcome:
    return lease_end(
        lease_id, kind=EndKind.REVOKE, reason=reason, only_if_attempt_state=only_if_attempt_state
    )


def lease_end_for_attempt(attempt: Attempt, *, reason: str, now: datetime) -> None:
    """Revoke the Attempt's active lease.

    Inside the caller's transaction, which holds the Run and Attempt locks.
    """
    lease = lock_active_lease(attempt)
    if lease is not None:
        lease_transition(lease, LeaseState.REVOKED, reason=reason, now=now)


def leases_end_for_session(session_pk: int, *, reason: str) -> int:
    """Fence: revoke every active lease of a Session that is no longer current."""
    ended = 0
    ids = list(
        RunLease.objects.filter(session_id=session_pk, state=LeaseState.ACTIVE)
        .order_by("id")
        .values_list("id", flat=True)
    )
    for lease_id in ids:
        if lease_revoke(lease_id, reason=reason) is Outcome.APPLIED:
            ended += 1
    return ended


def leases_end_not_held(*, session_pk: int, held: Collection[str], now: datetime) -> int:
    """End this Session's started leases that its agent's heartbeat did not list.

    After the heartbeat committed, one transaction per lease (Run → Attempt →
    RunLease, like every ending). Only Attempts started at least
    `policy.not_held_min_age()` ago: a heartbeat put together while a
    starting ACK was on the wire does not list it yet. The agent says it
    holds no process for these, so their retries wait for no grace
    (docs/adr/0005). Returns how many ended.
    """
    started_before = now - policy.not_held_min_age()
    ended = 0
    for lease_id in leases_not_held(
        session_pk=session_pk, held=held, started_before=started_before
    ):
        outcome = lease_end(
            lease_id,
            kind=EndKind.REVOKE,
            reason=EndReason.NOT_HELD,
            only_if_started_before=started_before,
        )
        ended += outcome is Outcome.APPLIED
    return ended


def leases_revoke_over_delivered(
    *, max_deliveries: int, session_pk: int | None = None, limit: int = policy.SWEEP_BATCH
) -> list[Outcome]:
    """Revoke claimed leases delivered `max_deliveries` times without a starting ACK.

    At most `limit` per call (the sweeper calls again; a pull revokes its own
    Session's before its cycle). Each is re-checked under the row locks: a
    starting ACK that committed after the read keeps its lease, because the
    Attempt is no longer `claimed`. Returns one outcome per lease examined.
    """
    return [
        lease_revoke(
            lease_id, reason=EndReason.MAX_DELIVERIES, only_if_attempt_state=AttemptState.CLAIMED
        )
        for lease_id in leases_over_delivered(
            max_deliveries=max_deliveries, session_pk=session_pk, limit=limit
        )
    ]


# ---------------------------------------------------------------------- cancel


def run_cancel(*, run: Run, actor: str = "") -> Outcome:
    """Cancel a Run (idempotent).

    A Run not yet started is cancelled at once (its claimed lease is revoked);
    a started one gets `cancel_requested`, which heartbeats and ACKs carry to the
    Worker, and its terminal ACK (or lease loss) ends the Run `cancelled`.
    """
    try:
        with transaction.atomic(durable=True):
            # Run → Attempt → RunLease, each its own row only (leases.locks):
            # an enqueue of the same Task revision never waits on this cancel.
            locked = lock_run(run.pk)
            if locked is None or locked.state in RUN_TERMINAL_STATES:
                return Outcome.UNCHANGED
            if locked.cancel_requested and locked.state == RunState.RUNNING:
                return Outcome.UNCHANGED
            now = db_now()
            run_request_cancel(locked)
            attempt = lock_active_attempt(locked.pk)
            if attempt is not None and attempt.state in (
                AttemptState.PENDING,
                AttemptState.CLAIMED,
            ):
                if attempt.state == AttemptState.CLAIMED:
                    lease_end_for_attempt(attempt, reason="run_cancelled", now=now)
                attempt_transition(
                    attempt,
                    AttemptState.CANCELLED,
                    reason="run_cancelled",
                    actor=actor,
                    finished_at=now,
                )
                run_transition(locked, RunState.CANCELLED, finished_at=now)
            elif attempt is None:
                run_transition(locked, RunState.CANCELLED, finished_at=now)
            run.refresh_from_db()
            return Outcome.APPLIED
    except LostRace:
        LOST_RACES.labels(operation="cancel").inc()
        return Outcome.LOST_RACE
