"""The lease audit: which active leases can no longer be honoured, and why (read-only).

The active RunLease is the recovery authority (docs/adr/0002), so an active
lease that can no longer be honoured — expired, fenced Session, cancelled Run,
an Attempt that moved on, a pinned spec that no longer hashes to the lease's
digest — is what an operator must see. One classification serves
`manage.py audit_leases` (every active lease, paged; `--expire` repairs through
`leases.end`) and the admin overview (a bounded first page), so both name a
lease the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Final

from django.db.models import QuerySet

from dispatch.core.errors import SpecError
from dispatch.core.policy import spec_matches_lease
from dispatch.core.spec import spec_sha256
from leases import policy
from leases.models import LeaseState, RunLease
from leases.reasons import EndReason
from runs.models import ATTEMPT_TERMINAL_STATES, RUN_TERMINAL_STATES, AttemptState
from runs.services import attempt_spec
from workers.models import SessionState

__all__ = [
    "CATEGORIES",
    "HEALTHY",
    "PROBLEMS",
    "REVOKE_REASONS",
    "LeaseFinding",
    "audit",
    "audit_page",
    "classify",
]

# Healthy categories first, then problems in the order they are checked: the
# first matching problem names the lease.
HEALTHY: Final = ("deliverable", "awaiting_start", "running", "cancelling")
PROBLEMS: Final = (
    "orphaned",
    "expired",
    "session_replaced",
    "session_offline",
    "cancelled",
    "spec_drift",
    "over_delivered",
)
CATEGORIES: Final = HEALTHY + PROBLEMS
# The reason recorded on a repaired lease (end_reason / AttemptEvent.reason):
# the one the sweeps and Session fencing record for the same ending
# (leases.reasons, docs/adr/0005).
REVOKE_REASONS: Final = {
    "orphaned": "audit_orphaned",
    "session_replaced": EndReason.WORKER_RESTARTED.value,
    "session_offline": EndReason.WORKER_LOST.value,
    "cancelled": "run_cancelled",
    "spec_drift": "spec_drift",
    "over_delivered": EndReason.MAX_DELIVERIES.value,
}
PAGE_SIZE: Final = 200


@dataclass(frozen=True)
class LeaseFinding:
    lease_id: int
    attempt_id: int
    attempt_state: AttemptState
    worker_id: int
    session_generation: int
    lease_generation: int
    category: str


def classify(lease: RunLease, *, now: datetime) -> str:
    """The category of one active lease (attempt, run, its revision and session read in)."""
    attempt, run, session = lease.attempt, lease.run, lease.session
    if (
        attempt.state in ATTEMPT_TERMINAL_STATES
        or attempt.state == AttemptState.PENDING
        or run.state in RUN_TERMINAL_STATES
        or attempt.lease_generation != lease.lease_generation
        or session.generation != lease.session_generation
    ):
        return "orphaned"
    if not policy.lease_is_live(lease, now=now):
        return "expired"
    if not policy.session_may_act(session, generation=lease.session_generation):
        # Fenced at the lease's own generation (checked above): the Session
        # was replaced or went offline, and the category names which.
        return f"session_{SessionState(session.state)}"
    if run.cancel_requested:
        # A started Attempt of a cancelled Run is the normal in-progress cancel:
        # heartbeats and ACKs carry the verdict and the Worker's terminal ACK
        # ends it. Only a lease that never started should have been revoked.
        if attempt.state in (AttemptState.STARTING, AttemptState.RUNNING):
            return "cancelling"
        return "cancelled"
    if _spec_drifted(lease):
        return "spec_drift"
    if attempt.state in (AttemptState.STARTING, AttemptState.RUNNING):
        return "running"
    if lease.delivery_count >= policy.max_deliveries():
        # Pulled max_deliveries times, never started: the pull and the sweep
        # revoke it (back to the queue after a backoff, or `undeliverable`).
        return "over_delivered"
    if lease.last_delivered_at is not None:
        # Pulled or announced to its Session, not yet ACKed starting.
        return "awaiting_start"
    return "deliverable"


def _spec_drifted(lease: RunLease) -> bool:
    # Re-materialize from the pinned revision exactly as recovery does
    # (docs/adr/0001 step 1); a revision that no longer validates is drift too.
    try:
        spec = attempt_spec(attempt=lease.attempt, run=lease.run, revision=lease.run.task_revision)
    except SpecError:
        return True
    return not spec_matches_lease(spec_sha256(spec), lease.spec_digest)


def _active_leases() -> QuerySet[RunLease]:
    # Everything `classify` reads, in the same query (partial index runlease_active).
    return RunLease.objects.filter(state=LeaseState.ACTIVE).select_related(
        "attempt", "run", "run__task_revision", "session"
    )


def _finding(lease: RunLease, *, now: datetime) -> LeaseFinding:
    return LeaseFinding(
        lease_id=lease.pk,
        attempt_id=lease.attempt_id,
        attempt_state=AttemptState(lease.attempt.state),
        worker_id=lease.worker_id,
        session_generation=lease.session_generation,
        lease_generation=lease.lease_generation,
        category=classify(lease, now=now),
    )


def audit(*, now: datetime) -> list[LeaseFinding]:
    """Every active lease, classified; paged by id (`manage.py audit_leases`)."""
    findings: list[LeaseFinding] = []
    after = 0
    while True:
        page = list(_active_leases().filter(pk__gt=after).order_by("id")[:PAGE_SIZE])
        findings.extend(_finding(lease, now=now) for lease in page)
        if len(page) < PAGE_SIZE:
            return findings
        after = page[-1].pk


def audit_page(*, now: datetime, limit: int) -> tuple[list[LeaseFinding], bool]:
    """The oldest `limit` active leases, classified, in one query; and whether more exist.

    For pages that must stay bounded (the admin overview): active leases are
    few in a healthy system (at most the Sessions' slots), so the page is
    usually everything, and the flag says when it is not.
    """
    page = list(_active_leases().order_by("id")[: limit + 1])
    return [_finding(lease, now=now) for lease in page[:limit]], len(page) > limit
