"""A Task's concurrency limit (README "Run policies"): counted from live leases in
the claim transaction (leases.quota), so it recovers after a cancel and after an
agent is killed with SIGKILL, and racing claims never exceed it."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection
from django.test import override_settings

from dispatch.core.ports import ClaimStatus
from leases.claim import lease_claim
from leases.end import run_cancel
from leases.models import LeaseState, RunLease
from leases.quota import QuotaLimit, quota_blocker
from qinglong import testing
from qinglong.testing import claim, make_run, make_task, open_session, pending_attempt
from runs.models import Run, RunState

ROOT = Path(__file__).resolve().parents[2]


def _claim(run: Run, *, slots: int = 4) -> str:
    return claim(pending_attempt(run), open_session(slots=slots).session)[0].status


@pytest.mark.django_db
def test_a_task_limit_holds_and_recovers_after_a_cancel() -> None:
    task = make_task(max_concurrent_runs=1)
    first, second = make_run(task), make_run(task)
    assert _claim(first) == ClaimStatus.WON
    assert (
        quota_blocker(project=task.project, task_id=task.pk, task_limit=1, lock=False)
        is QuotaLimit.TASK
    )
    assert _claim(second) == ClaimStatus.ATTEMPT_LOST
    second.refresh_from_db()
    assert second.state == RunState.QUEUED  # nothing changed
    run_cancel(run=first, actor="test")  # its lease is revoked with it
    assert _claim(second) == ClaimStatus.WON


@pytest.mark.django_db
def test_other_tasks_and_unlimited_tasks_are_not_held_back() -> None:
    limited = make_task(max_concurrent_runs=1)
    other = make_task(project=limited.project)
    assert _claim(make_run(limited)) == ClaimStatus.WON
    assert _claim(make_run(other)) == ClaimStatus.WON
    assert _claim(make_run(other)) == ClaimStatus.WON


@pytest.mark.django_db
def test_an_expired_lease_frees_its_slot_before_any_sweep() -> None:
    task = make_task(max_concurrent_runs=1)
    first, second = make_run(task), make_run(task)
    short = {**settings.QINGLONG_DISPATCH, "lease_ttl_s": 1}
    with override_settings(QINGLONG_DISPATCH=short):
        assert _claim(first) == ClaimStatus.WON
        assert _claim(second) == ClaimStatus.ATTEMPT_LOST
        time.sleep(1.05)
        # Not yet swept: the lease row is still `active`, but it is not live.
        assert RunLease.objects.filter(run=first, state=LeaseState.ACTIVE).exists()
        assert _claim(second) == ClaimStatus.WON


@pytest.mark.django_db
def test_the_revision_a_run_is_pinned_to_decides_its_limit() -> None:
    from runs.services import task_update

    task = make_task(max_concurrent_runs=1)
    pinned = [make_run(task), make_run(task)]
    task_update(task=task, definition=testing.definition(max_concurrent_runs=0))
    assert _claim(pinned[0]) == ClaimStatus.WON
    # The second Run is pinned to revision 1 (limit 1): held back …
    assert _claim(pinned[1]) == ClaimStatus.ATTEMPT_LOST
    # … while a Run of revision 2 (no limit) goes.
    assert _claim(make_run(task)) == ClaimStatus.WON


# ------------------------------------------------------------ PostgreSQL


AGENT_KILLED = """
import os, signal, sys
import django
django.setup()
from leases.ack import AckPhase, lease_ack
from leases.models import RunLease
from qinglong.testing import claim, open_session, pending_attempt
from runs.models import Run
run = Run.objects.get(pk=int(sys.argv[1]))
session = open_session(slots=1).session
outcome, offer_id, token = claim(pending_attempt(run), session)
assert outcome.status == "won", outcome
lease = RunLease.objects.get(offer_id=offer_id)
lease_ack(session=session, offer_id=offer_id, phase=AckPhase.STARTING,
          lease_token=token, spec_sha256=lease.spec_digest)
print("started", flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # the agent dies holding the Task's slot
"""


def _child_env() -> dict[str, str]:
    db = connection.settings_dict
    url = "postgres://{user}{password}@{host}:{port}/{name}".format(
        user=db["USER"] or "postgres",
        password=f":{db['PASSWORD']}" if db["PASSWORD"] else "",
        host=db["HOST"] or "127.0.0.1",
        port=db["PORT"] or 5432,
        name=db["NAME"],
    )
    return {
        **os.environ,
        "DATABASE_URL": url,
        "DJANGO_SETTINGS_MODULE": "qinglong.settings_test",
        "LOG_LEVEL": "WARNING",
        # The lease of the killed process lives 2 s (a real agent's would be
        # renewed by its heartbeats; this one never beats again).
        "QL_DISPATCH_LEASE_TTL_S": "2",
    }


def kill_an_agent_holding(run: Run) -> subprocess.CompletedProcess[str]:
    """A child process claims `run` on a Session of its own, ACKs starting and
    dies by SIGKILL holding the lease (which lives 2 s, see `_child_env`)."""
    child = subprocess.run(
        [sys.executable, "-c", AGENT_KILLED, str(run.pk)],
        cwd=ROOT,
        env=_child_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert child.returncode == -9, child.stderr[-2000:]
    return child


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_task_limit_recovers_after_its_agent_is_killed_with_sigkill() -> None:
    task = make_task(max_concurrent_runs=1)
    held, waiting = make_run(task), make_run(task)
    child = kill_an_agent_holding(held)
    assert child.stdout.strip() == "started"
    held.refresh_from_db()
    assert held.state == RunState.RUNNING
    assert _claim(waiting) == ClaimStatus.ATTEMPT_LOST  # the dead agent's slot
    time.sleep(2.1)
    # No sweep has run and no process will ever report: the lease is past
    # expires_at, so it no longer counts.
    assert _claim(waiting) == ClaimStatus.WON


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_racing_claims_never_exceed_a_task_limit() -> None:
    task = make_task(max_concurrent_runs=2)
    runs = [make_run(task) for _ in range(6)]
    requests = [
        testing.claim_request(pending_attempt(run), open_session(slots=2).session)[0]
        for run in runs
    ]
    barrier = threading.Barrier(len(requests))
    statuses: list[str] = []

    def racer(request) -> None:
        try:
            barrier.wait()
            statuses.append(lease_claim(request).status)
        finally:
            connection.close()

    threads = [threading.Thread(target=functools.partial(racer, r)) for r in requests]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(statuses).count(ClaimStatus.WON) == 2
    assert RunLease.objects.filter(run__task=task, state=LeaseState.ACTIVE).count() == 2
