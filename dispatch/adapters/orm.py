"""Django ORM implementations of the `dispatch.core` ports (docs/architecture.md, ports).

Every source reads one bounded keyset page per call: `limit + 1` rows (the extra
row only says whether a next page exists), joined in the same query so the
number of queries per page is constant whatever the backlog (docs/adr/0001: no
unbounded reads on an edge device). Cursors are opaque strings to the core; a
malformed one is a programming error and raises `ValueError`.

The filters mirror the port contracts in `dispatch.core.ports` exactly; the
shared contract suite (`dispatch/tests/test_port_contract.py`) runs the same
checks against these adapters and the in-memory fakes.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, Final

from django.db import connection
from django.db.models import Count, IntegerField, OuterRef, QuerySet, Subquery
from django.db.models.functions import Coalesce

from dispatch.adapters.queue import FirstWalk, OrmQueueReader, active_leases_by_session_sql
from dispatch.core.budget import HARD_CAPS
from dispatch.core.errors import SpecError
from dispatch.core.fairness import QueueGroup, Rotation, RowsWanted, WalkStart, fair_page
from dispatch.core.placement import Placement, validate_placement
from dispatch.core.policy import capacity, free_slots
from dispatch.core.ports import (
    Candidate,
    Clock,
    DispatchPlan,
    DispatchPorts,
    DispatchScope,
    Page,
    PlanUnavailable,
    RecoverableLease,
    WorkerRecord,
)
from dispatch.core.spec import SpecTemplate, TaskDefinition, build_spec
from leases import policy
from leases.claim import DatabaseClaimPort
from leases.models import LeaseState, RunLease
from qinglong.clock import DatabaseClock
from qinglong.prepared import int8_params, prepared_cursor, state_literal
from qinglong.rows import ModelColumns, load_row
from runs.models import Attempt, AttemptState, Run, RunState, TaskRevision
from runs.services import revision_definition
from workers.models import (
    SESSION_CURRENT_STATES,
    SessionState,
    Worker,
    WorkerAdminState,
    WorkerSession,
)

__all__ = [
    "CycleMemo",
    "FirstRows",
    "OrmCandidateSource",
    "OrmLeaseRecoverySource",
    "OrmPlanSource",
    "OrmWorkerSnapshotSource",
    "RecoveryFirstPage",
    "active_lease_count",
    "fair_rotation",
    "orm_ports",
    "recovery_page_from",
    "recovery_parts",
    "recovery_width",
    "revisions_read",
    "session_scope_record",
]

_CURSOR_SEP: Final = "|"
_MAX_LIMIT: Final = HARD_CAPS["page_size"]


def _id_cursor(cursor: str | None) -> int | None:
    if cursor is None:
        return None
    if not cursor.isascii() or not cursor.isdigit():
        raise ValueError("not a cursor of this source")
    return int(cursor)


def _check_limit(limit: int) -> None:
    # The core never asks for more than a hard-capped page (docs/adr/0001); a caller
    # that does is a bug, and silently reading a huge page is what we prevent.
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= _MAX_LIMIT:
        raise ValueError(f"limit must be an integer from 1 to {_MAX_LIMIT}")


def _session_uuid(scope: DispatchScope) -> uuid.UUID | None:
    if scope.session is None:
        return None
    try:
        return uuid.UUID(scope.session.session_id)
    except ValueError:
        return None


# ------------------------------------------------------------------- recovery


class OrmLeaseRecoverySource:
    """Active leases still eligible for re-delivery (docs/adr/0001 step 1, docs/adr/0002).

    `known_empty`: the caller already found none (a pull's snapshot, read at
    the cycle's `observed_at`), so the first page is empty without a read.

    `first_page`: the first global page the caller already read with its
    clock (`dispatch.cycles.global_start`), served without a read when the
    cycle asks for exactly that page (same `observed_at`, `due_before`,
    `max_deliveries` and limit).
    """

    def __init__(
        self, *, known_empty: bool = False, first_page: RecoveryFirstPage | None = None
    ) -> None:
        self.known_empty = known_empty
        self.first_page = first_page

    def recover_page(
        self,
        *,
        scope: DispatchScope,
        observed_at: datetime,
        due_before: datetime | None,
        max_deliveries: int,
        cursor: str | None,
        limit: int,
    ) -> Page[RecoverableLease]:
        _check_limit(limit)
        after = _id_cursor(cursor)
        if self.known_empty and after is None:
            return Page((), None)
        first = self.first_page
        if (
            first is not None
            and after is None
            and scope.session is None
            and (first.observed_at, first.due_before, first.max_deliveries, first.limit)
            == (observed_at, due_before, max_deliveries, limit)
        ):
            return first.page
        session_uuid = None
        if scope.session is not None:
            session_uuid = _session_uuid(scope)
            if session_uuid is None:
                return Page((), None)
        sql = _recovery_sql(
            session=session_uuid is not None, due=due_before is not None, after=after is not None
        )
        adapt = connection.ops.adapt_datetimefield_value
        params: list[Any] = [adapt(observed_at), max_deliveries]
        if session_uuid is not None:
            params.append(_SESSION_ID_FIELD.get_db_prep_value(session_uuid, connection))
        if due_before is not None:
            params.append(adapt(due_before))
        if after is not None:
            params.append(after)
        params += [False, limit + 1]
        # Every global cycle reads it: prepared once per connection and shape
        # (qinglong.prepared); its states are literals (the partial indexes).
        with prepared_cursor() as db:
            db.execute(sql, int8_params(params))
            rows = db.fetchall()
        return recovery_page_from(rows, limit)


@dataclass(frozen=True)
class RecoveryFirstPage:
    """A global recovery page read ahead, with the arguments it was read for."""

    observed_at: datetime
    due_before: datetime
    max_deliveries: int
    limit: int
    page: Page[RecoverableLease]


def recovery_page_from(rows: Sequence[Sequence[Any]], limit: int) -> Page[RecoverableLease]:
    """The page of rows read by `recovery_parts`' statement (`limit` + 1 at most)."""
    items = tuple(_recovered_row(row) for row in rows[:limit])
    return Page(items, items[-1].lease_id if len(rows) > limit else None)


def recovery_width() -> int:
    """How many columns a row of the recovery page has."""
    return sum(len(part) for part in _RECOVERY_PARTS)


# The columns a RecoverableLease needs: the revision's command and env are
# not read here, the plan source materializes them.
_RECOVERY_PARTS = (
    ModelColumns(
        RunLease,
        "l",
        only=(
            "attempt",
            "worker",
            "session_generation",
            "lease_generation",
            "spec_digest",
            "expires_at",
            "source",
            "placement_score",
            "pull_id",
            "token_digest",
            "delivery_count",
            "last_delivered_at",
        ),
    ),
    ModelColumns(Attempt, "a", only=("priority", "queued_at", "version")),
    ModelColumns(Run, "r", only=("project", "task", "task_revision")),
    ModelColumns(TaskRevision, "v", only=("revision", "executor_type")),
    ModelColumns(WorkerSession, "s", only=("session_id",)),
)
_SESSION_ID_FIELD: Final = WorkerSession._meta.get_field("session_id")
_RECOVERY_SQL: dict[tuple[str, bool, bool, bool], str] = {}


def _recovery_sql(*, session: bool, due: bool, after: bool) -> str:
    """The recovery page in SQL written once per database and shape (issue #12):
    every cycle reads it, and compiling the queryset cost more than running it.

    The port's contract, row for row: live at `observed_at`, the granted
    Session still the Worker's current one at the lease's generation
    (`leases.policy.lease_session_current_q`), active, the Attempt claimed at
    the lease's generation, the Run dispatching and not cancel-requested,
    delivered fewer than `max_deliveries` times; optionally one Session's,
    only past the redelivery backoff, after the cursor; in lease id order.
    """
    key = (connection.vendor, session, due, after)
    found = _RECOVERY_SQL.get(key)
    if found is None:
        leases, rows = recovery_parts(session=session, due=due, after=after, clock=False)
        found = _RECOVERY_SQL[key] = f"WITH {leases} {rows}"
    return found


def recovery_parts(*, session: bool, due: bool, after: bool, clock: bool) -> tuple[str, str]:
    """The recovery read's two parts: the CTE `l` of the leases that may be
    due, and the statement reading the page's rows from it (placeholders, in
    order: observed_at unless `clock`, max_deliveries, the Session's uuid,
    due_before (with `clock`: the backoff, an interval), the cursor, False,
    the row limit).

    `clock`: at the statement's own clock (`statement_timestamp()`, PostgreSQL)
    instead of a parameter — a global cycle's first statement reads its
    clock and this page at once (`dispatch.cycles`).
    """
    qn = connection.ops.quote_name

    def t(model: Any) -> str:
        return str(qn(model._meta.db_table))

    # The active leases that may be due come first, on their own
    # (MATERIALIZED: the planner cannot fold them into the joins): a plan
    # that walked the dispatching Runs and probed the leases of each read
    # every active lease once per Run, a cost that grew with the square of
    # the leases in flight while the table's statistics were older than
    # them (issue #12). This way a cycle reads each active lease at most
    # once, and only the few that may be due meet the other tables.
    active, current = (
        state_literal(LeaseState.ACTIVE),
        ", ".join(state_literal(state) for state in SESSION_CURRENT_STATES),
    )
    now = "statement_timestamp()" if clock else "%s"
    in_session = (
        f"AND l.session_id IN (SELECT s0.id FROM {t(WorkerSession)} s0 WHERE s0.session_id = %s) "  # noqa: S608  (names from model metadata; values are parameters)
        if session
        else ""
    )
    due_before = "statement_timestamp() - %s" if clock else "%s"
    due_sql = (
        f"AND (l.last_delivered_at IS NULL OR l.last_delivered_at <= {due_before}) " if due else ""
    )
    after_sql = "AND l.id > %s " if after else ""
    postgresql = connection.vendor == "postgresql"
    # SQLite reads `MATERIALIZED` from 3.35 only (Django 5.2 supports 3.31);
    # its planner needs no such fence here.
    materialized = "MATERIALIZED " if postgresql else ""
    leases = (
        f"l AS {materialized}(SELECT * FROM {t(RunLease)} l "  # noqa: S608  (names from model metadata; the states are the models' constants, state_literal; values are parameters)
        f"WHERE l.state = {active} AND l.expires_at > {now} AND l.delivery_count < %s "
        f"{in_session}{due_sql}{after_sql})"
    )
    session_ok = f"s.state IN ({current}) AND s.generation = l.session_generation"
    attempt_ok = (
        f"a.state = {state_literal(AttemptState.CLAIMED)} "
        "AND a.lease_generation = l.lease_generation"
    )
    run_ok = f"r.state = {state_literal(RunState.DISPATCHING)} AND r.cancel_requested = %s"
    select = ", ".join(part.select() for part in _RECOVERY_PARTS)
    if postgresql:
        # Each lease's rows by their keys, from `l` (LATERAL ... LIMIT 1: the
        # planner cannot turn the join around). With the statistics older than
        # the leases in flight (a burst of claims), the plain joins ran the
        # dispatching Runs first and `l` once per Run: 4 ms with 2,000 leases
        # in flight and none due, over a second with all of them due (issue #12).
        # The checks are answers of the row found by its key, not filters of
        # the lookup: with a state in its WHERE the planner took a partial
        # index of that state, as tiny as the old statistics said, and
        # filtered it by id once per lease.
        def by_key(part: ModelColumns[Any], on: str, ok: str) -> str:
            alias = part.alias
            return (
                f"JOIN LATERAL (SELECT {part.select()}, ({ok}) AS ok FROM {t(part.model)} "  # noqa: S608  (as above)
                f"{alias} WHERE {alias}.id = {on} LIMIT 1) {alias} ON {alias}.ok "
            )

        _, attempt_part, run_part, revision_part, session_part = _RECOVERY_PARTS
        joins = (
            by_key(session_part, "l.session_id", session_ok)
            + by_key(attempt_part, "l.attempt_id", attempt_ok)
            + by_key(run_part, "l.run_id", run_ok)
            + by_key(revision_part, "r.task_revision_id", "true")
        )
        where = ""
    else:
        joins = (
            f"JOIN {t(WorkerSession)} s ON s.id = l.session_id "
            f"JOIN {t(Attempt)} a ON a.id = l.attempt_id "
            f"JOIN {t(Run)} r ON r.id = l.run_id "
            f"JOIN {t(TaskRevision)} v ON v.id = r.task_revision_id "
        )
        where = f"WHERE {session_ok} AND {attempt_ok} AND {run_ok} "
    rows = f"SELECT {select} FROM l {joins}{where}ORDER BY l.id LIMIT %s"  # noqa: S608  (as above)
    return leases, rows


def _recovered_row(row: Sequence[Any]) -> RecoverableLease:
    loaded, _ = load_row(_RECOVERY_PARTS, row)
    lease, attempt, run, revision, session = loaded
    assert isinstance(lease, RunLease) and isinstance(attempt, Attempt)
    assert isinstance(run, Run) and isinstance(revision, TaskRevision)
    assert isinstance(session, WorkerSession)
    run.task_revision = revision
    lease.run, lease.attempt, lease.session = run, attempt, session
    return _recoverable(lease)


def _recoverable(lease: RunLease) -> RecoverableLease:
    run = lease.run
    attempt = lease.attempt
    revision = run.task_revision
    return RecoverableLease(
        lease_id=str(lease.pk),
        run_id=str(run.pk),
        attempt_id=str(attempt.pk),
        project_id=str(run.project_id),
        task_id=str(run.task_id),
        task_revision=revision.revision,
        executor_type=revision.executor_type,
        # The Attempt's copies, so a recovered offer orders exactly like the
        # candidate it was claimed from.
        priority=attempt.priority,
        queued_at=attempt.queued_at,
        worker_id=str(lease.worker_id),
        session_id=str(lease.session.session_id),
        session_generation=lease.session_generation,
        lease_generation=lease.lease_generation,
        spec_sha256=lease.spec_digest,
        expires_at=lease.expires_at,
        source=lease.source,
        placement_score=lease.placement_score,
        pull_id=None if lease.pull_id is None else str(lease.pull_id),
        token_digest=lease.token_digest,
        delivery_count=lease.delivery_count,
        last_delivered_at=lease.last_delivered_at,
        attempt_version=attempt.version,
    )


# --------------------------------------------------------- one cycle's memo


# The round-robin turn across Projects, kept for this process (docs/adr/0012).
fair_rotation = Rotation()


@dataclass
class CycleMemo:
    """What one cycle's candidate reads saw, for its plans (issue #12).

    A candidate row already names its Attempt, Run and pinned revision, and
    none of these ever changes for an Attempt (a Run is pinned to its
    revision at creation; revisions are immutable). So a plan for a
    candidate this cycle read needs no second read of the Attempt and its
    Run, and its revision comes from `revisions_read`. Bounded by what the
    cycle reads (its budget).
    """

    candidates: dict[str, tuple[Candidate, int]] = field(default_factory=dict)  # → revision pk
    # Told of each candidate planned: its Project had its turn (docs/adr/0012).
    rotation: Rotation = field(default_factory=lambda: fair_rotation)
    # Global scope: how many rows of the Worker snapshot the first walk reads
    # ahead (0: none), and those rows until the Worker source takes them.
    workers_ahead: int = 0
    worker_rows: list[Sequence[Any]] | None = None
    # The cycle's first walk, read with its first statement (global scope,
    # or a pull's snapshot), and a pull's first group's rows read with it.
    first_walk: FirstWalk | None = None
    first_rows: FirstRows | None = None


@dataclass(frozen=True)
class FirstRows:
    """The first candidates of one queue group read ahead (a pull's snapshot,
    `dispatch.cycles.pull_snapshot`): the rows `OrmQueueReader.rows` reads for
    it from its start at the cycle's `observed_at`, at most `limit`, each
    (attempt id, version, lease generation, run id, priority, queued_at,
    project id, task id, revision id, revision number, executor type)."""

    project_id: str
    revision_id: str
    limit: int
    rows: tuple[Sequence[Any], ...]


class _FirstRowsReader:
    """A `QueueReader` that serves one group's rows read ahead (`FirstRows`),
    once, to the first ask for that group from its start within their limit
    (a prefix of an ordered read is the shorter read), and reads the rest."""

    def __init__(self, reader: OrmQueueReader, first: FirstRows) -> None:
        self.reader = reader
        self.first: FirstRows | None = first
        self._group_of: dict[str, str] = {}

    @property
    def worker_rows(self) -> list[Sequence[Any]] | None:
        return self.reader.worker_rows

    def walk(self, *, start: WalkStart | None, cap: int) -> tuple[list[QueueGroup], bool]:
        return self.reader.walk(start=start, cap=cap)

    def revision_pk(self, candidate: Candidate) -> str:
        found = self._group_of.get(candidate.attempt_id)
        return self.reader.revision_pk(candidate) if found is None else found

    def rows(self, wanted: Sequence[RowsWanted]) -> Mapping[str, Sequence[Candidate]]:
        first, self.first = self.first, None
        served: list[Candidate] = []
        rest = list(wanted)
        if first is not None:
            for want in wanted:
                if (
                    (want.group.project_id, want.group.group_id)
                    == (first.project_id, first.revision_id)
                    and want.after is None
                    and (want.limit <= first.limit or len(first.rows) < first.limit)
                ):
                    served = [_first_row_candidate(row) for row in first.rows[: want.limit]]
                    rest.remove(want)
                    break
            else:
                first = None
        found = dict(self.reader.rows(rest)) if rest else {}
        if first is not None:
            for candidate in served:
                self._group_of[candidate.attempt_id] = first.revision_id
            found[first.revision_id] = served
        return found


def _first_row_candidate(row: Sequence[Any]) -> Candidate:
    attempt_id, version, generation, run_id, priority, queued_at = row[:6]
    project_id, task_id, _, number, executor_type = row[6:]
    return Candidate(
        run_id=str(run_id),
        attempt_id=str(attempt_id),
        project_id=str(project_id),
        task_id=str(task_id),
        task_revision=int(number),
        executor_type=str(executor_type),
        priority=int(priority),
        queued_at=_json_moment(queued_at),
        attempt_version=int(version),
        lease_generation=int(generation),
    )


def _json_moment(value: Any) -> datetime:
    moment = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    if moment.tzinfo is None:
        raise ValueError("a queued_at without its offset")
    return moment.astimezone(UTC)


@dataclass(frozen=True)
class _RevisionPlan:
    """A TaskRevision row with what every plan from it needs, worked out once.

    `definition` and `placement`: the row through the one shared validator
    (`runs.services.revision_definition`, `validate_placement`); None when
    that validator refuses it (then no plan is ever made from it).
    `template`: the revision's part of every spec made from it, through the
    spec validator once (`dispatch.core.spec.SpecTemplate`); None when the
    spec validator refuses it, and then each plan carries a plain spec that
    the cycle refuses as it always did.
    """

    revision: TaskRevision
    definition: TaskDefinition | None
    placement: Placement | None
    template: SpecTemplate | None = None


def _revision_plan(revision: TaskRevision) -> _RevisionPlan:
    try:
        definition = revision_definition(revision)
        placement = validate_placement(revision.placement)
    except SpecError:
        return _RevisionPlan(revision, None, None)
    try:
        template: SpecTemplate | None = SpecTemplate.of(definition)
    except SpecError:
        template = None
    return _RevisionPlan(revision, definition, placement, template)


class _Revisions:
    """TaskRevision rows by primary key, kept for this process (issue #12).

    A revision never changes (`ImmutableRevision`) and is never deleted while
    a Run points at it (PROTECT), so a row read once stays true, and so does
    what the shared validator says of it (`_RevisionPlan`); the cache saves
    the read and the validation. Bounded (least recently used out), thread-safe.
    """

    def __init__(self, size: int = 256) -> None:
        self._size = size
        self._rows: OrderedDict[int, _RevisionPlan] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, pk: int) -> _RevisionPlan | None:
        with self._lock:
            found = self._rows.get(pk)
            if found is not None:
                self._rows.move_to_end(pk)
                return found
        revision = TaskRevision.objects.filter(pk=pk).first()
        if revision is None:
            return None
        found = _revision_plan(revision)
        with self._lock:
            self._rows[pk] = found
            while len(self._rows) > self._size:
                self._rows.popitem(last=False)
        return found

    def read_missing(self, pks: set[int]) -> None:
        """Read the rows of `pks` not kept yet, in one statement (a page's
        candidates name a few revisions: one read, not one per revision)."""
        with self._lock:
            missing = [pk for pk in pks if pk not in self._rows]
        if len(missing) < 2:
            return  # none, or one: `get` reads it as cheaply
        found = {r.pk: _revision_plan(r) for r in TaskRevision.objects.filter(pk__in=missing)}
        with self._lock:
            for pk, plan in found.items():
                self._rows[pk] = plan
                self._rows.move_to_end(pk)
            while len(self._rows) > self._size:
                self._rows.popitem(last=False)

    def clear(self) -> None:
        """Forget every row (tests: a test database may reuse primary keys)."""
        with self._lock:
            self._rows.clear()


