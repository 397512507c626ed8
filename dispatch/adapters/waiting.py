"""Why a queued Run waits, and whether a Task can be placed at all (issue 11).

Both are asked for one Run or one revision, on demand (the operator API's
Run, the admin's Run page, an enqueue's answer), and are bounded: a fixed
number of statements, each reading at most `_CAP` Sessions or Workers, never
the queue. They apply the rules the candidate read applies
(`dispatch.adapters.queue`, docs/adr/0012) and say which one holds the Run
back, in operator words — never anything of the Task's command, cwd or env.

`run_waiting` answers for a queued Run, in this order (the first that holds):
dispatch paused, a `not_before` wait (lost-execution grace, redelivery or
retry backoff) until an instant, its Project at its limit (n of m), its Task
at its limit, no online Worker with its executor type and labels (naming
the missing ones), every matching Worker full, else eligible (its turn comes).

`placement_unmatched` answers at enqueue: no enrolled Worker (not disabled)
has the executor type and the required labels — the Run is accepted anyway,
Workers come and go.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final

from django.db import connection

from dispatch.core.errors import PlacementError
from dispatch.core.placement import normalize_placement, validate_placement
from dispatch.core.ports import to_rfc3339
from dispatch.models import DispatchControl
from leases.models import LeaseState, RunLease
from leases.quota import project_live_lease_count, task_live_lease_count
from qinglong.clock import db_now
from qinglong.prepared import prepared_cursor
from runs.models import Attempt, AttemptState, Run, RunState, TaskRevision
from workers.models import SessionState, Worker, WorkerAdminState, WorkerSession

__all__ = [
    "WAIT_REASONS",
    "enqueued_answers",
    "enqueued_waiting",
    "placement_unmatched",
    "run_waiting",
]

# The most Sessions or Workers one answer counts ("1000 or more" past it).
_CAP: Final = 1000
WAIT_REASONS: Final = (
    "dispatch_paused",
    "backoff",
    "project_limit",
    "task_limit",
    "no_matching_worker",
    "workers_full",
    "eligible",
)
_BACKOFF_WORDS: Final = {
    "lost_execution_grace": "its previous execution may still be running (lost-execution grace)",
    "redelivery_backoff": "its offer was delivered too often without a start (redelivery backoff)",
    "retry_backoff": "the Task's retry policy spaces its retries (retry backoff)",
}


def _t(model: Any) -> str:
    return str(connection.ops.quote_name(model._meta.db_table))


def _required(revision: TaskRevision) -> tuple[str, dict[str, str]] | None:
    """The revision's executor type and required labels (None: not a valid placement)."""
    try:
        placement = normalize_placement(
            validate_placement(revision.placement), revision.executor_type
        )
    except PlacementError:
        return None
    assert placement.executor_type is not None
    return placement.executor_type, dict(placement.required_labels)


# ------------------------------------------------------------ SQL matching


def _has_executor(alias: str, executor_type: str) -> tuple[str, list[Any]]:
    if connection.vendor == "postgresql":
        return f"{alias}.executor_types @> %s::jsonb", [json.dumps([executor_type])]
    return (
        f"EXISTS (SELECT 1 FROM json_each({alias}.executor_types) e WHERE e.value = %s)",  # noqa: S608  (an alias; the value is a parameter)
        [executor_type],
    )


def _has_label(alias: str, key: str, value: str) -> tuple[str, list[Any]]:
    if connection.vendor == "postgresql":
        return f"{alias}.labels @> %s::jsonb", [json.dumps({key: value})]
    # The path is a parameter too; label keys never hold a double quote.
    return f"json_extract({alias}.labels, %s) = %s", [f'$."{key}"', value]


def _matches(alias: str, executor_type: str, labels: Mapping[str, str]) -> tuple[str, list[Any]]:
    parts = [_has_executor(alias, executor_type)]
    parts += [_has_label(alias, key, value) for key, value in labels.items()]
    return " AND ".join(sql for sql, _ in parts), [p for _, params in parts for p in params]


def _placement_report(
    source: str,
    executor_type: str,
    labels: Mapping[str, str],
    *,
    free: str | None = None,
) -> tuple[int, int, bool, dict[str, str]]:
    """Over the rows of `source` (a FROM … WHERE … clause, alias `s`): how many
    match (capped), how many of those have a free slot (`free`, a condition;
    None: not asked), whether any has the executor type, and the required
    labels no row has at all."""
    columns, params = _report_columns(source, executor_type, labels, free=free)
    # Prepared once per connection (qinglong.prepared): its text depends only on
    # the question's shape (how many labels), and planning its subqueries cost
    # PostgreSQL more than running them (issue #12).
    with prepared_cursor() as cursor:
        cursor.execute("SELECT " + ", ".join(columns), params)
        row = cursor.fetchone()
    assert row is not None
    return _report_values(list(row), labels, free=free)


