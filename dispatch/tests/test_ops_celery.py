"""Celery beat + worker as REAL processes against the loopback Redis (README "Running it").

First one worker with embedded beat dispatches an enqueued Run to an open
Session and records DispatchCycle rows. Then two worker+beat processes run at
once: every beat is just one more cycle and claims are row-locked CAS, so there
is never a double claim — no Attempt with two active leases, no lease
generation used twice, no Session over its slots, and every claim a cycle
reports won is exactly one lease row.

Needs PostgreSQL (the child processes share the test database, which on the
SQLite pass is in memory) and Redis on 127.0.0.1:6379 (database 15, flushed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from django.db import connection
from django.db.models import Count

from dispatch.models import DispatchCycle
from leases.models import LeaseState, RunLease
from qinglong.testing import make_run, make_task, make_worker, open_session
from runs.models import AttemptEvent
from workers.models import WorkerSession

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]
BROKER = "redis://127.0.0.1:6379/15"


@pytest.fixture
def broker() -> Iterator[str]:
    client = redis.Redis.from_url(BROKER, socket_connect_timeout=2)
    client.flushdb()
    yield BROKER
    client.flushdb()
    client.close()


def child_env(broker: str) -> dict[str, str]:
    db = connection.settings_dict
    url = f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "qinglong.settings_test",
        "DATABASE_URL": url,
        "CELERY_BROKER_URL": broker,
        "LOG_LEVEL": "WARNING",
        # Summary rows of repeated outcomes every second, not every minute.
        "QL_CYCLE_SUMMARY_S": "1",
    }
    if db.get("PASSWORD"):
        env["PGPASSWORD"] = str(db["PASSWORD"])
    return env


def start_worker_with_beat(name: str, tmp_path: Path, env: dict[str, str]) -> subprocess.Popen:
    with (tmp_path / f"{name}.log").open("w") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "qinglong",
                "worker",
                "-B",
                "--pool=solo",
                "--loglevel=WARNING",
                "-n",
                f"{name}@%h",
                "-s",
                str(tmp_path / f"{name}-beat-schedule"),
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def cycles_recorded() -> int:
    """Cycles the rows stand for (a summary row sums repeats of one outcome)."""
    return sum(DispatchCycle.objects.values_list("cycles", flat=True))


def wait_for(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


def test_beat_dispatches_a_run_to_an_open_session_then_two_beats_never_double_claim(
    broker, tmp_path
):
    env = child_env(broker)
    session = open_session(make_worker(slots=2)[0]).session
    first = make_run()

    # --- one worker with embedded beat ------------------------------------
    procs = [start_worker_with_beat("solo", tmp_path, env)]
    try:
        got_lease = wait_for(
            lambda: (
                RunLease.objects.filter(run=first, session=session).exists()
                and DispatchCycle.objects.filter(scope="global").count() >= 2
            ),
            timeout=15,
        )
    finally:
        stop(procs)
    assert got_lease, (tmp_path / "solo.log").read_text()[-3000:]
    assert RunLease.objects.get(run=first).state == LeaseState.ACTIVE
    first_cycles = cycles_recorded()

    # --- two worker+beat processes racing over many runs and sessions -----
    sessions = [session] + [open_session(make_worker(slots=3)[0]).session for _ in range(3)]
    task = make_task()
    runs = [make_run(task) for _ in range(16)]
    procs = [start_worker_with_beat(f"racer{i}", tmp_path, env) for i in (1, 2)]
    try:
        wait_for(
            lambda: RunLease.objects.count() >= 12 and cycles_recorded() >= first_cycles + 10,
            timeout=20,
        )
        time.sleep(2)  # keep both beats racing over the saturated sessions a while
    finally:
        stop(procs)
    logs = "".join((tmp_path / f"racer{i}.log").read_text() for i in (1, 2))

    leases = RunLease.objects.all()
    active = leases.filter(state=LeaseState.ACTIVE)
    capacity = sum(min(s.slots, s.worker.slots) for s in WorkerSession.objects.all())
    # Every slot filled, none twice. (A lease nobody pulled may have been
    # revoked after max_deliveries re-deliveries and claimed again: that is a
    # new generation, not a double claim.)
    assert active.count() == capacity == 2 + 3 * 3, logs[-3000:]
    assert set(leases.exclude(state=LeaseState.ACTIVE).values_list("end_reason", flat=True)) <= {
        "max_deliveries"
    }
    # No attempt with two active leases, no lease generation used twice.
    assert not active.values("attempt").annotate(n=Count("id")).filter(n__gt=1)
    assert not leases.values("attempt", "lease_generation").annotate(n=Count("id")).filter(n__gt=1)
    # No Session over its slots.
    for s in sessions:
        assert active.filter(session=s).count() <= s.slots
    # Every claim a cycle reported won is exactly one lease and one claim event.
    cycles = list(DispatchCycle.objects.all())
    won = sum(c.counts.get("claims_won", 0) for c in cycles)
    lost = sum(c.counts.get("claims_lost", 0) for c in cycles)
    assert won == leases.count()
    assert AttemptEvent.objects.filter(reason="claim").count() == leases.count()
    racing_cycles = sum(c.cycles for c in cycles) - first_cycles
    assert racing_cycles >= 10
    queued = sum(1 for run in runs if type(run).objects.get(pk=run.pk).state == "queued")
    print(
        f"\ncelery real-process: phase 1 cycles={first_cycles}; phase 2 cycles={racing_cycles}; "
        f"leases={leases.count()} active={active.count()} capacity={capacity} "
        f"claims_won={won} claims_lost={lost} runs_still_queued={queued}"
    )
