"""Use cases of the catalogue: Projects, Tasks and their revisions, enqueueing Runs.

Every later change of a Run or an Attempt (claim, ACK, retry, cancel, expiry)
belongs to the lease authority, `leases` (docs/adr/0004); this module only
creates them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, NamedTuple

from django.db import DEFAULT_DB_ALIAS, connection, connections, transaction
from django.db.models import Max
from django.utils import timezone

from dispatch.core.errors import SpecError
from dispatch.core.spec import TaskDefinition, build_spec, validate_task_definition
from qinglong.clock import db_now
from qinglong.prepared import prepared_cursor
from qinglong.rows import ModelColumns
from runs.models import Attempt, Project, Run, Task, TaskRevision

# ------------------------------------------------------------- projects & tasks


class DefinitionError(ValueError):
    """A Task definition failed validation; nothing was saved."""

    def __init__(self, error: SpecError) -> None:
        super().__init__(str(error))
        self.field = error.field
        self.message = error.message


def _validated(definition: Mapping[str, object]) -> TaskDefinition:
    try:
        return validate_task_definition(definition)
    except SpecError as err:
        raise DefinitionError(err) from None


@transaction.atomic
def project_create(*, slug: str, name: str, max_concurrent_runs: int = 0) -> Project:
    project = Project(slug=slug, name=name, max_concurrent_runs=max_concurrent_runs)
    project.full_clean()
    project.save()
    return project


def _revision_create(*, task: Task, number: int, definition: TaskDefinition) -> TaskRevision:
    return TaskRevision.objects.create(
        task=task,
        revision=number,
        executor_type=definition.executor_type,
        command=list(definition.command),
        cwd=definition.cwd,
        env=dict(definition.env),
        timeout_s=definition.timeout_s,
        resources=dict(definition.resources),
        placement=definition.placement.to_wire(),
        max_attempts=definition.max_attempts,
        max_concurrent_runs=definition.policy.max_concurrent_runs,
        retry_on=definition.policy.retry_on.value,
        retry_backoff_s=definition.policy.retry_backoff_s,
        retry_backoff_max_s=definition.policy.retry_backoff_max_s,
    )


@transaction.atomic
def task_create(*, project: Project, name: str, definition: Mapping[str, object]) -> Task:
    """Create a Task with revision 1. Validation happens before any write."""
    validated = _validated(definition)
    task = Task(project=project, name=name)
    task.full_clean(exclude=["current_revision"])
    task.save()
    revision = _revision_create(task=task, number=1, definition=validated)
    task.current_revision = revision
    task.save(update_fields=["current_revision", "updated_at"])
    return task


@transaction.atomic
def task_update(*, task: Task, definition: Mapping[str, object]) -> TaskRevision:
    """Edit a Task: a new immutable revision n+1 becomes current; Runs keep theirs."""
    validated = _validated(definition)
    # Lock the Task so two concurrent edits cannot both take revision n+1.
    locked = Task.objects.select_for_update().get(pk=task.pk)
    last = locked.revisions.aggregate(n=Max("revision"))["n"] or 0
    revision = _revision_create(task=locked, number=last + 1, definition=validated)
    locked.current_revision = revision
    locked.save(update_fields=["current_revision", "updated_at"])
    task.current_revision = revision
    return revision


def revision_definition(revision: TaskRevision) -> TaskDefinition:
    """Re-validate a stored revision with the one shared validator."""
    return validate_task_definition(
        {
            "executor_type": revision.executor_type,
            "command": revision.command,
            "cwd": revision.cwd,
            "env": revision.env,
            "timeout_s": revision.timeout_s,
            "resources": revision.resources,
            "placement": revision.placement,
            "max_attempts": revision.max_attempts,
            "max_concurrent_runs": revision.max_concurrent_runs,
            "retry_on": revision.retry_on,
            "retry_backoff_s": revision.retry_backoff_s,
            "retry_backoff_max_s": revision.retry_backoff_max_s,
        }
    )


def attempt_spec(*, attempt: Attempt, run: Run, revision: TaskRevision) -> dict[str, object]:
    """The ExecutionSpec of an Attempt, materialized from its Run's pinned revision."""
    return build_spec(
        run_id=str(run.pk),
        attempt_id=str(attempt.pk),
        project_id=str(run.project_id),
        task_id=str(run.task_id),
        task_revision=revision.revision,
        definition=revision_definition(revision),
    )