def _report_columns(
    source: str, executor_type: str, labels: Mapping[str, str], *, free: str | None
) -> tuple[list[str], list[Any]]:
    """`_placement_report`'s select list and its parameters."""
    match_sql, match_params = _matches("s", executor_type, labels)
    columns = [f"(SELECT count(*) FROM (SELECT 1 {source} AND {match_sql} LIMIT {_CAP}) m)"]  # noqa: S608  (fragments of this module; values are parameters)
    params: list[Any] = list(match_params)
    if free is not None:
        columns.append(
            f"(SELECT count(*) FROM (SELECT 1 {source} AND {match_sql} AND {free} LIMIT {_CAP}) f)"  # noqa: S608
        )
        params += match_params
    executor_sql, executor_params = _has_executor("s", executor_type)
    columns.append(f"EXISTS (SELECT 1 {source} AND {executor_sql})")
    params += executor_params
    for key in labels:
        label_sql, label_params = _has_label("s", key, labels[key])
        columns.append(f"EXISTS (SELECT 1 {source} AND {label_sql})")
        params += label_params
    return columns, params


def _report_values(
    values: list[Any], labels: Mapping[str, str], *, free: str | None
) -> tuple[int, int, bool, dict[str, str]]:
    """`_placement_report`'s answer from the values of `_report_columns`."""
    matching = int(values.pop(0))
    matching_free = int(values.pop(0)) if free is not None else 0
    has_executor = bool(values.pop(0))
    missing = {
        key: labels[key] for key, present in zip(list(labels), values, strict=True) if not present
    }
    return matching, matching_free, has_executor, missing


def _labels_text(labels: Mapping[str, str]) -> str:
    return ", ".join(f"{key}={value}" for key, value in sorted(labels.items()))


def _requirement_text(executor_type: str, labels: Mapping[str, str]) -> str:
    text = f"executor type {executor_type}"
    return f"{text} and labels {_labels_text(labels)}" if labels else text


def _unmatched(
    who: str,
    executor_type: str,
    labels: Mapping[str, str],
    has_executor: bool,
    missing: dict[str, str],
) -> dict[str, Any]:
    lacking: list[str] = []
    if not has_executor:
        lacking.append(f"executor type {executor_type}")
    if missing:
        lacking.append(f"label{'s' if len(missing) > 1 else ''} {_labels_text(missing)}")
    if lacking:
        message = f"No {who} has {' or '.join(lacking)}."
    else:
        message = (
            f"No single {who} has all of {_requirement_text(executor_type, labels)} "
            "(each is on some Worker, never all on one)."
        )
    return {
        "missing_executor_type": None if has_executor else executor_type,
        "missing_labels": missing,
        "message": message,
    }


# --------------------------------------------------------------- at enqueue


def _invalid_placement() -> dict[str, Any]:
    return {
        "reason": "invalid_placement",
        "message": "The Task's placement is no longer valid; edit the Task.",
        "missing_executor_type": None,
        "missing_labels": {},
    }


def _enrolled_source() -> str:
    return f"FROM {_t(Worker)} s WHERE s.admin_state <> '{WorkerAdminState.DISABLED}'"


def placement_unmatched(revision: TaskRevision) -> dict[str, Any] | None:
    """None when some enrolled Worker (active or draining) has the revision's
    executor type and required labels; else why not, for the enqueue answer
    and the admin (`unplaceable_now`)."""
    required = _required(revision)
    if required is None:
        return _invalid_placement()
    executor_type, labels = required
    report = _placement_report(_enrolled_source(), executor_type, labels)
    return _enrolled_answer(executor_type, labels, report)


def _enrolled_answer(
    executor_type: str, labels: Mapping[str, str], report: tuple[int, int, bool, dict[str, str]]
) -> dict[str, Any] | None:
    matching, _, has_executor, missing = report
    if matching:
        return None
    return {
        "reason": "no_enrolled_worker",
        **_unmatched("enrolled Worker", executor_type, labels, has_executor, missing),
    }


# ------------------------------------------------------------- a queued Run


def _answer(reason: str, message: str, **facts: Any) -> dict[str, Any]:
    answer: dict[str, Any] = {
        "reason": reason,
        "message": message,
        "until": None,
        "backoff": None,
        "active": None,
        "limit": None,
        "missing_executor_type": None,
        "missing_labels": None,
        "matching_workers": None,
    }
    answer.update(facts)
    return answer


def _moment(value: datetime) -> str:
    return to_rfc3339(value)


def run_waiting(run_id: int) -> dict[str, Any] | None:
    """Why this Run is still queued (None when it is not queued)."""
    run = (
        Run.objects.select_related("project", "task_revision")
        .only(
            "id",
            "state",
            "project_id",
            "task_id",
            "project__slug",
            "project__max_concurrent_runs",
            "task_revision__executor_type",
            "task_revision__placement",
            "task_revision__max_concurrent_runs",
        )
        .filter(pk=run_id)
        .first()
    )
    if run is None or run.state != RunState.QUEUED:
        return None
    return _queued_waiting(run, fresh=False)


def enqueued_waiting(run: Run) -> dict[str, Any]:
    """`run_waiting` of a Run just enqueued (issue #12): its Project, Task and
    revision already read in, its Attempt #1 holding no `not_before`."""
    return _queued_waiting(run, fresh=True)


