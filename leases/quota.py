"""Run quotas: the one answer to "may another Run of this Task take a slot now?".

Two limits, each optional (0 = none):

- `Project.max_concurrent_runs`: Runs of the Project dispatching or running.
- `TaskRevision.max_concurrent_runs` (README "Run policies"), pinned in the
  Run's revision: **live leases** of the Task's Runs, i.e. active leases not
  past `expires_at`. A lease is the slot, so the count cannot leak: an agent
  killed with `kill -9` holds its slots only until its lease expires or its
  Session goes offline, a cancelled Run's lease is revoked with it.

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
from runs.models import Project, Run, RunState

__all__ = ["QuotaLimit", "quota_blocker", "task_live_lease_count"]


class QuotaLimit(enum.StrEnum):
    PROJECT = "project"  # Project.max_concurrent_runs is reached
    TASK = "task"  # the revision's max_concurrent_runs is reached


def task_live_lease_count(task_id: int, *, now: datetime) -> int:
    """Live leases of the Task's Runs: the slots its concurrency limit counts."""
    return (
        RunLease.objects.filter(lease_live_q(now), state=LeaseState.ACTIVE, run__task_id=task_id)
        .values("pk")
        .count()
    )


def quota_blocker(
    *, project: Project, task_id: int, task_limit: int, lock: bool, now: datetime | None = None
) -> QuotaLimit | None:
    """Which limit stops another Run of this Task from taking a slot, if any."""
    if project.max_concurrent_runs:
        if lock:
            lock_project(project.pk)
        active = Run.objects.filter(
            project_id=project.pk, state__in=(RunState.DISPATCHING, RunState.RUNNING)
        ).count()
        if active >= project.max_concurrent_runs:
            return QuotaLimit.PROJECT
    if task_limit:
        if lock:
            lock_task(task_id)
        moment = db_now() if now is None else now
        if task_live_lease_count(task_id, now=moment) >= task_limit:
            return QuotaLimit.TASK
    return None