revisions_read = _Revisions()


# ----------------------------------------------------------------- candidates


class OrmCandidateSource:
    """Fair pages of candidates (docs/adr/0001 step 2, docs/adr/0012).

    Two statements per page, whatever the backlog (`dispatch.adapters.queue`):
    the walk over queue groups, which decides per group whether it can be
    served now, and the first Runs of the chosen groups.
    """

    def __init__(self, memo: CycleMemo | None = None) -> None:
        self.memo = memo

    def candidate_page(
        self,
        *,
        observed_at: datetime,
        cursor: str | None,
        limit: int,
        scope: DispatchScope | None = None,
    ) -> Page[Candidate]:
        _check_limit(limit)
        memo = self.memo
        ahead = 0 if memo is None or cursor is not None else memo.workers_ahead
        first_walk = None
        if memo is not None and cursor is None:
            first_walk, memo.first_walk = memo.first_walk, None
        read = OrmQueueReader(
            observed_at=observed_at, scope=scope, workers_ahead=ahead, first_walk=first_walk
        )
        reader: OrmQueueReader | _FirstRowsReader = read
        if memo is not None and cursor is None and memo.first_rows is not None:
            reader, memo.first_rows = _FirstRowsReader(read, memo.first_rows), None
        rotation = fair_rotation if memo is None else memo.rotation
        page = fair_page(reader, cursor=cursor, limit=limit, rotation=rotation)
        if memo is not None:
            if ahead:
                memo.worker_rows = reader.worker_rows
            for item in page.items:
                memo.candidates[item.attempt_id] = (item, int(reader.revision_pk(item)))
            # Their pinned revisions, each plan's next read: the ones not kept
            # yet in one statement (a new process, new Tasks).
            revisions_read.read_missing({pk for _, pk in memo.candidates.values()})
        return page


