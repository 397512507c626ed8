"""Worker ACKs: `starting` → `running` → `succeeded`/`failed`, or `start_failed`.

The legal order is the Attempt state machine (`leases.transitions`): each
phase moves the Attempt to the state of the same name, so `starting` is legal
only from `claimed`, `running` only from `starting`, `succeeded`/`failed`
only from `running`, and `start_failed` from `claimed` or `starting`. A repeat
of the phase the Attempt is already in is a no-op (`Outcome.UNCHANGED`).

`ACK_PHASE_FIELDS` is the one table of what each phase's body requires and
may carry; the Worker API's serializer enforces it and its OpenAPI schema is
rendered from it, so neither can drift from the use case.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Final

from django.db import transaction

from dispatch.core.offer import token_digest, tokens_equal
from dispatch.core.policy import spec_matches_lease
from leases import policy
from leases.end import attempt_finish
from leases.errors import (
    IllegalTransition,
    LeaseConflict,
    LeaseError,
    LeaseForbidden,
    LeaseNotFound,
    LostRace,
    Outcome,
)
from leases.locks import LeaseChain, lock_lease_for_ack
from leases.models import LeaseState, RunLease
from leases.timeout import attempt_overdue
from leases.transitions import AttemptReport, lease_transition
from leases.writes import Writes
from output.redaction import redact, redaction_values
from qinglong.metrics import LOST_RACES
from runs.models import Attempt, AttemptState, Run, RunState
from workers.models import WorkerSession

__all__ = [
    "ACK_PHASE_DEPENDENT_FIELDS",
    "ACK_PHASE_FIELDS",
    "PHASE_TARGET",
    "AckPhase",
    "AckResult",
    "lease_ack",
]

logger = logging.getLogger("qinglong.dispatch")


class AckPhase(enum.StrEnum):
    STARTING = "starting"  # the Worker is about to spawn: only now may it run
    RUNNING = "running"  # spawned; carries the executor handle
    START_FAILED = "start_failed"  # could not start (nothing ran)
    SUCCEEDED = "succeeded"  # exited 0
    FAILED = "failed"  # exited non-zero


# The Attempt state each phase moves to.
PHASE_TARGET: Final[Mapping[AckPhase, AttemptState]] = MappingProxyType(
    {
        AckPhase.STARTING: AttemptState.STARTING,
        AckPhase.RUNNING: AttemptState.RUNNING,
        AckPhase.START_FAILED: AttemptState.START_FAILED,
        AckPhase.SUCCEEDED: AttemptState.SUCCEEDED,
        AckPhase.FAILED: AttemptState.FAILED,
    }
)

_TERMINAL_EXTRAS: Final = frozenset({"error_code", "output_tail"})
# The ACK's cross-field rules: phase → (fields it requires, fields it may carry)
# beyond phase, lease_token and spec_sha256.
ACK_PHASE_FIELDS: Final[Mapping[AckPhase, tuple[frozenset[str], frozenset[str]]]] = (
    MappingProxyType(
        {
            AckPhase.STARTING: (frozenset(), frozenset()),
            AckPhase.RUNNING: (frozenset({"executor_handle"}), frozenset()),
            AckPhase.SUCCEEDED: (frozenset({"exit_code"}), _TERMINAL_EXTRAS),
            AckPhase.FAILED: (frozenset({"exit_code"}), _TERMINAL_EXTRAS),
            AckPhase.START_FAILED: (frozenset(), frozenset({"exit_code"}) | _TERMINAL_EXTRAS),
        }
    )
)
ACK_PHASE_DEPENDENT_FIELDS: Final = ("executor_handle", "exit_code", "error_code", "output_tail")


@dataclass(frozen=True)
class AckResult:
    offer_id: str
    attempt_state: AttemptState
    run_state: RunState
    cancel_requested: bool
    outcome: Outcome


def _result(offer_id: str, attempt: Attempt, run: Run, outcome: Outcome) -> AckResult:
    return AckResult(
        offer_id=offer_id,
        attempt_state=AttemptState(attempt.state),
        run_state=RunState(run.state),
        cancel_requested=run.cancel_requested,
        outcome=outcome,
    )


def _authorize(lease: RunLease | None, *, session: WorkerSession, lease_token: str) -> RunLease:
    if lease is None:
        raise LeaseNotFound("no lease with that offer id")
    if lease.session_id != session.pk:
        raise LeaseForbidden("the lease belongs to another session")
    if not tokens_equal(token_digest(lease_token), lease.token_digest):
        raise LeaseForbidden("the lease token does not match", code="lease_token_invalid")
    return lease


def _refused(offer_id: str, session: WorkerSession) -> LeaseError:
    """Why no lease of this Session has that offer id: 404, or 403 for another's."""
    if RunLease.objects.filter(offer_id=offer_id).exists():
        return LeaseForbidden("the lease belongs to another session")
    return LeaseNotFound("no lease with that offer id")


