"""The legal state changes of Attempt, Run and RunLease, and the compare-and-set behind each.

Every write of execution state is one of the functions here: an
``UPDATE … WHERE id = ? AND version = ? AND state = ?`` that must touch exactly
one row (docs/adr/0002). The tables below are the whole state machine: a
change they do not list raises `IllegalTransition` before any write, and a
compare-and-set that touches no row raises `LostRace`, which rolls back the
caller's transaction (every use case is one, `atomic(durable=True)`). The
columns a transition may change besides state and version are the keys of
`AttemptChanges` / `RunChanges`, nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from types import MappingProxyType
from typing import Final, TypedDict, Unpack

from leases.errors import IllegalTransition, LostRace
from leases.models import LeaseState, RunLease
from notifications.services import run_event_emit
from runs.models import Attempt, AttemptEvent, AttemptState, Run, RunState

__all__ = [
    "ATTEMPT_TRANSITIONS",
    "LEASE_TRANSITIONS",
    "RUN_TRANSITIONS",
    "AttemptChanges",
    "AttemptReport",
    "RunChanges",
    "attempt_lift_wait",
    "attempt_transition",
    "lease_extend",
    "lease_record_execution_end",
    "lease_transition",
    "run_request_cancel",
    "run_transition",
]

_A = AttemptState
ATTEMPT_TRANSITIONS: Final[Mapping[AttemptState, frozenset[AttemptState]]] = MappingProxyType(
    {
        _A.PENDING: frozenset({_A.CLAIMED, _A.CANCELLED}),
        _A.CLAIMED: frozenset({_A.PENDING, _A.STARTING, _A.START_FAILED, _A.CANCELLED}),
        _A.STARTING: frozenset({_A.RUNNING, _A.START_FAILED, _A.LOST, _A.CANCELLED}),
        _A.RUNNING: frozenset({_A.SUCCEEDED, _A.FAILED, _A.LOST, _A.CANCELLED}),
    }
)
_R = RunState
RUN_TRANSITIONS: Final[Mapping[RunState, frozenset[RunState]]] = MappingProxyType(
    {
        _R.QUEUED: frozenset({_R.DISPATCHING, _R.CANCELLED}),
        _R.DISPATCHING: frozenset({_R.QUEUED, _R.RUNNING, _R.FAILED, _R.CANCELLED}),
        _R.RUNNING: frozenset({_R.QUEUED, _R.SUCCEEDED, _R.FAILED, _R.CANCELLED}),
    }
)
_L = LeaseState
# A lease ends once: released by a terminal ACK, expired, or revoked.
LEASE_TRANSITIONS: Final[Mapping[LeaseState, frozenset[LeaseState]]] = MappingProxyType(
    {_L.ACTIVE: frozenset({_L.RELEASED, _L.EXPIRED, _L.REVOKED})}
)


class AttemptReport(TypedDict, total=False):
    """What a Worker's terminal ACK reports, stored on the Attempt."""

    exit_code: int | None
    error_code: str
    output_tail: str


class AttemptChanges(AttemptReport, total=False):
    """The columns an Attempt transition may set besides state and version."""

    lease_generation: int  # a claim: the new lease's generation
    started_at: datetime  # ACK starting
    deadline_at: datetime  # ACK starting: when the control plane stops it
    executor_handle: str  # ACK running
    finished_at: datetime  # any terminal state
    not_before: datetime | None  # back to pending: the wait before the next claim
    not_before_reason: str  # why it waits (leases.reasons.WaitReason)


class RunChanges(TypedDict, total=False):
    """The columns a Run transition may set besides state and version."""

    finished_at: datetime  # any terminal state


def _legal(entity: str, allowed: frozenset[str], from_state: str, to_state: str) -> None:
    if to_state not in allowed:
        raise IllegalTransition(entity, from_state, to_state)


def attempt_transition(
    attempt: Attempt,
    to_state: AttemptState,
    *,
    reason: str,
    actor: str = "",
    **changes: Unpack[AttemptChanges],
) -> None:
    """Move one Attempt by compare-and-set; update the instance; append its history.

    Must run inside a transaction: `LostRace` is raised so the caller's
    transaction rolls back every other write of the use case with it.
    """
    allowed = ATTEMPT_TRANSITIONS.get(AttemptState(attempt.state), frozenset())
    _legal("attempt", allowed, attempt.state, to_state)
    updated = Attempt.objects.filter(
        pk=attempt.pk, version=attempt.version, state=attempt.state
    ).update(state=to_state, version=attempt.version + 1, **changes)
    if updated != 1:
        raise LostRace(f"attempt {attempt.pk} changed under us")
    from_state = attempt.state
    attempt.state = to_state
    attempt.version += 1
    for key, value in changes.items():
        setattr(attempt, key, value)
    AttemptEvent.objects.create(
        attempt=attempt,
        run_id=attempt.run_id,
        from_state=from_state,
        to_state=to_state,
        reason=reason,
        actor=actor[:80],
    )