# ------------------------------------------------------------------------ runs


def run_enqueue(
    *,
    task: Task,
    priority: int = 0,
    queued_at: datetime | None = None,
    schedule_id: int | None = None,
) -> Run:
    """Enqueue a Run pinned to the Task's current revision, with Attempt #1 pending.

    `schedule_id`: the Schedule that fired it (its overlap policy looks for it).
    """
    run, _ = run_enqueue_one(
        task=task, priority=priority, queued_at=queued_at, schedule_id=schedule_id
    )
    return run


def run_enqueue_one(
    *,
    task: Task,
    priority: int = 0,
    queued_at: datetime | None = None,
    schedule_id: int | None = None,
) -> tuple[Run, Attempt]:
    """`run_enqueue`, answering the Run and its Attempt #1 as written.

    On PostgreSQL both rows are one statement (issue #12): the Run's insert
    and the Attempt's, which reads the Run's id and queue time from it, with
    the database clock as `queued_at` when none is given — atomic on its own,
    so outside a transaction it costs one round trip instead of five
    (BEGIN, the clock, two inserts, COMMIT). Elsewhere, one transaction of
    the ORM's inserts.
    """
    if task.current_revision_id is None:
        raise DefinitionError(SpecError("task", "has no revision"))
    if isinstance(priority, bool) or not isinstance(priority, int) or not -1000 <= priority <= 1000:
        raise DefinitionError(SpecError("priority", "must be an integer from -1000 to 1000"))
    if connection.vendor == "postgresql":
        given = {
            "project_id": task.project_id,
            "task_id": task.pk,
            "task_revision_id": task.current_revision_id,
            "priority": priority,
            "schedule_id": schedule_id,
            "queued_at": queued_at,  # None: the database clock
        }
        if connection.in_atomic_block:
            # A savepoint, as `transaction.atomic` gives a nested call: a failed
            # insert leaves the caller's transaction usable.
            with transaction.atomic():
                return _insert_run_and_attempt(task, given)
        return _insert_run_and_attempt(task, given)
    run = Run(
        project_id=task.project_id,
        task=task,
        task_revision_id=task.current_revision_id,
        priority=priority,
        schedule_id=schedule_id,
    )
    attempt = Attempt(number=1, priority=priority)
    with transaction.atomic():
        run.queued_at = queued_at or db_now()
        run.save(force_insert=True)
        attempt.run = run
        attempt.queued_at = run.queued_at
        attempt.save(force_insert=True)
    return run, attempt


_ENQUEUE_SQL: dict[str, tuple[str, tuple[Any, ...], tuple[Any, ...]]] = {}


