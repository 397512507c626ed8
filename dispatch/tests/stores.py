"""Store builders for the port contract suite: one interface, two stores.

`FakeStoreBuilder` drives `dispatch.core.fakes.FakeStore`; `OrmStoreBuilder`
drives the real database through the same services production uses. The
contract tests only talk to this interface, so every check runs unchanged
against the in-memory fakes and the Django ORM adapters (docs/adr/0001, "Consequences").
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

from django.conf import settings
from django.db.models import F

from dispatch.adapters.orm import orm_ports
from dispatch.core.fakes import FakeStore, fake_ports
from dispatch.core.offer import derive_lease_token, offer_id_for, token_digest
from dispatch.core.ports import (
    NEW_CLAIM,
    PULL_CLAIM,
    Candidate,
    ClaimOutcome,
    ClaimRequest,
    ClaimStatus,
    DispatchPorts,
    PullCredential,
    SessionRef,
)
from dispatch.core.spec import spec_sha256
from dispatch.sweeps import sweep_over_delivered_leases
from leases.ack import AckPhase, lease_ack
from leases.end import lease_revoke, run_cancel
from leases.errors import Outcome
from leases.models import RunLease
from leases.renew import leases_record_delivery
from qinglong import testing
from qinglong.clock import db_now
from runs.models import Attempt, Run, Task
from runs.services import project_create, run_enqueue, task_update
from workers.models import SessionState, Worker, WorkerAdminState, WorkerSession
from workers.services import session_open

LEASE_TTL_S = 60
# An operator's revoke: unlike an over-delivery revoke, it bars nobody.
REVOKE_REASON = "operator_revoke"


@dataclass(frozen=True)
class Claimed:
    lease_id: str
    token: str


class StoreBuilder(Protocol):
    """What a contract test may do to a store; each store maps it to its own terms."""

    name: str

    def ports(self) -> DispatchPorts: ...
    def now(self) -> datetime: ...
    def add_task(
        self,
        *,
        executor_type: str = "process",
        max_concurrent_runs: int = 0,
        task_limit: int = 0,
        beside: str | None = None,
        placement: dict[str, object] | None = None,
    ) -> str:
        """A Task in a Project of its own, or in the Project of Task `beside`
        (`max_concurrent_runs`: the new Project's quota; `task_limit`: the Task
        revision's `max_concurrent_runs`; 0: none; `placement`: the Task's)."""
        ...

    def edit_task(self, task: str) -> None:
        """A new revision; existing Runs stay pinned to theirs."""
        ...

    def add_run(self, task: str, *, priority: int = 0, queued_at: datetime) -> tuple[str, str]: ...
    def add_worker(
        self,
        *,
        slots: int = 2,
        labels: dict[str, str] | None = None,
        session_slots: int | None = None,
    ) -> SessionRef: ...
    def replace_session(self, worker_id: str) -> SessionRef: ...
    def set_session_state(self, worker_id: str, state: str) -> None: ...
    def set_worker_admin_state(self, worker_id: str, state: str) -> None: ...
    def set_worker_slots(self, worker_id: str, slots: int) -> None: ...
    def cancel_run(self, run_id: str) -> None: ...
    def start(self, attempt_id: str, claimed: Claimed) -> None: ...
    def record_delivery(self, lease_id: str, at: datetime) -> None:
        """A Worker's pull delivering the lease at `at` (counted once per backoff)."""
        ...

    def attempt_state(self, attempt_id: str) -> str: ...
    def run_state(self, run_id: str) -> str: ...
    def hold_back(self, attempt_id: str, until: datetime | None) -> None:
        """Set the Attempt's `not_before` (None: eligible now)."""
        ...

    def revoke(self, lease_id: str) -> None: ...
    def revoke_over_delivered(self, *, max_deliveries: int) -> int: ...


def claim(builder: StoreBuilder, attempt_id: str, ref: SessionRef) -> Claimed:
    """Claim an Attempt through the store's own ports, exactly as the cycle would."""
    request, token = claim_request(builder, candidate_of(builder, attempt_id), ref)
    outcome = builder.ports().claims.claim(request)
    assert outcome.status is ClaimStatus.WON, outcome
    assert outcome.lease_id is not None
    return Claimed(outcome.lease_id, token)


def try_claim(
    builder: StoreBuilder,
    candidate: Candidate,
    ref: SessionRef,
    *,
    pull: PullCredential | None = None,
    lease_generation: int | None = None,
) -> ClaimOutcome:
    """One claim of a candidate read earlier (it may be stale by now: a lost race)."""
    request, _ = claim_request(
        builder, candidate, ref, pull=pull, lease_generation=lease_generation
    )
    return builder.ports().claims.claim(request)


