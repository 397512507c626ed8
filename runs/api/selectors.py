"""Reads of the operator API: Projects, Runs with Attempts and redacted lease facts.

Each function returns plain JSON-able dicts built field by field from an allow
list, so a new model field (or the pinned spec) can never leak by accident.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from django.db import connection

from dispatch.adapters.waiting import enqueued_answers, placement_unmatched, run_waiting
from dispatch.core.ports import to_rfc3339
from leases.models import RunLease
from qinglong.prepared import prepared_cursor
from qinglong.rows import ModelColumns
from runs.models import Attempt, Project, Run, RunState, Task, TaskRevision
from runs.services import EnqueuedRun

MAX_PAGE = 100
TOKEN_DIGEST_PREFIX_CHARS = 8


def _time(value: datetime | None) -> str | None:
    return None if value is None else to_rfc3339(value)


def project_json(project: Project) -> dict[str, Any]:
    return {
        "id": str(project.pk),
        "slug": project.slug,
        "name": project.name,
        "max_concurrent_runs": project.max_concurrent_runs,
        "created_at": _time(project.created_at),
    }


def project_page(*, cursor: str | None, limit: int) -> tuple[list[dict[str, Any]], str | None]:
    """Keyset page by slug (unique): stable under concurrent inserts."""
    qs = Project.objects.order_by("slug")
    if cursor is not None:
        qs = qs.filter(slug__gt=cursor)
    rows = list(qs[: limit + 1])
    more = len(rows) > limit
    rows = rows[:limit]
    return [project_json(p) for p in rows], (rows[-1].slug if more and rows else None)


def _run_summary(run: Run) -> dict[str, Any]:
    return {
        "id": str(run.pk),
        "project": run.project.slug,
        "task": run.task.name,
        "task_revision": run.task_revision.revision,
        "state": run.state,
        "priority": run.priority,
        "cancel_requested": run.cancel_requested,
        "queued_at": _time(run.queued_at),
        "created_at": _time(run.created_at),
        "finished_at": _time(run.finished_at),
    }


def run_summary(run: Run) -> dict[str, Any]:
    """A Run as the list shows it; its Project, Task and revision already read in."""
    return _run_summary(run)


def _lease_json(lease: RunLease) -> dict[str, Any]:
    return {
        "lease_id": str(lease.pk),
        "state": lease.state,
        "generation": lease.lease_generation,
        "source": lease.source,
        "worker_id": str(lease.worker_id),
        "session_generation": lease.session_generation,
        "claimed_at": _time(lease.claimed_at),
        "expires_at": _time(lease.expires_at),
        "ended_at": _time(lease.ended_at),
        "end_reason": lease.end_reason,
        "delivery_count": lease.delivery_count,
        "token_digest_prefix": lease.token_digest[:TOKEN_DIGEST_PREFIX_CHARS],
        # docs/adr/0005: a restarted Worker confirmed this execution gone.
        "execution_confirmed_at": _time(lease.execution_confirmed_at),
        "execution_outcome": lease.execution_outcome,
        "execution_exit_code": lease.execution_exit_code,
        "execution_confirmed_by": lease.execution_confirmed_by,
    }


def _attempt_json(attempt: Attempt, leases: list[RunLease]) -> dict[str, Any]:
    return {
        "id": str(attempt.pk),
        "number": attempt.number,
        "state": attempt.state,
        "lease_generation": attempt.lease_generation,
        "executor_handle": attempt.executor_handle,
        "exit_code": attempt.exit_code,
        "error_code": attempt.error_code,
        "not_before": _time(attempt.not_before),
        "not_before_reason": attempt.not_before_reason,
        "created_at": _time(attempt.created_at),
        "started_at": _time(attempt.started_at),
        "finished_at": _time(attempt.finished_at),
        "leases": [_lease_json(lease) for lease in leases],
    }


def _runs() -> Any:
    # select_related only the identity columns: never the revision's definition.
    return Run.objects.select_related("project", "task", "task_revision").only(
        "id",
        "state",
        "priority",
        "cancel_requested",
        "queued_at",
        "created_at",
        "finished_at",
        "project__slug",
        "task__name",
        "task_revision__revision",
    )


def run_detail(run_id: int) -> dict[str, Any] | None:
    run = _runs().filter(pk=run_id).first()
    if run is None:
        return None
    leases: dict[int, list[RunLease]] = defaultdict(list)
    for lease in RunLease.objects.filter(run_id=run.pk).order_by("lease_generation", "id"):
        leases[lease.attempt_id].append(lease)
    attempts = Attempt.objects.filter(run_id=run.pk).order_by("number")
    return {
        **_run_summary(run),
        "attempts": [_attempt_json(a, leases[a.pk]) for a in attempts],
        # docs/adr/0012: why it still waits, asked now (bounded; never the spec).
        "waiting": run_waiting(run.pk) if run.state == RunState.QUEUED else None,
    }


_TASK = ModelColumns(Task, "t")
_PROJECT = ModelColumns(Project, "p")
# Only what the enqueue's answer reads of the revision (its number, and what
# why-waiting and unplaceable_now ask): never the command, cwd or env.
_REVISION = ModelColumns(
    TaskRevision,
    "v",
    only=("task", "revision", "executor_type", "placement", "max_concurrent_runs"),
)
_TASK_SQL: dict[str, str] = {}


def task_by_name(project_slug: str, name: str) -> Task | None:
    """The Task `name` of Project `project_slug`, its Project and current revision read in.

    The enqueue's lookup, once per request (issue #12): SQL written once per
    database and prepared once per connection (`qinglong.prepared`), loaded as
    a queryset would (`qinglong.rows`).
    """
    sql = _TASK_SQL.get(connection.vendor)
    if sql is None:
        qn = connection.ops.quote_name
        sql = _TASK_SQL[connection.vendor] = (
            f"SELECT {_TASK.select()}, {_PROJECT.select()}, {_REVISION.select()} "  # noqa: S608  (names from model metadata; values are parameters)
            f"FROM {qn(Task._meta.db_table)} t "
            f"JOIN {qn(Project._meta.db_table)} p ON p.{qn('id')} = t.{qn('project_id')} "
            f"LEFT JOIN {qn(TaskRevision._meta.db_table)} v "
            f"ON v.{qn('id')} = t.{qn('current_revision_id')} "
            f"WHERE p.{qn('slug')} = %s AND t.{qn('name')} = %s"
        )
    with prepared_cursor() as cursor:
        cursor.execute(sql, [project_slug, name])
        row = cursor.fetchone()
    if row is None:
        return None
    task_end = len(_TASK)
    project_end = task_end + len(_PROJECT)
    task = _TASK.load(row[:task_end])
    task.project = _PROJECT.load(row[task_end:project_end])
    if row[project_end] is not None:  # the revision's id: NULL when the Task has none
        task.current_revision = _REVISION.load(row[project_end:])
    return task


def enqueued_detail(run: Run, attempt: Attempt) -> dict[str, Any]:
    """A Run just enqueued, exactly as `run_detail` answers it, and its
    `unplaceable_json`, from the rows in hand.

    Its one Attempt is pending and holds no lease yet; its Project, Task and
    revision are read in. Only `waiting` and the placement are asked, without
    reading the Run or its Attempt again (they depend on the rest of the
    system), in as few statements as `enqueued_answers` can.
    """
    if run.state == RunState.QUEUED:
        waiting, reason = enqueued_answers(run)
    else:  # pragma: no cover - a Run is enqueued queued
        waiting, reason = None, placement_unmatched(run.task_revision)
    return {
        **_run_summary(run),
        "attempts": [_attempt_json(attempt, [])],
        "waiting": waiting,
        "unplaceable_now": reason is not None,
        "unplaceable_reason": reason,
    }


def enqueued_summaries(runs: Sequence[EnqueuedRun], tasks: Mapping[int, Task]) -> list[Any]:
    """The answer of a bulk enqueue (issue #12): per Run, `run_summary` and
    `unplaceable_json`, exactly as they would say it, from the rows just
    written and their Tasks (each with its Project and current revision read
    in) — no model instance per Run, the placement asked once per placement."""
    per_task: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
    seen: dict[Any, Any] = {}
    for task_id, task in tasks.items():
        revision = task.current_revision
        assert revision is not None
        head = {"project": task.project.slug, "task": task.name, "task_revision": revision.revision}
        per_task[task_id] = head, unplaceable_json(revision, seen)
    times: dict[datetime, str] = {}  # a bulk's Runs share their instants

    def moment(value: datetime | None) -> str | None:
        if value is None:
            return None
        found = times.get(value)
        if found is None:
            found = times[value] = to_rfc3339(value)
        return found

    results = []
    for run in runs:
        head, tail = per_task[run.task_id]
        results.append(
            {
                "id": str(run.id),
                **head,
                "state": run.state,
                "priority": run.priority,
                "cancel_requested": run.cancel_requested,
                "queued_at": moment(run.queued_at),
                "created_at": moment(run.created_at),
                "finished_at": moment(run.finished_at),
                **tail,
            }
        )
    return results


def unplaceable_json(revision: TaskRevision, seen: dict[Any, Any] | None = None) -> dict[str, Any]:
    """`unplaceable_now` and its reason for a Run just enqueued on `revision`
    (asked once per executor type and placement when `seen` is shared across a
    bulk enqueue: the answer depends on nothing else of the revision)."""
    key = (revision.executor_type, json.dumps(revision.placement, sort_keys=True))
    if seen is not None and key in seen:
        reason = seen[key]
    else:
        reason = placement_unmatched(revision)
        if seen is not None:
            seen[key] = reason
    return {"unplaceable_now": reason is not None, "unplaceable_reason": reason}


def run_page(
    *, state: RunState | None, cursor: int | None, limit: int
) -> tuple[list[dict[str, Any]], str | None]:
    """Keyset page, newest first (index run_state_id serves the state filter)."""
    qs = _runs().order_by("-id")
    if state is not None:
        qs = qs.filter(state=state)
    if cursor is not None:
        qs = qs.filter(id__lt=cursor)
    rows = list(qs[: limit + 1])
    more = len(rows) > limit
    rows = rows[:limit]
    return [_run_summary(r) for r in rows], (str(rows[-1].pk) if more and rows else None)
