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

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection
from django.utils import timezone

from leases.models import LeaseState, RunLease
from qinglong.rows import ModelColumns
from runs.models import ATTEMPT_ACTIVE_STATES, Attempt, Project, Run, Task, TaskRevision
from workers.models import Worker, WorkerSession

__all__ = [
    "ClaimRows",
    "LeaseChain",
    "lock_active_attempt",
    "lock_active_lease",
    "lock_attempt",
    "lock_claim_rows",
    "lock_lease",
    "lock_lease_chain",
    "lock_lease_for_ack",
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
    now: datetime | None = None  # the database clock, when the lock statement read it


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


# ------------------------------------------------ one statement per use case
#
# The two hot paths take their locks in one statement on PostgreSQL (issue
# #12, docs/adr/0011): a locking SELECT over several tables locks its rows in
# the order its locking clauses name them (`FOR UPDATE OF r, a … FOR NO KEY
# UPDATE OF s`), which is the order above; leases/tests/test_lock_scope_postgres.py
# holds each row in turn from another connection and checks what the
# statement holds meanwhile.


@dataclass(frozen=True)
class ClaimRows:
    """What the claim read under its locks (Run, Attempt and, when taken, the Session).

    The instances carry only the columns the claim reads and writes; they are
    never saved.
    """

    run: Run
    attempt: Attempt
    project_limit: int  # Project.max_concurrent_runs (0 = none)
    task_limit: int  # the pinned revision's max_concurrent_runs (0 = none)
    session: WorkerSession | None  # None: not locked yet (a limit) or not found
    now: datetime  # the database clock once the locks were held


def _columns(meta: Any, alias: str, names: tuple[str, ...], prefix: str) -> str:
    qn = connection.ops.quote_name
    return ", ".join(
        f"{alias}.{qn(meta.get_field(name).column)} AS {prefix}{name}" for name in names
    )


_RUN_COLUMNS = ("id", "state", "version", "cancel_requested", "project_id", "task_id")
_ATTEMPT_COLUMNS = ("id", "run_id", "number", "state", "version", "lease_generation")
_SESSION_COLUMNS = ("id", "worker_id", "generation", "state", "slots")
_WORKER_COLUMNS = ("slots", "admin_state")


_CLAIM_ROWS_SQL: dict[tuple[str, bool], str] = {}


def _claim_rows_sql(vendor: str, *, skip: bool) -> str:
    """The text of `lock_claim_rows` for this database (written once per variant)."""
    found = _CLAIM_ROWS_SQL.get((vendor, skip))
    if found is not None:
        return found
    qn = connection.ops.quote_name
    postgres = vendor == "postgresql"
    run_lock = "FOR UPDATE OF r, a" + (" SKIP LOCKED" if skip else "")
    session_lock = "FOR NO KEY UPDATE OF s"
    no_limits = "(SELECT ra.p_limit = 0 AND ra.t_limit = 0 FROM ra)"
    sql = f"""
        WITH ra AS (
            SELECT {_columns(Run._meta, "r", _RUN_COLUMNS, "r_")},
                   {_columns(Attempt._meta, "a", _ATTEMPT_COLUMNS, "a_")},
                   p.{qn("max_concurrent_runs")} AS p_limit,
                   v.{qn("max_concurrent_runs")} AS t_limit
            FROM {qn(Run._meta.db_table)} r
            JOIN {qn(Attempt._meta.db_table)} a ON a.{qn("run_id")} = r.{qn("id")}
            JOIN {qn(Project._meta.db_table)} p ON p.{qn("id")} = r.{qn("project_id")}
            JOIN {qn(TaskRevision._meta.db_table)} v ON v.{qn("id")} = r.{qn("task_revision_id")}
            WHERE r.{qn("id")} = %s AND a.{qn("id")} = %s
            {run_lock if postgres else ""}
        ), sw AS (
            SELECT {_columns(WorkerSession._meta, "s", _SESSION_COLUMNS, "s_")},
                   {_columns(Worker._meta, "w", _WORKER_COLUMNS, "w_")}
            FROM {qn(WorkerSession._meta.db_table)} s
            JOIN {qn(Worker._meta.db_table)} w ON w.{qn("id")} = s.{qn("worker_id")}
            WHERE s.{qn("session_id")} = %s AND {no_limits}
            {session_lock if postgres else ""}
        )
        SELECT ra.*, sw.*{", clock_timestamp() AS now" if postgres else ""}
        FROM ra LEFT JOIN sw ON 1 = 1
    """  # noqa: S608  (names from model metadata; values are parameters)
    _CLAIM_ROWS_SQL[(vendor, skip)] = sql
    return sql


def lock_claim_rows(
    *, run_id: int, attempt_id: int, session_id: str, skip_locked: bool
) -> ClaimRows | None:
    """1, 2 and 4 of the order for a claim: Run → Attempt → WorkerSession, one statement.

    The Session is locked in the same statement only when neither the
    Project nor the pinned revision has a concurrency limit: otherwise
    Project and Task come first (`leases.quota.quota_blocker(lock=True)`)
    and the caller locks the Session after them with `lock_session`. None
    when the Run or Attempt does not exist (or, with `skip_locked`, another
    transaction holds one of them). No state is checked here: the rows come
    back as they are once locked, and the claim decides.
    """
    postgres = connection.vendor == "postgresql"
    sql = _claim_rows_sql(connection.vendor, skip=_skip(skip_locked))
    # The Session's CTE reads `ra` in its WHERE: PostgreSQL must have locked
    # Run and Attempt before it can even look at the Session row.
    session_key = WorkerSession._meta.get_field("session_id").get_db_prep_value(
        uuid.UUID(session_id), connection
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [run_id, attempt_id, session_key])
        names = [column[0] for column in cursor.description]
        values = cursor.fetchone()
    if values is None:
        return None
    row = dict(zip(names, values, strict=True))
    run = Run(**{name: row[f"r_{name}"] for name in _RUN_COLUMNS})
    run.cancel_requested = bool(run.cancel_requested)
    attempt = Attempt(**{name: row[f"a_{name}"] for name in _ATTEMPT_COLUMNS})
    session = None
    if row["s_id"] is not None:
        worker = Worker(pk=row["s_worker_id"], **{n: row[f"w_{n}"] for n in _WORKER_COLUMNS})
        session = WorkerSession(**{name: row[f"s_{name}"] for name in _SESSION_COLUMNS})
        session.worker = worker
    now = row["now"] if postgres else timezone.now()
    return ClaimRows(
        run=run,
        attempt=attempt,
        project_limit=int(row["p_limit"]),
        task_limit=int(row["t_limit"]),
        session=session,
        now=now,
    )


_ACK_RUN = ModelColumns(Run, "r")
_ACK_REVISION = ModelColumns(TaskRevision, "v")
_ACK_ATTEMPT = ModelColumns(Attempt, "a")
_ACK_SESSION = ModelColumns(WorkerSession, "s")
_ACK_LEASE = ModelColumns(RunLease, "l")
_ACK_PARTS = (_ACK_RUN, _ACK_REVISION, _ACK_ATTEMPT, _ACK_SESSION, _ACK_LEASE)


def lock_lease_for_ack(*, offer_id: str, session_pk: int) -> LeaseChain | None:
    """Run → Attempt → WorkerSession → RunLease of one of this Session's leases, one statement.

    Found by offer id and owning Session together, so a request naming
    another Session's lease locks nothing. The locks are those of
    `lock_lease_chain(with_session=True)` (`FOR UPDATE` of Run, Attempt and
    lease, `FOR NO KEY UPDATE` of the Session), taken in that order by one
    statement; the Run comes with its pinned revision (retry policy, timeout,
    output redaction), not locked. `LeaseChain.now` is the database clock at
    this statement (the process clock on SQLite). Hand-written SQL loaded
    like a queryset (`qinglong.rows`): this runs once per ACK.
    """
    qn = connection.ops.quote_name
    postgres = connection.vendor == "postgresql"
    selects = ", ".join(part.select() for part in _ACK_PARTS)
    sql = (
        f"SELECT {selects}{', statement_timestamp()' if postgres else ''} "  # noqa: S608  (names from model metadata; values are parameters)
        f"FROM {qn(Run._meta.db_table)} r, {qn(TaskRevision._meta.db_table)} v, "
        f"{qn(Attempt._meta.db_table)} a, {qn(WorkerSession._meta.db_table)} s, "
        f"{qn(RunLease._meta.db_table)} l "
        f"WHERE l.{qn('offer_id')} = %s AND l.{qn('session_id')} = %s "
        f"AND r.{qn('id')} = l.{qn('run_id')} AND v.{qn('id')} = r.{qn('task_revision_id')} "
        f"AND a.{qn('id')} = l.{qn('attempt_id')} AND s.{qn('id')} = l.{qn('session_id')}"
        + (" FOR UPDATE OF r, a FOR NO KEY UPDATE OF s FOR UPDATE OF l" if postgres else "")
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [offer_id, session_pk])
        row = cursor.fetchone()
    if row is None:
        return None
    loaded = []
    offset = 0
    for part in _ACK_PARTS:
        loaded.append(part.load(row[offset : offset + len(part)]))
        offset += len(part)
    run, revision, attempt, session, lease = loaded
    assert isinstance(run, Run) and isinstance(revision, TaskRevision)
    assert isinstance(attempt, Attempt) and isinstance(session, WorkerSession)
    assert isinstance(lease, RunLease)
    run.task_revision = revision
    lease.run, lease.attempt, lease.session = run, attempt, session
    now = row[offset] if postgres else timezone.now()
    return LeaseChain(run=run, attempt=attempt, session=session, lease=lease, now=now)
