"""Sweeper vs ACK on PostgreSQL, two real connections (one per thread).

A lease expiring while its ACK commits: the two writers serialize on the row
locks (Run → Attempt → RunLease), each re-checks under the lock, and exactly one
of them wins. No completion is ever overwritten, and a late ACK never
resurrects an expired lease (README "Worker API").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connections

from dispatch.sweeps import sweep_expired_leases
from leases import ack as ack_use_case
from leases import end as end_use_case
from leases.ack import AckPhase, lease_ack
from leases.errors import LeaseConflict, Outcome
from leases.models import LeaseState, RunLease
from qinglong.clock import db_now
from qinglong.testing import claim, make_run, open_session, pending_attempt
from runs.models import Attempt, Run

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

HOLD_S = 1.0


def in_thread(name: str, fn: Callable[[], Any], results: dict[str, Any]) -> threading.Thread:
    def runner() -> None:
        try:
            results[name] = fn()
        except Exception as err:  # the outcome under test may be an exception
            results[name] = err
        finally:
            connections.close_all()

    thread = threading.Thread(target=runner, name=name)
    thread.start()
    return thread


def hold_inside(
    monkeypatch, module: Any, func_name: str, *, thread: str, entered: threading.Event
) -> None:
    """Make `module.<func_name>` pause (locks held, transaction open) in one thread."""
    real = getattr(module, func_name)
    if module is ack_use_case:
        # An ACK held between its checks and its writes: the portable path (the
        # one statement of leases.ack_statement has no moment in between).
        monkeypatch.setattr(module, "decides_in_one_statement", lambda *a, **k: False)

    def slow(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == thread:
            entered.set()
            time.sleep(HOLD_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, func_name, slow)


def claimed(ack: tuple[AckPhase, ...] = ()):
    opened = open_session()
    run = make_run()
    _, offer_id, token = claim(pending_attempt(run), opened.session)
    lease = RunLease.objects.get(offer_id=offer_id)
    for phase in ack:
        ack_phase(opened.session, lease, token, phase)
    return opened.session, run, lease, token


def ack_phase(session, lease, token, phase):
    return lease_ack(
        session=session,
        offer_id=lease.offer_id,
        phase=phase,
        lease_token=token,
        spec_sha256=lease.spec_digest,
        executor_handle="pid:1",
        exit_code=0,
    )


def expire_in(lease: RunLease, seconds: float) -> None:
    RunLease.objects.filter(pk=lease.pk).update(expires_at=db_now() + timedelta(seconds=seconds))


def test_starting_ack_committing_as_the_lease_expires_wins_and_the_sweeper_backs_off(
    monkeypatch,
) -> None:
    session, run, lease, token = claimed()
    # The ACK passes its expiry check, then holds its locks past expires_at.
    expire_in(lease, HOLD_S / 2)
    entered = threading.Event()
    # `_apply` runs once every check passed, under the ACK's locks, before its writes.
    hold_inside(monkeypatch, ack_use_case, "_apply", thread="ack", entered=entered)
    results: dict[str, Any] = {}
    ack = in_thread("ack", lambda: ack_phase(session, lease, token, AckPhase.STARTING), results)
    assert entered.wait(10)
    time.sleep(HOLD_S / 2 + 0.1)  # now the lease is past expires_at, ACK uncommitted
    sweeper = in_thread("sweeper", sweep_expired_leases, results)
    ack.join(20)
    sweeper.join(20)
    assert results["ack"].outcome is Outcome.APPLIED
    swept = results["sweeper"]
    assert (swept.examined, swept.applied) == (1, 0)  # re-checked under lock: renewed
    lease.refresh_from_db()
    assert lease.state == LeaseState.ACTIVE
    assert lease.expires_at > db_now()
    assert Attempt.objects.get(pk=lease.attempt_id).state == "starting"
    assert Run.objects.get(pk=run.pk).state == "running"


def test_sweeper_expiring_first_makes_the_waiting_starting_ack_a_409(monkeypatch) -> None:
    session, run, lease, token = claimed()
    expire_in(lease, -1)
    entered = threading.Event()
    hold_inside(monkeypatch, end_use_case, "lease_transition", thread="sweeper", entered=entered)
    results: dict[str, Any] = {}
    sweeper = in_thread("sweeper", sweep_expired_leases, results)
    assert entered.wait(10)
    ack = in_thread("ack", lambda: ack_phase(session, lease, token, AckPhase.STARTING), results)
    sweeper.join(20)
    ack.join(20)
    assert results["sweeper"].applied == 1
    assert isinstance(results["ack"], LeaseConflict)
    assert results["ack"].code == "lease_expired"
    lease.refresh_from_db()
    assert lease.state == LeaseState.EXPIRED
    attempt = Attempt.objects.get(pk=lease.attempt_id)
    # Back to pending for the next claim (generation + 1): nothing ever ran.
    assert (attempt.state, attempt.started_at) == ("pending", None)
    assert Run.objects.get(pk=run.pk).state == "queued"


def test_completion_committing_while_the_sweeper_waits_is_never_overwritten(monkeypatch) -> None:
    session, run, lease, token = claimed(ack=(AckPhase.STARTING, AckPhase.RUNNING))
    lease.refresh_from_db()
    expire_in(lease, HOLD_S / 2)
    entered = threading.Event()
    # Hold the succeeded ACK under its locks, its checks passed, before it writes and commits.
    hold_inside(monkeypatch, ack_use_case, "_apply", thread="ack", entered=entered)
    results: dict[str, Any] = {}
    ack = in_thread("ack", lambda: ack_phase(session, lease, token, AckPhase.SUCCEEDED), results)
    assert entered.wait(10)
    time.sleep(HOLD_S / 2 + 0.1)
    sweeper = in_thread("sweeper", sweep_expired_leases, results)
    ack.join(20)
    sweeper.join(20)
    assert results["ack"].outcome is Outcome.APPLIED
    assert results["sweeper"].applied == 0
    lease.refresh_from_db()
    assert lease.state == LeaseState.RELEASED
    assert Attempt.objects.get(pk=lease.attempt_id).state == "succeeded"
    assert Run.objects.get(pk=run.pk).state == "succeeded"
    # And a later sweep still leaves the released lease alone.
    assert sweep_expired_leases().examined == 0
