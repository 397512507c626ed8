"""The Django entry point of the dispatcher: one bounded cycle, recorded.

`dispatch_cycle` is what the Worker pull endpoint (session scope), the Celery
beat task and `manage.py dispatch_once` / `run_dispatcher` (global scope) call.
It wraps the pure `dispatch_once` (docs/adr/0001) with what only Django can do:
the operator kill switch, max-delivery revocation, delivery telemetry on the
leases, the content-free notification of Sessions, and the redacted
`DispatchCycle` record. Only `DispatchCycleResult.summary()` is ever logged or
stored — never an offer, a spec or a token (docs/adr/0003).

Recording is aggregated per process (`CycleRecorder`, issue #12): the first
cycle of each outcome (scope, status, reason) in a window of
`QL_CYCLE_SUMMARY_S` seconds is written at once (one row, one INFO line); the
rest of that window's cycles with the same outcome become one summary row
(`cycles` = how many, counts summed) when the window closes, the process
stops, or at exit. An idle box therefore writes about two rows a minute per
process instead of one per cycle and per pull; a rejected cycle (a port broke
its contract) is always a row of its own.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from django.conf import settings
from django.db import connection
from django.utils import timezone

from dispatch.adapters.orm import (
    FirstRows,
    RecoveryFirstPage,
    fair_rotation,
    orm_ports,
    recovery_page_from,
    recovery_parts,
    recovery_width,
    session_scope_record,
)
from dispatch.adapters.queue import FirstWalk, walk_params, walk_sql
from dispatch.core.budget import DispatchBudget
from dispatch.core.cycle import dispatch_once
from dispatch.core.fairness import WALK_CAP
from dispatch.core.offer import ClaimedExecutionOffer, OfferSource
from dispatch.core.ports import DispatchScope, PullCredential, Scope, WorkerRecord
from dispatch.core.result import CycleStatus, DispatchCycleResult
from dispatch.models import DispatchControl, DispatchCycle
from leases.end import leases_revoke_over_delivered
from leases.errors import Outcome
from leases.models import LeaseState, RunLease
from leases.renew import leases_record_delivery
from qinglong.clock import db_now
from qinglong.metrics import cycle_observed
from qinglong.prepared import int8_params, prepared_cursor, state_literal
from qinglong.rows import ModelColumns
from runs.models import Attempt, AttemptState, Run, RunState
from workers.models import (
    SESSION_CURRENT_STATES,
    SessionState,
    Worker,
    WorkerAdminState,
    WorkerSession,
)

__all__ = [
    "CycleRecorder",
    "GlobalStart",
    "NullOfferNotifier",
    "OfferNotifier",
    "PullSnapshot",
    "cycle_recorder",
    "dispatch_budget",
    "dispatch_cycle",
    "dispatch_paused",
    "dispatch_set_paused",
    "global_start",
    "pull_snapshot",
]

logger = logging.getLogger("qinglong.dispatch")

_CONTROL_PK = 1


class OfferNotifier(Protocol):
    """Tells each target Session that it has an offer; never carries content.

    docs/adr/0003: in global scope nothing pushes a spec or token
    anywhere. An implementation may send only ids (session id, offer id); the
    Worker then pulls, and session-scope recovery re-materializes the offer.
    """

    def notify(self, offers: Sequence[ClaimedExecutionOffer]) -> None: ...


class NullOfferNotifier:
    """The embedded default: Workers poll `pull` on their own cadence."""

    def notify(self, offers: Sequence[ClaimedExecutionOffer]) -> None:
        return None


_BUDGETS: dict[tuple[tuple[str, object], ...], DispatchBudget] = {}


def dispatch_budget() -> DispatchBudget:
    """The budget from `settings.QINGLONG_DISPATCH` (validated: fail loudly).

    Validated once per distinct content of the setting (every cycle asks;
    a test or an operator that changes it gets the new budget, checked)."""
    values = settings.QINGLONG_DISPATCH
    key = tuple(sorted(values.items()))
    try:
        budget = _BUDGETS.get(key)
    except TypeError:  # an unhashable value: invalid anyway, let validation say why
        return DispatchBudget.from_mapping(values)
    if budget is None:
        budget = DispatchBudget.from_mapping(values)
        if len(_BUDGETS) < 64:  # a handful in practice; never unbounded
            _BUDGETS[key] = budget
    return budget


def dispatch_paused() -> bool:
    """The operator kill switch (DispatchControl pk=1; no row = running)."""
    paused = DispatchControl.objects.filter(pk=_CONTROL_PK).values_list("paused", flat=True).first()
    return bool(paused)


class _ReadClock:
    """The `Clock` port over a time already read from the database."""

    def __init__(self, now: datetime) -> None:
        self._now = now

    def now(self) -> datetime:
        return self._now


def _paused_and_clock() -> tuple[bool, datetime | None]:
    """The kill switch and the database clock in one statement on PostgreSQL.

    The clock is the cycle's `observed_at` (docs/adr/0001 step 1); elsewhere
    it is left to the cycle's own clock port (the process clock on SQLite).
    """
    if connection.vendor != "postgresql":
        return dispatch_paused(), None
    table = connection.ops.quote_name(DispatchControl._meta.db_table)
    with prepared_cursor() as cursor:
        cursor.execute(
            f"SELECT statement_timestamp(), (SELECT paused FROM {table} WHERE id = %s)",  # noqa: S608  (a model's table name)
            [_CONTROL_PK],
        )
        row = cursor.fetchone()
    assert row is not None
    now: datetime = row[0]
    return bool(row[1]), now.astimezone(UTC)


@dataclass(frozen=True)
class GlobalStart:
    """What a global cycle reads first, in one statement (issue #12): the kill
    switch, the clock (`observed_at`), the first recovery page at that clock
    and, when that page is empty, the first walk of the candidate read with
    the Worker rows ahead (`walk`; None: not read)."""

    observed_at: datetime
    paused: bool
    recovery: RecoveryFirstPage
    walk: FirstWalk | None = None


_GLOBAL_START_SQL: dict[str, str] = {}


def global_start(budget: DispatchBudget, *, workers_ahead: int = 0) -> GlobalStart | None:
    """The kill switch, the clock, the first global recovery page and the first
    walk (PostgreSQL; None: read them the long way).

    The same recovery page `OrmLeaseRecoverySource` reads (its SQL,
    `recovery_parts`) at the statement's own clock, which is the cycle's
    `observed_at`; the cycle's first recovery read is then served from it.
    Paused, the statement reads no lease. Neither paused nor with a lease to
    re-deliver (then the cycle claims nothing new), it also walks the queue
    groups from this process's turn (`fair_rotation`) as the cycle's first
    candidate page would, at that clock, with `workers_ahead` Worker rows
    (`dispatch.adapters.queue.walk_sql`): the walk is then served from it.
    One round trip instead of three.
    """
    if connection.vendor != "postgresql":
        return None
    sql = _GLOBAL_START_SQL.get(connection.vendor)
    if sql is None:
        leases, rows = recovery_parts(session=False, due=True, after=False, clock=True)
        width = recovery_width()
        names = ", ".join(f"c{i}" for i in range(width))
        table = connection.ops.quote_name(DispatchControl._meta.db_table)
        walk_ctes, walk_body, _ = walk_sql(DispatchScope.global_(), workers_ahead=True, clock=True)
        walked = ", ".join(f"wr.{name}" for name in _WALK_COLUMNS[:-2])
        sql = _GLOBAL_START_SQL[connection.vendor] = (
            f"WITH RECURSIVE h AS (SELECT statement_timestamp() AS now, "  # noqa: S608  (names from model metadata; values are parameters)
            f"COALESCE((SELECT c.paused FROM {table} c WHERE c.id = %s), false) AS paused), "
            # Paused: the one-time filter runs before the page, which is not read.
            f"{leases}, x({names}) AS (SELECT * FROM ({rows}) y WHERE NOT (SELECT paused FROM h)), "
            f"{walk_ctes} "
            "SELECT h.now, h.paused, CASE WHEN h.paused OR EXISTS (SELECT 1 FROM x) THEN NULL "
            f"ELSE (SELECT COALESCE(json_agg(json_build_array({walked}) "
            f"ORDER BY wr.part, wr.n), '[]') FROM ({walk_body}) "
            f"AS wr({', '.join(_WALK_COLUMNS)})) END, "
            "x.* FROM h LEFT JOIN x ON true ORDER BY x.c0"
        )
    backoff = timedelta(seconds=budget.redelivery_backoff_s)
    limit = budget.recovery_page_size
    walk_from = fair_rotation.start()
    params = [_CONTROL_PK, budget.max_deliveries, backoff, False, limit + 1]
    params += walk_params(
        walk_from,
        WALK_CAP,
        DispatchScope.global_(),
        workers_ahead=workers_ahead,
        workers_column=True,
    )
    with prepared_cursor() as cursor:
        cursor.execute(sql, int8_params(params))
        rows_read = cursor.fetchall()
    now: datetime = rows_read[0][0]
    observed_at = now.astimezone(UTC)
    found = [row[3:] for row in rows_read if row[3] is not None]
    walked_rows = rows_read[0][2]
    return GlobalStart(
        observed_at=observed_at,
        paused=bool(rows_read[0][1]),
        recovery=RecoveryFirstPage(
            observed_at=observed_at,
            due_before=observed_at - backoff,
            max_deliveries=budget.max_deliveries,
            limit=limit,
            page=recovery_page_from(found, limit),
        ),
        walk=(
            None
            if walked_rows is None
            else FirstWalk(
                start=walk_from,
                cap=WALK_CAP,
                workers_ahead=workers_ahead,
                rows=tuple(tuple(row) for row in walked_rows),
            )
        ),
    )


# The columns of the walk read with the global start (`walk_sql` with `clock`):
# its ten, the Worker rows ahead, and the row's place.
_WALK_COLUMNS = (*(f"w{i}" for i in range(11)), "part", "n")


@dataclass(frozen=True)
class PullSnapshot:
    """What a pull's cycle reads before its candidates, in one statement (issue #12).

    All of it at the cycle's `observed_at` (the statement's clock): the kill
    switch; whether the Session has leases to revoke for over-delivery
    (`leases.selectors.over_delivered_leases`) or to re-deliver
    (`dispatch.adapters.orm.OrmLeaseRecoverySource`); and the Session as the
    Worker snapshot lists it in session scope (`session_page`: its record,
    or none when it takes no claims).
    """

    observed_at: datetime
    paused: bool
    over_delivered: bool
    recoverable: bool
    session_page: tuple[WorkerRecord, ...]
    # The cycle's first walk, read at that clock when the cycle may claim
    # (None: not read): neither paused, nor over-delivered, nor anything to
    # re-deliver, and the Session takes claims.
    walk: FirstWalk | None = None
    # With the walk, when it found exactly one servable group (the candidate
    # page then asks for that group's rows alone): its first rows (else None).
    rows: FirstRows | None = None


def pull_snapshot(
    scope: DispatchScope, *, session_pk: int | None, max_deliveries: int, page_size: int = 8
) -> PullSnapshot | None:
    """The lean start of a pull's cycle (PostgreSQL); None: read it the long way.

    Four reads of the plain cycle — the kill switch and the clock, the
    over-delivered leases, the recovery page, the Session's record — and its
    first candidate page's walk and rows become one: the recovery page and
    the Worker page of the cycle are then served from it when it found
    nothing to re-deliver, and the first walk and, when it found exactly one
    servable group (a pull's common case: then the page reads that group's
    rows alone), that group's first rows (`FirstRows`: from its start, at
    most `page_size` and its rooms) when it walked (`orm_ports`). The statement
    is SQL written once (a pull is the hottest request; compiling it as a
    queryset cost 5 ms of CPU), each part the SQL form of its port's filter:
    `leases.selectors.over_delivered_leases`,
    `dispatch.adapters.orm.OrmLeaseRecoverySource` (in session scope, at the
    statement's own clock), `leases.policy.claimable_sessions_q`, and the
    walk of `dispatch.adapters.queue.walk_sql` in this scope from this
    process's turn (`fair_rotation`) at that clock with the rows read's filter
    for its one servable group — both run only when the cycle may claim
    (neither paused, nor over-delivered, nor anything to re-deliver, and the
    Session takes claims); the tests hold each part to its port.
    """
    if connection.vendor != "postgresql" or scope.session is None:
        return None
    try:
        session_key = uuid.UUID(scope.session.session_id)
    except ValueError:
        return None
    sql = _snapshot_sql(scope, by_pk=session_pk is not None)
    params: list[Any] = [_CONTROL_PK, max_deliveries, max_deliveries, session_key]
    if session_pk is not None:
        params.append(session_pk)
    walk_from = fair_rotation.start()
    params += walk_params(walk_from, WALK_CAP, scope, workers_ahead=0)
    params += [page_size, page_size, page_size, WALK_CAP]
    # Prepared once per connection: planning it cost the server about ten
    # times as much as running it (qinglong.prepared).
    with prepared_cursor() as cursor:
        cursor.execute(sql, int8_params(params))
        row = cursor.fetchone()
    if row is None:
        return None
    observed_at, paused = row[0], row[1]
    width = len(_SNAPSHOT_SESSION)
    session = _SNAPSHOT_SESSION.load(row[2 : 2 + width])
    worker_slots, takes_claims, active, over_delivered, recoverable, walked, first = row[
        2 + width :
    ]
    session.worker = Worker(pk=session.worker_id, slots=worker_slots)
    record = session_scope_record(
        session, scope, takes_claims=bool(takes_claims), active_leases=int(active)
    )
    return PullSnapshot(
        observed_at=observed_at.astimezone(UTC),
        paused=bool(paused),
        over_delivered=bool(over_delivered),
        recoverable=bool(recoverable),
        session_page=() if record is None else (record,),
        walk=(
            None
            if walked is None
            else FirstWalk(
                start=walk_from,
                cap=WALK_CAP,
                workers_ahead=0,
                rows=tuple(tuple(row) for row in walked),
            )
        ),
        rows=(
            None
            if first is None
            else FirstRows(
                project_id=str(first[0]),
                revision_id=str(first[1]),
                limit=int(first[2]),
                rows=tuple(tuple(row) for row in first[3]),
            )
        ),
    )


_SNAPSHOT_SESSION = ModelColumns(
    WorkerSession,
    "s",
    only=("id", "session_id", "worker", "generation", "executor_types", "labels", "slots"),
)
_SNAPSHOT_SQL: dict[tuple[str, bool, str], str] = {}

# The columns of the session-scope walk read with the snapshot (`walk_sql`
# with `clock`): its ten and the row's place.
_SESSION_WALK_COLUMNS = (*(f"w{i}" for i in range(10)), "part", "n")


def _snapshot_sql(scope: DispatchScope, *, by_pk: bool) -> str:
    walk_ctes, walk_body, _ = walk_sql(scope, workers_ahead=False, clock=True)
    key = (connection.vendor, by_pk, walk_ctes)
    found = _SNAPSHOT_SQL.get(key)
    if found is not None:
        return found
    qn = connection.ops.quote_name

    def t(model: Any) -> str:
        return str(qn(model._meta.db_table))

    # The states are constants of the text, not parameters: the statement is
    # prepared (qinglong.prepared), and only a literal `l.state = 'active'`
    # lets a generic plan use the partial index `runlease_active_session` —
    # with a parameter it would read every lease the Session ever held.
    online, active = state_literal(SessionState.ONLINE), state_literal(WorkerAdminState.ACTIVE)
    lease_active, claimed = state_literal(LeaseState.ACTIVE), state_literal(AttemptState.CLAIMED)
    current = ", ".join(state_literal(state) for state in SESSION_CURRENT_STATES)
    dispatching = state_literal(RunState.DISPATCHING)
    queued, pending = state_literal(RunState.QUEUED), state_literal(AttemptState.PENDING)
    # The walk's rows as `OrmQueueReader.walk` takes a walk read ahead: its
    # ten columns and, last, the Worker rows' column (none in session scope).
    walked = ", ".join(f"wk.{name}" for name in _SESSION_WALK_COLUMNS[:-2])
    # `snap` is MATERIALIZED: inlined, each of its subqueries (the leases'
    # EXISTS) would run once per reference — for its column and each CASE.
    may_claim = (
        "NOT (snap.paused OR snap.over_delivered OR snap.recoverable OR NOT snap.takes_claims)"
    )
    found = _SNAPSHOT_SQL[key] = f"""
        WITH RECURSIVE snap AS MATERIALIZED (SELECT statement_timestamp() AS now,
            COALESCE((SELECT c.paused FROM {t(DispatchControl)} c WHERE c.id = %s), false)
                AS paused,
            {_SNAPSHOT_SESSION.select()}, w.slots AS w_slots,
            (s.state = {online} AND w.admin_state = {active}) AS takes_claims,
            (SELECT count(*) FROM {t(RunLease)} l
             WHERE l.session_id = s.id AND l.state = {lease_active}) AS active_leases,
            EXISTS (
                SELECT 1 FROM {t(RunLease)} l JOIN {t(Attempt)} a ON a.id = l.attempt_id
                WHERE l.session_id = s.id AND l.state = {lease_active} AND l.delivery_count >= %s
                  AND a.state = {claimed}
            ) AS over_delivered,
            EXISTS (
                SELECT 1 FROM {t(RunLease)} l
                JOIN {t(Attempt)} a ON a.id = l.attempt_id
                JOIN {t(Run)} r ON r.id = l.run_id
                WHERE l.session_id = s.id AND l.expires_at > statement_timestamp()
                  AND s.state IN ({current}) AND s.generation = l.session_generation
                  AND l.state = {lease_active} AND a.state = {claimed}
                  AND a.lease_generation = l.lease_generation
                  AND r.state = {dispatching} AND NOT r.cancel_requested AND l.delivery_count < %s
            ) AS recoverable
        FROM {t(WorkerSession)} s JOIN {t(Worker)} w ON w.id = s.worker_id
        WHERE s.session_id = %s {"AND s.id = %s" if by_pk else ""}),
        {walk_ctes},
        wk AS MATERIALIZED (SELECT * FROM ({walk_body}) AS wr({", ".join(_SESSION_WALK_COLUMNS)})),
        fg AS (
            SELECT c.w0, c.w1, c.w3, c.w4, LEAST(%s,
                CASE WHEN c.w5 = 0 THEN %s ELSE c.w5 - c.w7 END,
                CASE WHEN c.w6 = 0 THEN %s ELSE c.w6 - c.w8 END) AS lim,
                count(*) OVER () AS servable
            FROM (SELECT * FROM wk ORDER BY wk.part, wk.n LIMIT %s) c
            WHERE c.w9 = 1 AND (c.w5 = 0 OR c.w5 > c.w7) AND (c.w6 = 0 OR c.w6 > c.w8)
            ORDER BY c.part, c.n LIMIT 1
        )
        SELECT snap.*,
            CASE WHEN {may_claim} THEN (SELECT COALESCE(json_agg(json_build_array({walked}, NULL)
                ORDER BY wk.part, wk.n), '[]') FROM wk) END,
            CASE WHEN {may_claim} THEN (SELECT json_build_array(fg.w0, fg.w1, fg.lim, (
                SELECT COALESCE(json_agg(json_build_array(g.id, g.version, g.lease_generation,
                    g.run_id, g.priority, g.queued_at, g.project_id, g.task_id,
                    g.task_revision_id, fg.w3, fg.w4)
                    ORDER BY g.priority DESC, g.queued_at, g.run_id), '[]')
                FROM (
                    SELECT a.id, a.version, a.lease_generation, r.id AS run_id, r.priority,
                        r.queued_at, r.project_id, r.task_id, r.task_revision_id
                    FROM {t(Run)} r JOIN {t(Attempt)} a ON a.run_id = r.id
                    WHERE r.state = {queued} AND r.project_id = fg.w0
                      AND r.task_revision_id = fg.w1 AND a.state = {pending}
                      AND NOT r.cancel_requested
                      AND (a.not_before IS NULL OR a.not_before <= statement_timestamp())
                    ORDER BY r.priority DESC, r.queued_at, r.id LIMIT fg.lim
                ) g)) FROM fg WHERE fg.servable = 1) END
        FROM snap
    """  # noqa: S608  (names from model metadata; the states are the models' own constants, checked by state_literal; values are parameters)
    return found


def dispatch_set_paused(*, paused: bool, reason: str = "", actor: str = "") -> None:
    DispatchControl.objects.update_or_create(
        pk=_CONTROL_PK,
        defaults={"paused": paused, "reason": reason[:200], "updated_by": actor[:150]},
    )
    logger.info(
        "dispatch paused" if paused else "dispatch resumed",
        extra={"event": "dispatch_paused" if paused else "dispatch_resumed", "actor": actor[:150]},
    )


def _ensure_no_outer_transaction() -> None:
    # lease_claim commits each claim on its own (atomic(durable=True)): inside
    # an outer transaction a rollback would erase leases whose offers were
    # already handed out. Test-case wrappers are the one allowed exception,
    # exactly as Django's durable check allows them.
    blocks = getattr(connection, "atomic_blocks", [])
    if connection.in_atomic_block and not all(
        getattr(block, "_from_testcase", False) for block in blocks
    ):
        raise RuntimeError("dispatch_cycle must not run inside a transaction")


def _session_pk(scope: DispatchScope, session_pk: int | None) -> int | None:
    if session_pk is not None or scope.session is None:
        return session_pk
    try:
        session_uuid = uuid.UUID(scope.session.session_id)
    except ValueError:
        return None
    return (
        WorkerSession.objects.filter(session_id=session_uuid).values_list("pk", flat=True).first()
    )


def _revoke_over_delivered(*, session_pk: int, max_deliveries: int) -> int:
    """Before a pull: past max_deliveries without a starting ACK, this Session's
    lease is revoked; its Attempt returns to pending and waits one redelivery
    backoff (any Worker, this one included, may take it then), or fails its Run
    `undeliverable` after `max_delivery_rounds` such revokes (docs/adr/0005)."""
    outcomes = leases_revoke_over_delivered(max_deliveries=max_deliveries, session_pk=session_pk)
    return sum(outcome is Outcome.APPLIED for outcome in outcomes)


OutcomeKey = tuple[str, str, str]  # (scope, status, reason)


@dataclass
class _Pending:
    """The cycles of one outcome not written yet in the current window."""

    started_at: datetime
    observed_at: datetime | None = None
    cycles: int = 0
    duration_ms: int = 0
    truncated: bool = False
    counts: Counter[str] = field(default_factory=Counter)
    sessions: set[uuid.UUID | None] = field(default_factory=set)

    def add(self, result: DispatchCycleResult, session_id: uuid.UUID | None) -> None:
        self.observed_at = result.observed_at or self.observed_at
        self.cycles += 1
        self.duration_ms += result.duration_ms
        self.truncated = self.truncated or result.truncated
        self.counts.update(result.counts.as_dict())
        self.sessions.add(session_id)


def _window_s() -> float:
    return float(settings.QINGLONG_CYCLE_SUMMARY_S)


class CycleRecorder:
    """Writes DispatchCycle rows for one process: a new outcome at once, repeats summed.

    Thread-safe (a web process runs pulls on several threads). The first
    cycle of an outcome in the current window is one row and one INFO line,
    exactly its `summary()`; later cycles of that outcome in the window are
    added to one pending summary, written as one row (`cycles` > 1 possible,
    counts summed, `started_at` the first cycle's, `observed_at` the last
    one's, `session_id` only when every cycle was the same Session's) when
    the window is over, on `flush()` (the dispatcher loop's stop, a Celery
    worker's shutdown) and at interpreter exit. A rejected cycle is always
    written at once. What a summary sums is never lost while the process
    lives; a process killed without running its exit handlers loses at most
    one window of repeats (never a first occurrence, never a rejection).
    """

    def __init__(
        self,
        *,
        window_s: Callable[[], float] = _window_s,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._window_s = window_s
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._window_started = monotonic()
        self._seen: set[OutcomeKey] = set()
        self._pending: dict[OutcomeKey, _Pending] = {}
        self._exit_hook = False

    def record(self, result: DispatchCycleResult, *, scope: DispatchScope) -> bool:
        """Record one cycle; True when it was written as a row of its own."""
        # Every cycle, written now or summed later: the Prometheus counters.
        cycle_observed(result)
        session_id = None if scope.session is None else _uuid_or_none(scope.session.session_id)
        key: OutcomeKey = (str(result.scope), str(result.status), str(result.reason))
        now = self._monotonic()
        with self._lock:
            due: dict[OutcomeKey, _Pending] = {}
            if now - self._window_started >= self._window_s():
                due, self._pending, self._seen = self._pending, {}, set()
                self._window_started = now
            first = key not in self._seen or result.status is CycleStatus.REJECTED
            if first:
                self._seen.add(key)
            else:
                pending = self._pending.get(key)
                if pending is None:
                    pending = self._pending[key] = _Pending(started_at=_started_at(result))
                pending.add(result, session_id)
            if not self._exit_hook:
                # Repeats still pending when the process ends are written then.
                atexit.register(self._flush_at_exit)
                self._exit_hook = True
        _write_summaries(due)
        if first:
            _write_row(result, session_id=session_id)
        elif logger.isEnabledFor(logging.DEBUG):  # the summary is built only to be logged
            logger.debug("dispatch cycle", extra={"event": "dispatch_cycle", **result.summary()})
        return first

    def flush(self) -> int:
        """Write every pending summary now; returns how many rows were written."""
        with self._lock:
            due, self._pending = self._pending, {}
        return _write_summaries(due)

    def reset(self) -> None:
        """Forget everything (tests): the next cycle of any outcome is written at once."""
        with self._lock:
            self._pending, self._seen = {}, set()
            self._window_started = self._monotonic()

    def _flush_at_exit(self) -> None:
        try:
            self.flush()
        except Exception:  # noqa: BLE001  (the database may be gone at exit)
            logger.warning(
                "pending dispatch cycle summaries not written at exit",
                extra={"event": "dispatch_cycle_summary_lost"},
            )


def _uuid_or_none(value: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(value)
    except ValueError:
        return None


def _started_at(result: DispatchCycleResult) -> datetime:
    # observed_at is the database clock at cycle start; a paused cycle never
    # read it, so the process clock stands in.
    return result.observed_at or timezone.now()


def _write_row(result: DispatchCycleResult, *, session_id: uuid.UUID | None) -> None:
    summary = result.summary()
    DispatchCycle.objects.create(
        started_at=_started_at(result),
        observed_at=result.observed_at,
        duration_ms=result.duration_ms,
        scope=str(result.scope),
        status=str(result.status),
        reason=str(result.reason),
        truncated=result.truncated,
        counts=result.counts.as_dict(),
        session_id=session_id,
        cycles=1,
    )
    logger.info("dispatch cycle", extra={"event": "dispatch_cycle", **summary})


def _write_summaries(due: dict[OutcomeKey, _Pending]) -> int:
    rows = [
        DispatchCycle(
            started_at=pending.started_at,
            observed_at=pending.observed_at,
            duration_ms=min(pending.duration_ms, _MAX_DURATION_MS),
            scope=scope,
            status=status,
            reason=reason,
            truncated=pending.truncated,
            counts=dict(pending.counts),
            session_id=next(iter(pending.sessions)) if len(pending.sessions) == 1 else None,
            cycles=pending.cycles,
        )
        for (scope, status, reason), pending in due.items()
        if pending.cycles
    ]
    if not rows:
        return 0
    DispatchCycle.objects.bulk_create(rows)
    for row in rows:
        logger.info(
            "dispatch cycles",
            extra={
                "event": "dispatch_cycle_summary",
                "scope": row.scope,
                "status": row.status,
                "reason": row.reason,
                "cycles": row.cycles,
                "truncated": row.truncated,
                "duration_ms": row.duration_ms,
                "counts": row.counts,
            },
        )
    return len(rows)


# PositiveIntegerField: a summed duration never overflows the column.
_MAX_DURATION_MS = 2**31 - 1

# The one recorder of this process.
cycle_recorder = CycleRecorder()


def dispatch_cycle(
    *,
    scope: DispatchScope,
    pull: PullCredential | None = None,
    max_offers: int | None = None,
    session_pk: int | None = None,
    notifier: OfferNotifier | None = None,
) -> DispatchCycleResult:
    """Run and record one bounded dispatch cycle (docs/adr/0001).

    Session scope (a Worker's pull) needs `pull`; its offers are the pull
    response. Global scope hands its offers, content-free, to `notifier`.
    Must not be called inside a transaction: each claim commits on its own.
    """
    _ensure_no_outer_transaction()
    budget = dispatch_budget()
    snapshot = (
        pull_snapshot(
            scope,
            session_pk=session_pk,
            max_deliveries=budget.max_deliveries,
            page_size=budget.candidate_page_size,
        )
        if scope.kind is Scope.SESSION
        else None
    )
    # Global scope: the snapshot's pages and the row saying whether more
    # follow, read with the first walk (one statement fewer per claiming cycle).
    ahead = (
        budget.worker_page_size * budget.worker_max_pages + 1 if scope.kind is Scope.GLOBAL else 0
    )
    start = global_start(budget, workers_ahead=ahead) if scope.kind is Scope.GLOBAL else None
    observed_at: datetime | None
    if snapshot is not None:
        is_paused, observed_at = snapshot.paused, snapshot.observed_at
    elif start is not None:
        is_paused, observed_at = start.paused, start.observed_at
    else:
        is_paused, observed_at = _paused_and_clock()
    if is_paused:
        paused = DispatchCycleResult.paused(scope.kind)
        cycle_recorder.record(paused, scope=scope)
        return paused
    if scope.kind is Scope.SESSION and (snapshot is None or snapshot.over_delivered):
        pk = _session_pk(scope, session_pk)
        if pk is not None and _revoke_over_delivered(
            session_pk=pk, max_deliveries=budget.max_deliveries
        ):
            # A revoke just wrote the Attempt's `not_before`: the cycle must
            # observe a moment after it, not the one read before (nor the
            # snapshot read with it).
            observed_at, snapshot = None, None
    result = dispatch_once(
        scope=scope,
        budget=budget,
        ports=orm_ports(
            clock=None if observed_at is None else _ReadClock(observed_at),
            delivered=True,
            recovery_known_empty=snapshot is not None and not snapshot.recoverable,
            session_page=None if snapshot is None else snapshot.session_page,
            worker_pages=budget.worker_max_pages if scope.kind is Scope.GLOBAL else 1,
            recovery_first_page=None if start is None else start.recovery,
            workers_ahead=ahead,
            first_walk=(
                snapshot.walk if snapshot is not None else None if start is None else start.walk
            ),
            first_rows=None if snapshot is None else snapshot.rows,
        ),
        secret=str(settings.QINGLONG_LEASE_SECRET).encode(),
        pull=pull,
        max_offers=max_offers,
    )
    redelivered = [o for o in result.offers if o.source is OfferSource.LEASE_RECOVERY]
    if redelivered:
        # Telemetry (never authority), on the database clock: a pull counts
        # toward max_deliveries, at most once per redelivery backoff (a
        # re-poll inside it is not a delivery, docs/adr/0005); a global
        # announcement only restarts the backoff (docs/adr/0002). A new
        # claim's lease was written delivered by the claim itself (`orm_ports`).
        leases_record_delivery(
            (offer.lease.lease_id for offer in redelivered),
            # The cycle's own reading of that clock (observed_at): one
            # statement fewer, a few milliseconds earlier.
            now=result.observed_at or db_now(),
            count=scope.kind is Scope.SESSION,
        )
    cycle_recorder.record(result, scope=scope)
    if scope.kind is Scope.GLOBAL and result.offers:
        _notify(notifier or NullOfferNotifier(), result.offers)
    return result


def _notify(notifier: OfferNotifier, offers: Sequence[ClaimedExecutionOffer]) -> None:
    try:
        notifier.notify(offers)
    except Exception:
        # The leases are committed and recovery re-delivers them once the
        # backoff passes (docs/adr/0002), so a failed nudge costs latency, not work.
        logger.exception(
            "offer notification failed",
            extra={"event": "offer_notify_failed", "offers": len(offers)},
        )
