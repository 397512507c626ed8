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

import threading
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from django.db import connection
from django.db.models import Count, IntegerField, OuterRef, QuerySet, Subquery
from django.db.models.functions import Coalesce

from dispatch.adapters.queue import OrmQueueReader
from dispatch.core.budget import HARD_CAPS
from dispatch.core.errors import SpecError
from dispatch.core.fairness import Rotation, fair_page
from dispatch.core.placement import validate_placement
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
from leases import policy
from leases.claim import DatabaseClaimPort
from leases.models import LeaseState, RunLease
from qinglong.clock import DatabaseClock
from qinglong.rows import ModelColumns, load_row
from runs.models import Attempt, AttemptState, Run, RunState, TaskRevision
from runs.services import attempt_spec
from workers.models import (
    SESSION_CURRENT_STATES,
    SessionState,
    Worker,
    WorkerAdminState,
    WorkerSession,
)

__all__ = [
    "CycleMemo",
    "OrmCandidateSource",
    "OrmLeaseRecoverySource",
    "OrmPlanSource",
    "OrmWorkerSnapshotSource",
    "active_lease_count",
    "fair_rotation",
    "orm_ports",
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
    """

    def __init__(self, *, known_empty: bool = False) -> None:
        self.known_empty = known_empty

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
        session_uuid = None
        if scope.session is not None:
            session_uuid = _session_uuid(scope)
            if session_uuid is None:
                return Page((), None)
        sql = _recovery_sql(
            session=session_uuid is not None, due=due_before is not None, after=after is not None
        )
        adapt = connection.ops.adapt_datetimefield_value
        params: list[Any] = [
            adapt(observed_at),
            *SESSION_CURRENT_STATES,
            LeaseState.ACTIVE,
            AttemptState.CLAIMED,
            RunState.DISPATCHING,
            False,
            max_deliveries,
        ]
        if session_uuid is not None:
            params.append(_SESSION_ID_FIELD.get_db_prep_value(session_uuid, connection))
        if due_before is not None:
            params.append(adapt(due_before))
        if after is not None:
            params.append(after)
        params.append(limit + 1)
        with connection.cursor() as db:
            db.execute(sql, params)
            rows = db.fetchall()
        items = tuple(_recovered_row(row) for row in rows[:limit])
        return Page(items, items[-1].lease_id if len(rows) > limit else None)


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
    if found is not None:
        return found
    qn = connection.ops.quote_name

    def t(model: Any) -> str:
        return str(qn(model._meta.db_table))

    found = _RECOVERY_SQL[key] = (
        f"SELECT {', '.join(part.select() for part in _RECOVERY_PARTS)} "  # noqa: S608  (names from model metadata; values are parameters)
        f"FROM {t(RunLease)} l "
        f"JOIN {t(WorkerSession)} s ON s.id = l.session_id "
        f"JOIN {t(Attempt)} a ON a.id = l.attempt_id "
        f"JOIN {t(Run)} r ON r.id = l.run_id "
        f"JOIN {t(TaskRevision)} v ON v.id = r.task_revision_id "
        "WHERE l.expires_at > %s AND s.state IN (%s, %s) "
        "AND s.generation = l.session_generation AND l.state = %s "
        "AND a.state = %s AND a.lease_generation = l.lease_generation "
        "AND r.state = %s AND r.cancel_requested = %s AND l.delivery_count < %s "
        + ("AND s.session_id = %s " if session else "")
        + ("AND (l.last_delivered_at IS NULL OR l.last_delivered_at <= %s) " if due else "")
        + ("AND l.id > %s " if after else "")
        + "ORDER BY l.id LIMIT %s"
    )
    return found


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


class _Revisions:
    """TaskRevision rows by primary key, kept for this process (issue #12).

    A revision never changes (`ImmutableRevision`) and is never deleted while
    a Run points at it (PROTECT), so a row read once stays true; the cache
    only saves the read. Bounded (least recently used out), thread-safe.
    """

    def __init__(self, size: int = 256) -> None:
        self._size = size
        self._rows: OrderedDict[int, TaskRevision] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, pk: int) -> TaskRevision | None:
        with self._lock:
            revision = self._rows.get(pk)
            if revision is not None:
                self._rows.move_to_end(pk)
                return revision
        revision = TaskRevision.objects.filter(pk=pk).first()
        if revision is not None:
            with self._lock:
                self._rows[pk] = revision
                while len(self._rows) > self._size:
                    self._rows.popitem(last=False)
        return revision

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
        reader = OrmQueueReader(observed_at=observed_at, scope=scope)
        rotation = fair_rotation if self.memo is None else self.memo.rotation
        page = fair_page(reader, cursor=cursor, limit=limit, rotation=rotation)
        if self.memo is not None:
            for item in page.items:
                self.memo.candidates[item.attempt_id] = (item, int(reader.revision_pk(item)))
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
    """

    def __init__(self, *, session_page: tuple[WorkerRecord, ...] | None = None) -> None:
        self.session_page = session_page

    def worker_page(
        self, *, scope: DispatchScope, cursor: str | None, limit: int
    ) -> Page[WorkerRecord]:
        _check_limit(limit)
        after = _id_cursor(cursor)
        if self.session_page is not None and scope.session is not None and after is None:
            return Page(self.session_page, None)
        if scope.session is None:
            return _global_worker_page(after, limit)
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


_SESSION_ROW = ModelColumns(
    WorkerSession,
    "s",
    only=("id", "session_id", "worker", "generation", "executor_types", "labels", "slots"),
)
_WORKER_PAGE_SQL: dict[tuple[str, bool], str] = {}


def _global_worker_page(after: int | None, limit: int) -> Page[WorkerRecord]:
    """The global Worker page in SQL written once per database (issue #12): every
    cycle reads it, and compiling the queryset cost more than running it.

    The same rows as the session-scope queryset above: `claimable_sessions_q`
    (the Session online, its Worker active), in worker id order, each with its
    active leases counted in the same statement.
    """
    key = (connection.vendor, after is not None)
    sql = _WORKER_PAGE_SQL.get(key)
    if sql is None:
        qn = connection.ops.quote_name
        sql = _WORKER_PAGE_SQL[key] = (
            f"SELECT {_SESSION_ROW.select()}, w.{qn('slots')}, "  # noqa: S608  (names from model metadata; values are parameters)
            f"(SELECT count(*) FROM {qn(RunLease._meta.db_table)} l "
            f"WHERE l.{qn('session_id')} = s.{qn('id')} AND l.{qn('state')} = %s) "
            f"FROM {qn(WorkerSession._meta.db_table)} s "
            f"JOIN {qn(Worker._meta.db_table)} w ON w.{qn('id')} = s.{qn('worker_id')} "
            f"WHERE s.{qn('state')} = %s AND w.{qn('admin_state')} = %s "
            + (f"AND s.{qn('worker_id')} > %s " if after is not None else "")
            + f"ORDER BY s.{qn('worker_id')} LIMIT %s"
        )
    params: list[Any] = [LeaseState.ACTIVE, SessionState.ONLINE, WorkerAdminState.ACTIVE]
    if after is not None:
        params.append(after)
    params.append(limit + 1)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    width = len(_SESSION_ROW)
    records = []
    for row in rows[:limit]:
        session = _SESSION_ROW.load(row[:width])
        worker_slots, active = row[width], row[width + 1]
        records.append(
            WorkerRecord(
                worker_id=str(session.worker_id),
                session_id=str(session.session_id),
                session_generation=session.generation,
                executor_types=frozenset(str(t) for t in session.executor_types),
                labels={str(k): str(v) for k, v in dict(session.labels).items()},
                free_slots=free_slots(capacity(session.slots, worker_slots), int(active)),
            )
        )
    more = len(rows) > limit
    return Page(tuple(records), records[-1].worker_id if more else None)


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
            attempt, run, revision = remembered
            assert self.memo is not None
            self.memo.rotation.served(candidate.project_id)
        else:
            found = (
                Attempt.objects.select_related("run__task_revision")
                .filter(pk=int(candidate.attempt_id), run_id=int(candidate.run_id))
                .first()
            )
            if found is None:
                raise PlanUnavailable("the attempt or its run is gone")
            attempt, run, revision = found, found.run, found.run.task_revision
        # The Run is pinned to one revision; a candidate built from another one
        # (drift) must not be materialized from whatever is there now.
        if revision.revision != candidate.task_revision:
            raise PlanUnavailable("the pinned revision does not match the candidate")
        try:
            spec = attempt_spec(attempt=attempt, run=run, revision=revision)
            placement = validate_placement(revision.placement)
        except SpecError:
            # A stored revision the shared validator now refuses cannot be
            # materialized: fail closed for this candidate (docs/adr/0002).
            raise PlanUnavailable("the pinned revision is not valid") from None
        return DispatchPlan(
            run_id=str(run.pk),
            attempt_id=str(attempt.pk),
            project_id=str(run.project_id),
            task_id=str(run.task_id),
            task_revision=revision.revision,
            spec=spec,
            placement=placement,
        )

    def _remembered(self, candidate: Candidate) -> tuple[Attempt, Run, TaskRevision] | None:
        """The rows of a candidate this cycle read, exactly as read; the revision
        from `revisions_read`. None for anything else (a recovered lease, a
        candidate this cycle did not read, or one whose identity differs)."""
        if self.memo is None:
            return None
        seen = self.memo.candidates.get(candidate.attempt_id)
        if seen is None or seen[0] != candidate:
            return None
        revision_pk = seen[1]
        revision = revisions_read.get(revision_pk)
        if revision is None:
            return None
        run = Run(
            pk=int(candidate.run_id),
            project_id=int(candidate.project_id),
            task_id=int(candidate.task_id),
            task_revision_id=revision_pk,
        )
        attempt = Attempt(pk=int(candidate.attempt_id), run_id=run.pk)
        return attempt, run, revision


def orm_ports(
    *,
    clock: Clock | None = None,
    delivered: bool = False,
    recovery_known_empty: bool = False,
    session_page: tuple[WorkerRecord, ...] | None = None,
) -> DispatchPorts:
    """The production wiring of one cycle: ORM sources sharing one `CycleMemo`,
    the one claim path, the database clock (or `clock`, already read).

    `delivered`: the caller hands out every won claim's offer at once
    (`dispatch.cycles.dispatch_cycle`), so each lease is written delivered
    and needs no telemetry write after the cycle. `recovery_known_empty`
    and `session_page`: what a pull's snapshot already read at the cycle's
    `observed_at` (`OrmLeaseRecoverySource`, `OrmWorkerSnapshotSource`).
    """
    memo = CycleMemo()
    return DispatchPorts(
        recovery=OrmLeaseRecoverySource(known_empty=recovery_known_empty),
        candidates=OrmCandidateSource(memo),
        workers=OrmWorkerSnapshotSource(session_page=session_page),
        plans=OrmPlanSource(memo),
        claims=DatabaseClaimPort(delivered=delivered),
        clock=clock or DatabaseClock(),
    )