def _candidate(attempt: Attempt) -> Candidate:
    run = attempt.run
    revision = run.task_revision
    return Candidate(
        run_id=str(run.pk),
        attempt_id=str(attempt.pk),
        project_id=str(run.project_id),
        task_id=str(run.task_id),
        task_revision=revision.revision,
        executor_type=revision.executor_type,
        priority=attempt.priority,
        queued_at=attempt.queued_at,
        attempt_version=attempt.version,
        lease_generation=attempt.lease_generation,
    )


# -------------------------------------------------------------------- workers


def active_lease_count() -> Subquery:
    """The active leases of the outer WorkerSession row (slot usage), as a subquery."""
    return Subquery(
        RunLease.objects.filter(session=OuterRef("pk"), state=LeaseState.ACTIVE)
        .order_by()
        .values("session")
        .annotate(n=Count("id"))
        .values("n")[:1],
        output_field=IntegerField(),
    )


class OrmWorkerSnapshotSource:
    """Current ONLINE Sessions of ACTIVE Workers by worker id (docs/adr/0001 step 3).

    `session_page`: in session scope, the page the caller already read for
    exactly that Session (a pull's snapshot, `session_scope_record`), served
    without a read.

    `pages`: in global scope the first page's statement reads up to this many
    pages at once (the cycle's `worker_max_pages`: the snapshot reads every
    page until the fleet or that budget ends), and the next pages are served
    from it — the same rows, in the same pages, as one statement per page
    would read, from one snapshot, in one round trip (issue #12).
    """

    def __init__(
        self,
        *,
        session_page: tuple[WorkerRecord, ...] | None = None,
        pages: int = 1,
        memo: CycleMemo | None = None,
    ) -> None:
        self.session_page = session_page
        self.pages = pages
        # The rows the cycle's first walk read ahead (`CycleMemo.worker_rows`).
        self.memo = memo
        # The pages read ahead: (cursor, limit) -> page.
        self._ahead: dict[tuple[str, int], Page[WorkerRecord]] = {}

    def worker_page(
        self, *, scope: DispatchScope, cursor: str | None, limit: int
    ) -> Page[WorkerRecord]:
        _check_limit(limit)
        after = _id_cursor(cursor)
        if self.session_page is not None and scope.session is not None and after is None:
            return Page(self.session_page, None)
        if scope.session is None:
            if cursor is not None:
                ahead = self._ahead.pop((cursor, limit), None)
                if ahead is not None:
                    return ahead
            return self._global_pages(after, limit)
        # Draining Sessions/Workers keep their leases but take no new claims,
        # so they are not in the snapshot at all (only recovery sees them).
        qs: QuerySet[WorkerSession] = WorkerSession.objects.filter(policy.claimable_sessions_q())
        if scope.session is not None:
            session_uuid = _session_uuid(scope)
            if session_uuid is None or not scope.session.worker_id.isdigit():
                return Page((), None)
            # Exactly the authenticated Session, and only while it is still the
            # generation the request authenticated as (docs/adr/0001 step 8).
            qs = qs.filter(
                session_id=session_uuid,
                worker_id=int(scope.session.worker_id),
                generation=scope.session.session_generation,
            )
        if after is not None:
            qs = qs.filter(worker_id__gt=after)
        rows = list(
            qs.select_related("worker")
            .only(
                "id",
                "session_id",
                "generation",
                "executor_types",
                "labels",
                "slots",
                "worker__id",
                "worker__slots",
            )
            # Slot usage in the same query: no per-Session count (no N+1).
            .annotate(active_leases=Coalesce(active_lease_count(), 0))
            .order_by("worker_id")[: limit + 1]
        )
        page, more = rows[:limit], len(rows) > limit
        items = tuple(_worker_record(session) for session in page)
        return Page(items, str(page[-1].worker_id) if more else None)

    def _global_pages(self, after: int | None, limit: int) -> Page[WorkerRecord]:
        """The page after `after`; the first one reads `pages` pages ahead."""
        pages = self.pages if after is None else 1
        count = limit * pages + 1
        memo = self.memo
        if after is None and memo is not None and memo.worker_rows is not None:
            rows, memo.worker_rows = memo.worker_rows, None
            # The same rows `_global_worker_records` reads, read by the walk
            # (`dispatch.adapters.queue`) for exactly this many.
            records = (
                # PostgreSQL's text of a uuid is its canonical form already.
                _worker_records(rows, canonical_ids=True)
                if memo.workers_ahead == count
                else _global_worker_records(after, count)
            )
        else:
            records = _global_worker_records(after, count)
        self._ahead.clear()
        read: list[Page[WorkerRecord]] = []
        for start in range(0, limit * pages, limit):
            items = tuple(records[start : start + limit])
            more = len(records) > start + limit
            read.append(Page(items, items[-1].worker_id if more else None))
            if not more:
                break
        for before, page in itertools.pairwise(read):
            assert before.next_cursor is not None
            self._ahead[(before.next_cursor, limit)] = page
        return read[0]


