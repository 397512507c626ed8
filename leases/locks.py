"""Row locks of execution state: one helper per row kind, one order for every path.

The order, everywhere, is **Run → Attempt → (Project) → (Task) →
WorkerSession → RunLease**, so two use cases on PostgreSQL never deadlock
(docs/adr/0004; the Task row only for a Task concurrency limit, `leases.quota`).
A Worker row is locked only by Session opens and credential rotations, which
hold nothing else of this list while they do.

Each helper locks its own row only: `of=("self",)` here and nowhere else, so
a Task revision or Project joined in for reading is never locked (a cancel or
an ACK of one Run must not hold up an enqueue or a claim of its siblings).
Session, Project and Worker locks are `FOR NO KEY UPDATE`: the foreign-key
checks (`KEY SHARE`) of a lease or Run insert never wait on them. On SQLite,
which has no row locks, each is a plain read and the transaction's
`BEGIN IMMEDIATE` serializes writers instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import connection

from leases.models import LeaseState, RunLease
from runs.models import ATTEMPT_ACTIVE_STATES, Attempt, Project, Run, Task
from workers.models import Worker, WorkerSession

__all__ = [
    "LeaseChain",
    "lock_active_attempt",
    "lock_active_lease",
    "lock_attempt",
    "lock_lease",
    "lock_lease_chain",
    "lock_project",
    "lock_run",
    "lock_session",
    "lock_task",
    "lock_worker",
]

_SELF = ("self",)


def _skip(skip_locked: bool) -> bool:
    # SKIP LOCKED lets racing global dispatchers pass over each other's rows;
    # SQLite serializes writers and has no row locks.
    return skip_locked and connection.features.has_select_for_update_skip_locked


def lock_run(run_id: int | str, *, skip_locked: bool = False) -> Run | None:
    """1. The Run, with its pinned revision and Project read in (not locked)."""
    return (
        Run.objects.select_for_update(skip_locked=_skip(skip_locked), of=_SELF)
        .select_related("task_revision", "project")
        .filter(pk=run_id)
        .first()
    )


def lock_attempt(
    attempt_id: int | str, *, run_id: int | None = None, skip_locked: bool = False
) -> Attempt | None:
    """2. One Attempt (of `run_id`, when given)."""
    qs = Attempt.objects.select_for_update(skip_locked=_skip(skip_locked), of=_SELF).filter(
        pk=attempt_id
    )
    if run_id is not None:
        qs = qs.filter(run_id=run_id)
    return qs.first()


def lock_active_attempt(run_id: int) -> Attempt | None:
    """2. The Run's one non-terminal Attempt, if any (attempt_one_active_per_run)."""
    return (
        Attempt.objects.select_for_update(of=_SELF)
        .filter(run_id=run_id, state__in=ATTEMPT_ACTIVE_STATES)
        .order_by("-number")
        .first()
    )


def lock_project(project_id: int) -> None:
    """3. A Project with a quota: two claims in it cannot both take its last slot."""
    Project.objects.select_for_update(no_key=True, of=_SELF).filter(pk=project_id).values_list(
        "pk", flat=True
    ).first()


def lock_task(task_id: int) -> None:
    """3b. A Task with a concurrency limit: two claims cannot both take its last slot."""
    Task.objects.select_for_update(no_key=True, of=_SELF).filter(pk=task_id).values_list(
        "pk", flat=True
    ).first()


def lock_session(*, pk: int | None = None, session_id: str | None = None) -> WorkerSession | None:
    """4. A WorkerSession (by primary key or public id), its Worker read in (not locked)."""
    qs = WorkerSession.objects.select_for_update(no_key=True, of=_SELF).select_related("worker")
    if pk is not None:
        qs = qs.filter(pk=pk)
    if session_id is not None:
        qs = qs.filter(session_id=session_id)
    return qs.first()


def lock_lease(lease_id: int) -> RunLease | None:
    """5. One RunLease."""
    return RunLease.objects.select_for_update(of=_SELF).filter(pk=lease_id).first()


def lock_active_lease(attempt: Attempt) -> RunLease | None:
    """5. The Attempt's active lease, if any (at most one: runlease_one_active)."""
    return (
        RunLease.objects.select_for_update(of=_SELF)
        .filter(attempt=attempt, state=LeaseState.ACTIVE)
        .first()
    )


def lock_worker(worker_pk: int) -> Worker:
    """A Worker (registry): Session generations and credential changes, one at a time."""
    return Worker.objects.select_for_update(no_key=True, of=_SELF).get(pk=worker_pk)


@dataclass(frozen=True)
class LeaseChain:
    """The rows of one lease, locked in order."""

    run: Run
    attempt: Attempt
    session: WorkerSession | None  # only when asked for (ACKs re-check the fence)
    lease: RunLease


def lock_lease_chain(lease_id: int, *, with_session: bool = False) -> LeaseChain | None:
    """Lock Run → Attempt → (WorkerSession) → RunLease of one lease, in the order above."""
    ids = RunLease.objects.filter(pk=lease_id).values("run_id", "attempt_id", "session_id").first()
    if ids is None:
        return None
    run = lock_run(ids["run_id"])
    attempt = lock_attempt(ids["attempt_id"])
    session = lock_session(pk=ids["session_id"]) if with_session else None
    lease = lock_lease(lease_id)
    # A lease row is never deleted, nor are the rows it protects (PROTECT).
    assert run is not None and attempt is not None and lease is not None
    assert not with_session or session is not None
    return LeaseChain(run=run, attempt=attempt, session=session, lease=lease)
