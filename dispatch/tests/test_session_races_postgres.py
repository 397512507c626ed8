"""Lost races of the Session use cases on PostgreSQL (real connections, one per thread).

Credential rotation against a claim and against a Session open, racing
heartbeats of one Session, and two retention sweeps at once: each ends in a
state one writer alone could produce, and a fenced Session keeps nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connections

from dispatch.core.ports import ClaimStatus
from dispatch.sweeps import prune_ended_sessions
from leases import claim as ds
from leases.models import LeaseState, RunLease
from qinglong import testing
from qinglong.clock import db_now
from workers import services as ws
from workers.models import SESSION_CURRENT_STATES, SessionState, Worker, WorkerSession
from workers.services import (
    CredentialRotated,
    session_heartbeat,
    session_open,
    worker_rotate_credential,
)

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _thread(target: Callable[[], Any], name: str, out: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        try:
            out[name] = target()
        except Exception as err:  # the outcome under test may be an exception
            out[name] = err
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, name=name)
    thread.start()
    return thread


def _pause_in(module: Any, thread_name: str, monkeypatch: pytest.MonkeyPatch, func: str = "db_now"):
    """Make `module.<func>` block in the named thread until released (it holds its locks)."""
    paused, go = threading.Event(), threading.Event()
    real = getattr(module, func)

    def slow(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == thread_name and not go.is_set():
            paused.set()
            go.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, func, slow)
    return paused, go


def test_a_claim_holding_the_session_lock_commits_first_and_rotation_then_ends_its_lease(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    attempt = testing.pending_attempt(testing.make_run())
    session = testing.open_session().session
    request, _ = testing.claim_request(attempt, session)
    # lease_grant runs under the claim's locks, just before its writes.
    paused, go = _pause_in(ds, "claimer", monkeypatch, func="lease_grant")
    out: dict[str, Any] = {}
    claimer = _thread(lambda: ds.lease_claim(request).status, "claimer", out)
    assert paused.wait(10)  # the claim holds Run, Attempt and the Session row
    rotator = _thread(lambda: worker_rotate_credential(worker=session.worker), "rotator", out)
    time.sleep(0.5)  # the rotation's fence now waits on the Session row
    assert rotator.is_alive()
    go.set()
    claimer.join(20)
    rotator.join(20)
    assert out["claimer"] is ClaimStatus.WON
    assert isinstance(out["rotator"], str)
    lease = RunLease.objects.get(attempt=attempt)
    assert (lease.state, lease.end_reason) == (LeaseState.REVOKED, "credential_rotated")
    attempt.refresh_from_db()
    assert attempt.state == "pending"
    assert not WorkerSession.objects.filter(state__in=SESSION_CURRENT_STATES).exists()


def test_a_session_open_authenticated_before_a_rotation_loses_to_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker, _ = testing.make_worker()
    authenticated = Worker.objects.get(pk=worker.pk)  # the old credential checked out
    paused, go = _pause_in(ws, "rotator", monkeypatch)
    out: dict[str, Any] = {}
    rotator = _thread(lambda: worker_rotate_credential(worker=worker), "rotator", out)
    assert paused.wait(10)  # the rotation holds the Worker row
    opener = _thread(
        lambda: (
            session_open(
                worker=authenticated, executor_types=["process"], labels={}, slots=1
            ).session.generation
        ),
        "opener",
        out,
    )
    time.sleep(0.5)  # the open now waits on the Worker row
    assert opener.is_alive()
    go.set()
    rotator.join(20)
    opener.join(20)
    assert isinstance(out["rotator"], str)
    assert isinstance(out["opener"], CredentialRotated)
    assert not WorkerSession.objects.filter(worker=worker).exists()


def test_a_session_open_that_commits_first_is_fenced_by_the_rotation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker, _ = testing.make_worker()
    paused, go = _pause_in(ws, "opener", monkeypatch)
    out: dict[str, Any] = {}
    opener = _thread(
        lambda: session_open(worker=worker, executor_types=["process"], labels={}, slots=1),
        "opener",
        out,
    )
    assert paused.wait(10)  # the open holds the Worker row
    rotator = _thread(lambda: worker_rotate_credential(worker=worker), "rotator", out)
    time.sleep(0.5)
    assert rotator.is_alive()
    go.set()
    opener.join(20)
    rotator.join(20)
    session = WorkerSession.objects.get(worker=worker)
    assert out["opener"].session.pk == session.pk
    assert (session.state, session.end_reason) == (SessionState.REPLACED, "credential_rotated")


def test_racing_due_heartbeats_of_one_session_record_once() -> None:
    session = testing.open_session().session
    WorkerSession.objects.filter(pk=session.pk).update(
        heartbeat_at=session.heartbeat_at - timedelta(minutes=1)
    )
    barrier = threading.Barrier(6)
    out: dict[str, Any] = {}

    def beat() -> bool:
        fresh = WorkerSession.objects.select_related("worker").get(pk=session.pk)
        barrier.wait(10)  # every one read the Session as due
        return session_heartbeat(session=fresh, draining=False).recorded

    threads = [_thread(beat, f"beat{i}", out) for i in range(6)]
    for thread in threads:
        thread.join(20)
    assert sorted(out.values()) == [False] * 5 + [True]


def test_two_retention_sweeps_at_once_delete_each_session_once() -> None:
    worker, _ = testing.make_worker()
    for _ in range(30):
        testing.open_session(worker)
    WorkerSession.objects.exclude(state__in=SESSION_CURRENT_STATES).update(
        ended_at=db_now() - timedelta(days=30)
    )
    out: dict[str, Any] = {}
    threads = [
        _thread(
            lambda: prune_ended_sessions(retention_days=7, batch_size=5, max_batches=10),
            f"p{i}",
            out,
        )
        for i in range(2)
    ]
    for thread in threads:
        thread.join(30)
    assert not any(isinstance(result, Exception) for result in out.values()), out
    assert sum(result.applied for result in out.values()) == 29
    assert list(WorkerSession.objects.values_list("state", flat=True)) == ["online"]
