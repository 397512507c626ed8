"""In-memory fakes of every dispatcher port, over one shared store.

Shipped beside the ports (procrastinate's `testing.py` style) so the core's
tests, the contract suite and other apps' unit tests use the same fakes. They
honour the port contracts in `dispatch.core.ports` — keyset order, filters,
page limits, the claim's checks in the database's order — so one contract
suite (`dispatch/tests/test_port_contract.py`) runs against them and the ORM
adapters.

Port objects keep no state of their own beyond call logs: a "restart" is simply
new port objects over the same `FakeStore`. These fakes are well behaved; the
deliberately broken variants that prove the cycle fails closed live with the
tests that use them (`dispatch/tests/core/misbehaving.py`), on the `_page`,
`_in_scope`, `_is_live`, `_plan` and `_claim` hooks below.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final, TypeVar

from dispatch.core import policy
from dispatch.core.budget import HARD_CAPS, DispatchBudget
from dispatch.core.errors import SpecError
from dispatch.core.fairness import (
    QueueGroup,
    Rotation,
    RowsWanted,
    WalkStart,
    candidate_key,
    candidate_order,
    fair_page,
)
from dispatch.core.placement import placement_score
from dispatch.core.policy import MAX_DELIVERIES_REASON, UNDELIVERABLE_REASON
from dispatch.core.ports import (
    Candidate,
    CandidateSource,
    ClaimOutcome,
    ClaimPort,
    ClaimRequest,
    ClaimStatus,
    Clock,
    DispatchPlan,
    DispatchPorts,
    DispatchScope,
    LeaseRecoverySource,
    Page,
    PlanUnavailable,
    RecoverableLease,
    RunDispatchPlanSource,
    SessionRef,
    WorkerRecord,
    WorkerSnapshotSource,
    id_sort_key,
)
from dispatch.core.spec import TaskDefinition, build_spec, validate_task_definition

__all__ = [
    "DEFAULT_NOW",
    "MAX_DELIVERIES_REASON",
    "UNDELIVERABLE_REASON",
    "FakeCandidateSource",
    "FakeClaimPort",
    "FakeClock",
    "FakeLeaseRecoverySource",
    "FakePlanSource",
    "FakeStore",
    "FakeWorkerSnapshotSource",
    "fake_ports",
    "keyset_page",
]

DEFAULT_NOW: Final = datetime(2026, 7, 18, 12, 0, tzinfo=UTC)
_DEFAULT_BUDGET: Final = DispatchBudget()
R = TypeVar("R")


class FakeClock:
    """The Clock port; time moves only when a test says so."""

    def __init__(self, now: datetime = DEFAULT_NOW) -> None:
        if now.tzinfo is None:
            raise ValueError("FakeClock needs a tz-aware datetime")
        self._now = now
        self.calls = 0

    def now(self) -> datetime:
        self.calls += 1
        return self._now

    def advance(self, seconds: float) -> datetime:
        self._now += timedelta(seconds=seconds)
        return self._now


# ---------------------------------------------------------------- store rows


@dataclass
class FakeProject:
    project_id: str
    max_concurrent_runs: int = 0  # 0: no quota


@dataclass
class FakeTask:
    project_id: str
    task_id: str
    revisions: dict[int, TaskDefinition]
    current_revision: int


@dataclass
class FakeRun:
    run_id: str
    project_id: str
    task_id: str
    task_revision: int
    executor_type: str
    priority: int
    queued_at: datetime
    state: str = "queued"  # queued | dispatching | running | ...
    cancel_requested: bool = False


@dataclass
class FakeAttempt:
    attempt_id: str
    run_id: str
    # Copies of the Run's, as in the database: candidates and recovered leases
    # order by the Attempt's own copy.
    priority: int
    queued_at: datetime
    state: str = "pending"  # pending | claimed | starting | ...
    version: int = 1
    lease_generation: int = 0
    # Not claimable before this instant (None: now), as Attempt.not_before.
    not_before: datetime | None = None
    error_code: str = ""


@dataclass
class FakeSession:
    session_id: str
    generation: int
    slots: int
    state: str = "online"  # online | draining | offline | replaced


@dataclass
class FakeWorker:
    worker_id: str
    executor_types: frozenset[str]
    labels: dict[str, str]
    slots: int
    admin_state: str = "active"  # active | draining | disabled
    session: FakeSession | None = None


@dataclass
class FakeLease:
    lease_id: str
    attempt_id: str
    run_id: str
    worker_id: str
    session_id: str
    session_generation: int
    lease_generation: int
    token_digest: str
    spec_sha256: str
    placement_score: int | None
    source: str
    pull_id: str | None
    claimed_at: datetime
    expires_at: datetime
    state: str = "active"  # active | released | expired | revoked
    end_reason: str = ""
    delivery_count: int = 0
    last_delivered_at: datetime | None = None


class FakeStore:
    """Shared in-memory state: what the database is to the ORM adapters."""

    def __init__(self, now: datetime = DEFAULT_NOW) -> None:
        self.clock = FakeClock(now)
        self.projects: dict[str, FakeProject] = {}
        self.tasks: dict[str, FakeTask] = {}
        self.runs: dict[str, FakeRun] = {}
        self.attempts: dict[str, FakeAttempt] = {}
        self.workers: dict[str, FakeWorker] = {}
        self.leases: dict[str, FakeLease] = {}
        # Distinct ranges make a mixed-up id fail loudly instead of matching.
        self._next = {"project": 1, "task": 10, "run": 100, "attempt": 1000, "worker": 1}
        self._next_lease = 5000
        self._next_session = 1
        # The round-robin turn across Projects (a "process" of these ports).
        self.rotation = Rotation()

    # -- ids --------------------------------------------------------------------

    def _new_id(self, kind: str) -> str:
        value = self._next[kind]
        self._next[kind] = value + 1
        return str(value)

    def _new_session(self, generation: int, slots: int) -> FakeSession:
        number = self._next_session
        self._next_session += 1
        return FakeSession(f"00000000-0000-4000-8000-{number:012d}", generation, slots)

    # -- projects, tasks and runs ---------------------------------------------------

    def add_task(
        self,
        *,
        definition: Mapping[str, object] | TaskDefinition,
        project_id: str | None = None,
        max_concurrent_runs: int = 0,
    ) -> tuple[str, str, int]:
        """A Task at revision 1 (in a new Project unless `project_id` names one);
        returns (project_id, task_id, revision)."""
        if project_id is None:
            project_id = self._new_id("project")
            self.projects[project_id] = FakeProject(project_id, max_concurrent_runs)
        else:
            self.projects.setdefault(project_id, FakeProject(project_id, max_concurrent_runs))
        task_id = self._new_id("task")
        self.tasks[task_id] = FakeTask(
            project_id=project_id,
            task_id=task_id,
            revisions={1: _definition(definition)},
            current_revision=1,
        )
        return project_id, task_id, 1

    def edit_task(self, task_id: str, definition: Mapping[str, object] | TaskDefinition) -> int:
        """An edit is a new immutable revision; existing Runs stay pinned."""
        task = self.tasks[task_id]
        task.current_revision += 1
        task.revisions[task.current_revision] = _definition(definition)
        return task.current_revision

    def rewrite_revision(
        self, task_id: str, revision: int, definition: Mapping[str, object] | TaskDefinition
    ) -> None:
        """Corrupt a frozen revision in place: the drift recovery must catch."""
        self.tasks[task_id].revisions[revision] = _definition(definition)

    def drop_revision(self, task_id: str, revision: int) -> None:
        del self.tasks[task_id].revisions[revision]

    def add_run(
        self,
        *,
        task_id: str,
        priority: int = 0,
        queued_at: datetime | None = None,
        revision: int | None = None,
    ) -> tuple[str, str]:
        """A queued Run pinned to `revision` (default current) with a pending Attempt."""
        task = self.tasks[task_id]
        pinned = task.current_revision if revision is None else revision
        run_id, attempt_id = self._new_id("run"), self._new_id("attempt")
        queued = self.clock.now() if queued_at is None else queued_at
        self.runs[run_id] = FakeRun(
            run_id=run_id,
            project_id=task.project_id,
            task_id=task_id,
            task_revision=pinned,
            executor_type=task.revisions[pinned].executor_type,
            priority=priority,
            queued_at=queued,
        )
        self.attempts[attempt_id] = FakeAttempt(
            attempt_id=attempt_id, run_id=run_id, priority=priority, queued_at=queued
        )
        return run_id, attempt_id

    def cancel_run(self, run_id: str) -> None:
        self.runs[run_id].cancel_requested = True

    def start_attempt(self, attempt_id: str) -> None:
        """The `starting` ACK: from here the spec is never re-delivered (docs/adr/0002)."""
        attempt = self.attempts[attempt_id]
        attempt.state = "starting"
        attempt.version += 1
        self.runs[attempt.run_id].state = "running"

    def live_leases(self, project_id: str, *, task_id: str | None = None) -> int:
        """Active leases not past `expires_at` of the Project's (or the Task's) Runs:
        the slots their `max_concurrent_runs` count (`leases.quota`)."""
        now = self.clock.now()
        return sum(
            1
            for lease in self.leases.values()
            if lease.state == "active"
            and policy.lease_is_live(lease.expires_at, now)
            and self.runs[lease.run_id].project_id == project_id
            and (task_id is None or self.runs[lease.run_id].task_id == task_id)
        )

    def project_has_room(self, project_id: str) -> bool:
        """`max_concurrent_runs`: live leases of the Project's Runs hold a place
        (active and not past `expires_at`, as `leases.quota` counts)."""
        limit = self.projects[project_id].max_concurrent_runs
        return not limit or self.live_leases(project_id) < limit

    def task_has_room(self, run: FakeRun) -> bool:
        """The pinned revision's `max_concurrent_runs`: live leases of the Task's Runs
        hold a place (active and not past `expires_at`, as `leases.quota` counts)."""
        limit = self.tasks[run.task_id].revisions[run.task_revision].policy.max_concurrent_runs
        if not limit:
            return True
        now = self.clock.now()
        busy = sum(
            1
            for lease in self.leases.values()
            if lease.state == "active"
            and policy.lease_is_live(lease.expires_at, now)
            and self.runs[lease.run_id].task_id == run.task_id
        )
        return busy < limit

    # -- workers ------------------------------------------------------------------

    def add_worker(
        self,
        *,
        executor_types: Iterable[str] = ("process",),
        labels: Mapping[str, str] | None = None,
        slots: int = 1,
        session_slots: int | None = None,
        worker_id: str | None = None,
    ) -> SessionRef:
        """A Worker with one online Session (generation 1).

        The Session asks for `session_slots` (default: the Worker's) and gets at
        most the Worker's, as a Session open does.
        """
        wid = worker_id if worker_id is not None else self._new_id("worker")
        self.workers[wid] = FakeWorker(
            worker_id=wid,
            executor_types=frozenset(executor_types),
            labels=dict(labels or {}),
            slots=slots,
            session=self._new_session(1, policy.capacity(session_slots or slots, slots)),
        )
        return self.session_ref(wid)

    def session_ref(self, worker_id: str) -> SessionRef:
        session = self.workers[worker_id].session
        if session is None:
            raise KeyError(worker_id)
        return SessionRef(worker_id, session.session_id, session.generation)

    def replace_session(self, worker_id: str, *, slots: int | None = None) -> SessionRef:
        """Open a new Session: the old one is fenced (state replaced)."""
        worker = self.workers[worker_id]
        old = worker.session
        if old is not None:
            old.state = "replaced"
        worker.session = self._new_session(
            (old.generation if old else 0) + 1,
            policy.capacity(slots or worker.slots, worker.slots),
        )
        return self.session_ref(worker_id)

    def set_session_state(self, worker_id: str, state: str) -> None:
        session = self.workers[worker_id].session
        if session is not None:
            session.state = state

    def free_slots(self, worker_id: str) -> int:
        """min(Session slots, Worker slots) minus the Session's active leases."""
        worker = self.workers[worker_id]
        session = worker.session
        if session is None:
            return 0
        busy = sum(
            1
            for lease in self.leases.values()
            if lease.state == "active"
            and lease.worker_id == worker_id
            and lease.session_id == session.session_id
            and lease.session_generation == session.generation
        )
        return policy.free_slots(policy.capacity(session.slots, worker.slots), busy)

    def is_current_session(self, ref: SessionRef, states: Collection[str]) -> bool:
        worker = self.workers.get(ref.worker_id)
        if worker is None or worker.session is None:
            return False
        return (
            worker.session.session_id == ref.session_id
            and worker.session.generation == ref.session_generation
            and worker.session.state in states
        )

    # -- leases -------------------------------------------------------------------

    def record_delivery(self, lease_id: str, at: datetime | None = None) -> None:
        """Telemetry only (docs/adr/0002); feeds the redelivery backoff filter."""
        lease = self.leases[lease_id]
        lease.delivery_count += 1
        lease.last_delivered_at = self.clock.now() if at is None else at

    def record_pull(
        self,
        lease_id: str,
        at: datetime | None = None,
        *,
        redelivery_backoff_s: int = _DEFAULT_BUDGET.redelivery_backoff_s,
    ) -> bool:
        """A Worker's pull delivering the lease, counted as `leases.renew` counts it.

        docs/adr/0005: it counts toward max_deliveries only when the last
        counted delivery is at least one redelivery backoff old; a re-poll
        inside the backoff changes nothing. True when it counted.
        """
        lease = self.leases[lease_id]
        now = self.clock.now() if at is None else at
        last = lease.last_delivered_at
        if lease.state != "active" or (
            last is not None and last > now - timedelta(seconds=redelivery_backoff_s)
        ):
            return False
        lease.delivery_count += 1
        lease.last_delivered_at = now
        return True

    def expire_leases(self) -> int:
        """The expiry sweeper: a claimed Attempt goes back to pending."""
        now = self.clock.now()
        expired = [
            lease
            for lease in self.leases.values()
            if lease.state == "active" and not policy.lease_is_live(lease.expires_at, now)
        ]
        for lease in expired:
            self._end_lease(lease, "expired", reason="lease_expired")
        return len(expired)

    def revoke_lease(self, lease_id: str, *, reason: str) -> bool:
        """Revoke one active lease; False when it had already ended."""
        lease = self.leases[lease_id]
        if lease.state != "active":
            return False
        self._end_lease(lease, "revoked", reason=reason)
        return True

    def revoke_over_delivered(
        self,
        *,
        max_deliveries: int,
        redelivery_backoff_s: int = _DEFAULT_BUDGET.redelivery_backoff_s,
        max_delivery_rounds: int = _DEFAULT_BUDGET.max_delivery_rounds,
    ) -> int:
        """The over-delivery sweep: claimed leases pulled `max_deliveries` times.

        As `leases.end` (docs/adr/0005): the Attempt waits one redelivery
        backoff and is then claimable by any Worker, the same one included;
        the `max_delivery_rounds`-th revoke fails its Run `undeliverable`.
        """
        over = [
            lease
            for lease in self.leases.values()
            if lease.state == "active"
            and lease.delivery_count >= max_deliveries
            and self.attempts[lease.attempt_id].state == "claimed"
        ]
        for lease in over:
            self._end_lease(lease, "revoked", reason=MAX_DELIVERIES_REASON)
            attempt = self.attempts[lease.attempt_id]
            if attempt.state != "pending":
                continue
            rounds = sum(
                1
                for other in self.leases.values()
                if other.attempt_id == attempt.attempt_id
                and other.end_reason == MAX_DELIVERIES_REASON
            )
            if rounds < max_delivery_rounds:
                attempt.not_before = self.clock.now() + timedelta(seconds=redelivery_backoff_s)
            else:
                attempt.state = "start_failed"
                attempt.error_code = UNDELIVERABLE_REASON
                self.runs[attempt.run_id].state = "failed"
        return len(over)

    def _end_lease(self, lease: FakeLease, state: str, *, reason: str) -> None:
        # Only a claimed Attempt is modelled: it returns to pending and its Run
        # to queued. (A started one is lost and the retry policy decides; the
        # dispatcher never sees it again, so the fakes do not model it.)
        lease.state = state
        lease.end_reason = reason
        attempt = self.attempts[lease.attempt_id]
        if attempt.lease_generation == lease.lease_generation and attempt.state == "claimed":
            attempt.state = "pending"
            attempt.version += 1
            self.runs[attempt.run_id].state = "queued"

    def defer_attempt(self, attempt_id: str, until: datetime | None) -> None:
        """Set an Attempt's `not_before` (a retry held back, docs/adr/0005)."""
        attempt = self.attempts[attempt_id]
        attempt.not_before = until
        attempt.version += 1

    def active_lease_for(self, attempt_id: str) -> FakeLease | None:
        return next(
            (
                lease
                for lease in self.leases.values()
                if lease.attempt_id == attempt_id and lease.state == "active"
            ),
            None,
        )

    def insert_lease(self, request: ClaimRequest) -> FakeLease:
        lease_id = str(self._next_lease)
        self._next_lease += 1
        now = self.clock.now()
        lease = FakeLease(
            lease_id=lease_id,
            attempt_id=request.attempt_id,
            run_id=request.run_id,
            worker_id=request.worker_id,
            session_id=request.session_id,
            session_generation=request.session_generation,
            lease_generation=request.lease_generation,
            token_digest=request.token_digest,
            spec_sha256=request.spec_sha256,
            placement_score=request.placement_score,
            source=request.source,
            pull_id=request.pull_id,
            claimed_at=now,
            expires_at=now + timedelta(seconds=request.lease_ttl_s),
        )
        self.leases[lease_id] = lease
        return lease

    # -- the surface the contract suite's store builder uses ------------------------

    def advance(self, seconds: float) -> datetime:
        return self.clock.advance(seconds)

    def ports(self) -> DispatchPorts:
        return fake_ports(self)


def _definition(value: Mapping[str, object] | TaskDefinition) -> TaskDefinition:
    return value if isinstance(value, TaskDefinition) else validate_task_definition(value)


# ---------------------------------------------------------------- paging


def keyset_page(
    rows: list[R],
    *,
    key: Callable[[R], tuple[Any, ...]],
    after: tuple[Any, ...] | None,
    encode: Callable[[R], str],
    limit: int,
) -> Page[R]:
    """The rows after `after` (rows already sorted by `key`), at most `limit`."""
    remaining = rows if after is None else [row for row in rows if key(row) > after]
    items = remaining[:limit]
    more = len(remaining) > len(items)
    return Page(tuple(items), encode(items[-1]) if more and items else None)


_MAX_LIMIT: Final = HARD_CAPS["page_size"]


def _check_limit(limit: int) -> None:
    # The same bounds as the ORM adapters: the core never asks for more than a
    # hard-capped page.
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= _MAX_LIMIT:
        raise ValueError(f"limit must be an integer from 1 to {_MAX_LIMIT}")


class _PagedSource:
    """Call log and the paging hook shared by the three paged sources."""

    def __init__(self, store: FakeStore) -> None:
        self.store = store
        self.calls: list[dict[str, object]] = []

    def _page(
        self,
        rows: list[R],
        *,
        key: Callable[[R], tuple[Any, ...]],
        after: tuple[Any, ...] | None,
        encode: Callable[[R], str],
        cursor: str | None,
        limit: int,
    ) -> Page[R]:
        return keyset_page(rows, key=key, after=after, encode=encode, limit=limit)


# ---------------------------------------------------------------- ports


class FakeLeaseRecoverySource(_PagedSource):
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
        self.calls.append(
            {
                "scope": scope,
                "observed_at": observed_at,
                "due_before": due_before,
                "max_deliveries": max_deliveries,
                "cursor": cursor,
                "limit": limit,
            }
        )
        _check_limit(limit)
        rows = sorted(
            (
                self._as_recoverable(lease)
                for lease in self.store.leases.values()
                if self._eligible(lease, scope, observed_at, due_before, max_deliveries)
            ),
            key=lambda row: id_sort_key(row.lease_id),
        )
        return self._page(
            rows,
            key=lambda row: id_sort_key(row.lease_id),
            after=None if cursor is None else id_sort_key(cursor),
            encode=lambda row: row.lease_id,
            cursor=cursor,
            limit=limit,
        )

    def _eligible(
        self,
        lease: FakeLease,
        scope: DispatchScope,
        observed_at: datetime,
        due_before: datetime | None,
        max_deliveries: int,
    ) -> bool:
        store = self.store
        attempt = store.attempts[lease.attempt_id]
        run = store.runs[lease.run_id]
        ref = SessionRef(lease.worker_id, lease.session_id, lease.session_generation)
        return (
            lease.state == "active"
            and attempt.state == "claimed"
            and attempt.lease_generation == lease.lease_generation
            and run.state == "dispatching"
            and not run.cancel_requested
            and self._is_live(lease, observed_at)
            and store.is_current_session(ref, ("online", "draining"))
            and self._in_scope(scope, ref)
            and (
                due_before is None
                or lease.last_delivered_at is None
                or lease.last_delivered_at <= due_before
            )
            and lease.delivery_count < max_deliveries
        )

    def _is_live(self, lease: FakeLease, observed_at: datetime) -> bool:
        return policy.lease_is_live(lease.expires_at, observed_at)

    def _in_scope(self, scope: DispatchScope, ref: SessionRef) -> bool:
        return scope.session is None or scope.session == ref

    def _as_recoverable(self, lease: FakeLease) -> RecoverableLease:
        run = self.store.runs[lease.run_id]
        attempt = self.store.attempts[lease.attempt_id]
        return RecoverableLease(
            lease_id=lease.lease_id,
            run_id=run.run_id,
            attempt_id=attempt.attempt_id,
            project_id=run.project_id,
            task_id=run.task_id,
            task_revision=run.task_revision,
            executor_type=run.executor_type,
            priority=attempt.priority,
            queued_at=attempt.queued_at,
            worker_id=lease.worker_id,
            session_id=lease.session_id,
            session_generation=lease.session_generation,
            lease_generation=lease.lease_generation,
            spec_sha256=lease.spec_sha256,
            expires_at=lease.expires_at,
            source=lease.source,
            placement_score=lease.placement_score,
            pull_id=lease.pull_id,
            token_digest=lease.token_digest,
            delivery_count=lease.delivery_count,
            last_delivered_at=lease.last_delivered_at,
            attempt_version=attempt.version,
        )


class FakeCandidateSource(_PagedSource):
    """Fair pages (`dispatch.core.fairness`) over the store's queue groups.

    `emitted`, shared with the `FakePlanSource` of the same ports (as the ORM
    adapters share a `CycleMemo`), collects the candidates handed out, so a
    plan for one of them tells the rotation that its Project had its turn.
    """

    def __init__(self, store: FakeStore, emitted: set[str] | None = None) -> None:
        super().__init__(store)
        self.emitted = emitted

    def candidate_page(
        self,
        *,
        observed_at: datetime,
        cursor: str | None,
        limit: int,
        scope: DispatchScope | None = None,
    ) -> Page[Candidate]:
        self.calls.append({"observed_at": observed_at, "cursor": cursor, "limit": limit})
        _check_limit(limit)
        reader = FakeQueueReader(self.store, observed_at=observed_at, scope=scope)
        page = fair_page(reader, cursor=cursor, limit=limit, rotation=self.store.rotation)
        if self.emitted is not None:
            self.emitted.update(item.attempt_id for item in page.items)
        return page


class FakeQueueReader:
    """`QueueReader` over the store: what the ORM adapter's two statements read.

    Groups are (Project, Task revision); ids compare as `id_sort_key`. With a
    scope, a group is servable when its Project and Task are under their
    limits (live leases) and a Worker in scope that takes claims and has a
    free slot matches its placement. With a scope and no such Worker at all,
    no group is walked (the ORM's walk is gated the same way).
    """

    def __init__(
        self, store: FakeStore, *, observed_at: datetime, scope: DispatchScope | None
    ) -> None:
        self.store = store
        self.observed_at = observed_at
        self.scope = scope

    def walk(self, *, start: WalkStart | None, cap: int) -> tuple[list[QueueGroup], bool]:
        store = self.store
        if self.scope is not None and not self._open_workers():
            return [], False  # no free slot in view: nothing could be served
        keys = sorted(
            {
                (run.project_id, _group_id(run))
                for run in store.runs.values()
                if run.state == "queued"
            },
            key=_group_order,
        )
        if start is not None:
            position = (id_sort_key(start[0]), _after_all if start[1] is None else start[1])
            after = [k for k in keys if _walk_key(k) > position]
            keys = after + [k for k in keys if _walk_key(k) <= position]
        groups = [self._group(project_id, group_id) for project_id, group_id in keys[:cap]]
        return groups, len(keys) > cap

    def _group(self, project_id: str, group_id: str) -> QueueGroup:
        task_id, revision = group_id.split(":")
        definition = self.store.tasks[task_id].revisions[int(revision)]
        if self.scope is None:
            return QueueGroup(project_id, group_id, task_id, servable=True)
        project_limit = self.store.projects[project_id].max_concurrent_runs
        task_limit = definition.policy.max_concurrent_runs
        project_room = (
            None if not project_limit else project_limit - self.store.live_leases(project_id)
        )
        task_room = (
            None
            if not task_limit
            else task_limit - self.store.live_leases(project_id, task_id=task_id)
        )
        servable = (
            (project_room is None or project_room > 0)
            and (task_room is None or task_room > 0)
            and self._placeable(definition)
        )
        return QueueGroup(project_id, group_id, task_id, servable, project_room, task_room)

    def _open_workers(self) -> list[FakeWorker]:
        """The Workers in scope that take claims and have a free slot."""
        scope = self.scope
        assert scope is not None
        found = []
        for worker in self.store.workers.values():
            session = worker.session
            if worker.admin_state != "active" or session is None or session.state != "online":
                continue
            ref = SessionRef(worker.worker_id, session.session_id, session.generation)
            if scope.session is not None and scope.session != ref:
                continue
            if self.store.free_slots(worker.worker_id) <= 0:
                continue
            found.append(worker)
        return found

    def _placeable(self, definition: TaskDefinition) -> bool:
        for worker in self._open_workers():
            score = placement_score(
                definition.placement, executor_types=worker.executor_types, labels=worker.labels
            )
            if score is not None:
                return True
        return False

    def rows(self, wanted: Sequence[RowsWanted]) -> Mapping[str, Sequence[Candidate]]:
        found: dict[str, list[Candidate]] = {}
        for want in wanted:
            after = None if want.after is None else candidate_order(want.after)
            rows = sorted(
                (
                    candidate
                    for candidate in self._candidates()
                    if candidate.project_id == want.group.project_id
                    and _candidate_group(candidate) == want.group.group_id
                    and (after is None or candidate_order(candidate_key(candidate)) > after)
                ),
                key=lambda c: candidate_order(candidate_key(c)),
            )
            found[want.group.group_id] = rows[: want.limit]
        return found

    def _candidates(self) -> Iterable[Candidate]:
        observed_at = self.observed_at
        for attempt in self.store.attempts.values():
            run = self.store.runs[attempt.run_id]
            if attempt.state != "pending" or run.state != "queued" or run.cancel_requested:
                continue
            if attempt.not_before is not None and attempt.not_before > observed_at:
                continue  # held back (docs/adr/0005)
            yield Candidate(
                run_id=run.run_id,
                attempt_id=attempt.attempt_id,
                project_id=run.project_id,
                task_id=run.task_id,
                task_revision=run.task_revision,
                executor_type=run.executor_type,
                priority=attempt.priority,
                queued_at=attempt.queued_at,
                attempt_version=attempt.version,
                lease_generation=attempt.lease_generation,
            )


# Sorts after every group id of a Project (`WalkStart` with no group).
_after_all: Final = "\U0010ffff"


def _group_id(run: FakeRun) -> str:
    return f"{run.task_id}:{run.task_revision}"


def _candidate_group(candidate: Candidate) -> str:
    return f"{candidate.task_id}:{candidate.task_revision}"


def _walk_key(key: tuple[str, str]) -> tuple[tuple[int, int, str], str]:
    return (id_sort_key(key[0]), key[1])


def _group_order(key: tuple[str, str]) -> tuple[tuple[int, int, str], str]:
    return _walk_key(key)


class FakeWorkerSnapshotSource(_PagedSource):
    def worker_page(
        self, *, scope: DispatchScope, cursor: str | None, limit: int
    ) -> Page[WorkerRecord]:
        self.calls.append({"scope": scope, "cursor": cursor, "limit": limit})
        _check_limit(limit)
        rows = sorted(self._records(scope), key=lambda row: id_sort_key(row.worker_id))
        return self._page(
            rows,
            key=lambda row: id_sort_key(row.worker_id),
            after=None if cursor is None else id_sort_key(cursor),
            encode=lambda row: row.worker_id,
            cursor=cursor,
            limit=limit,
        )

    def _records(self, scope: DispatchScope) -> Iterable[WorkerRecord]:
        for worker in self.store.workers.values():
            session = worker.session
            if worker.admin_state != "active" or session is None or session.state != "online":
                continue
            ref = SessionRef(worker.worker_id, session.session_id, session.generation)
            if not self._in_scope(scope, ref):
                continue
            yield WorkerRecord(
                worker_id=worker.worker_id,
                session_id=session.session_id,
                session_generation=session.generation,
                executor_types=worker.executor_types,
                labels=dict(worker.labels),
                free_slots=self.store.free_slots(worker.worker_id),
            )

    def _in_scope(self, scope: DispatchScope, ref: SessionRef) -> bool:
        return scope.session is None or scope.session == ref


class FakePlanSource:
    """Builds plans from the Run's pinned revision, like the ORM adapter.

    `prepared` keeps every plan handed out, with its spec as a live mutable dict,
    so a test can mutate the source's data after the cycle and show the offer
    kept its own copy.
    """

    def __init__(self, store: FakeStore, emitted: set[str] | None = None) -> None:
        self.store = store
        self.emitted = emitted
        self.calls: list[Candidate] = []
        self.prepared: list[DispatchPlan] = []

    def prepare(self, candidate: Candidate) -> DispatchPlan:
        self.calls.append(candidate)
        if self.emitted is not None and candidate.attempt_id in self.emitted:
            # A candidate of this cycle (not a recovered lease): its Project
            # had its turn (docs/adr/0012).
            self.store.rotation.served(candidate.project_id)
        plan = self._plan(candidate)
        self.prepared.append(plan)
        return plan

    def _plan(self, candidate: Candidate) -> DispatchPlan:
        run = self.store.runs.get(candidate.run_id)
        attempt = self.store.attempts.get(candidate.attempt_id)
        if run is None or attempt is None or attempt.run_id != run.run_id:
            raise PlanUnavailable("the attempt or its run is gone")
        # The Run is pinned to one revision; a candidate built from another one
        # is never materialized from whatever is there now.
        if run.task_revision != candidate.task_revision:
            raise PlanUnavailable("the pinned revision does not match the candidate")
        definition = self.store.tasks[run.task_id].revisions.get(run.task_revision)
        if definition is None:
            raise PlanUnavailable("the pinned revision is gone")
        try:
            spec = build_spec(
                run_id=run.run_id,
                attempt_id=attempt.attempt_id,
                project_id=run.project_id,
                task_id=run.task_id,
                task_revision=run.task_revision,
                definition=definition,
            )
        except SpecError:
            # A stored revision the shared validator now refuses (docs/adr/0002).
            raise PlanUnavailable("the pinned revision is not valid") from None
        return DispatchPlan(
            run_id=run.run_id,
            attempt_id=attempt.attempt_id,
            project_id=run.project_id,
            task_id=run.task_id,
            task_revision=run.task_revision,
            spec=spec,
            placement=definition.placement,
        )


class FakeClaimPort:
    """The claim transaction (docs/adr/0002), against the store.

    The checks run in the database claim's order, so a request that breaks
    several rules gets the same answer from both (the contract suite's claim
    section holds them to it).
    """

    def __init__(self, store: FakeStore) -> None:
        self.store = store
        self.calls: list[ClaimRequest] = []

    def claim(self, request: ClaimRequest) -> ClaimOutcome:
        self.calls.append(request)
        return self._claim(request)

    def claim_many(self, requests: Sequence[ClaimRequest]) -> tuple[ClaimOutcome, ...]:
        """The page claim by claim, in order (the contract's meaning of a page)."""
        return tuple(self.claim(request) for request in requests)

    def _claim(self, request: ClaimRequest) -> ClaimOutcome:
        store = self.store
        lost = ClaimOutcome(ClaimStatus.ATTEMPT_LOST)
        unavailable = ClaimOutcome(ClaimStatus.WORKER_UNAVAILABLE)
        run = store.runs.get(request.run_id)
        if run is None or run.state != "queued" or run.cancel_requested:
            return lost
        attempt = store.attempts.get(request.attempt_id)
        if (
            attempt is None
            or attempt.run_id != run.run_id
            or attempt.state != "pending"
            or attempt.version != request.expected_version
            or request.lease_generation != attempt.lease_generation + 1
        ):
            return lost
        if not store.project_has_room(run.project_id) or not store.task_has_room(run):
            return lost
        ref = SessionRef(request.worker_id, request.session_id, request.session_generation)
        worker = store.workers.get(request.worker_id)
        if (
            worker is None
            or worker.admin_state != "active"
            or not store.is_current_session(ref, ("online",))
        ):
            return unavailable
        session_leases = [
            lease
            for lease in store.leases.values()
            if lease.session_id == request.session_id
            and lease.session_generation == request.session_generation
        ]
        if request.pull_id is not None and any(
            lease.pull_id == request.pull_id and lease.token_digest != request.token_digest
            for lease in session_leases
        ):
            # One pull id, one token (docs/adr/0003).
            return unavailable
        if store.free_slots(request.worker_id) <= 0:
            return unavailable
        attempt.state = "claimed"
        attempt.version += 1
        attempt.lease_generation = request.lease_generation
        run.state = "dispatching"
        lease = store.insert_lease(request)
        return ClaimOutcome(ClaimStatus.WON, lease_id=lease.lease_id, expires_at=lease.expires_at)


def fake_ports(
    store: FakeStore,
    *,
    recovery: LeaseRecoverySource | None = None,
    candidates: CandidateSource | None = None,
    workers: WorkerSnapshotSource | None = None,
    plans: RunDispatchPlanSource | None = None,
    claims: ClaimPort | None = None,
    clock: Clock | None = None,
) -> DispatchPorts:
    """Fresh port objects over `store` (a "restarted" dispatcher), any replaced."""
    emitted: set[str] = set()  # one cycle's candidates, as the ORM's CycleMemo
    return DispatchPorts(
        recovery=recovery or FakeLeaseRecoverySource(store),
        candidates=candidates or FakeCandidateSource(store, emitted),
        workers=workers or FakeWorkerSnapshotSource(store),
        plans=plans or FakePlanSource(store, emitted),
        claims=claims or FakeClaimPort(store),
        clock=clock or store.clock,
    )