def claim_request(
    builder: StoreBuilder,
    candidate: Candidate,
    ref: SessionRef,
    *,
    pull: PullCredential | None = None,
    lease_generation: int | None = None,
) -> tuple[ClaimRequest, str]:
    """The ClaimRequest `dispatch_once` would send (global scope, or a pull's);
    returns it and the lease token."""
    plan = builder.ports().plans.prepare(candidate)
    generation = candidate.lease_generation + 1 if lease_generation is None else lease_generation
    offer_id = offer_id_for(
        attempt_id=candidate.attempt_id,
        lease_generation=generation,
        worker_id=ref.worker_id,
        session_id=ref.session_id,
        session_generation=ref.session_generation,
    )
    if pull is None:
        token = derive_lease_token(str(settings.QINGLONG_LEASE_SECRET).encode(), offer_id)
    else:
        token = pull.token
    request = ClaimRequest(
        attempt_id=candidate.attempt_id,
        run_id=candidate.run_id,
        expected_version=candidate.attempt_version,
        lease_generation=generation,
        worker_id=ref.worker_id,
        session_id=ref.session_id,
        session_generation=ref.session_generation,
        offer_id=offer_id,
        token_digest=token_digest(token),
        spec_sha256=spec_sha256(plan.spec),
        placement_score=0,
        source=NEW_CLAIM if pull is None else PULL_CLAIM,
        pull_id=None if pull is None else pull.pull_id,
        lease_ttl_s=LEASE_TTL_S,
        skip_locked=False,
    )
    return request, token


def candidate_of(
    builder: StoreBuilder, attempt_id: str, *, observed_at: datetime | None = None
) -> Candidate:
    """The Attempt as the candidate source lists it now (or at `observed_at`)."""
    return _find_candidate(builder.ports(), attempt_id, observed_at=observed_at)


def _find_candidate(
    ports: DispatchPorts, attempt_id: str, *, observed_at: datetime | None = None
) -> Candidate:
    cursor: str | None = None
    at = ports.clock.now() if observed_at is None else observed_at
    for _ in range(100):
        page = ports.candidates.candidate_page(observed_at=at, cursor=cursor, limit=64)
        for candidate in page.items:
            if candidate.attempt_id == attempt_id:
                return candidate
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    raise AssertionError(f"attempt {attempt_id} is not a candidate")


# ------------------------------------------------------------------------ fakes


class FakeStoreBuilder:
    name = "fakes"

    def __init__(self) -> None:
        self.store = FakeStore()

    def ports(self) -> DispatchPorts:
        return fake_ports(self.store)

    def now(self) -> datetime:
        return self.store.clock.now()

    def add_task(
        self,
        *,
        executor_type: str = "process",
        max_concurrent_runs: int = 0,
        task_limit: int = 0,
        beside: str | None = None,
        placement: dict[str, object] | None = None,
    ) -> str:
        extra = {} if placement is None else {"placement": placement}
        _, task_id, _ = self.store.add_task(
            definition=testing.definition(
                executor_type=executor_type, max_concurrent_runs=task_limit, **extra
            ),
            project_id=None if beside is None else self.store.tasks[beside].project_id,
            max_concurrent_runs=max_concurrent_runs,
        )
        return task_id

    def edit_task(self, task: str) -> None:
        self.store.edit_task(task, testing.definition(command=["echo", "revised"]))

    def add_run(self, task: str, *, priority: int = 0, queued_at: datetime) -> tuple[str, str]:
        return self.store.add_run(task_id=task, priority=priority, queued_at=queued_at)

    def add_worker(
        self,
        *,
        slots: int = 2,
        labels: dict[str, str] | None = None,
        session_slots: int | None = None,
    ) -> SessionRef:
        return self.store.add_worker(slots=slots, labels=labels, session_slots=session_slots)

    def replace_session(self, worker_id: str) -> SessionRef:
        return self.store.replace_session(worker_id)

    def set_session_state(self, worker_id: str, state: str) -> None:
        self.store.set_session_state(worker_id, state)

    def set_worker_admin_state(self, worker_id: str, state: str) -> None:
        self.store.workers[worker_id].admin_state = state

    def set_worker_slots(self, worker_id: str, slots: int) -> None:
        self.store.workers[worker_id].slots = slots

    def cancel_run(self, run_id: str) -> None:
        self.store.cancel_run(run_id)

    def start(self, attempt_id: str, claimed: Claimed) -> None:
        self.store.start_attempt(attempt_id)

    def record_delivery(self, lease_id: str, at: datetime) -> None:
        self.store.record_pull(lease_id, at)

    def attempt_state(self, attempt_id: str) -> str:
        return self.store.attempts[attempt_id].state

    def run_state(self, run_id: str) -> str:
        return self.store.runs[run_id].state

    def hold_back(self, attempt_id: str, until: datetime | None) -> None:
        self.store.defer_attempt(attempt_id, until)

    def revoke(self, lease_id: str) -> None:
        assert self.store.revoke_lease(lease_id, reason=REVOKE_REASON)

    def revoke_over_delivered(self, *, max_deliveries: int) -> int:
        return self.store.revoke_over_delivered(max_deliveries=max_deliveries)


