"""Bounded reads behind the overview page and the `/metrics` gauges.

Every function is a fixed number of queries whatever the number of Runs,
Attempts or cycles (the overview test counts them at 100 and 100,000 Runs),
and each reads through an index that bounds its work:

| read | index |
|---|---|
| Runs by unfinished state | `run_state_id` (state, -id) |
| the queue (pending Attempts) | `attempt_candidate_keyset` (partial, pending) |
| Runs finished per minute / hour | `run_finished` (finished_at, state): a time range |
| Workers: newest Session | `workersession_unique_generation` |
| Workers: slots used | `runlease_active_session` |
| lease problems | `runlease_active` (the audit's first page) |
| truncated cycles | `dispatchcycle_truncated` |
| truncations by reason | `dispatchcycle_started`: a time range |

Lists are capped (`limit`) and say whether more exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Final

from django.db.models import Count, IntegerField, Min, OuterRef, Q, Subquery, Sum, Value
from django.db.models.functions import Coalesce, Trunc

from dispatch.core.policy import capacity, free_slots
from dispatch.models import DispatchControl, DispatchCycle
from leases.audit import PROBLEMS, LeaseFinding, audit_page
from leases.models import LeaseState, RunLease
from runs.models import Attempt, AttemptState, Run, RunState
from workers.models import (
    SESSION_CURRENT_STATES,
    SessionState,
    Worker,
    WorkerAdminState,
    WorkerSession,
)

__all__ = [
    "FINISHED_STATES",
    "UNFINISHED_STATES",
    "Bucket",
    "FinishedSeries",
    "Queue",
    "WorkerRow",
    "dispatch_control",
    "lease_problems",
    "queue",
    "recent_truncations",
    "runs_by_state",
    "runs_finished",
    "truncations_by_reason",
    "workers_with_slots",
]

UNFINISHED_STATES: Final = (RunState.QUEUED, RunState.DISPATCHING, RunState.RUNNING)
FINISHED_STATES: Final = (RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED)


# ------------------------------------------------------------------------ runs


def runs_by_state() -> dict[RunState, int]:
    """Runs in each unfinished state now (one GROUP BY over `run_state_id`).

    Finished Runs are history, counted per time window (`runs_finished`), so
    this read never grows with the archive.
    """
    counts = dict.fromkeys(UNFINISHED_STATES, 0)
    rows = (
        Run.objects.filter(state__in=UNFINISHED_STATES)
        .values("state")
        .annotate(n=Count("id"))
        .order_by()
    )
    for row in rows:
        counts[RunState(row["state"])] = row["n"]
    return counts


@dataclass(frozen=True)
class Queue:
    """Pending Attempts: queued Runs waiting for a claim."""

    depth: int
    # Not claimable yet (`Attempt.not_before` in the future: a backoff or a grace).
    waiting: int
    oldest_queued_at: datetime | None

    def oldest_age_s(self, now: datetime) -> float | None:
        if self.oldest_queued_at is None:
            return None
        return max(0.0, (now - self.oldest_queued_at).total_seconds())


def queue(*, now: datetime) -> Queue:
    """Queue depth, how much of it waits, and the oldest queued time (one query)."""
    agg = Attempt.objects.filter(state=AttemptState.PENDING).aggregate(
        depth=Count("id"),
        waiting=Count("id", filter=Q(not_before__gt=now)),
        oldest=Min("queued_at"),
    )
    return Queue(depth=agg["depth"], waiting=agg["waiting"], oldest_queued_at=agg["oldest"])


class Step(StrEnum):
    MINUTE = "minute"
    HOUR = "hour"

    @property
    def delta(self) -> timedelta:
        return timedelta(minutes=1) if self is Step.MINUTE else timedelta(hours=1)

    def floor(self, at: datetime) -> datetime:
        at = at.replace(second=0, microsecond=0)
        return at if self is Step.MINUTE else at.replace(minute=0)


@dataclass(frozen=True)
class Bucket:
    start: datetime
    counts: dict[RunState, int]

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@dataclass(frozen=True)
class FinishedSeries:
    """Runs that finished per bucket, by end state, oldest bucket first."""

    step: Step
    buckets: tuple[Bucket, ...]

    def totals(self) -> dict[RunState, int]:
        return {s: sum(b.counts[s] for b in self.buckets) for s in FINISHED_STATES}


def runs_finished(*, now: datetime, step: Step, buckets: int) -> FinishedSeries:
    """Runs finished in each of the last `buckets` steps (the current one partial).

    One aggregate query over a time range of the `run_finished` index: at most
    3 rows per bucket come back, however many Runs finished.
    """
    first = step.floor(now) - step.delta * (buckets - 1)
    rows = (
        Run.objects.filter(finished_at__gte=first, finished_at__lte=now)
        .annotate(bucket=Trunc("finished_at", step.value))
        .values("bucket", "state")
        .annotate(n=Count("id"))
        .order_by()
    )
    found: dict[tuple[datetime, str], int] = {
        (row["bucket"], row["state"]): row["n"] for row in rows
    }
    starts = [first + step.delta * i for i in range(buckets)]
    return FinishedSeries(
        step=step,
        buckets=tuple(
            Bucket(start, {s: found.get((start, s.value), 0) for s in FINISHED_STATES})
            for start in starts
        ),
    )


# --------------------------------------------------------------------- workers


@dataclass(frozen=True)
class WorkerRow:
    worker_id: int
    name: str
    admin_state: str
    worker_slots: int
    # Its newest Session (the current one, if any): None if it never opened one.
    session_state: SessionState | None
    session_slots: int | None
    heartbeat_at: datetime | None
    used: int

    @property
    def current(self) -> bool:
        return self.session_state in SESSION_CURRENT_STATES

    @property
    def capacity(self) -> int:
        if not self.current or self.session_slots is None:
            return 0
        return capacity(self.session_slots, self.worker_slots)

    @property
    def takes_claims(self) -> bool:
        # The row form of leases.policy.session_takes_claims: a draining
        # Session or Worker keeps its leases but gets no new ones.
        return (
            self.session_state == SessionState.ONLINE
            and self.admin_state == WorkerAdminState.ACTIVE
        )

    @property
    def free(self) -> int:
        """Slots a claim could take now (0 while draining or disabled)."""
        return free_slots(self.capacity, self.used) if self.takes_claims else 0


def workers_with_slots(*, limit: int) -> tuple[list[WorkerRow], bool]:
    """Workers by name with their newest Session, slots used and free (one query).

    Used = active leases held by the current Session (what the claim counts).
    """
    newest = WorkerSession.objects.filter(worker=OuterRef("pk")).order_by("-generation")
    used = (
        RunLease.objects.filter(
            worker=OuterRef("pk"),
            state=LeaseState.ACTIVE,
            session__state__in=SESSION_CURRENT_STATES,
        )
        .order_by()
        .values("worker")
        .annotate(n=Count("id"))
        .values("n")
    )
    rows = list(
        Worker.objects.order_by("name")
        .annotate(
            session_state=Subquery(newest.values("state")[:1]),
            session_slots=Subquery(newest.values("slots")[:1]),
            heartbeat_at=Subquery(newest.values("heartbeat_at")[:1]),
            used=Coalesce(Subquery(used, output_field=IntegerField()), Value(0)),
        )
        .values(
            "pk",
            "name",
            "admin_state",
            "slots",
            "session_state",
            "session_slots",
            "heartbeat_at",
            "used",
        )[: limit + 1]
    )
    return [
        WorkerRow(
            worker_id=row["pk"],
            name=row["name"],
            admin_state=row["admin_state"],
            worker_slots=row["slots"],
            session_state=(
                None if row["session_state"] is None else SessionState(row["session_state"])
            ),
            session_slots=row["session_slots"],
            heartbeat_at=row["heartbeat_at"],
            used=row["used"],
        )
        for row in rows[:limit]
    ], len(rows) > limit


# ---------------------------------------------------------------------- leases


def lease_problems(*, now: datetime, limit: int) -> tuple[list[LeaseFinding], bool]:
    """Active leases the audit names a problem, among its first page (`leases.audit`).

    The same classifier as `manage.py audit_leases`; the flag says the page did
    not reach every active lease (run the command for all of them).
    """
    findings, more = audit_page(now=now, limit=limit)
    return [f for f in findings if f.category in PROBLEMS], more


# -------------------------------------------------------------------- dispatch


def recent_truncations(*, limit: int) -> list[DispatchCycle]:
    """The newest truncated cycles (partial index `dispatchcycle_truncated`)."""
    return list(DispatchCycle.objects.filter(truncated=True).order_by("-id")[:limit])


def truncations_by_reason(*, since: datetime) -> dict[str, int]:
    """Truncated cycles since `since`, by reason (a time range of `dispatchcycle_started`).

    A row may stand for several cycles of one outcome (`cycles`): they are summed.
    """
    rows = (
        DispatchCycle.objects.filter(started_at__gte=since, truncated=True)
        .values("reason")
        .annotate(n=Sum("cycles"))
        .order_by("-n", "reason")
    )
    return {row["reason"]: row["n"] for row in rows}


def dispatch_control() -> DispatchControl | None:
    """The kill switch row (None = never set: dispatch runs)."""
    return DispatchControl.objects.filter(pk=1).first()