_WORKER_PAGE_SQL: dict[tuple[str, bool], str] = {}


def _global_worker_records(after: int | None, count: int) -> list[WorkerRecord]:
    """The first `count` records of the global Worker snapshot after worker id
    `after`, in SQL written once per database (issue #12): every
    cycle reads it, and compiling the queryset cost more than running it.

    The same rows as the session-scope queryset above: `claimable_sessions_q`
    (the Session online, its Worker active), in worker id order, each with its
    active leases counted in the same statement (`active_leases_by_session_sql`).
    Prepared once per connection
    (its states literals, `qinglong.prepared`); each row becomes its record
    without a model instance, the Session's JSON read once per distinct text
    (`_capabilities`).
    """
    key = (connection.vendor, after is not None)
    sql = _WORKER_PAGE_SQL.get(key)
    if sql is None:
        qn = connection.ops.quote_name
        sql = _WORKER_PAGE_SQL[key] = (
            f"SELECT s.{qn('worker_id')}, s.{qn('session_id')}, s.{qn('generation')}, "  # noqa: S608  (names from model metadata; the states are the models' constants, state_literal; values are parameters)
            f"s.{qn('executor_types')}, s.{qn('labels')}, s.{qn('slots')}, w.{qn('slots')}, "
            "COALESCE(c.n, 0) "
            f"FROM {qn(WorkerSession._meta.db_table)} s "
            f"JOIN {qn(Worker._meta.db_table)} w ON w.{qn('id')} = s.{qn('worker_id')} "
            f"LEFT JOIN ({active_leases_by_session_sql()}) c ON c.session_id = s.{qn('id')} "
            f"WHERE s.{qn('state')} = {state_literal(SessionState.ONLINE)} "
            f"AND w.{qn('admin_state')} = {state_literal(WorkerAdminState.ACTIVE)} "
            + (f"AND s.{qn('worker_id')} > %s " if after is not None else "")
            + f"ORDER BY s.{qn('worker_id')} LIMIT %s"
        )
    params: list[Any] = [] if after is None else [after]
    params.append(count)
    with prepared_cursor() as cursor:
        cursor.execute(sql, int8_params(params))
        rows = cursor.fetchall()
    return _worker_records(rows)