def lease_ack(
    *,
    session: WorkerSession,
    offer_id: str,
    phase: AckPhase,
    lease_token: str,
    spec_sha256: str,
    executor_handle: str = "",
    exit_code: int | None = None,
    error_code: str = "",
    output_tail: str = "",
) -> AckResult:
    """Apply one Worker ACK as a compare-and-set; a repeat of the same phase is a no-op.

    Two statements on PostgreSQL (docs/adr/0011): the lease's rows locked in
    one (`leases.locks.lock_lease_for_ack`, found by offer id and this
    Session together, so another Session's request locks nothing), and the
    phase's writes in one (`leases.writes`). A failed start or run (retry
    policy) and the end of a cancelled Run go through `leases.end.attempt_finish`.
    """
    try:
        with transaction.atomic(durable=True):
            chain = lock_lease_for_ack(offer_id=offer_id, session_pk=session.pk)
            if chain is None:
                raise _refused(offer_id, session)
            assert chain.session is not None and chain.now is not None
            run, attempt, lease, now = chain.run, chain.attempt, chain.lease, chain.now
            _authorize(lease, session=session, lease_token=lease_token)
            if not policy.session_may_act(chain.session, generation=lease.session_generation):
                # Fenced between authentication and this lock: the replacement
                # ends this lease, so nothing may start or finish under it.
                raise LeaseConflict(
                    "the session is no longer current", code=f"session_{chain.session.state}"
                )
            if not spec_matches_lease(spec_sha256, lease.spec_digest):
                raise LeaseConflict("spec_sha256 differs from the lease", code="spec_mismatch")
            target = PHASE_TARGET[phase]
            if attempt.lease_generation == lease.lease_generation and attempt.state == target:
                return _result(offer_id, attempt, run, Outcome.UNCHANGED)
            if lease.state != LeaseState.ACTIVE:
                raise LeaseConflict(f"the lease is {lease.state}", code=f"lease_{lease.state}")
            if not policy.lease_is_live(lease, now=now):
                raise LeaseConflict("the lease has expired", code="lease_expired")
            if attempt.lease_generation != lease.lease_generation:
                raise LeaseConflict("the lease is stale", code="lease_stale")
            _apply(
                phase,
                chain,
                now=now,
                actor=f"worker:{session.worker_id}",
                executor_handle=executor_handle,
                exit_code=exit_code,
                error_code=error_code,
                output_tail=output_tail,
            )
    except IllegalTransition as err:
        raise LeaseConflict(
            f"{phase} is not allowed after {err.from_state}", code="illegal_phase"
        ) from None
    except LostRace:
        LOST_RACES.labels(operation="ack").inc()
        raise LeaseConflict("the lease changed concurrently", code="lease_conflict") from None
    logger.info(
        "lease ack",
        extra={
            "event": "lease_ack",
            "lease_id": lease.pk,
            "phase": str(phase),
            "attempt_state": attempt.state,
        },
    )
    return _result(offer_id, attempt, run, Outcome.APPLIED)


def _apply(
    phase: AckPhase,
    chain: LeaseChain,
    *,
    now: datetime,
    actor: str,
    executor_handle: str,
    exit_code: int | None,
    error_code: str,
    output_tail: str,
) -> None:
    """The writes of one accepted phase, under the chain's locks."""
    run, attempt, lease = chain.run, chain.attempt, chain.lease
    writes = Writes()
    if phase is AckPhase.STARTING:
        if run.cancel_requested:
            raise LeaseConflict("the run was cancelled", code="run_cancelled")
        writes.attempt(
            attempt,
            AttemptState.STARTING,
            reason="ack_starting",
            actor=actor,
            started_at=now,
            # README "Run policies": past this (and a margin) the control
            # plane stops it and ends it `timed_out`.
            deadline_at=now + timedelta(seconds=run.task_revision.timeout_s),
        )
        writes.run(run, RunState.RUNNING)
        writes.lease_extend(lease, expires_at=now + policy.lease_ttl())
        writes.apply()
        return
    if phase is AckPhase.RUNNING:
        if attempt_overdue(attempt, now=now):
            # README "Run policies": past its timeout and the margin, the
            # control plane's verdict is stop (the sweep ends it).
            raise LeaseConflict("the attempt ran past its timeout", code="timed_out")
        writes.attempt(
            attempt,
            AttemptState.RUNNING,
            reason="ack_running",
            actor=actor,
            executor_handle=executor_handle[:200],
        )
        writes.lease_extend(lease, expires_at=now + policy.lease_ttl())
        writes.apply()
        return
    target = PHASE_TARGET[phase]
    report: AttemptReport = {
        "exit_code": exit_code,
        "error_code": error_code[:64],
        # Stored redacted of the pinned revision's env values, like live
        # output (output.redaction; the revision is read in by the lock).
        "output_tail": redact(output_tail, redaction_values(run.task_revision.env)),
    }
    if phase is AckPhase.SUCCEEDED and not run.cancel_requested:
        # A success ends its Run `succeeded`: no retry policy applies
        # (leases.end.attempt_finish decides every other ending).
        writes.lease_end(lease, LeaseState.RELEASED, reason=f"ack_{phase}", now=now)
        writes.attempt(
            attempt, target, reason=f"ack_{phase}", actor=actor, finished_at=now, **report
        )
        writes.run(run, RunState.SUCCEEDED, finished_at=now)
        writes.apply()
        return
    lease_transition(lease, LeaseState.RELEASED, reason=f"ack_{phase}", now=now)
    attempt_finish(attempt, run, target, reason=f"ack_{phase}", actor=actor, now=now, **report)
