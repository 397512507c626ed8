"""Bounded, single-shot sweeps (docs/architecture.md "Worker API and operations"), in plain Python.

Celery beat tasks, `manage.py run_dispatcher` and the tests all call these
functions, so there is one implementation of each sweep. Every sweep reads a
bounded batch of ids and applies one service per id; the service re-checks its
condition under row locks and applies a compare-and-set, so two sweeps running
at once (duplicate beats, a redelivered task, the loop and Celery together)
just find less to do: by construction they can never double-apply anything,
nor overwrite a completion (the services refuse to touch a non-active lease).

Each returns a small dict of counts — the only thing a Celery result may carry.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime, timedelta
from typing import Final

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, OuterRef, Q, QuerySet

from dispatch.models import DispatchCycle
from leases.end import lease_expire, leases_revoke_over_delivered
from leases.errors import Outcome
from leases.models import LeaseState, RunLease
from leases.policy import SWEEP_BATCH, lease_expired_q
from leases.timeout import attempt_time_out, attempts_overdue
from output.services import OUTPUT_PRUNE_BATCH, output_prune
from qinglong.clock import db_now
from workers.models import SESSION_ENDED_STATES, WorkerSession
from workers.services import session_mark_offline_if_stale, sessions_stale

__all__ = [
    "SweepCounts",
    "prune_dispatch_cycles",
    "prune_ended_sessions",
    "prune_live_output",
    "run_all_sweeps",
    "sweep_expired_leases",
    "sweep_over_delivered_leases",
    "sweep_stale_sessions",
    "sweep_timed_out_attempts",
]

# Defaults keep one sweep well under a second on either database; a page or
# batch of lease or Session ids is one dispatch page at its hard cap.
EXPIRY_PAGE_SIZE: Final = SWEEP_BATCH
EXPIRY_MAX_PAGES: Final = 4
SESSION_BATCH: Final = SWEEP_BATCH
PRUNE_BATCH: Final = 500
PRUNE_MAX_BATCHES: Final = 10
SESSION_PRUNE_BATCH: Final = 200
SESSION_PRUNE_MAX_BATCHES: Final = 5


@dataclass
class SweepCounts:
    examined: int = 0
    applied: int = 0  # this sweep made the transition
    unchanged: int = 0  # re-checked under lock: nothing to do any more
    lost_race: int = 0  # another writer changed the row first
    truncated: bool = False  # the batch limit was reached; more may remain

    def record(self, outcome: Outcome | bool) -> None:
        self.examined += 1
        if outcome is True or outcome is Outcome.APPLIED:
            self.applied += 1
        elif outcome is Outcome.LOST_RACE:
            self.lost_race += 1
        else:
            self.unchanged += 1

    def as_dict(self) -> dict[str, int | bool]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _expired_page(
    now: datetime, after: tuple[datetime, int] | None, limit: int
) -> list[tuple[datetime, int]]:
    # Keyset over (expires_at, id) among the active leases (runlease_active; no
    # index on expires_at since leases.0005, so renewals are HOT updates): rows
    # a service left active (lost race, renewed meanwhile) are stepped over
    # instead of being re-read by every page.
    qs = RunLease.objects.filter(lease_expired_q(now), state=LeaseState.ACTIVE)
    if after is not None:
        last_expiry, last_id = after
        qs = qs.filter(Q(expires_at__gt=last_expiry) | Q(expires_at=last_expiry, id__gt=last_id))
    return list(qs.order_by("expires_at", "id").values_list("expires_at", "id")[:limit])


def sweep_expired_leases(
    *, page_size: int = EXPIRY_PAGE_SIZE, max_pages: int = EXPIRY_MAX_PAGES
) -> SweepCounts:
    """Expire active leases past `expires_at` by the database clock."""
    counts = SweepCounts()
    # One observed "now" for the selection; `lease_expire` re-checks expiry
    # against its own database "now" under the row locks, so a lease an ACK
    # renewed in between is left alone.
    now = db_now()
    cursor: tuple[datetime, int] | None = None
    for _ in range(max_pages):
        rows = _expired_page(now, cursor, page_size)
        for expires_at, lease_id in rows:
            counts.record(lease_expire(lease_id))
            cursor = (expires_at, lease_id)
        if len(rows) < page_size:
            return counts
    counts.truncated = bool(_expired_page(now, cursor, 1))
    return counts


def sweep_stale_sessions(*, limit: int = SESSION_BATCH) -> SweepCounts:
    """Mark Sessions offline after missed heartbeats (their leases end with them)."""
    counts = SweepCounts()
    ids = sessions_stale(now=db_now(), limit=limit)
    for session_pk in ids:
        # A CAS that re-checks staleness at write time: a heartbeat that landed
        # after the read keeps its Session online.
        counts.record(session_mark_offline_if_stale(session_pk=session_pk))
    counts.truncated = len(ids) >= limit
    return counts


def sweep_over_delivered_leases(
    *, max_deliveries: int | None = None, limit: int = SWEEP_BATCH
) -> SweepCounts:
    """Revoke claimed leases delivered `max_deliveries` times without a starting ACK."""
    deliveries = (
        int(settings.QINGLONG_DISPATCH["max_deliveries"])
        if max_deliveries is None
        else max_deliveries
    )
    counts = SweepCounts()
    # Each is re-checked under the row locks (still `claimed`): a starting ACK
    # that won meanwhile must not become a lost Attempt.
    outcomes = leases_revoke_over_delivered(max_deliveries=deliveries, limit=limit)
    for outcome in outcomes:
        counts.record(outcome)
    counts.truncated = len(outcomes) >= limit
    return counts


def sweep_timed_out_attempts(*, limit: int = SWEEP_BATCH) -> SweepCounts:
    """End started Attempts past their timeout and margin `timed_out` (README "Run policies").

    No agent needs to be there: the lease is revoked and the retry policy
    decides. Each is re-checked under its row locks, so a terminal ACK that
    won meanwhile is left alone.
    """
    counts = SweepCounts()
    ids = attempts_overdue(now=db_now(), limit=limit)
    for attempt_id in ids:
        counts.record(attempt_time_out(attempt_id))
    counts.truncated = len(ids) >= limit
    return counts


def prune_dispatch_cycles(
    *,
    retention_s: int | None = None,
    batch_size: int = PRUNE_BATCH,
    max_batches: int = PRUNE_MAX_BATCHES,
) -> SweepCounts:
    """Delete DispatchCycle rows older than the retention, a bounded id batch at a time."""
    seconds = int(settings.QINGLONG_CYCLE_RETENTION_S) if retention_s is None else retention_s
    cutoff = db_now() - timedelta(seconds=seconds)
    counts = SweepCounts()
    for _ in range(max_batches):
        # Small deletes by primary key: no long lock on a big table, and a
        # concurrent prune just deletes fewer rows.
        ids = list(
            DispatchCycle.objects.filter(started_at__lt=cutoff)
            .order_by("started_at", "id")
            .values_list("id", flat=True)[:batch_size]
        )
        if not ids:
            return counts
        deleted, _ = DispatchCycle.objects.filter(pk__in=ids).delete()
        counts.examined += len(ids)
        counts.applied += deleted
        counts.unchanged += len(ids) - deleted
        if len(ids) < batch_size:
            return counts
    counts.truncated = DispatchCycle.objects.filter(started_at__lt=cutoff).exists()
    return counts


def _prunable_sessions(cutoff: datetime) -> QuerySet[WorkerSession]:
    # The partial index workersession_prunable: ended, not yet found leased.
    return WorkerSession.objects.filter(
        state__in=SESSION_ENDED_STATES, kept_for_leases=False, ended_at__lt=cutoff
    )


def prune_ended_sessions(
    *,
    retention_days: int | None = None,
    batch_size: int = SESSION_PRUNE_BATCH,
    max_batches: int = SESSION_PRUNE_MAX_BATCHES,
) -> SweepCounts:
    """Delete ended Sessions older than the retention that no lease points at.

    A Session some lease points at is lease history (RunLease.session is
    PROTECT): it is kept and marked `kept_for_leases`, so no later sweep reads
    it again and every sweep stays bounded. Ended is final (no Session comes
    back, no lease is ever claimed for one), so neither decision can go stale;
    the delete re-checks both conditions in its own statement anyway.
    """
    days = (
        int(settings.QINGLONG_SESSION_RETENTION_DAYS) if retention_days is None else retention_days
    )
    cutoff = db_now() - timedelta(days=days)
    leased = Exists(RunLease.objects.filter(session_id=OuterRef("pk")))
    counts = SweepCounts()
    for _ in range(max_batches):
        batch = list(
            _prunable_sessions(cutoff)
            .annotate(leased=leased)
            .order_by("ended_at", "id")
            .values_list("id", "leased")[:batch_size]
        )
        if not batch:
            return counts
        keep = [pk for pk, has_leases in batch if has_leases]
        drop = [pk for pk, has_leases in batch if not has_leases]
        with transaction.atomic(durable=True):
            if keep:
                WorkerSession.objects.filter(pk__in=keep).update(kept_for_leases=True)
            deleted = 0
            if drop:
                deleted, _ = _prunable_sessions(cutoff).filter(pk__in=drop).filter(~leased).delete()
        counts.examined += len(batch)
        counts.applied += deleted
        counts.unchanged += len(batch) - deleted
        if len(batch) < batch_size:
            return counts
    counts.truncated = _prunable_sessions(cutoff).exists()
    return counts


def prune_live_output() -> SweepCounts:
    """Delete the live output of Attempts ended over QL_OUTPUT_RETENTION_DAYS ago (bounded)."""
    counts = SweepCounts()
    pruned = output_prune()
    counts.examined = counts.applied = pruned
    counts.truncated = pruned >= OUTPUT_PRUNE_BATCH
    return counts


def run_all_sweeps() -> dict[str, dict[str, int | bool]]:
    """Every sweep once, in dependency order: sessions first (their leases end
    with them), then expiry, then over-delivery, then timeouts, then retention."""
    return {
        "stale_sessions": sweep_stale_sessions().as_dict(),
        "expired_leases": sweep_expired_leases().as_dict(),
        "over_delivered_leases": sweep_over_delivered_leases().as_dict(),
        "timed_out_attempts": sweep_timed_out_attempts().as_dict(),
        "pruned_cycles": prune_dispatch_cycles().as_dict(),
        "pruned_sessions": prune_ended_sessions().as_dict(),
        "pruned_output": prune_live_output().as_dict(),
    }
