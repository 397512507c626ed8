"""Ports of `dispatch_once` and the data that crosses them.

The core never touches the database: the Django ORM adapters (and the in-memory
fakes in `dispatch.core.fakes`) implement these Protocols. Each docstring states
the contract both must honour; the shared contract suite checks it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Final, Generic, Protocol, TypeVar

from dispatch.core.placement import Placement

__all__ = [
    "LEASE_SOURCES",
    "NEW_CLAIM",
    "PULL_CLAIM",
    "Candidate",
    "CandidateSource",
    "ClaimOutcome",
    "ClaimPort",
    "ClaimRequest",
    "ClaimStatus",
    "Clock",
    "DispatchPlan",
    "DispatchPorts",
    "DispatchScope",
    "LeaseRecoverySource",
    "Page",
    "PlanUnavailable",
    "PullCredential",
    "RecoverableLease",
    "RunDispatchPlanSource",
    "Scope",
    "SessionRef",
    "WorkerRecord",
    "WorkerSnapshotSource",
    "id_sort_key",
    "to_rfc3339",
]

T = TypeVar("T")

# RunLease.source values (docs/adr/0003: global claims and pull claims).
NEW_CLAIM: Final = "new_claim"
PULL_CLAIM: Final = "pull_claim"
LEASE_SOURCES: Final = frozenset({NEW_CLAIM, PULL_CLAIM})


def id_sort_key(value: str) -> tuple[int, int, str]:
    """Numeric-aware order of database ids ("9" < "10"), total over any strings.

    Decimal strings sort by value before any other string (the raw string breaks
    ties such as "010" vs "10"), so the Worker snapshot order is deterministic
    (docs/adr/0001 step 7) and the same as ORDER BY an integer primary key.
    """
    if value.isascii() and value.isdigit():
        return (0, int(value), value)
    return (1, 0, value)


def to_rfc3339(moment: datetime) -> str:
    """RFC 3339 UTC with "Z" (the wire format); naive datetimes are a bug, not local time."""
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise ValueError("a naive datetime cannot be put on the wire")
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


class Scope(StrEnum):
    GLOBAL = "global"  # Celery beat / run_dispatcher: every Worker in the Registry
    SESSION = "session"  # a Worker's pull: exactly its authenticated Session


@dataclass(frozen=True)
class SessionRef:
    worker_id: str
    session_id: str
    session_generation: int


@dataclass(frozen=True)
class DispatchScope:
    kind: Scope
    session: SessionRef | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Scope):
            raise TypeError("DispatchScope.kind must be a Scope")
        if (self.kind is Scope.SESSION) != (self.session is not None):
            raise ValueError("a session is required in session scope and only there")

    @classmethod
    def global_(cls) -> DispatchScope:
        return cls(Scope.GLOBAL)

    @classmethod
    def for_session(cls, ref: SessionRef) -> DispatchScope:
        return cls(Scope.SESSION, ref)


@dataclass(frozen=True)
class Candidate:
    run_id: str
    attempt_id: str
    project_id: str
    task_id: str
    task_revision: int
    executor_type: str
    priority: int
    queued_at: datetime
    attempt_version: int
    # The Attempt's current (last used) lease generation; a claim uses +1.
    lease_generation: int


@dataclass(frozen=True)
class WorkerRecord:
    worker_id: str
    session_id: str
    session_generation: int
    executor_types: frozenset[str]
    labels: Mapping[str, str]
    free_slots: int

    @property
    def session(self) -> SessionRef:
        return SessionRef(self.worker_id, self.session_id, self.session_generation)


@dataclass(frozen=True)
class RecoverableLease:
    lease_id: str
    run_id: str
    attempt_id: str
    project_id: str
    task_id: str
    task_revision: int
    executor_type: str
    priority: int
    queued_at: datetime
    worker_id: str
    session_id: str
    session_generation: int
    lease_generation: int
    spec_sha256: str
    expires_at: datetime
    source: str  # "new_claim" | "pull_claim"
    placement_score: int | None
    pull_id: str | None
    token_digest: str = field(repr=False)
    delivery_count: int
    last_delivered_at: datetime | None
    # The Attempt's CAS version; recovery never claims, so -1 ("unknown") is fine.
    attempt_version: int = -1

    @property
    def session(self) -> SessionRef:
        return SessionRef(self.worker_id, self.session_id, self.session_generation)

    def as_candidate(self) -> Candidate:
        """The pinned identity the plan source re-materializes from (docs/adr/0002)."""
        return Candidate(
            run_id=self.run_id,
            attempt_id=self.attempt_id,
            project_id=self.project_id,
            task_id=self.task_id,
            task_revision=self.task_revision,
            executor_type=self.executor_type,
            priority=self.priority,
            queued_at=self.queued_at,
            attempt_version=self.attempt_version,
            lease_generation=self.lease_generation,
        )


@dataclass(frozen=True)
class Page(Generic[T]):
    items: tuple[T, ...]
    next_cursor: str | None  # None = no more rows

    def __post_init__(self) -> None:
        if not isinstance(self.items, tuple):
            object.__setattr__(self, "items", tuple(self.items))


@dataclass(frozen=True)
class DispatchPlan:
    run_id: str
    attempt_id: str
    project_id: str
    task_id: str
    task_revision: int
    # The unchecked ExecutionSpec: trusted memory only, never repr'd (docs/adr/0002).
    spec: Mapping[str, object] = field(repr=False)
    placement: Placement


class PlanUnavailable(Exception):
    """The Run's pinned Project/Task/revision cannot be materialized."""


@dataclass(frozen=True)
class PullCredential:
    """docs/adr/0003: the Worker's own pull id and high-entropy lease token."""

    pull_id: str
    token: str = field(repr=False)