# -------------------------------------------------------------------------- ORM


class OrmStoreBuilder:
    """The real database (whichever one this pass runs on), via the services."""

    name = "orm"

    def ports(self) -> DispatchPorts:
        return orm_ports()

    def now(self) -> datetime:
        return db_now()

    def add_task(
        self,
        *,
        executor_type: str = "process",
        max_concurrent_runs: int = 0,
        task_limit: int = 0,
        beside: str | None = None,
        placement: dict[str, object] | None = None,
    ) -> str:
        if beside is None:
            project = project_create(
                slug=f"contract-{uuid.uuid4().hex[:12]}",
                name="Contract project",
                max_concurrent_runs=max_concurrent_runs,
            )
        else:
            project = Task.objects.get(pk=int(beside)).project
        extra: dict[str, Any] = {} if placement is None else {"placement": placement}
        task = testing.make_task(
            project, executor_type=executor_type, max_concurrent_runs=task_limit, **extra
        )
        return str(task.pk)

    def edit_task(self, task: str) -> None:
        task_update(
            task=Task.objects.get(pk=int(task)),
            definition=testing.definition(command=["echo", "revised"]),
        )

    def add_run(self, task: str, *, priority: int = 0, queued_at: datetime) -> tuple[str, str]:
        run = run_enqueue(
            task=Task.objects.get(pk=int(task)), priority=priority, queued_at=queued_at
        )
        return str(run.pk), str(testing.pending_attempt(run).pk)

    def add_worker(
        self,
        *,
        slots: int = 2,
        labels: dict[str, str] | None = None,
        session_slots: int | None = None,
    ) -> SessionRef:
        worker, _ = testing.make_worker(slots=slots, labels=labels)
        return _ref(testing.open_session(worker, slots=session_slots).session)

    def replace_session(self, worker_id: str) -> SessionRef:
        worker = Worker.objects.get(pk=int(worker_id))
        opened = session_open(
            worker=worker,
            executor_types=list(worker.executor_types),
            labels=dict(worker.labels),
            slots=worker.slots,
        )
        return _ref(opened.session)

    def set_session_state(self, worker_id: str, state: str) -> None:
        WorkerSession.objects.filter(
            worker_id=int(worker_id), state__in=(SessionState.ONLINE, SessionState.DRAINING)
        ).update(state=state)

    def set_worker_admin_state(self, worker_id: str, state: str) -> None:
        Worker.objects.filter(pk=int(worker_id)).update(admin_state=state)

    def set_worker_slots(self, worker_id: str, slots: int) -> None:
        Worker.objects.filter(pk=int(worker_id)).update(slots=slots)

    def cancel_run(self, run_id: str) -> None:
        run_cancel(run=Run.objects.get(pk=int(run_id)))

    def start(self, attempt_id: str, claimed: Claimed) -> None:
        lease = RunLease.objects.select_related("session").get(pk=int(claimed.lease_id))
        lease_ack(
            session=lease.session,
            offer_id=lease.offer_id,
            phase=AckPhase.STARTING,
            lease_token=claimed.token,
            spec_sha256=lease.spec_digest,
        )
        assert Attempt.objects.get(pk=int(attempt_id)).state == "starting"

    def record_delivery(self, lease_id: str, at: datetime) -> None:
        leases_record_delivery([lease_id], now=at)

    def attempt_state(self, attempt_id: str) -> str:
        return str(Attempt.objects.get(pk=int(attempt_id)).state)

    def run_state(self, run_id: str) -> str:
        return str(Run.objects.get(pk=int(run_id)).state)

    def hold_back(self, attempt_id: str, until: datetime | None) -> None:
        # The column the lease services set (a lost execution's grace, an
        # over-delivery backoff); written directly to test the read's boundary.
        Attempt.objects.filter(pk=int(attempt_id)).update(
            not_before=until, version=F("version") + 1
        )

    def revoke(self, lease_id: str) -> None:
        assert lease_revoke(int(lease_id), reason=REVOKE_REASON) is Outcome.APPLIED

    def revoke_over_delivered(self, *, max_deliveries: int) -> int:
        return sweep_over_delivered_leases(max_deliveries=max_deliveries).applied


def _ref(session: WorkerSession) -> SessionRef:
    return SessionRef(str(session.worker_id), str(session.session_id), session.generation)


def unknown_session(ref: SessionRef) -> SessionRef:
    return SessionRef(ref.worker_id, str(uuid.uuid4()), ref.session_generation)


def seconds(n: float) -> timedelta:
    return timedelta(seconds=n)


__all__ = [
    "Claimed",
    "FakeStoreBuilder",
    "OrmStoreBuilder",
    "StoreBuilder",
    "WorkerAdminState",
    "candidate_of",
    "claim",
    "claim_request",
    "seconds",
    "try_claim",
    "unknown_session",
]
