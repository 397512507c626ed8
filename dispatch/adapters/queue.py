"""The fair candidate read over the database (docs/adr/0012, `dispatch.core.fairness`).

`OrmQueueReader` is the `QueueReader` of the ORM adapter: at most two
statements per candidate page, whatever the backlog (a cycle's first walk,
and a pull's first rows of a lone group, come from the cycle's first
statement: `dispatch.cycles`).

1. **The walk** (`walk`): a recursive skip scan over the partial index
   `run_queue_group` (Run: project, task_revision, priority DESC, queued_at,
   id WHERE state = 'queued'), one index probe per queue group (a Project and
   a pinned revision), starting after a position and wrapping around, at most
   `cap` + 1 groups. For each group, in the same statement and decided once
   per group, never per Run: the room under its Project's and its Task's
   `max_concurrent_runs` (live leases, counted as `leases.quota` counts them)
   and whether a Session in scope that takes claims and has a free slot
   matches its executor type and required labels (`servable_sessions_cte`,
   `placement_matches`). The Sessions are read once per statement, in SQL;
   nothing loads them. With no such Session at all (a full fleet, a full
   pulling Session), no group is walked: the first probes are gated on one.
2. **The rows** (`rows`): for each chosen group, its first candidates after
   this cycle's position in its Project, each an ordered range of the same
   index with a LIMIT: on PostgreSQL prepared — one text of plain values
   for a single group, one for any number of groups (a LATERAL over arrays
   of the groups and their positions); a group read from its start is
   placed after a key before every Run. Elsewhere one `UNION ALL` branch per
   group.

The SQL is written per database vendor where JSON is involved (PostgreSQL
`jsonb` containment; SQLite's `json_each`); everything else is the same text.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from django.db import connection
from django.utils.dateparse import parse_datetime

from dispatch.core.fairness import QueueGroup, RowsWanted, WalkStart
from dispatch.core.ports import Candidate, DispatchScope
from leases.models import LeaseState, RunLease
from qinglong.prepared import int8_params, prepared_cursor, state_literal
from runs.models import Attempt, AttemptState, Project, Run, RunState, TaskRevision
from workers.models import SessionState, Worker, WorkerAdminState, WorkerSession

__all__ = [
    "WORKER_AHEAD_COLUMNS",
    "FirstWalk",
    "OrmQueueReader",
    "active_leases_by_session_sql",
    "placement_matches",
    "project_busy_sql",
    "servable_sessions_cte",
    "task_busy_sql",
    "walk_params",
    "walk_sql",
]

# Sorts after every revision id of a Project (a walk start "after the Project").
_AFTER_ALL: Final = 2**62
_BEFORE_ALL: Final = -1


def _t(model: Any) -> str:
    return str(connection.ops.quote_name(model._meta.db_table))


def _dt(value: datetime) -> Any:
    """A datetime as the backend stores it (SQLite: naive UTC text)."""
    return connection.ops.adapt_datetimefield_value(value)


def _from_db_datetime(value: Any) -> datetime:
    if isinstance(value, datetime):
        moment = value
    else:
        parsed = parse_datetime(str(value))
        if parsed is None:
            raise ValueError("not a datetime")
        moment = parsed
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment


# ------------------------------------------------------- shared SQL fragments


def active_leases_by_session_sql() -> str:
    """SQL: `(session_id, n)`, the active leases of every Session that has some.

    One pass over the active leases (`runlease_active_session`), grouped,
    for a statement that counts the slots of many Sessions: a count per
    Session row costs the same with good statistics, but a plan made while
    the statistics knew no leases (analysed when there were none, before
    the cycle's own claims) counted each Session by reading every active
    lease, a cost of Sessions times leases in flight (issue #12).

    On PostgreSQL the grouped pass is a `MATERIALIZED` CTE: a nested loop
    may still put it on its inner side (statistics that knew no leases), and
    a plain subquery there is grouped again for every Session row — each
    active lease read once per Session; a materialized one is computed once
    and its rows re-read. (SQLite reads `MATERIALIZED` only from 3.35.)
    """
    grouped = (
        f"SELECT l.session_id, count(*) AS n FROM {_t(RunLease)} l "  # noqa: S608  (names from model metadata; the state is the model's constant, state_literal)
        f"WHERE l.state = {state_literal(LeaseState.ACTIVE)} GROUP BY l.session_id"
    )
    if connection.vendor != "postgresql":
        return grouped
    return f"WITH active_counts AS MATERIALIZED ({grouped}) SELECT session_id, n FROM active_counts"  # noqa: S608  (the text above)


def servable_sessions_cte(scope: DispatchScope) -> tuple[str, list[Any]]:
    """`servable(executor_types, labels)`: the Sessions in scope that take claims
    now and have a free slot (min(Session, Worker slots) minus active leases, as the
    Worker snapshot counts). Returns the CTE body and its parameters."""
    least = "LEAST" if connection.vendor == "postgresql" else "MIN"
    select = (
        "SELECT s.executor_types AS executor_types, s.labels AS labels "  # noqa: S608  (table names from model metadata)
        f"FROM {_t(WorkerSession)} s JOIN {_t(Worker)} w ON w.id = s.worker_id "
    )
    takes_claims = (
        f"WHERE s.state = {state_literal(SessionState.ONLINE)} "
        f"AND w.admin_state = {state_literal(WorkerAdminState.ACTIVE)} "
    )
    if scope.session is None:
        # Every Session: their active leases counted in one pass, grouped.
        return (
            f"{select}LEFT JOIN ({active_leases_by_session_sql()}) c ON c.session_id = s.id "
            f"{takes_claims}AND COALESCE(c.n, 0) < {least}(s.slots, w.slots)",
            [],
        )
    sql = (
        f"{select}{takes_claims}AND (SELECT count(*) FROM {_t(RunLease)} l "  # noqa: S608  (table names from model metadata)
        f"WHERE l.session_id = s.id AND l.state = {state_literal(LeaseState.ACTIVE)}) "
        f"< {least}(s.slots, w.slots)"
    )
    params: list[Any] = []
    ref = scope.session
    try:
        session_uuid = uuid.UUID(ref.session_id)
    except ValueError:
        session_uuid = None
    if session_uuid is None or not ref.worker_id.isdigit():
        return sql + " AND 1 = 0", params
    field = WorkerSession._meta.get_field("session_id")
    sql += " AND s.session_id = %s AND s.worker_id = %s AND s.generation = %s"
    params += [
        field.get_db_prep_value(session_uuid, connection),
        int(ref.worker_id),
        ref.session_generation,
    ]
    return sql, params


def placement_matches(session: str, revision: str) -> str:
    """SQL: the Session row `session` (executor_types, labels) takes the placement
    of revision row `revision` (executor_type, placement): the executor type is
    one of the Session's and every required label is one of its labels with the
    same value — `dispatch.core.placement.placement_score` is not None."""
    if connection.vendor == "postgresql":
        return (
            f"{session}.executor_types @> jsonb_build_array({revision}.executor_type) "
            f"AND {session}.labels @> CASE WHEN jsonb_typeof({revision}.placement -> "
            f"'required_labels') = 'object' THEN {revision}.placement -> 'required_labels' "
            "ELSE '{}'::jsonb END"
        )
    return (
        f"EXISTS (SELECT 1 FROM json_each({session}.executor_types) e "  # noqa: S608  (aliases, no values)
        f"WHERE e.value = {revision}.executor_type) "
        f"AND NOT EXISTS (SELECT 1 FROM json_each({revision}.placement, '$.required_labels') rl "
        f"WHERE rl.key IS NOT NULL AND json_extract({session}.labels, "
        "'$.\"' || rl.key || '\"') IS NOT rl.value)"
    )


def _busy_sql(column: str, owner: str, now: str) -> str:
    return (
        f"(SELECT count(*) FROM {_t(Run)} rr JOIN {_t(RunLease)} l ON l.run_id = rr.id "  # noqa: S608  (table names from model metadata)
        f"WHERE rr.{column} = {owner} "
        f"AND rr.state IN ({state_literal(RunState.DISPATCHING)}, "
        f"{state_literal(RunState.RUNNING)}) "
        f"AND l.state = {state_literal(LeaseState.ACTIVE)} AND l.expires_at > {now})"
    )


def project_busy_sql(owner: str, *, now: str = "%s") -> str:
    """SQL counting the live leases of Project `owner`'s Runs (`leases.quota`);
    parameters: `busy_params(now)` (none when `now` is an SQL expression)."""
    return _busy_sql("project_id", owner, now)


def task_busy_sql(owner: str, *, now: str = "%s") -> str:
    """SQL counting the live leases of Task `owner`'s Runs (`leases.quota`)."""
    return _busy_sql("task_id", owner, now)


def busy_params(now: datetime) -> list[Any]:
    return [_dt(now)]


# Issue #12: a global cycle's walk also reads the first page(s) of its Worker
# snapshot — the same rows `dispatch.adapters.orm` reads with a statement of
# its own (the Session online, its Worker active, in worker id order, with its
# active leases) — so a claiming cycle is one statement shorter and counts
# every Session's active leases once instead of twice.
WORKER_AHEAD_COLUMNS: Final = (
    "worker_id",
    "session_id",
    "generation",
    "executor_types",
    "labels",
    "slots",
    "w_slots",
    "n",
)


def _global_sessions_ctes() -> str:
    """`ac`, `sess` (every Session taking claims, with its active leases) and
    `servable` (those with a free slot: `servable_sessions_cte`'s rows)."""
    least = "LEAST" if connection.vendor == "postgresql" else "MIN"
    return (
        f"ac AS MATERIALIZED (SELECT l.session_id, count(*) AS n FROM {_t(RunLease)} l "  # noqa: S608  (table names from model metadata; the states are the models' constants, state_literal)
        f"WHERE l.state = {state_literal(LeaseState.ACTIVE)} GROUP BY l.session_id), "
        "sess AS MATERIALIZED (SELECT s.worker_id, s.session_id, s.generation, "
        "s.executor_types, s.labels, s.slots, w.slots AS w_slots, COALESCE(ac.n, 0) AS n "
        f"FROM {_t(WorkerSession)} s JOIN {_t(Worker)} w ON w.id = s.worker_id "
        "LEFT JOIN ac ON ac.session_id = s.id "
        f"WHERE s.state = {state_literal(SessionState.ONLINE)} "
        f"AND w.admin_state = {state_literal(WorkerAdminState.ACTIVE)}), "
        "servable AS MATERIALIZED (SELECT sess.executor_types, sess.labels FROM sess "
        f"WHERE sess.n < {least}(sess.slots, sess.w_slots))"
    )


def _workers_ahead_sql() -> str:
    """The walk's last column: on its first row, when a Session could be
    served, the first `%s` Sessions of `sess` by worker id as a JSON array of
    `WORKER_AHEAD_COLUMNS` (the JSON columns as their text); else NULL."""
    columns = ", ".join(
        f"z.{c}::text" if c in ("executor_types", "labels") else f"z.{c}"
        for c in WORKER_AHEAD_COLUMNS
    )
    return (
        "CASE WHEN (wk.part, wk.n) = (SELECT w1.part, w1.n FROM walked w1 "  # noqa: S608  (aliases, no values)
        "ORDER BY w1.part, w1.n LIMIT 1) AND EXISTS (SELECT 1 FROM servable) "
        f"THEN (SELECT json_agg(json_build_array({columns}) ORDER BY z.worker_id) "
        "FROM (SELECT * FROM sess ORDER BY sess.worker_id LIMIT %s) z) END"
    )


@dataclass(frozen=True)
class FirstWalk:
    """A cycle's first walk read ahead (`dispatch.cycles.global_start`): the
    rows `OrmQueueReader.walk` reads for `start` and `cap` (global scope, the
    Worker rows ahead on the first when `workers_ahead`), at the cycle's clock."""

    start: WalkStart | None
    cap: int
    workers_ahead: int
    rows: tuple[Sequence[Any], ...]


def _walk_start(start: WalkStart | None) -> tuple[int, int]:
    if start is None:
        return _BEFORE_ALL, _BEFORE_ALL
    if not start[0].isdigit() or not (start[1] is None or start[1].isdigit()):
        raise ValueError("not a cursor of this source")
    return int(start[0]), _AFTER_ALL if start[1] is None else int(start[1])


def walk_params(
    start: WalkStart | None,
    cap: int,
    scope: DispatchScope | None,
    *,
    workers_ahead: int,
    now: datetime | None = None,
    workers_column: bool | None = None,
) -> list[Any]:
    """The parameters of `walk_sql`'s text, in order: a Session scope's, the
    start and the cap, the busy counts' clock (`now`; none for the text with
    `clock`), the Worker rows' limit (global scope with `workers_ahead`, or
    `workers_column`: a text with the Worker rows, even to read none), the cap."""
    sp, sg = _walk_start(start)
    limit = cap + 1
    params: list[Any] = []
    if scope is not None and scope.session is not None:
        params += servable_sessions_cte(scope)[1]
    params += [sp, sg, limit, sp, sg, limit, sp, sg]
    if scope is not None and now is not None:
        params += [*busy_params(now), *busy_params(now)]
    if workers_column is None:
        workers_column = bool(workers_ahead) and scope is not None and scope.session is None
    if workers_column:
        params.append(workers_ahead)
    params.append(limit)
    return params


def walk_sql(
    scope: DispatchScope | None, *, workers_ahead: bool, clock: bool
) -> tuple[str, str, str]:
    """The walk's CTEs (after `WITH RECURSIVE`), its SELECT and the whole
    statement, written once per database and shape. `workers_ahead` (global scope): the Worker
    rows on the first row; `clock`: the busy counts at `statement_timestamp()`
    instead of a parameter."""
    kind = "none" if scope is None else "global" if scope.session is None else "session"
    ahead = workers_ahead and kind == "global"
    # A Session's scope: its servable Sessions' text (one that names no valid
    # Session matches none and takes no parameters).
    servable = servable_sessions_cte(scope)[0] if scope is not None and kind == "session" else ""
    key = (connection.vendor, kind, ahead, clock, servable)
    found = _WALK_SQL.get(key)
    if found is not None:
        return found
    run = _t(Run)
    successor = (
        f"SELECT r2.id FROM {run} r2 WHERE r2.state = {state_literal(RunState.QUEUED)} "  # noqa: S608  (table names from model metadata)
        "AND (r2.project_id, r2.task_revision_id) > (w.project_id, w.revision_id) "
        "ORDER BY r2.project_id, r2.task_revision_id LIMIT 1"
    )
    first = (
        f"SELECT r.project_id, r.task_revision_id FROM {run} r "  # noqa: S608  (table names from model metadata)
        f"WHERE r.state = {state_literal(RunState.QUEUED)} "
        "{extra} ORDER BY r.project_id, r.task_revision_id LIMIT 1"
    )
    # With Sessions in view (a scope), none of them with a free slot: no
    # group could be served, and none is walked (a one-time filter; the
    # index is not descended at all, whatever the backlog).
    gate = "" if scope is None else "AND EXISTS (SELECT 1 FROM servable) "
    ctes = (
        "after_walk(project_id, revision_id, n) AS ("  # noqa: S608
        "SELECT project_id, task_revision_id, 1 FROM ("
        + first.format(extra=f"{gate}AND (r.project_id, r.task_revision_id) > (%s, %s)")
        + ") a0 UNION ALL "  # noqa: S608
        f"SELECT r.project_id, r.task_revision_id, w.n + 1 FROM after_walk w "
        f"JOIN {run} r ON r.id = ({successor}) WHERE w.n < %s), "
        "before_walk(project_id, revision_id, n) AS ("
        "SELECT project_id, task_revision_id, 1 FROM ("
        + first.format(extra=gate)
        + ") b0 WHERE (project_id, task_revision_id) <= (%s, %s) UNION ALL "  # noqa: S608
        f"SELECT r.project_id, r.task_revision_id, w.n + 1 FROM before_walk w "
        f"JOIN {run} r ON r.id = ({successor}) "
        "WHERE w.n < %s AND (r.project_id, r.task_revision_id) <= (%s, %s)), "
        "walked AS (SELECT 0 AS part, n, project_id, revision_id FROM after_walk "
        "UNION ALL SELECT 1, n, project_id, revision_id FROM before_walk)"
    )
    workers = ""
    if scope is None:
        flags = "0, 0, 1"
    else:
        if ahead:
            # The global Sessions, their active leases counted once for
            # both the servable ones and the Worker rows read ahead.
            ctes = f"{_global_sessions_ctes()}, " + ctes
            workers = f", {_workers_ahead_sql()}"
        else:
            servable_sql = servable or servable_sessions_cte(scope)[0]
            ctes = f"servable AS MATERIALIZED ({servable_sql}), " + ctes
        now = "statement_timestamp()" if clock else "%s"
        project_busy = project_busy_sql("p.id", now=now)
        task_busy = task_busy_sql("v.task_id", now=now)
        flags = (
            f"CASE WHEN p.max_concurrent_runs = 0 THEN 0 ELSE {project_busy} END, "  # noqa: S608
            f"CASE WHEN v.max_concurrent_runs = 0 THEN 0 ELSE {task_busy} END, "
            f"CASE WHEN EXISTS (SELECT 1 FROM servable f WHERE {placement_matches('f', 'v')}) "
            "THEN 1 ELSE 0 END"
        )
    # Read inside another statement (`clock`), each row also says its place.
    place = ", wk.part, wk.n" if clock else ""
    body = (
        "SELECT wk.project_id, wk.revision_id, v.task_id, v.revision, v.executor_type, "  # noqa: S608  (table names from model metadata)
        f"p.max_concurrent_runs, v.max_concurrent_runs, {flags}{workers}{place} "
        f"FROM walked wk JOIN {_t(Project)} p ON p.id = wk.project_id "
        f"JOIN {_t(TaskRevision)} v ON v.id = wk.revision_id "
        "ORDER BY wk.part, wk.n LIMIT %s"
    )
    found = _WALK_SQL[key] = (ctes, body, f"WITH RECURSIVE {ctes} {body}")
    return found


_WALK_SQL: dict[tuple[str, str, bool, bool, str], tuple[str, str, str]] = {}


# ------------------------------------------------------------------ the reader


class OrmQueueReader:
    """`dispatch.core.fairness.QueueReader` over the database (module docstring)."""

    def __init__(
        self,
        *,
        observed_at: datetime,
        scope: DispatchScope | None,
        workers_ahead: int = 0,
        first_walk: FirstWalk | None = None,
    ) -> None:
        self.observed_at = observed_at
        self.scope = scope
        # revision pk → (revision number, executor type), from the walk.
        self._revisions: dict[str, tuple[int, str]] = {}
        # attempt id → its pinned revision's pk, from the rows read.
        self._group_of: dict[str, str] = {}
        # Global scope on PostgreSQL: the walk also reads the first
        # `workers_ahead` rows of the global Worker snapshot (`worker_rows`).
        self.workers_ahead = workers_ahead
        self.worker_rows: list[Sequence[Any]] | None = None
        # The first walk, already read (`FirstWalk`): served once if asked for.
        self.first_walk = first_walk

    def revision_pk(self, candidate: Candidate) -> str:
        """The pinned revision's primary key of a candidate this reader returned."""
        return self._group_of[candidate.attempt_id]

    def walk(self, *, start: WalkStart | None, cap: int) -> tuple[list[QueueGroup], bool]:
        first, self.first_walk = self.first_walk, None
        if first is not None and (first.start, first.cap) == (start, cap):
            # Read with the cycle's first statement (`dispatch.cycles.global_start`),
            # at this `observed_at`, with the Worker rows ahead (when asked for).
            rows: list[Sequence[Any]] = list(first.rows)
            workers = True
            self.workers_ahead = first.workers_ahead
        else:
            scope = self.scope
            ahead = self._workers_ahead()
            *_, text = walk_sql(scope, workers_ahead=ahead > 0, clock=False)
            params = walk_params(start, cap, scope, workers_ahead=ahead, now=self.observed_at)
            # Every cycle walks: PostgreSQL plans the walk once per connection and
            # scope kind (qinglong.prepared). Its states are literals in the text,
            # so the generic plan keeps the partial indexes on queued Runs and
            # active leases.
            with prepared_cursor() as cursor:
                cursor.execute(text, int8_params(params))
                rows = cursor.fetchall()
            workers = ahead > 0
        if workers:
            # On the walk's first row only, and only when a Session could be
            # served (otherwise no candidate, so no Worker snapshot, follows).
            found = rows[0][-1] if rows and self.workers_ahead else None
            self.worker_rows = None if found is None else list(found)
            self.workers_ahead = 0  # read once per reader
            rows = [row[:-1] for row in rows]
        groups: list[QueueGroup] = []
        for row in rows[:cap]:
            (project_id, revision_id, task_id, number, executor_type) = row[:5]
            project_limit, task_limit, project_busy, task_busy, placeable = row[5:]
            self._revisions[str(revision_id)] = (int(number), str(executor_type))
            if self.scope is None:
                groups.append(
                    QueueGroup(str(project_id), str(revision_id), str(task_id), servable=True)
                )
                continue
            project_room = project_limit - project_busy if project_limit else None
            task_room = task_limit - task_busy if task_limit else None
            servable = (
                bool(placeable)
                and (project_room is None or project_room > 0)
                and (task_room is None or task_room > 0)
            )
            groups.append(
                QueueGroup(
                    str(project_id),
                    str(revision_id),
                    str(task_id),
                    servable,
                    project_room,
                    task_room,
                )
            )
        return groups, len(rows) > cap

    def _workers_ahead(self) -> int:
        # Its Worker rows go with the walk only once per reader.
        scope = self.scope
        if (
            not self.workers_ahead
            or scope is None
            or scope.session is not None
            or connection.vendor != "postgresql"
        ):
            return 0
        return self.workers_ahead

    def rows(self, wanted: Sequence[RowsWanted]) -> Mapping[str, Sequence[Candidate]]:
        if not wanted:
            return {}
        if connection.vendor == "postgresql":
            fetched = self._rows_prepared(wanted)
        else:
            fetched = self._rows_union(wanted)
        found: dict[str, list[Candidate]] = {}
        for row in fetched:
            attempt_id, version, generation, run_id, priority, queued_at = row[:6]
            project_id, task_id, revision_id = row[6:]
            number, executor_type = self._revisions[str(revision_id)]
            self._group_of[str(attempt_id)] = str(revision_id)
            found.setdefault(str(revision_id), []).append(
                Candidate(
                    run_id=str(run_id),
                    attempt_id=str(attempt_id),
                    project_id=str(project_id),
                    task_id=str(task_id),
                    task_revision=number,
                    executor_type=executor_type,
                    priority=int(priority),
                    queued_at=_from_db_datetime(queued_at),
                    attempt_version=int(version),
                    lease_generation=int(generation),
                )
            )
        for rows in found.values():
            # Each branch is ordered; the UNION ALL keeps no promise about it.
            rows.sort(key=lambda c: (-c.priority, c.queued_at, int(c.run_id)))
        return found

    def _rows_prepared(self, wanted: Sequence[RowsWanted]) -> list[tuple[Any, ...]]:
        """PostgreSQL: one text for a single group (plain values) and one for
        any number of groups (a LATERAL over a JSON array of the groups), so
        each is planned once per connection (qinglong.prepared) and then runs
        one generic plan instead of being planned on every cycle (issue #12)."""
        with prepared_cursor() as cursor:
            if len(wanted) == 1:
                # One group (a pull's common case): its own text of plain
                # values, which PostgreSQL keeps one plan of.
                (want,) = wanted
                # A group read from its start stands after the sentinel key that
                # sorts before every Run (`_FROM_THE_START`).
                priority, queued_at, run_id = want.after or _FROM_THE_START
                cursor.execute(
                    _rows_sql(one=True),
                    int8_params(
                        [
                            int(want.group.project_id),
                            int(want.group.group_id),
                            self.observed_at,
                            priority,
                            priority,
                            queued_at,
                            queued_at,
                            int(run_id),
                            want.limit,
                        ]
                    ),
                )
            else:
                cursor.execute(_rows_sql(one=False), [_groups_json(wanted), self.observed_at])
            return list(cursor.fetchall())

    def _rows_union(self, wanted: Sequence[RowsWanted]) -> list[tuple[Any, ...]]:
        """Elsewhere (SQLite): one `UNION ALL` branch per group."""
        run, attempt = _t(Run), _t(Attempt)
        branches: list[str] = []
        params: list[Any] = []
        for index, want in enumerate(wanted):
            sql = (
                "SELECT * FROM (SELECT a.id, a.version, a.lease_generation, r.id AS run_id, "  # noqa: S608  (table names from model metadata)
                "r.priority, r.queued_at, r.project_id, r.task_id, r.task_revision_id "
                f"FROM {run} r JOIN {attempt} a ON a.run_id = r.id "
                "WHERE r.state = %s AND r.project_id = %s AND r.task_revision_id = %s "
                "AND a.state = %s AND r.cancel_requested = %s "
                "AND (a.not_before IS NULL OR a.not_before <= %s)"
            )
            params += [
                RunState.QUEUED,
                int(want.group.project_id),
                int(want.group.group_id),
                AttemptState.PENDING,
                False,
                _dt(self.observed_at),
            ]
            if want.after is not None:
                priority, queued_at, run_id = want.after
                # The exact successor of `after` in (priority DESC, queued_at, id).
                sql += (
                    " AND r.priority <= %s AND (r.priority < %s OR r.queued_at > %s "
                    "OR (r.queued_at = %s AND r.id > %s))"
                )
                moment = _dt(queued_at)
                params += [priority, priority, moment, moment, int(run_id)]
            sql += f" ORDER BY r.priority DESC, r.queued_at, r.id LIMIT %s) g{index}"
            params.append(want.limit)
            branches.append(sql)
        with connection.cursor() as cursor:
            cursor.execute(" UNION ALL ".join(branches), params)
            return list(cursor.fetchall())


# Before every Run in (priority DESC, queued_at, id): the highest priority a
# column can hold, the earliest moment, no id (every real queued_at is later).
_FROM_THE_START: Final = (2**31 - 1, datetime(1, 1, 1, tzinfo=UTC), "0")


def _groups_json(wanted: Sequence[RowsWanted]) -> str:
    """The wanted groups as the JSON array `_rows_sql(one=False)` reads: for
    each its keys, the key it is read after and its limit (a moment in ISO
    8601 with its offset and microseconds: exactly the value)."""
    groups = []
    for want in wanted:
        priority, queued_at, run_id = want.after or _FROM_THE_START
        groups.append(
            {
                "project_id": int(want.group.project_id),
                "revision_id": int(want.group.group_id),
                "priority": int(priority),
                "queued_at": queued_at.isoformat(),
                "run_id": int(run_id),
                "lim": int(want.limit),
            }
        )
    return json.dumps(groups)


_ROWS_SQL: dict[tuple[str, bool], str] = {}


def _rows_sql(*, one: bool) -> str:
    """The rows of the wanted groups on PostgreSQL: for each (project, revision,
    after-key, limit) of the arrays — or the one group's plain values — the
    group's first candidates after that key, an ordered range of
    `run_queue_group` (its state a literal: the generic plan keeps the
    partial index)."""
    found = _ROWS_SQL.get((connection.vendor, one))
    if found is not None:
        return found
    if one:
        # In this text the group's key comes first, then the clock, then the
        # after-key (priority twice, queued_at twice, run id) and the limit.
        group = "%s", "%s", "%s", "%s::timestamptz", "%s", "%s"
    else:
        group = "w.project_id", "w.revision_id", "w.priority", "w.queued_at", "w.run_id", "w.lim"
    project, revision, priority, queued_at, run_id, limit = group
    candidates = (
        "SELECT a.id, a.version, a.lease_generation, r.id AS run_id, "  # noqa: S608  (table names from model metadata; the states are the models' constants, state_literal)
        "r.priority, r.queued_at, r.project_id, r.task_id, r.task_revision_id "
        f"FROM {_t(Run)} r JOIN {_t(Attempt)} a ON a.run_id = r.id "
        f"WHERE r.state = {state_literal(RunState.QUEUED)} "
        f"AND r.project_id = {project} AND r.task_revision_id = {revision} "
        f"AND a.state = {state_literal(AttemptState.PENDING)} AND NOT r.cancel_requested "
        "AND (a.not_before IS NULL OR a.not_before <= %s::timestamptz) "
        # The exact successor of the after-key in (priority DESC, queued_at, id).
        f"AND r.priority <= {priority} AND (r.priority < {priority} "
        f"OR r.queued_at > {queued_at} OR (r.queued_at = {queued_at} AND r.id > {run_id})) "
        f"ORDER BY r.priority DESC, r.queued_at, r.id LIMIT {limit}"
    )
    if one:
        found = candidates
    else:
        # The groups as a JSON array, not as arrays: the planner counts 100
        # rows in `json_to_recordset` whether it knows the value or not, so
        # the plan made for the value at hand never looks cheaper than the
        # generic one and PostgreSQL keeps the generic plan — over arrays,
        # `unnest` counts the elements of a known array (8) but 10 for a
        # parameter, and every call was planned again (0.5 ms; issue #12).
        found = (
            "SELECT g.* FROM json_to_recordset(%s::json) AS w(project_id bigint, "  # noqa: S608  (the text above)
            "revision_id bigint, priority integer, queued_at timestamptz, run_id bigint, "
            f"lim integer) CROSS JOIN LATERAL ({candidates}) g"
        )
    _ROWS_SQL[(connection.vendor, one)] = found
    return found
