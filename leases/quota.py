"""Run quotas: the one answer to "may another Run of this Task take a slot now?".

Two limits, each optional (0 = none):

- `Project.max_concurrent_runs`: **live leases** of the Project's Runs.
- `TaskRevision.max_concurrent_runs` (README "Run policies"), pinned in the
  Run's revision: **live leases** of the Task's Runs.

A live lease is an active lease not past `expires_at`. A lease is the slot,
so the count cannot leak (docs/adr/0012): no counter is kept anywhere; an
agent killed with `kill -9` holds its slots only until its lease expires or
its Session goes offline, a cancelled Run's lease is revoked with it, and a
claim whose process dies before it commits leaves no lease at all. Both
counts go through the Runs that can hold a lease (dispatching or running:
partial indexes `run_project_active`, `run_task_active`), so they cost what
the Project or Task has in flight, never its history. The fair candidate
read (`dispatch.adapters.queue`) counts them with the same SQL to skip a
full Project or Task before any claim.

The claim asks inside its transaction with `lock=True`: the Project row (only
with a Project limit) and then the Task row (only with a Task limit) are
locked in the lock order (Run → Attempt → Project → Task → WorkerSession →
RunLease, `leases.locks`), so two claims cannot both take the last slot. The
scheduler asks without locks to record a fire `blocked` instead of queueing
it behind a full limit; the claim still decides.
"""

from __future__ import annotations

import enum
from datetime import datetime

from leases.locks import lock_project, lock_task
from leases.models import LeaseState, RunLease
from leases.policy import lease_live_q
from qinglong.clock import db_now
from runs.models import Project, RunState

__all__ = ["QuotaLimit", "project_live_lease_count", "quota_blocker", "task_live_lease_count"]

_IN_FLIGHT = (RunState.DISPATCHING, RunState.RUNNING)


class QuotaLimit(enum.StrEnum):
    PROJECT = "project"  # Project.max_concurrent_runs is reached
    TASK = "task"  # the revision's max_concurrent_runs is reached


def project_live_lease_count(project_id: int, *, now: datetime) -> int:
    """Live leases of the Project's Runs: the slots its concurrency limit counts."""
    return (
        RunLease.objects.filter(
            lease_live_q(now),
            state=LeaseState.ACTIVE,
            run__project_id=project_id,
            run__state__in=_IN_FLIGHT,
        )
        .values("pk")
        .count()
    )


def task_live_lease_count(task_id: int, *, now: datetime) -> int:
    """Live leases of the Task's Runs: the slots its concurrency limit counts."""
    return (
        RunLease.objects.filter(
            lease_live_q(now),
            state=LeaseState.ACTIVE,
            run__task_id=task_id,
            run__state__in=_IN_FLIGHT,
        )
        .values("pk")
        .count()
    )


def quota_blocker(
    *, project: Project, task_id: int, task_limit: int, lock: bool, now: datetime | None = None
) -> QuotaLimit | None:
    """Which limit stops another Run of this Task from taking a slot, if any."""
    moment = now
    if project.max_concurrent_runs:
        if lock:
            lock_project(project.pk)
        # Read the clock after the lock: the count sees every lease committed before it.
        moment = db_now() if moment is None else moment
        if project_live_lease_count(project.pk, now=moment) >= project.max_concurrent_runs:
            return QuotaLimit.PROJECT
    if task_limit:
        if lock:
            lock_task(task_id)
        moment = db_now() if moment is None else moment
        if task_live_lease_count(task_id, now=moment) >= task_limit:
            return QuotaLimit.TASK
    return None
