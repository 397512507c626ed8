"""Concurrency limits recover after a cancel and after an agent is killed with
SIGKILL (issue 13, README "Run policies"), for both limits: the Task's and the
Project's `max_concurrent_runs` count live leases (`leases.quota`), so a
cancel that revokes or ends the lease frees its slot, and an expired lease no
longer counts, before any sweep (the Task's: leases/tests/test_task_quota.py).

A started Run that is cancelled keeps its slot until its process has really
stopped (the agent's terminal ACK) or its lease is gone: two never run at once.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from dispatch.core.ports import ClaimStatus
from dispatch.sweeps import sweep_expired_leases
from leases.ack import AckPhase, lease_ack
from leases.end import run_cancel
from leases.models import LeaseState, RunLease
from leases.tests.test_task_quota import kill_an_agent_holding
from qinglong.testing import claim, make_run, make_task, open_session, pending_attempt
from runs.models import Project, Run, RunState, Task
from runs.services import project_create
from workers.models import WorkerSession

Held = tuple[WorkerSession, str, str]  # Session, offer id, lease token


def _claim(run: Run) -> tuple[str, Held]:
    session = open_session(slots=4).session
    outcome, offer_id, token = claim(pending_attempt(run), session)
    return outcome.status, (session, offer_id, token)


def _limited(kind: str) -> Task:
    """A Task held to one Run at a time, by its own limit or its Project's."""
    if kind == "task":
        return make_task(max_concurrent_runs=1)
    project: Project = project_create(
        slug=f"quota-{time.monotonic_ns()}", name="Quota", max_concurrent_runs=1
    )
    return make_task(project)


def _ack(held: Held, phase: AckPhase, **fields: Any) -> None:
    session, offer_id, token = held
    lease = RunLease.objects.get(offer_id=offer_id)
    lease_ack(
        session=session,
        offer_id=offer_id,
        phase=phase,
        lease_token=token,
        spec_sha256=lease.spec_digest,
        **fields,
    )


@pytest.mark.django_db
@pytest.mark.parametrize("kind", ["task", "project"])
def test_a_limit_recovers_at_once_when_a_claimed_run_is_cancelled(kind: str) -> None:
    task = _limited(kind)
    first, second = make_run(task), make_run(task)
    assert _claim(first)[0] == ClaimStatus.WON
    assert _claim(second)[0] == ClaimStatus.ATTEMPT_LOST
    run_cancel(run=first, actor="test")  # not started: cancelled, lease revoked
    first.refresh_from_db()
    assert first.state == RunState.CANCELLED
    assert _claim(second)[0] == ClaimStatus.WON


@pytest.mark.django_db
@pytest.mark.parametrize("kind", ["task", "project"])
def test_a_limit_recovers_when_a_cancelled_running_run_has_stopped(kind: str) -> None:
    task = _limited(kind)
    first, second = make_run(task), make_run(task)
    status, held = _claim(first)
    assert status == ClaimStatus.WON
    _ack(held, AckPhase.STARTING)
    _ack(held, AckPhase.RUNNING, executor_handle="pid:1")
    run_cancel(run=first, actor="test")
    first.refresh_from_db()
    assert (first.state, first.cancel_requested) == (RunState.RUNNING, True)
    # Its process still runs until the agent stops it: the slot stays taken.
    assert _claim(second)[0] == ClaimStatus.ATTEMPT_LOST
    _ack(held, AckPhase.FAILED, exit_code=-15)  # the agent stopped it
    first.refresh_from_db()
    assert first.state == RunState.CANCELLED
    assert _claim(second)[0] == ClaimStatus.WON


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_project_limit_recovers_after_its_agent_is_killed_with_sigkill() -> None:
    task = _limited("project")
    held, waiting = make_run(task), make_run(task)
    kill_an_agent_holding(held)  # its lease lives 2 s
    held.refresh_from_db()
    assert held.state == RunState.RUNNING
    assert _claim(waiting)[0] == ClaimStatus.ATTEMPT_LOST  # the dead agent's slot
    time.sleep(2.1)
    # No sweep has run and no process will ever report: the lease is past
    # expires_at, so it no longer holds the Project's slot.
    assert RunLease.objects.get(run=held).state == LeaseState.ACTIVE
    assert _claim(waiting)[0] == ClaimStatus.WON
    # The expired-lease sweep then ends the dead agent's Run.
    assert sweep_expired_leases().applied == 1
    held.refresh_from_db()
    assert held.state == RunState.FAILED  # max_attempts 1: lost, not retried


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kind", ["task", "project"])
def test_a_limit_recovers_after_a_cancel_of_a_run_whose_agent_was_killed(kind: str) -> None:
    task = _limited(kind)
    held, waiting = make_run(task), make_run(task)
    kill_an_agent_holding(held)
    run_cancel(run=held, actor="test")  # started: a request nobody will hear
    assert _claim(waiting)[0] == ClaimStatus.ATTEMPT_LOST
    time.sleep(2.1)
    sweep_expired_leases()
    held.refresh_from_db()
    assert held.state == RunState.CANCELLED
    assert RunLease.objects.get(run=held).state == LeaseState.EXPIRED
    assert _claim(waiting)[0] == ClaimStatus.WON