@dataclass(frozen=True)
class ClaimRequest:
    attempt_id: str
    run_id: str
    expected_version: int
    lease_generation: int  # the NEW generation (candidate's + 1)
    worker_id: str
    session_id: str
    session_generation: int
    offer_id: str
    token_digest: str = field(repr=False)
    spec_sha256: str
    placement_score: int | None
    source: str  # "new_claim" (global scope) | "pull_claim" (session scope)
    pull_id: str | None
    lease_ttl_s: int
    skip_locked: bool  # global scope: another dispatcher holding the row is not an error


class ClaimStatus(StrEnum):
    WON = "won"  # the lease is committed
    # Already leased, no longer claimable or a CAS version conflict: stop this candidate.
    ATTEMPT_LOST = "attempt_lost"
    # Session gone, not current, or no free slot: try the next Worker.
    WORKER_UNAVAILABLE = "worker_unavailable"


@dataclass(frozen=True)
class ClaimOutcome:
    status: ClaimStatus
    lease_id: str | None = None
    expires_at: datetime | None = None

    def __post_init__(self) -> None:
        # A won claim without its lease facts could never be recovered (docs/adr/0002).
        if self.status is ClaimStatus.WON and (self.lease_id is None or self.expires_at is None):
            raise ValueError("a won claim must carry lease_id and expires_at")


class LeaseRecoverySource(Protocol):
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
        """Active leases in a stable key order, at most `limit`.

        Only: Attempt claimed, Run dispatching, not cancel_requested,
        expires_at > observed_at, the lease's session still the Worker's current
        online/draining Session; session scope: that session only; when
        due_before is not None, only leases never delivered or last delivered
        at or before due_before; delivery_count < max_deliveries.
        """
        ...


class CandidateSource(Protocol):
    def candidate_page(
        self,
        *,
        observed_at: datetime,
        cursor: str | None,
        limit: int,
        scope: DispatchScope | None = None,
    ) -> Page[Candidate]:
        """Attempt pending, Run queued, not cancelled, and eligible at
        `observed_at` (no `not_before`, or `not_before` <= observed_at); at
        most `limit`, each Attempt once per cycle (a page may be empty and
        still promise more).

        Order (docs/adr/0012, `dispatch.core.fairness`): Projects round-robin,
        starting after the Project the process served last; within a Project
        priority DESC, queued_at, run id.

        With a `scope` (the cycle always passes one) only what can be claimed
        now: not past its Project's or its Task's `max_concurrent_runs` (live
        leases, `leases.quota`), and its executor type and required labels
        matched by a Session in scope that takes claims and has a free slot.
        Without one (tools, tests) every queued Run, in the same order."""
        ...


class WorkerSnapshotSource(Protocol):
    def worker_page(
        self, *, scope: DispatchScope, cursor: str | None, limit: int
    ) -> Page[WorkerRecord]:
        """Current ONLINE sessions of active Workers, ascending by `id_sort_key`
        of the worker id; session scope: just that session; at most `limit`."""
        ...


class RunDispatchPlanSource(Protocol):
    def prepare(self, candidate: Candidate) -> DispatchPlan:
        """The plan from the Run's pinned revision; raises PlanUnavailable."""
        ...


class ClaimPort(Protocol):
    def claim(self, request: ClaimRequest) -> ClaimOutcome:
        """The one atomic write of a lease (docs/adr/0002), checked in this order:

        1. ATTEMPT_LOST unless the Run is queued and not cancel_requested, and
           the Attempt is that Run's, pending, at `expected_version`, with
           `lease_generation` = its last generation + 1;
        2. ATTEMPT_LOST when the Run's Project has a `max_concurrent_runs`
           quota and that many live leases (active, not past `expires_at`)
           belong to its Runs, or the Run's pinned revision has a
           `max_concurrent_runs` limit and that many live leases belong to
           Runs of its Task (`leases.quota`, docs/adr/0012);
        3. WORKER_UNAVAILABLE unless the Session is the Worker's current ONLINE
           Session at `session_generation` and the Worker is active;
        4. WORKER_UNAVAILABLE when this Session already has a lease with this
           `pull_id` and another token (one pull id, one token: docs/adr/0003);
        5. WORKER_UNAVAILABLE when the Session's active leases already fill
           min(Session slots, Worker slots);
        6. else WON: Attempt claimed, Run dispatching, lease active until
           now + `lease_ttl_s`.

        An Attempt once over-delivered to a Session is not barred from it:
        it waits its backoff in `not_before`, which the candidate read
        honours, and may then go to any Worker (docs/adr/0005).
        """
        ...

    def claim_many(self, requests: Sequence[ClaimRequest]) -> Sequence[ClaimOutcome]:
        """A page of claims (issue #12): one outcome per request, in order.

        Each outcome is the one `claim` would give its request had the
        requests before it been claimed one after the other: a Session an
        earlier request filled is WORKER_UNAVAILABLE to a later one, a quota
        an earlier one took is taken, an Attempt claimed by an earlier one
        is ATTEMPT_LOST (one pull id, one token, counts the page's grants
        too). Every WON is committed when this returns, each lease exactly
        as `claim` writes it. The page may be written in one transaction
        (the database) or claim by claim (the fakes, SQLite); a rival may
        win between two requests either way, which is a lost race for that
        request only.
        """
        ...


class Clock(Protocol):
    def now(self) -> datetime:
        """Tz-aware UTC; the database clock on PostgreSQL."""
        ...


@dataclass(frozen=True)
class DispatchPorts:
    recovery: LeaseRecoverySource
    candidates: CandidateSource
    workers: WorkerSnapshotSource
    plans: RunDispatchPlanSource
    claims: ClaimPort
    clock: Clock