def _worker_records(
    rows: Sequence[Sequence[Any]], *, canonical_ids: bool = False
) -> list[WorkerRecord]:
    """Records of rows of the global Worker snapshot: worker id, session id,
    generation, executor types and labels (their JSON text), the Session's and
    the Worker's slots, active leases (`WORKER_AHEAD_COLUMNS`).

    `canonical_ids`: each session id is `str(uuid.UUID)`'s text already (a
    uuid PostgreSQL wrote as text), taken as it is."""
    records = []
    for worker_id, session_id, generation, types, labels, slots, worker_slots, active in rows:
        executor_types, label_map = _capabilities(types, labels)
        records.append(
            WorkerRecord(
                worker_id=str(worker_id),
                session_id=session_id if canonical_ids else _uuid_text(session_id),
                session_generation=int(generation),
                executor_types=executor_types,
                labels=label_map,
                free_slots=free_slots(capacity(slots, worker_slots), int(active)),
            )
        )
    return records


def _uuid_text(value: Any) -> str:
    """A UUID column's value as `str(uuid.UUID)` (SQLite stores it as bare hex)."""
    return str(value if isinstance(value, uuid.UUID) else uuid.UUID(str(value)))


_CAPABILITIES: dict[tuple[str, str], tuple[frozenset[str], Mapping[str, str]]] = {}
_MAX_CAPABILITIES: Final = 1024


