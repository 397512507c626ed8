"""A restarted Worker's report on the executions of its earlier Sessions (docs/adr/0005).

When a Session is replaced or lost while an Attempt was started, the Attempt
is `lost` and its retry waits the lost-execution grace (`leases.end`), since
the old process may still run. The reference agent journals every execution;
after a restart it ends the processes its old Session left behind and then
reports each one with the new Session (`POST /api/v1/worker/reconcile`). A
report names the lease by offer id and proves it with the lease token: it
records, once, that the execution is gone (who, when, outcome, exit code, on
the lease), and lifts the grace of the Run's retry so it may start at once.

A report for a lease of another Worker, with a wrong token, or for an offer
id that does not exist gets the same answer (`unknown`): no oracle.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from django.db import transaction

from dispatch.core.offer import token_digest, tokens_equal
from leases.errors import LostRace
from leases.locks import lock_active_attempt, lock_lease, lock_run
from leases.models import ExecutionOutcome, RunLease
from leases.reasons import WaitReason
from leases.transitions import attempt_lift_wait, lease_record_execution_end
from qinglong.clock import db_now
from runs.models import Attempt, AttemptState
from workers.models import WorkerSession

__all__ = ["ExecutionReport", "ReconcileStatus", "leases_reconcile"]

logger = logging.getLogger("qinglong.dispatch")

# Compared against when no lease has the offer id, so an unknown id costs the
# same digest comparison as another Worker's (no timing oracle either).
_NO_DIGEST = "0" * 64


class ReconcileStatus(enum.StrEnum):
    CONFIRMED = "confirmed"  # recorded now
    ALREADY_CONFIRMED = "already_confirmed"  # an earlier report recorded it
    UNKNOWN = "unknown"  # no such lease of this Worker, or a wrong token


@dataclass(frozen=True)
class ExecutionReport:
    offer_id: str
    lease_token: str = field(repr=False)
    outcome: ExecutionOutcome
    exit_code: int | None


def leases_reconcile(
    *, session: WorkerSession, reports: Sequence[ExecutionReport]
) -> list[tuple[str, ReconcileStatus]]:
    """Apply each report in order; one transaction per report. Idempotent."""
    by = f"worker:{session.worker_id} session:{session.generation}"
    return [(report.offer_id, _reconcile_one(session, report, by=by)) for report in reports]


def _reconcile_one(session: WorkerSession, report: ExecutionReport, *, by: str) -> ReconcileStatus:
    seen = (
        RunLease.objects.filter(offer_id=report.offer_id)
        .only("id", "worker_id", "token_digest")
        .first()
    )
    presented = token_digest(report.lease_token)
    token_ok = tokens_equal(presented, seen.token_digest if seen is not None else _NO_DIGEST)
    # Any Session generation of this Worker: the report comes from the Session
    # that replaced the one the lease was granted to.
    if seen is None or seen.worker_id != session.worker_id or not token_ok:
        return ReconcileStatus.UNKNOWN
    for _ in range(3):
        try:
            status = _record(seen.pk, report, by=by)
        except LostRace:
            continue  # a racing report or claim moved a row: read again
        logger.info(
            "execution reconciled",
            extra={
                "event": "execution_reconciled",
                "lease_id": seen.pk,
                "outcome": str(report.outcome),
                "status": str(status),
            },
        )
        return status
    raise LostRace(f"lease {seen.pk} kept changing under a reconcile report")


def _record(lease_id: int, report: ExecutionReport, *, by: str) -> ReconcileStatus:
    with transaction.atomic(durable=True):
        ids = RunLease.objects.filter(pk=lease_id).values("run_id", "attempt_id").first()
        assert ids is not None  # a lease row is never deleted
        # Run → Attempt → RunLease (leases.locks). The Attempt locked is the
        # Run's active one: the retry whose wait this report may lift.
        run = lock_run(ids["run_id"])
        assert run is not None
        retry = lock_active_attempt(run.pk)
        lease = lock_lease(lease_id)
        assert lease is not None
        if lease.execution_confirmed_at is not None:
            return ReconcileStatus.ALREADY_CONFIRMED
        now = db_now()
        lease_record_execution_end(
            lease,
            at=now,
            outcome=report.outcome,
            exit_code=report.exit_code,
            by=by,
        )
        lost = (
            Attempt.objects.filter(pk=ids["attempt_id"])
            .values_list("state", "number", "lease_generation")
            .first()
        )
        assert lost is not None
        state, number, generation = lost
        if (
            retry is not None
            and state == AttemptState.LOST
            and generation == lease.lease_generation
            and retry.number == number + 1
            and retry.state == AttemptState.PENDING
            and retry.not_before is not None
            and retry.not_before > now
            and retry.not_before_reason == WaitReason.LOST_EXECUTION_GRACE
        ):
            # The execution this retry waited for is gone: no overlap is
            # possible any more, so the retry may be claimed at once. (A wait
            # already over is left alone: nothing to lift, no row to move.)
            attempt_lift_wait(retry)
    return ReconcileStatus.CONFIRMED