def _enqueue_sql() -> tuple[str, tuple[Any, ...], tuple[Any, ...]]:
    """The one-statement enqueue and the Run and Attempt fields it takes values for."""
    found = _ENQUEUE_SQL.get(connection.vendor)
    if found is not None:
        return found
    qn = connection.ops.quote_name
    run_fields = tuple(f for f in Run._meta.concrete_fields if not f.primary_key)
    attempt_fields = tuple(f for f in Attempt._meta.concrete_fields if not f.primary_key)
    from_run = {"run": f"r.{qn('id')}", "queued_at": f"r.{qn('queued_at')}"}
    # Every parameter cast to its column's type: the statement is prepared
    # (qinglong.prepared), and PostgreSQL cannot infer one in a SELECT list.
    run_values = ", ".join(
        f"COALESCE({_param(f)}, statement_timestamp())" if f.name == "queued_at" else _param(f)
        for f in run_fields
    )
    attempt_values = ", ".join(from_run.get(f.name) or _param(f) for f in attempt_fields)
    sql = f"""
        WITH r AS (
            INSERT INTO {qn(Run._meta.db_table)} ({", ".join(qn(f.column) for f in run_fields)})
            VALUES ({run_values})
            RETURNING {_RUN_ROW.select()}
        ), a AS (
            INSERT INTO {qn(Attempt._meta.db_table)}
                ({", ".join(qn(f.column) for f in attempt_fields)})
            SELECT {attempt_values} FROM r
            RETURNING {_ATTEMPT_ROW.select()}
        )
        SELECT r.*, a.* FROM r, a
    """  # noqa: S608  (names from model metadata; values are parameters)
    taken = tuple(f for f in attempt_fields if f.name not in from_run)
    found = _ENQUEUE_SQL[connection.vendor] = (sql, run_fields, taken)
    return found


def _param(field: Any) -> str:
    """A placeholder cast to the field's column type — `varchar` without its
    length, which an explicit cast would silently truncate to (the column
    itself still refuses a value too long)."""
    db_type = str(field.db_type(connection))
    return f"%s::{'varchar' if db_type.startswith('varchar(') else db_type}"


# RETURNING lists without a table alias: an INSERT's RETURNING names its own columns.
_RUN_ROW = ModelColumns(Run, "")
_ATTEMPT_ROW = ModelColumns(Attempt, "")


def _insert_run_and_attempt(task: Task, given: dict[str, Any]) -> tuple[Run, Attempt]:
    sql, run_fields, attempt_fields = _enqueue_sql()
    db = connections[DEFAULT_DB_ALIAS]  # not the proxy: one lookup instead of one per field
    params = _insert_values(run_fields, given, db)
    params += _insert_values(attempt_fields, {"number": 1, "priority": given["priority"]}, db)
    with prepared_cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    assert row is not None
    width = len(_RUN_ROW)
    written = _RUN_ROW.load(row[:width])
    first = _ATTEMPT_ROW.load(row[width:])
    written.task = task  # the Task (and what it has read in) the caller passed
    first.run = written
    return written, first


_GIVEN, _NOW, _CONSTANT, _CALLED = range(4)
_PLANS: dict[tuple[str, tuple[Any, ...], frozenset[str]], list[tuple[int, Any, Any]]] = {}


def _insert_values(fields: tuple[Any, ...], given: dict[str, Any], db: Any) -> list[Any]:
    """Each field's value for an INSERT, as `Model.save()` writes a new instance
    made with `given` (by attname): the given value, else `auto_now(_add)`'s
    clock, else the field's default — prepared for the database. How each field
    gets its value is worked out once (a constant default prepared once), so an
    enqueue builds no model instance to take its defaults from (issue #12)."""
    key = (db.vendor, fields, frozenset(given))
    plan = _PLANS.get(key)
    if plan is None:
        plan = []
        for f in fields:
            if f.attname in given:
                plan.append((_GIVEN, f, None))
            elif getattr(f, "auto_now", False) or getattr(f, "auto_now_add", False):
                plan.append((_NOW, f, None))
            elif f.has_default() and callable(f.default):
                plan.append((_CALLED, f, None))
            else:
                plan.append((_CONSTANT, f, f.get_db_prep_save(f.get_default(), db)))
        _PLANS[key] = plan
    now = None
    values = []
    for kind, f, constant in plan:
        if kind == _CONSTANT:
            values.append(constant)
        elif kind == _GIVEN:
            values.append(f.get_db_prep_save(given[f.attname], db))
        elif kind == _NOW:
            now = now or timezone.now()
            values.append(f.get_db_prep_save(now, db))
        else:
            values.append(f.get_db_prep_save(f.get_default(), db))
    return values