def _capabilities(types: Any, labels: Any) -> tuple[frozenset[str], Mapping[str, str]]:
    """A Session's executor types and labels from their JSON columns, as the
    model's JSON fields decode them. Sessions mostly share a few shapes, so each
    distinct text is decoded once per process (bounded); the labels are a
    read-only mapping, shared by every record with the same text."""
    if not (isinstance(types, str) and isinstance(labels, str)):
        # Already decoded (a driver that parses JSON itself): nothing to share.
        return _decoded_capabilities(types, labels)
    found = _CAPABILITIES.get((types, labels))
    if found is None:
        found = _decoded_capabilities(json.loads(types), json.loads(labels))
        if len(_CAPABILITIES) >= _MAX_CAPABILITIES:
            _CAPABILITIES.clear()
        _CAPABILITIES[(types, labels)] = found
    return found


def _decoded_capabilities(types: Any, labels: Any) -> tuple[frozenset[str], Mapping[str, str]]:
    return (
        frozenset(str(t) for t in types),
        MappingProxyType({str(k): str(v) for k, v in dict(labels).items()}),
    )


def session_scope_record(
    session: WorkerSession, scope: DispatchScope, *, takes_claims: bool, active_leases: int
) -> WorkerRecord | None:
    """The record `worker_page` lists in session scope for this Session row, if any.

    `takes_claims`: the row passed `leases.policy.claimable_sessions_q`;
    it must also be exactly the scope's Session, Worker and generation.
    """
    ref = scope.session
    if (
        ref is None
        or not takes_claims
        or str(session.session_id) != ref.session_id
        or str(session.worker_id) != ref.worker_id
        or session.generation != ref.session_generation
    ):
        return None
    session.active_leases = active_leases  # type: ignore[attr-defined]
    return _worker_record(session)