def run_transition(run: Run, to_state: RunState, **changes: Unpack[RunChanges]) -> None:
    """Move one Run by compare-and-set; update the instance."""
    _legal("run", RUN_TRANSITIONS.get(RunState(run.state), frozenset()), run.state, to_state)
    updated = Run.objects.filter(pk=run.pk, version=run.version, state=run.state).update(
        state=to_state, version=run.version + 1, **changes
    )
    if updated != 1:
        raise LostRace(f"run {run.pk} changed under us")
    run.state = to_state
    run.version += 1
    for key, value in changes.items():
        setattr(run, key, value)
    # Webhooks: the outbox rows of a Run that just ended, in this transaction
    # (one CAS above = one state change = one delivery per subscription).
    run_event_emit(run=run)


def run_request_cancel(run: Run) -> None:
    """Mark a Run `cancel_requested` by compare-and-set; its state does not change.

    The version moves too, so a claim that read the Run before the cancel
    loses its own compare-and-set instead of dispatching a cancelled Run.
    """
    updated = Run.objects.filter(pk=run.pk, version=run.version, state=run.state).update(
        cancel_requested=True, version=run.version + 1
    )
    if updated != 1:
        raise LostRace(f"run {run.pk} changed under us")
    run.cancel_requested = True
    run.version += 1


def lease_transition(lease: RunLease, to_state: LeaseState, *, reason: str, now: datetime) -> None:
    """End one active lease (released, expired or revoked) by compare-and-set."""
    allowed = LEASE_TRANSITIONS.get(LeaseState(lease.state), frozenset())
    _legal("lease", allowed, lease.state, to_state)
    updated = RunLease.objects.filter(
        pk=lease.pk, version=lease.version, state=LeaseState.ACTIVE
    ).update(state=to_state, version=lease.version + 1, ended_at=now, end_reason=reason)
    if updated != 1:
        raise LostRace(f"lease {lease.pk} changed under us")
    lease.state = to_state
    lease.version += 1
    lease.ended_at = now
    lease.end_reason = reason


def attempt_lift_wait(attempt: Attempt) -> None:
    """Make a pending Attempt claimable now (a reconcile report, docs/adr/0005).

    Not a state change, but a compare-and-set on (state, version) all the
    same, and the version moves: a claim that read the Attempt before
    loses its own compare-and-set instead of acting on a stale row.
    """
    updated = Attempt.objects.filter(
        pk=attempt.pk, version=attempt.version, state=AttemptState.PENDING
    ).update(not_before=None, not_before_reason="", version=attempt.version + 1)
    if updated != 1:
        raise LostRace(f"attempt {attempt.pk} changed under us")
    attempt.not_before = None
    attempt.not_before_reason = ""
    attempt.version += 1


def lease_record_execution_end(
    lease: RunLease, *, at: datetime, outcome: str, exit_code: int | None, by: str
) -> None:
    """Record, once, that the execution a lease granted is confirmed gone (docs/adr/0005).

    A fact about the past, in any lease state; the lease's own state and
    expiry do not change. The version moves so racing reports record once.
    """
    updated = RunLease.objects.filter(
        pk=lease.pk, version=lease.version, execution_confirmed_at__isnull=True
    ).update(
        execution_confirmed_at=at,
        execution_outcome=outcome,
        execution_exit_code=exit_code,
        execution_confirmed_by=by[:80],
        version=lease.version + 1,
    )
    if updated != 1:
        raise LostRace(f"lease {lease.pk} changed under us")
    lease.execution_confirmed_at = at
    lease.execution_outcome = outcome
    lease.execution_exit_code = exit_code
    lease.execution_confirmed_by = by[:80]
    lease.version += 1


def lease_extend(lease: RunLease, *, expires_at: datetime) -> None:
    """Move an active lease's expiry (an ACK's renewal) by compare-and-set."""
    updated = RunLease.objects.filter(
        pk=lease.pk, version=lease.version, state=LeaseState.ACTIVE
    ).update(expires_at=expires_at, version=lease.version + 1)
    if updated != 1:
        raise LostRace(f"lease {lease.pk} changed under us")
    lease.expires_at = expires_at
    lease.version += 1
