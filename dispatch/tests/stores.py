"""Store builders for the port contract suite: one interface, two stores.

`FakeStoreBuilder` drives `dispatch.core.fakes.FakeStore`; `OrmStoreBuilder`
drives the real database through the same services production uses. The
contract tests only talk to this interface, so every check runs unchanged
against the in-memory fakes and the Django ORM adapters (DESIGN §6).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Protocol

from django.conf import settings

from dispatch.adapters.orm import orm_ports
from dispatch.core.fakes import FakeStore, fake_ports
from dispatch.core.offer import derive_lease_token, offer_id_for, token_digest
from dispatch.core.ports import (
    NEW_CLAIM,
    Candidate,
    ClaimRequest,
    ClaimStatus,
    DispatchPorts,
    SessionRef,
)
from dispatch.core.spec import spec_sha256
from dispatch.models import RunLease
from dispatch.services import AckPhase, lease_ack, leases_record_delivery
from qinglong import testing
from qinglong.clock import db_now
from runs.models import Attempt, Run, Task
from runs.services import run_cancel, run_enqueue
from workers.models import SessionState, Worker, WorkerAdminState, WorkerSession
from workers.services import session_open

LEASE_TTL_S = 60


@dataclass(frozen=True)
class Claimed:
    lease_id: str
    token: str


class StoreBuilder(Protocol):
    """What a contract test may do to a store; each store maps it to its own terms."""

    name: str

    def ports(self) -> DispatchPorts: ...
    def now(self) -> datetime: ...
    def add_task(self, *, executor_type: str = "process") -> str: ...
    def add_run(self, task: str, *, priority: int = 0, queued_at: datetime) -> tuple[str, str]: ...
    def add_worker(self, *, slots: int = 2, labels: dict[str, str] | None = None) -> SessionRef: ...
    def replace_session(self, worker_id: str) -> SessionRef: ...
    def set_session_state(self, worker_id: str, state: str) -> None: ...
    def set_worker_admin_state(self, worker_id: str, state: str) -> None: ...
    def cancel_run(self, run_id: str) -> None: ...
    def start(self, attempt_id: str, claimed: Claimed) -> None: ...
    def record_delivery(self, lease_id: str, at: datetime) -> None: ...


def claim(builder: StoreBuilder, attempt_id: str, ref: SessionRef) -> Claimed:
    """Claim an Attempt through the store's own ports, exactly as the cycle would."""
    ports = builder.ports()
    candidate = _find_candidate(ports, attempt_id)
    plan = ports.plans.prepare(candidate)
    generation = candidate.lease_generation + 1
    offer_id = offer_id_for(
        attempt_id=attempt_id,
        lease_generation=generation,
        worker_id=ref.worker_id,
        session_id=ref.session_id,
        session_generation=ref.session_generation,
    )
    token = derive_lease_token(str(settings.QINGLONG_LEASE_SECRET).encode(), offer_id)
    outcome = ports.claims.claim(
        ClaimRequest(
            attempt_id=attempt_id,
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
            source=NEW_CLAIM,
            pull_id=None,
            lease_ttl_s=LEASE_TTL_S,
            skip_locked=False,
        )
    )
    assert outcome.status is ClaimStatus.WON, outcome
    assert outcome.lease_id is not None
    return Claimed(outcome.lease_id, token)


def _find_candidate(ports: DispatchPorts, attempt_id: str) -> Candidate:
    cursor: str | None = None
    for _ in range(100):
        page = ports.candidates.candidate_page(cursor=cursor, limit=64)
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

    def add_task(self, *, executor_type: str = "process") -> str:
        _, task_id, _ = self.store.add_task(
            definition=testing.definition(executor_type=executor_type)
        )
        return task_id

    def add_run(self, task: str, *, priority: int = 0, queued_at: datetime) -> tuple[str, str]:
        return self.store.add_run(task_id=task, priority=priority, queued_at=queued_at)

    def add_worker(self, *, slots: int = 2, labels: dict[str, str] | None = None) -> SessionRef:
        return self.store.add_worker(slots=slots, labels=labels)

    def replace_session(self, worker_id: str) -> SessionRef:
        return self.store.replace_session(worker_id)

    def set_session_state(self, worker_id: str, state: str) -> None:
        self.store.set_session_state(worker_id, state)

    def set_worker_admin_state(self, worker_id: str, state: str) -> None:
        self.store.workers[worker_id].admin_state = state

    def cancel_run(self, run_id: str) -> None:
        self.store.cancel_run(run_id)

    def start(self, attempt_id: str, claimed: Claimed) -> None:
        self.store.start_attempt(attempt_id)

    def record_delivery(self, lease_id: str, at: datetime) -> None:
        self.store.record_delivery(lease_id, at)


# -------------------------------------------------------------------------- ORM


class OrmStoreBuilder:
    """The real database (whichever one this pass runs on), via the services."""

    name = "orm"

    def ports(self) -> DispatchPorts:
        return orm_ports()

    def now(self) -> datetime:
        return db_now()

    def add_task(self, *, executor_type: str = "process") -> str:
        return str(testing.make_task(executor_type=executor_type).pk)

    def add_run(self, task: str, *, priority: int = 0, queued_at: datetime) -> tuple[str, str]:
        run = run_enqueue(
            task=Task.objects.get(pk=int(task)), priority=priority, queued_at=queued_at
        )
        return str(run.pk), str(testing.pending_attempt(run).pk)

    def add_worker(self, *, slots: int = 2, labels: dict[str, str] | None = None) -> SessionRef:
        worker, _ = testing.make_worker(slots=slots, labels=labels)
        return _ref(testing.open_session(worker).session)

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
    "claim",
    "seconds",
    "unknown_session",
]