def _worker_record(session: WorkerSession) -> WorkerRecord:
    active: int = session.active_leases  # type: ignore[attr-defined]
    return WorkerRecord(
        worker_id=str(session.worker_id),
        session_id=str(session.session_id),
        session_generation=session.generation,
        executor_types=frozenset(str(t) for t in session.executor_types),
        labels={str(k): str(v) for k, v in dict(session.labels).items()},
        free_slots=free_slots(policy.session_capacity(session), active),
    )


# ----------------------------------------------------------------------- plans


class OrmPlanSource:
    """Re-materializes a plan from the Run's pinned revision (docs/adr/0001 step 4, §5).

    One query per plan, and only for the candidate the cycle is about to claim
    (the core calls `prepare` lazily, docs/adr/0001, Consequences: plans stay bounded).
    """

    def __init__(self, memo: CycleMemo | None = None) -> None:
        self.memo = memo

    def prepare(self, candidate: Candidate) -> DispatchPlan:
        if not candidate.attempt_id.isdigit() or not candidate.run_id.isdigit():
            raise PlanUnavailable("not a database id")
        remembered = self._remembered(candidate)
        if remembered is not None:
            assert self.memo is not None
            self.memo.rotation.served(candidate.project_id)
            # The candidate's ids are exactly the rows this cycle read.
            plan = remembered
            run_id, attempt_id = candidate.run_id, candidate.attempt_id
            project_id, task_id = candidate.project_id, candidate.task_id
        else:
            found = (
                Attempt.objects.select_related("run__task_revision")
                .filter(pk=int(candidate.attempt_id), run_id=int(candidate.run_id))
                .first()
            )
            if found is None:
                raise PlanUnavailable("the attempt or its run is gone")
            run = found.run
            plan = _revision_plan(run.task_revision)
            run_id, attempt_id = str(run.pk), str(found.pk)
            project_id, task_id = str(run.project_id), str(run.task_id)
        revision = plan.revision
        # The Run is pinned to one revision; a candidate built from another one
        # (drift) must not be materialized from whatever is there now.
        if revision.revision != candidate.task_revision:
            raise PlanUnavailable("the pinned revision does not match the candidate")
        if plan.definition is None or plan.placement is None:
            # A stored revision the shared validator now refuses cannot be
            # materialized: fail closed for this candidate (docs/adr/0002).
            raise PlanUnavailable("the pinned revision is not valid")
        # `runs.services.attempt_spec`, from the definition validated once;
        # with a template, only the Run's ids are validated and digested per
        # plan (the revision's part was, once).
        # An id the spec validator refuses makes a plain spec, which the cycle
        # refuses (`invalid_spec`) as it always did.
        spec: Mapping[str, object] | None = None
        if plan.template is not None:
            with contextlib.suppress(SpecError):
                spec = plan.template.spec(
                    run_id=run_id,
                    attempt_id=attempt_id,
                    project_id=project_id,
                    task_id=task_id,
                    task_revision=revision.revision,
                )
        if spec is None:
            spec = build_spec(
                run_id=run_id,
                attempt_id=attempt_id,
                project_id=project_id,
                task_id=task_id,
                task_revision=revision.revision,
                definition=plan.definition,
            )
        return DispatchPlan(
            run_id=run_id,
            attempt_id=attempt_id,
            project_id=project_id,
            task_id=task_id,
            task_revision=revision.revision,
            spec=spec,
            placement=plan.placement,
        )

    def _remembered(self, candidate: Candidate) -> _RevisionPlan | None:
        """The pinned revision of a candidate this cycle read, exactly as read,
        from `revisions_read`. None for anything else (a recovered lease, a
        candidate this cycle did not read, or one whose identity differs)."""
        if self.memo is None:
            return None
        seen = self.memo.candidates.get(candidate.attempt_id)
        if seen is None or seen[0] != candidate:
            return None
        return revisions_read.get(seen[1])


