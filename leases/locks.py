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
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.db.models import Model
from django.db.models.base import ModelState
from django.utils import timezone

from leases.models import LeaseState, RunLease
from qinglong.prepared import array_element, array_text, int8_params, prepared_cursor
from qinglong.rows import ModelColumns, load_row
from runs.models import (
    ATTEMPT_ACTIVE_STATES,
    Attempt,
    Project,
    Run,
    RunState,
    Task,
    TaskRevision,
)
from workers.models import Worker, WorkerSession

__all__ = [
    "BatchKey",
    "BatchLimits",
    "BatchRow",
    "ClaimBatchRows",
    "ClaimRows",
    "LeaseChain",
    "lock_active_attempt",
    "lock_active_lease",
    "lock_attempt",
    "lock_claim_batch",
    "lock_claim_batch_limits",
    "lock_claim_rows",
    "lock_lease",
    "lock_lease_chain",
    "lock_lease_for_ack",
    "lock_leases_for_acks",
    "lock_project",
    "lock_run",
    "lock_session",
    "lock_task",
    "lock_worker",
    "session_counts_cte",
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


# docs/adr/0011, "Claims commit asynchronously": the claim's transaction
# (only it: `set_config(..., true)` is local to the transaction) commits
# without waiting for its WAL flush when QINGLONG_CLAIM_ASYNC_COMMIT is on.
# Every lock statement of a claim carries it, so it costs no round trip.
_ASYNC_COMMIT = (
    "set_config('synchronous_commit', CASE WHEN %s THEN 'off' "
    "ELSE current_setting('synchronous_commit') END, true) AS commit_mode"
)


def _async_commit() -> bool:
    return bool(settings.QINGLONG_CLAIM_ASYNC_COMMIT)


# Issue #12: the statements after a claim's lock statement (a page's write
# above all) are prepared (qinglong.prepared), but PostgreSQL kept planning
# them anew on every execution: costed for arrays of unknown length, their
# generic plan looked dearer than a plan made for the arrays at hand, which
# took the server about 3 ms per page to make. The plans are the same (an
# index probe per key, the states literals in the text), so the claim's
# transaction — only it: `set_config(..., true)` is local to the transaction —
# runs the generic one. Carried by the lock statement: no round trip.
_GENERIC_PLANS = "set_config('plan_cache_mode', 'force_generic_plan', true) AS plan_mode"


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
    tail = f", clock_timestamp() AS now, {_ASYNC_COMMIT}, {_GENERIC_PLANS}" if postgres else ""
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
        SELECT ra.*, sw.*{tail}
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
    params: list[Any] = [run_id, attempt_id, session_key]
    if postgres:
        params.append(_async_commit())
    # Every claim runs it: prepared once per connection (qinglong.prepared).
    with prepared_cursor() as cursor:
        cursor.execute(sql, int8_params(params))
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


# The columns an ACK reads (issue #12): what its checks, its writes, the retry
# policy of a failed or lost Attempt (`leases.end.attempt_finish`, which
# creates the next Attempt), the output redaction and the webhook of an ended
# Run use — never the revision's command, cwd, resources or placement, nor the
# Session's token digest. A field left out is deferred (`qinglong.rows`):
# reading one would load it with a query of its own, which the statement
# counts of leases/tests/test_statement_counts_postgres.py would show.
_ACK_RUN = ModelColumns(
    Run,
    "r",
    only=(
        "project",
        "task",
        "task_revision",
        "state",
        "priority",
        "queued_at",
        "cancel_requested",
        "version",
        "finished_at",
    ),
)
_ACK_REVISION = ModelColumns(
    TaskRevision,
    "v",
    only=(
        "timeout_s",
        "env",  # output redaction (output.redaction)
        "max_attempts",
        "max_concurrent_runs",
        "retry_on",
        "retry_backoff_s",
        "retry_backoff_max_s",
    ),
)
_ACK_ATTEMPT = ModelColumns(
    Attempt,
    "a",
    only=(
        "run",
        "number",
        "state",
        "version",
        "lease_generation",
        "priority",
        "queued_at",
        "started_at",
        "deadline_at",
        "finished_at",
    ),
)
_ACK_SESSION = ModelColumns(WorkerSession, "s", only=("worker", "generation", "state"))
_ACK_LEASE = ModelColumns(
    RunLease,
    "l",
    only=(
        "attempt",
        "run",
        "worker",
        "session",
        "session_generation",
        "lease_generation",
        "offer_id",
        "token_digest",
        "spec_digest",
        "state",
        "version",
        "expires_at",
        "execution_confirmed_at",
    ),
)
_ACK_PARTS = (_ACK_RUN, _ACK_REVISION, _ACK_ATTEMPT, _ACK_SESSION, _ACK_LEASE)
_ACK_SQL: dict[str, str] = {}


def _ack_sql() -> str:
    """The text of `lock_lease_for_ack` for this database (written once per vendor)."""
    vendor = connection.vendor
    found = _ACK_SQL.get(vendor)
    if found is not None:
        return found
    qn = connection.ops.quote_name
    postgres = vendor == "postgresql"
    selects = ", ".join(part.select() for part in _ACK_PARTS)
    found = _ACK_SQL[vendor] = (
        f"SELECT {selects}{', statement_timestamp()' if postgres else ''} "  # noqa: S608  (names from model metadata; values are parameters)
        f"FROM {qn(Run._meta.db_table)} r, {qn(TaskRevision._meta.db_table)} v, "
        f"{qn(Attempt._meta.db_table)} a, {qn(WorkerSession._meta.db_table)} s, "
        f"{qn(RunLease._meta.db_table)} l "
        f"WHERE l.{qn('offer_id')} = %s AND l.{qn('session_id')} = %s "
        f"AND r.{qn('id')} = l.{qn('run_id')} AND v.{qn('id')} = r.{qn('task_revision_id')} "
        f"AND a.{qn('id')} = l.{qn('attempt_id')} AND s.{qn('id')} = l.{qn('session_id')}"
        + (" FOR UPDATE OF r, a FOR NO KEY UPDATE OF s FOR UPDATE OF l" if postgres else "")
    )
    return found


def lock_lease_for_ack(*, offer_id: str, session_pk: int) -> LeaseChain | None:
    """Run → Attempt → WorkerSession → RunLease of one of this Session's leases, one statement.

    Found by offer id and owning Session together, so a request naming
    another Session's lease locks nothing. The locks are those of
    `lock_lease_chain(with_session=True)` (`FOR UPDATE` of Run, Attempt and
    lease, `FOR NO KEY UPDATE` of the Session), taken in that order by one
    statement; the Run comes with its pinned revision (retry policy, timeout,
    output redaction), not locked. `LeaseChain.now` is the database clock at
    this statement (the process clock on SQLite). Hand-written SQL loaded
    like a queryset (`qinglong.rows`), only the columns an ACK reads, and
    prepared once per connection (`qinglong.prepared`): this runs once per ACK.
    """
    postgres = connection.vendor == "postgresql"
    with prepared_cursor() as cursor:
        cursor.execute(_ack_sql(), [offer_id, session_pk])
        row = cursor.fetchone()
    if row is None:
        return None
    loaded, offset = load_row(_ACK_PARTS, row)
    run, revision, attempt, session, lease = loaded
    assert isinstance(run, Run) and isinstance(revision, TaskRevision)
    assert isinstance(attempt, Attempt) and isinstance(session, WorkerSession)
    assert isinstance(lease, RunLease)
    run.task_revision = revision
    lease.run, lease.attempt, lease.session = run, attempt, session
    now = row[offset] if postgres else timezone.now()
    return LeaseChain(run=run, attempt=attempt, session=session, lease=lease, now=now)


def _read_part(part: ModelColumns[Any], values: Sequence[Any], db: Any) -> Any:
    """`part.load(values)` without `Model.__init__` (`_read`): the same
    converted values, every column not read deferred (issue 12: three to
    five rows per ACK of a batch); `db` the default database's wrapper."""
    converted = part.convert(values, db)
    return _read(part.model, dict(zip(part.attnames, converted, strict=True)))


_ACK_SHARED = (_ACK_REVISION, _ACK_SESSION)
assert all(part.fields[0].primary_key for part in _ACK_SHARED)


def _aliased(part: ModelColumns[Any]) -> str:
    """`part`'s columns, each named `<alias>_<column>` (unique across models)."""
    qn = connection.ops.quote_name
    return ", ".join(
        f"{part.alias}.{qn(field.column)} AS {qn(part.alias + '_' + field.column)}"
        for field in part.fields
    )


def _names(part: ModelColumns[Any], table: str) -> str:
    qn = connection.ops.quote_name
    return ", ".join(f"{table}.{qn(part.alias + '_' + field.column)}" for field in part.fields)


_ACKS_SQL: dict[str, str] = {}


def _acks_sql() -> str:
    found = _ACKS_SQL.get(connection.vendor)
    if found is not None:
        return found
    qn = connection.ops.quote_name
    lease = qn(RunLease._meta.db_table)
    # `ra`: every Run and Attempt (with the pinned revision, not locked),
    # sorted by Run id; `s`: the Session, read only once `ra` is complete
    # (its WHERE counts `ra`); `ll`: the leases, sorted by id, once `s` is.
    # The leases are found by offer id (unique) and the Session only checked:
    # `session_id + 0` is a filter, never an index condition. A generic plan
    # costs `= ANY(array)` at 10 rows, and with the lease table's statistics
    # older than its rows (analysed when a Session had few leases, as after
    # the e2e bench's ANALYZE) it read the leases through `runlease_pull` by
    # Session instead — every lease the Session ever had, on each batch (issue
    # 12: 0.99 against 0.21 ms for 2 offers of a Session with 1,584 leases).
    # The statement also turns the rest of the batch's transaction to generic
    # plans (`_GENERIC_PLANS`, as a claim's does): PostgreSQL otherwise planned
    # each wave of writes anew (`leases.writes._apply_wave`, 0.5 ms a wave).
    found = f"""
        WITH ra AS MATERIALIZED (
            SELECT {_aliased(_ACK_RUN)}, {_aliased(_ACK_REVISION)}, {_aliased(_ACK_ATTEMPT)},
                   l.{qn("id")} AS lease_id
            FROM {lease} l
            JOIN {qn(Run._meta.db_table)} r ON r.{qn("id")} = l.{qn("run_id")}
            JOIN {qn(TaskRevision._meta.db_table)} v ON v.{qn("id")} = r.{qn("task_revision_id")}
            JOIN {qn(Attempt._meta.db_table)} a ON a.{qn("id")} = l.{qn("attempt_id")}
            WHERE l.{qn("offer_id")} = ANY(%s::varchar[]) AND l.{qn("session_id")} + 0 = %s
            ORDER BY r.{qn("id")}, a.{qn("id")}
            FOR UPDATE OF r, a
        ),
        s AS MATERIALIZED (
            SELECT {_aliased(_ACK_SESSION)} FROM {qn(WorkerSession._meta.db_table)} s
            WHERE s.{qn("id")} = %s AND (SELECT count(*) FROM ra) > 0
            FOR NO KEY UPDATE OF s
        ),
        ll AS MATERIALIZED (
            SELECT {_aliased(_ACK_LEASE)} FROM {lease} l
            WHERE l.{qn("id")} IN (SELECT ra.lease_id FROM ra) AND (SELECT count(*) FROM s) > 0
            ORDER BY l.{qn("id")}
            FOR UPDATE OF l
        )
        SELECT {_names(_ACK_RUN, "ra")}, {_names(_ACK_REVISION, "ra")},
               {_names(_ACK_ATTEMPT, "ra")}, {_names(_ACK_SESSION, "s")},
               {_names(_ACK_LEASE, "ll")}, statement_timestamp(), {_GENERIC_PLANS}
        FROM ra JOIN ll ON ll.{qn("l_id")} = ra.lease_id CROSS JOIN s
    """  # noqa: S608  (names from model metadata; values are parameters)
    _ACKS_SQL[connection.vendor] = found
    return found


def lock_leases_for_acks(*, offer_ids: Sequence[str], session_pk: int) -> dict[str, LeaseChain]:
    """The chains of several of this Session's leases, locked in one statement
    (PostgreSQL): every Run and Attempt, sorted by Run id, then the Session,
    then every lease, sorted by id — the lock order, and rows of one kind in
    ascending id like a page of claims (below), so this waits in no cycle
    with a single ACK, a claim, a cancel or another batch (docs/adr/0013).

    Found by offer id *and* this Session (another Session's lease locks
    nothing and is simply absent from the answer); loaded like
    `lock_lease_for_ack`'s rows, one `LeaseChain` per offer id found, all
    sharing the one Session instance and `now` (the statement's clock).
    """
    assert connection.vendor == "postgresql", "several ACKs lock in one statement on PostgreSQL"
    unique = sorted(set(offer_ids))
    with prepared_cursor() as cursor:
        # The Session's id as bigint whatever its value: one prepared statement.
        cursor.execute(_acks_sql(), int8_params([unique, session_pk, session_pk]))
        rows = cursor.fetchall()
    chains: dict[str, LeaseChain] = {}
    # One instance per revision (immutable) and for the one Session: read once.
    shared: dict[tuple[str, Any], Any] = {}
    db = connections[DEFAULT_DB_ALIAS]  # looked up once, not once per row
    for row in rows:
        loaded = []
        offset = 0
        for part in _ACK_PARTS:
            values = row[offset : offset + len(part)]
            offset += len(part)
            if part in _ACK_SHARED:
                key = (part.alias, values[0])  # the primary key comes first
                if key not in shared:
                    shared[key] = _read_part(part, values, db)
                loaded.append(shared[key])
            else:
                loaded.append(_read_part(part, values, db))
        run, revision, attempt, session, lease = loaded
        assert isinstance(run, Run) and isinstance(revision, TaskRevision)
        assert isinstance(attempt, Attempt) and isinstance(session, WorkerSession)
        assert isinstance(lease, RunLease)
        run.task_revision = revision
        lease.run, lease.attempt, lease.session = run, attempt, session
        chains[lease.offer_id] = LeaseChain(
            run=run, attempt=attempt, session=session, lease=lease, now=row[offset]
        )
    return chains


# ------------------------------------------------ a page of claims at once
#
# A global cycle claims its whole page of (candidate, Session) pairs in one
# transaction (issue #12, docs/adr/0011, "Set-based claims"): every Run and
# Attempt of the page in one statement, sorted by Run id, then the Projects
# and Tasks with a limit, each kind sorted by id, then the Sessions, sorted
# by id. Every transaction that holds rows of several kinds takes them in the
# lock order above, and rows of one kind in ascending id, so two batches (or
# a batch and any single-row path) never wait on each other in a cycle.
#
# The counts a claim decides on (the Session's active leases, its pull ids,
# the Project's busy Runs, the Task's live leases) are read by these
# statements too, but a statement's snapshot is taken before it waits for a
# lock: a count can miss a lease committed while it waited. `leases.claim`
# therefore decides on them and then checks, in the statement that writes,
# that none of them grew (`claim_count_sql`): under the locks they can only
# shrink.


@dataclass(frozen=True)
class BatchKey:
    """One request of a batch, as the lock statement needs it."""

    index: int  # its place in the batch (the answer's order)
    run_id: int
    attempt_id: int
    session_key: uuid.UUID | None  # WorkerSession.session_id; None: not a UUID
    pull_id: uuid.UUID | None
    token_digest: str


@dataclass(frozen=True)
class BatchRow:
    """A Run and its Attempt, locked, with the limits of its Project and revision."""

    run: Run
    attempt: Attempt
    project_limit: int
    task_limit: int


@dataclass(frozen=True)
class BatchLimits:
    """What the claims read under the Session locks (stale until checked again)."""

    sessions: dict[uuid.UUID, tuple[WorkerSession, int]]  # session_id → (row, active leases)
    pull_conflicts: frozenset[int]  # request indexes whose pull id has another token
    project_busy: dict[int, int]  # Project id → live leases of its Runs
    task_live: dict[int, int]  # Task id → live leases of its Runs
    # The database clock once these locks were held and their snapshot taken
    # (`lock_claim_batch_limits`; None: read with the Runs, `ClaimBatchRows.now`).
    # A lease claimed under them is stamped with it, never with a clock read
    # before a wait: a lease another transaction ended while this one waited
    # then never looks as if it overlapped the new one.
    now: datetime | None = None


@dataclass(frozen=True)
class ClaimBatchRows:
    """What `lock_claim_batch` read: the locked pairs by request index."""

    rows: dict[int, BatchRow]  # a request absent here: not found, or skipped (locked)
    limits: BatchLimits | None  # None: a limit applies, Sessions not locked yet
    now: datetime | None  # the database clock once the locks were held (None: no row)

    @property
    def needs_limits(self) -> bool:
        return self.limits is None and any(
            row.project_limit or row.task_limit for row in self.rows.values()
        )


def claim_count_sql(kind: str, key: str, now: str = "") -> str:
    """The SQL text of each count a claim decides on, for a key expression.

    `session`: active leases of the Session (`runlease_active_session`);
    `project` and `task`: live leases (active, `expires_at` after `now`) of
    the Project's or Task's Runs in flight — `leases.quota` counts the same
    (`project_live_lease_count`, `task_live_lease_count`), through the
    partial indexes `run_project_active` and `run_task_active`.
    """
    qn = connection.ops.quote_name
    lease, run = qn(RunLease._meta.db_table), qn(Run._meta.db_table)
    active = f"'{LeaseState.ACTIVE}'"
    if kind == "session":
        return (
            f"(SELECT count(*) FROM {lease} cl "  # noqa: S608  (names from model metadata; values are parameters)
            f"WHERE cl.session_id = {key} AND cl.state = {active})"
        )
    if kind in ("project", "task"):
        in_flight = f"'{RunState.DISPATCHING}', '{RunState.RUNNING}'"
        return (
            f"(SELECT count(*) FROM {run} cr JOIN {lease} cl ON cl.run_id = cr.id "  # noqa: S608  (names from model metadata; values are parameters)
            f"WHERE cr.{kind}_id = {key} AND cr.state IN ({in_flight}) "
            f"AND cl.state = {active} AND cl.expires_at > {now})"
        )
    raise ValueError(kind)


def pull_conflict_sql(session: str, pull_id: str, token: str) -> str:
    """docs/adr/0003, one pull id one token: another lease of the Session has this
    pull id with another token."""
    lease = connection.ops.quote_name(RunLease._meta.db_table)
    return (
        f"EXISTS (SELECT 1 FROM {lease} cl WHERE cl.session_id = {session} "  # noqa: S608  (names from model metadata; values are parameters)
        f"AND cl.pull_id = {pull_id} AND cl.token_digest <> {token})"
    )


_BATCH_RUN = ("id", "state", "version", "cancel_requested", "project_id", "task_id")
_BATCH_ATTEMPT = ("id", "run_id", "state", "version", "lease_generation")
_BATCH_SESSION = ("id", "session_id", "worker_id", "generation", "state", "slots")


def _batch_keys_sql() -> str:
    return (
        "SELECT * FROM unnest(%s::integer[], %s::bigint[], %s::bigint[], %s::uuid[], "
        "%s::uuid[], %s::varchar(64)[]) AS q(idx, run_id, attempt_id, sess, pull, tok)"
    )


def _batch_keys_params(keys: Sequence[BatchKey]) -> list[Any]:
    return [
        _key_array([k.index for k in keys]),
        _key_array([k.run_id for k in keys]),
        _key_array([k.attempt_id for k in keys]),
        _key_array([k.session_key for k in keys]),
        _key_array([k.pull_id for k in keys]),
        _key_array([k.token_digest for k in keys]),
    ]


def _key_array(values: Sequence[int | uuid.UUID | str | None]) -> str:
    """An array of keys as its text form (`{…}`, `qinglong.prepared.array_text`),
    which the statement casts to the column's array type: psycopg sends it as
    text of unknown type, so the statement's parameter types never change, and
    does not run a dumper per element (issue #12). A key of a type that form
    does not write exactly is an error, never a guessed literal."""
    text = array_text(values)
    if text is None:
        kinds = sorted({type(v).__name__ for v in values if array_element(v) is None})
        raise TypeError(f"not an array key type: {', '.join(kinds)}")
    return text


def _sessions_cte(where: str) -> str:
    qn = connection.ops.quote_name
    return (
        f"sw AS MATERIALIZED (SELECT {', '.join(f's.{qn(c)}' for c in _BATCH_SESSION)}, "  # noqa: S608  (names from model metadata; values are parameters)
        f"w.{qn('slots')} AS w_slots, w.{qn('admin_state')} AS w_admin_state "
        f"FROM {qn(WorkerSession._meta.db_table)} s "
        f"JOIN {qn(Worker._meta.db_table)} w ON w.{qn('id')} = s.{qn('worker_id')} "
        f"WHERE {where} ORDER BY s.{qn('id')} FOR NO KEY UPDATE OF s)"
    )


def session_counts_cte(name: str, keys: str) -> str:
    """`<name>(session_id, n)`: the active leases of the Sessions whose ids the
    array expression `keys` holds (those with none are absent), counted in one pass.

    A `MATERIALIZED` CTE, so whatever the plan each active lease is read at
    most once per statement: with the statistics of the lease table older
    than the leases in flight (analysed when there were none; dispatch_bench's
    (c), a box without autovacuum), a count per Session row was planned as a
    scan of another partial index on active leases filtered by Session, and
    read every active lease once per Session of the page (issue #12).
    """
    qn = connection.ops.quote_name
    return (
        f"{name} AS MATERIALIZED (SELECT cl.session_id, count(*) AS n "  # noqa: S608  (names from model metadata; values are parameters)
        f"FROM {qn(RunLease._meta.db_table)} cl WHERE cl.state = '{LeaseState.ACTIVE}' "
        f"AND cl.session_id = ANY({keys}) GROUP BY cl.session_id)"
    )


def _sessions_select() -> str:
    """The Sessions locked (`sw`) with their active leases (`sc`, after
    `_sessions_cte`), and the requests (`q`) whose pull id conflicts: two
    JSON columns."""
    fields = ", ".join(f"sw.{c}" for c in _BATCH_SESSION)
    return (
        f"(SELECT json_agg(json_build_array({fields}, sw.w_slots, sw.w_admin_state, "  # noqa: S608  (names from model metadata; values are parameters)
        "COALESCE(sc.n, 0))) FROM sw LEFT JOIN sc ON sc.session_id = sw.id), "
        "(SELECT json_agg(q.idx) FROM q JOIN sw ON sw.session_id = q.sess "
        f"WHERE q.pull IS NOT NULL AND {pull_conflict_sql('sw.id', 'q.pull', 'q.tok')})"
    )


_M = TypeVar("_M", bound=Model)


def _read(model: type[_M], values: dict[str, Any]) -> _M:
    """An instance of `model` holding exactly `values` (by attname), as read
    from the database, never saved.

    Without `Model.__init__`, which fills every other field with its default
    (60-100 us a row, four rows per claim of a page: issue 12). A field not
    given is deferred: reading it would load it (a query the statement-count
    tests see), never answer a default that is not the row's.
    """
    instance = model.__new__(model)
    state = ModelState()
    # The `connection` proxy's alias, without a thread-local lookup per row.
    state.adding, state.db = False, DEFAULT_DB_ALIAS
    instance._state = state
    instance.__dict__.update(values)
    return instance


def _load_sessions(
    rows: list[list[Any]] | None, conflicts: list[int] | None
) -> tuple[dict[uuid.UUID, tuple[WorkerSession, int]], frozenset[int]]:
    sessions: dict[uuid.UUID, tuple[WorkerSession, int]] = {}
    for values in rows or ():
        *fields, w_slots, w_admin_state, active = values
        session = _read(WorkerSession, dict(zip(_BATCH_SESSION, fields, strict=True)))
        session.session_id = uuid.UUID(str(session.session_id))
        session.worker = _read(
            Worker, {"id": session.worker_id, "slots": w_slots, "admin_state": w_admin_state}
        )
        sessions[session.session_id] = (session, int(active))
    return sessions, frozenset(conflicts or ())


_CLAIM_BATCH_SQL: dict[tuple[str, bool], str] = {}


def _claim_batch_sql(*, skip: bool) -> str:
    found = _CLAIM_BATCH_SQL.get((connection.vendor, skip))
    if found is not None:
        return found
    qn = connection.ops.quote_name
    run_lock = "FOR UPDATE OF r, a" + (" SKIP LOCKED" if skip else "")
    run_cols = _columns(Run._meta, "r", _BATCH_RUN, "r_")
    attempt_cols = _columns(Attempt._meta, "a", _BATCH_ATTEMPT, "a_")
    # Sessions are locked here only when no locked row has a limit: with one,
    # the Projects and Tasks come first (`lock_claim_batch_limits`). Reading
    # `ra` in the WHERE makes every Run and Attempt locked before any Session.
    sessions_where = (
        "s.session_id = ANY((SELECT CASE WHEN bool_or(ra.p_limit <> 0 OR ra.t_limit <> 0) "
        "THEN NULL ELSE array_agg(ra.sess) END FROM ra)::uuid[])"
    )
    sql = f"""
        WITH q AS ({_batch_keys_sql()}),
        ra AS MATERIALIZED (
            SELECT q.idx, q.sess, {run_cols}, {attempt_cols},
                   p.{qn("max_concurrent_runs")} AS p_limit,
                   v.{qn("max_concurrent_runs")} AS t_limit
            FROM q
            JOIN {qn(Run._meta.db_table)} r ON r.{qn("id")} = q.run_id
            JOIN {qn(Attempt._meta.db_table)} a
              ON a.{qn("id")} = q.attempt_id AND a.{qn("run_id")} = r.{qn("id")}
            JOIN {qn(Project._meta.db_table)} p ON p.{qn("id")} = r.{qn("project_id")}
            JOIN {qn(TaskRevision._meta.db_table)} v ON v.{qn("id")} = r.{qn("task_revision_id")}
            ORDER BY r.{qn("id")}, a.{qn("id")}
            {run_lock}
        ),
        {_sessions_cte(sessions_where)},
        {session_counts_cte("sc", "ARRAY(SELECT sw.id FROM sw)")}
        SELECT (SELECT json_agg(ra) FROM ra), {_sessions_select()},
               clock_timestamp(), {_ASYNC_COMMIT}, {_GENERIC_PLANS}
    """  # noqa: S608  (names from model metadata; values are parameters)
    _CLAIM_BATCH_SQL[(connection.vendor, skip)] = sql
    return sql


def lock_claim_batch(keys: Sequence[BatchKey], *, skip_locked: bool) -> ClaimBatchRows:
    """1, 2 and 4 of the order for a page of claims, in one statement (PostgreSQL).

    Every requested Run and Attempt, sorted by Run id (`SKIP LOCKED` in global
    scope: a pair another transaction holds is left out, as a lost race),
    then — only when no locked Run's Project or pinned revision has a
    concurrency limit — the Sessions the locked pairs name, sorted by id,
    with their active leases and the requests whose pull id already has
    another token. With a limit, `lock_claim_batch_limits` locks Projects,
    Tasks and Sessions next. No state is checked here; the claim decides.
    """
    assert connection.vendor == "postgresql", "a batch of claims is one statement on PostgreSQL"
    sql = _claim_batch_sql(skip=_skip(skip_locked))
    with prepared_cursor() as cursor:  # once per page: prepared once per connection
        cursor.execute(sql, int8_params([*_batch_keys_params(keys), _async_commit()]))
        row = cursor.fetchone()
    assert row is not None
    pairs, session_rows, conflicts, now, _, _ = row
    rows = {int(values["idx"]): _batch_row(values) for values in pairs or ()}
    limits: BatchLimits | None = None
    if not any(r.project_limit or r.task_limit for r in rows.values()):
        sessions, pull_conflicts = _load_sessions(session_rows, conflicts)
        limits = BatchLimits(sessions, pull_conflicts, {}, {})
    return ClaimBatchRows(rows=rows, limits=limits, now=now if rows else None)


def _batch_row(values: dict[str, Any]) -> BatchRow:
    """A locked pair from its JSON object (`ra`); never saved."""
    run = _read(Run, {name: values[f"r_{name}"] for name in _BATCH_RUN})
    attempt = _read(Attempt, {name: values[f"a_{name}"] for name in _BATCH_ATTEMPT})
    return BatchRow(
        run=run,
        attempt=attempt,
        project_limit=int(values["p_limit"]),
        task_limit=int(values["t_limit"]),
    )


_LIMITS_SQL: dict[str, str] = {}


def lock_claim_batch_limits(
    keys: Sequence[BatchKey], rows: dict[int, BatchRow], *, now: datetime
) -> BatchLimits:
    """3, 3b and 4 of the order for a page of claims with limits, in one statement.

    The Projects with a `max_concurrent_runs` quota, then the Tasks whose
    pinned revision has a limit, then the Sessions the locked pairs name —
    each kind sorted by id, each read after the one before is locked — and
    the counts the quotas and slots are decided on (live leases at `now` per
    Project and per Task, active leases per Session), the requests whose
    pull id already has another token and the database clock once all of it
    is held (`BatchLimits.now`).
    """
    sql = _LIMITS_SQL.get(connection.vendor)
    if sql is None:
        qn = connection.ops.quote_name
        sql = f"""
            WITH q AS ({_batch_keys_sql()}),
            pl AS MATERIALIZED (
                SELECT p.{qn("id")} FROM {qn(Project._meta.db_table)} p
                WHERE p.{qn("id")} = ANY(%s::bigint[]) ORDER BY p.{qn("id")}
                FOR NO KEY UPDATE OF p
            ),
            tl AS MATERIALIZED (
                SELECT t.{qn("id")} FROM {qn(Task._meta.db_table)} t
                WHERE t.{qn("id")} = ANY(%s::bigint[]) AND (SELECT count(*) FROM pl) >= 0
                ORDER BY t.{qn("id")} FOR NO KEY UPDATE OF t
            ),
            {_sessions_cte("s.session_id = ANY(%s::uuid[]) AND (SELECT count(*) FROM tl) >= 0")},
            {session_counts_cte("sc", "ARRAY(SELECT sw.id FROM sw)")}
            SELECT
                (SELECT json_agg(
                    json_build_array(pl.id, {claim_count_sql("project", "pl.id", "%s")})) FROM pl),
                (SELECT json_agg(json_build_array(tl.id, {claim_count_sql("task", "tl.id", "%s")}))
                 FROM tl),
                {_sessions_select()},
                clock_timestamp()
        """  # noqa: S608  (names from model metadata; values are parameters)
        _LIMITS_SQL[connection.vendor] = sql
    locked = [key for key in keys if key.index in rows]
    project_ids = sorted({r.run.project_id for r in rows.values() if r.project_limit})
    task_ids = sorted({r.run.task_id for r in rows.values() if r.task_limit})
    session_keys = sorted({k.session_key for k in locked if k.session_key is not None})
    params = [*_batch_keys_params(keys), project_ids, task_ids, session_keys, now, now]
    with prepared_cursor() as cursor:
        cursor.execute(sql, int8_params(params))
        row = cursor.fetchone()
    assert row is not None
    projects, tasks, session_rows, conflicts, locked_at = row
    sessions, pull_conflicts = _load_sessions(session_rows, conflicts)
    return BatchLimits(
        sessions=sessions,
        pull_conflicts=pull_conflicts,
        project_busy={int(pk): int(n) for pk, n in projects or ()},
        task_live={int(pk): int(n) for pk, n in tasks or ()},
        now=locked_at,
    )