def enqueued_answers(run: Run) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """`enqueued_waiting(run)` and `placement_unmatched` of its revision, as
    each answers alone, with the enrolled-Worker question asked in the kill
    switch's statement on PostgreSQL: one statement fewer for a single
    enqueue (issue #12)."""
    revision = run.task_revision
    required = _required(revision)
    if connection.vendor != "postgresql" or required is None:
        unplaceable = placement_unmatched(revision)
        return _queued_waiting(run, fresh=True), unplaceable
    executor_type, labels = required
    columns, params = _report_columns(_enrolled_source(), executor_type, labels, free=None)
    paused, now, values = _paused_and_now(columns, params)
    report = _report_values(values, labels, free=None)
    unplaceable = _enrolled_answer(executor_type, labels, report)
    return _queued_waiting(run, fresh=True, paused_now=(paused, now)), unplaceable


def _paused_and_now(
    columns: list[str] | None = None, params: list[Any] | None = None
) -> tuple[bool, datetime, list[Any]]:
    """The kill switch and the database clock, in one statement on PostgreSQL,
    with the values of further `columns` asked in the same statement."""
    if connection.vendor != "postgresql":
        assert not columns
        paused = DispatchControl.objects.filter(pk=1).values_list("paused", flat=True).first()
        return bool(paused), db_now(), []
    table = connection.ops.quote_name(DispatchControl._meta.db_table)
    more = "".join(f", {column}" for column in columns or ())
    with prepared_cursor() as cursor:
        cursor.execute(
            f"SELECT (SELECT paused FROM {table} WHERE id = 1), statement_timestamp(){more}",  # noqa: S608  (a model's table name, this module's fragments; values are parameters)
            params or [],
        )
        row = cursor.fetchone()
    assert row is not None
    moment: datetime = row[1]
    return bool(row[0]), moment.astimezone(UTC), list(row[2:])


def _queued_waiting(
    run: Run, *, fresh: bool, paused_now: tuple[bool, datetime] | None = None
) -> dict[str, Any]:
    paused, now = paused_now or _paused_and_now()[:2]
    if paused:
        return _answer(
            "dispatch_paused",
            "Dispatch is paused: no Run is handed out until an operator resumes it.",
        )
    attempt = (
        None
        if fresh
        else Attempt.objects.filter(run_id=run.pk, state=AttemptState.PENDING)
        .only("not_before", "not_before_reason")
        .first()
    )
    if attempt is not None and attempt.not_before is not None and attempt.not_before > now:
        why = _BACKOFF_WORDS.get(attempt.not_before_reason, "it is held back")
        until = _moment(attempt.not_before)
        return _answer(
            "backoff",
            f"Not before {until}: {why}.",
            until=until,
            backoff=attempt.not_before_reason or None,
        )
    project, revision = run.project, run.task_revision
    if project.max_concurrent_runs:
        active = project_live_lease_count(project.pk, now=now)
        if active >= project.max_concurrent_runs:
            return _answer(
                "project_limit",
                f"Project {project.slug} is at its limit: {active} of "
                f"{project.max_concurrent_runs} Runs running.",
                active=active,
                limit=project.max_concurrent_runs,
            )
    if revision.max_concurrent_runs:
        active = task_live_lease_count(run.task_id, now=now)
        if active >= revision.max_concurrent_runs:
            return _answer(
                "task_limit",
                f"Its Task is at its limit: {active} of {revision.max_concurrent_runs} Runs "
                "running.",
                active=active,
                limit=revision.max_concurrent_runs,
            )
    required = _required(revision)
    if required is None:
        return _answer(
            "no_matching_worker",
            "The Task's placement is no longer valid: no Worker can take it; edit the Task.",
        )
    executor_type, labels = required
    least = "LEAST" if connection.vendor == "postgresql" else "MIN"
    source = (
        f"FROM {_t(WorkerSession)} s JOIN {_t(Worker)} w ON w.id = s.worker_id "
        f"WHERE s.state = '{SessionState.ONLINE}' AND w.admin_state = '{WorkerAdminState.ACTIVE}'"
    )
    free = (
        f"(SELECT count(*) FROM {_t(RunLease)} l WHERE l.session_id = s.id "  # noqa: S608  (a model's table, an enum value)
        f"AND l.state = '{LeaseState.ACTIVE}') < {least}(s.slots, w.slots)"
    )
    matching, matching_free, has_executor, missing = _placement_report(
        source, executor_type, labels, free=free
    )
    if not matching:
        facts = _unmatched("online Worker", executor_type, labels, has_executor, missing)
        return _answer("no_matching_worker", facts.pop("message"), matching_workers=0, **facts)
    if not matching_free:
        many = "1000 or more" if matching >= _CAP else str(matching)
        return _answer(
            "workers_full",
            f"All {many} online Workers with {_requirement_text(executor_type, labels)} "
            "are full; it is claimed when one frees a slot.",
            matching_workers=matching,
        )
    return _answer(
        "eligible",
        "Eligible now: a dispatch cycle claims it in its turn (Projects take turns; within "
        "its Project, higher priority and older Runs go first).",
        matching_workers=matching,
    )