def orm_ports(
    *,
    clock: Clock | None = None,
    delivered: bool = False,
    recovery_known_empty: bool = False,
    session_page: tuple[WorkerRecord, ...] | None = None,
    worker_pages: int = 1,
    recovery_first_page: RecoveryFirstPage | None = None,
    workers_ahead: int = 0,
    first_walk: FirstWalk | None = None,
    first_rows: FirstRows | None = None,
) -> DispatchPorts:
    """The production wiring of one cycle: ORM sources sharing one `CycleMemo`,
    the one claim path, the database clock (or `clock`, already read).

    `delivered`: the caller hands out every won claim's offer at once
    (`dispatch.cycles.dispatch_cycle`), so each lease is written delivered
    and needs no telemetry write after the cycle. `recovery_known_empty`
    and `session_page`: what a pull's snapshot already read at the cycle's
    `observed_at` (`OrmLeaseRecoverySource`, `OrmWorkerSnapshotSource`).
    `workers_ahead` (global scope): the cycle's first walk also reads that
    many rows of the Worker snapshot — its pages' rows and one more — which
    its first Worker page then serves (`dispatch.adapters.queue`);
    `first_walk`: that walk, already read with the cycle's first statement
    (`dispatch.cycles.global_start`, `pull_snapshot`), served to its first
    candidate page; `first_rows`: a pull's first group's rows read with it.
    """
    memo = CycleMemo(workers_ahead=workers_ahead, first_walk=first_walk, first_rows=first_rows)
    return DispatchPorts(
        recovery=OrmLeaseRecoverySource(
            known_empty=recovery_known_empty, first_page=recovery_first_page
        ),
        candidates=OrmCandidateSource(memo),
        workers=OrmWorkerSnapshotSource(session_page=session_page, pages=worker_pages, memo=memo),
        plans=OrmPlanSource(memo),
        claims=DatabaseClaimPort(delivered=delivered),
        clock=clock or DatabaseClock(),
    )