# A bulk enqueue is one transaction of at most this many Runs (POST /api/v1/runs
# with a list): big enough to amortize a request, small enough to bound its work.
MAX_BULK_RUNS = 1000


class BulkItemError(ValueError):
    """Item `index` of a bulk enqueue is refused; nothing was enqueued.

    `code` names the rule it breaks (`no_revision`, `out_of_range`), never its value.
    """

    def __init__(self, index: int, field: str, code: str) -> None:
        super().__init__(f"[{index}].{field}: {code}")
        self.index = index
        self.field = field
        self.code = code


class EnqueuedRun(NamedTuple):
    """A Run as a bulk enqueue wrote it: what its answer shows (issue #12)."""

    id: int
    task_id: int
    state: str
    priority: int
    cancel_requested: bool
    queued_at: datetime
    created_at: datetime
    finished_at: datetime | None


def run_enqueue_bulk(*, items: Sequence[tuple[Task, int]]) -> list[Run]:
    """Enqueue one Run per (Task, priority), all or nothing, in the order given.

    The same rules as `run_enqueue` for each item; the first item that breaks
    one raises `BulkItemError` naming it, before anything is written. Every
    Run of the request is queued at the same instant (one clock reading), so
    they keep the request's order within a priority. On PostgreSQL one
    statement writes the Runs and their Attempts (`run_enqueue_bulk_rows`).
    """
    rows = _enqueue_bulk(items)
    if connection.vendor != "postgresql":
        return rows  # the ORM's Runs
    tasks = {task.pk: task for task, _ in items}
    runs = []
    for row in rows:
        run = _RUN_ROW.load(row)
        run.task = tasks[run.task_id]
        runs.append(run)
    return runs


def run_enqueue_bulk_rows(*, items: Sequence[tuple[Task, int]]) -> list[EnqueuedRun]:
    """`run_enqueue_bulk` answering what a Run's summary shows, without a model
    instance per Run (the operator API's list form; issue #12)."""
    rows = _enqueue_bulk(items)
    if connection.vendor != "postgresql":
        return [
            EnqueuedRun(
                run.pk,
                run.task_id,
                run.state,
                run.priority,
                run.cancel_requested,
                run.queued_at,
                run.created_at,
                run.finished_at,
            )
            for run in rows
        ]
    at = _SUMMARY_AT
    return [EnqueuedRun(*(row[i] for i in at)) for row in rows]


def _enqueue_bulk(items: Sequence[tuple[Task, int]]) -> list[Any]:
    """Check every item, then write: rows of `_RUN_ROW` on PostgreSQL, else Runs."""
    if not 1 <= len(items) <= MAX_BULK_RUNS:
        raise BulkItemError(0, "body", "out_of_range")
    revisions: list[int] = []
    for index, (task, priority) in enumerate(items):
        if task.current_revision_id is None:
            raise BulkItemError(index, "task", "no_revision")
        revisions.append(task.current_revision_id)
        if (
            isinstance(priority, bool)
            or not isinstance(priority, int)
            or not -1000 <= priority <= 1000
        ):
            raise BulkItemError(index, "priority", "out_of_range")
    if connection.vendor == "postgresql":
        if connection.in_atomic_block:
            with transaction.atomic():  # a savepoint, as for run_enqueue_one
                return _insert_bulk(items, revisions)
        return _insert_bulk(items, revisions)
    with transaction.atomic():
        now = db_now()
        runs = Run.objects.bulk_create(
            Run(
                project_id=task.project_id,
                task=task,
                task_revision_id=revision_id,
                priority=priority,
                queued_at=now,
            )
            for (task, priority), revision_id in zip(items, revisions, strict=True)
        )
        Attempt.objects.bulk_create(
            Attempt(run=run, number=1, priority=run.priority, queued_at=now) for run in runs
        )
    return runs


# The Run columns a bulk enqueue takes from each item (one array each).
_BULK_VARYING = ("project", "task", "task_revision", "priority")
_BULK_SQL: dict[str, tuple[str, tuple[Any, ...], tuple[Any, ...]]] = {}
# Where EnqueuedRun's fields are in a row of _RUN_ROW.
_SUMMARY_AT = tuple(
    next(i for i, f in enumerate(_RUN_ROW.fields) if f.attname == name)
    for name in EnqueuedRun._fields
)


def _bulk_sql() -> tuple[str, tuple[Any, ...], tuple[Any, ...]]:
    """One statement for a bulk enqueue on PostgreSQL, written once: the Runs
    from one array per varying column (`unnest … WITH ORDINALITY`, inserted in
    the request's order, so their ids follow it), queued at the statement's
    clock; Attempt #1 of each from the Runs' RETURNING; the Runs answered in
    id order. Atomic on its own; prepared once per connection (its text does
    not depend on the number of items). Also the Run and Attempt fields whose value
    is the same for every item (given as parameters)."""
    found = _BULK_SQL.get(connection.vendor)
    if found is not None:
        return found
    qn = connection.ops.quote_name
    run_fields = tuple(f for f in Run._meta.concrete_fields if not f.primary_key)
    attempt_fields = tuple(f for f in Attempt._meta.concrete_fields if not f.primary_key)
    varying = [next(f for f in run_fields if f.name == name) for name in _BULK_VARYING]
    run_values = []
    for f in run_fields:
        if f.name in _BULK_VARYING:
            run_values.append(f"i.{qn(f.column)}")
        elif f.name == "queued_at":
            run_values.append("statement_timestamp()")
        else:
            run_values.append(_param(f))
    from_run = {"run": f"r.{qn('id')}", "queued_at": f"r.{qn('queued_at')}"}
    from_run["priority"] = f"r.{qn('priority')}"
    attempt_values = [from_run.get(f.name) or _param(f) for f in attempt_fields]
    arrays = ", ".join(f"%s::{f.db_type(connection)}[]" for f in varying)
    names = ", ".join(qn(f.column) for f in varying)
    sql = f"""
        WITH r AS (
            INSERT INTO {qn(Run._meta.db_table)} ({", ".join(qn(f.column) for f in run_fields)})
            SELECT {", ".join(run_values)}
            FROM unnest({arrays}) WITH ORDINALITY AS i({names}, n)
            ORDER BY i.n
            RETURNING {_RUN_ROW.select()}
        ), a AS (
            INSERT INTO {qn(Attempt._meta.db_table)}
                ({", ".join(qn(f.column) for f in attempt_fields)})
            SELECT {", ".join(attempt_values)} FROM r
        )
        SELECT * FROM r ORDER BY {qn("id")}
    """  # noqa: S608  (names from model metadata; values are parameters)
    run_constant = tuple(
        f for f in run_fields if f.name not in _BULK_VARYING and f.name != "queued_at"
    )
    attempt_constant = tuple(f for f in attempt_fields if f.name not in from_run)
    found = _BULK_SQL[connection.vendor] = (sql, run_constant, attempt_constant)
    return found


def _insert_bulk(items: Sequence[tuple[Task, int]], revisions: list[int]) -> list[Any]:
    sql, run_constant, attempt_constant = _bulk_sql()
    db = connections[DEFAULT_DB_ALIAS]
    # The columns every item shares (defaults, auto_now_add); its own are arrays.
    params: list[Any] = _insert_values(run_constant, {}, db)
    params += [
        [task.project_id for task, _ in items],
        [task.pk for task, _ in items],
        revisions,
        [priority for _, priority in items],
    ]
    params += _insert_values(attempt_constant, {"number": 1}, db)
    with prepared_cursor() as cursor:
        cursor.execute(sql, params)
        rows: list[Any] = cursor.fetchall()
    return rows


def run_attempts(run: Run) -> Iterable[Attempt]:
    return run.attempts.order_by("number")
