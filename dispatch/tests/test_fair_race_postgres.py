"""Concurrency limits under racing dispatchers and killed ones (issue 11, PostgreSQL).

- Four OS processes run global `dispatch_cycle` in a loop while two more act
  as the Workers of 20 Sessions (pull, ACK starting, running, succeeded), over
  Projects with `max_concurrent_runs` of 1, 2 and 3, a Task limit of 1 and an
  unlimited Project. From the leases' own history (claimed_at, ended_at) no
  Project and no Task ever had more live leases than its limit — and the
  limited Projects were served all along (the fair read, docs/adr/0012).
- Dispatcher processes are killed with SIGKILL in the middle of claims (held
  at the Session lock, after they locked the Run, the Attempt and the
  Project) and at random moments: nothing they did not commit remains, and
  afterwards a Project fills up to exactly its limit again — no slot is lost,
  since a slot is a live lease and nothing else (`leases.quota`).
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict
from datetime import datetime
from pathlib import Path

import psycopg
import pytest
from django.db import connection
from django.db.models import Count, Q

from dispatch.core.ports import DispatchScope
from dispatch.cycles import dispatch_cycle
from dispatch.tests.test_race_postgres import child_env, child_reports
from leases.end import run_cancel
from leases.models import LeaseState, RunLease
from qinglong import testing
from runs.models import Attempt, AttemptState, Project, Run, RunState, Task
from runs.services import project_create, run_enqueue_bulk
from workers.models import WorkerSession

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]
GLOBAL = DispatchScope.global_()
RUN_FOR_S = 20.0


def _project(limit: int) -> Project:
    return project_create(
        slug=f"race-{limit}-{time.monotonic_ns()}", name="Race", max_concurrent_runs=limit
    )


def _enqueue(task: Task, count: int) -> None:
    run_enqueue_bulk(items=[(task, i % 3) for i in range(count)])


def _spawn(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "dispatch.tests._race_child", *args],
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _max_overlap(intervals: list[tuple[datetime, datetime | None]]) -> int:
    """Most leases live at one instant; an end at t comes before a start at t."""
    events: list[tuple[datetime, int]] = []
    for start, end in intervals:
        events.append((start, 1))
        if end is not None:
            events.append((end, -1))
    events.sort(key=lambda e: (e[0], e[1]))
    live = peak = 0
    for _, step in events:
        live += step
        peak = max(peak, live)
    return peak


def _lease_intervals(**run_filter: object) -> list[tuple[datetime, datetime | None]]:
    return [
        (claimed, ended)
        for claimed, ended in RunLease.objects.filter(
            **{f"run__{k}": v for k, v in run_filter.items()}
        ).values_list("claimed_at", "ended_at")
    ]


def _consistent() -> None:
    """Nothing half-done: every claimed Attempt has exactly one active lease,
    every active lease its claimed or started Attempt, every Run in flight one."""
    claimed = Attempt.objects.filter(state=AttemptState.CLAIMED)
    assert (
        claimed.annotate(n=Count("leases", filter=Q(leases__state=LeaseState.ACTIVE)))
        .exclude(n=1)
        .count()
        == 0
    )
    assert (
        RunLease.objects.filter(state=LeaseState.ACTIVE)
        .exclude(
            attempt__state__in=(AttemptState.CLAIMED, AttemptState.STARTING, AttemptState.RUNNING)
        )
        .count()
        == 0
    )
    in_flight = Run.objects.filter(state__in=(RunState.DISPATCHING, RunState.RUNNING))
    assert (
        in_flight.annotate(n=Count("leases", filter=Q(leases__state=LeaseState.ACTIVE)))
        .exclude(n=1)
        .count()
        == 0
    )


def test_four_dispatchers_never_exceed_a_project_or_task_limit() -> None:
    limits = {1: _project(1), 2: _project(2), 3: _project(3)}
    tasks = {limit: testing.make_task(project) for limit, project in limits.items()}
    task_limited = testing.make_task(_project(0), max_concurrent_runs=1)
    free = testing.make_task(_project(0))
    for each in (*tasks.values(), task_limited, free):
        _enqueue(each, 60)
    sessions = [testing.open_session(slots=2).session for _ in range(20)]
    pks = [str(s.pk) for s in sessions]
    deadline = str(time.time() + RUN_FOR_S)
    children = [_spawn(["global", deadline]) for _ in range(4)] + [
        _spawn(["puller", deadline, *pks[i::2]]) for i in range(2)
    ]
    reports = child_reports(children, timeout=RUN_FOR_S + 60)

    peaks = {limit: _max_overlap(_lease_intervals(project=p)) for limit, p in limits.items()}
    task_peak = _max_overlap(_lease_intervals(task=task_limited))
    served = {limit: RunLease.objects.filter(run__project=p).count() for limit, p in limits.items()}
    print(
        "\nfair race:",
        json.dumps(
            {
                "peaks_by_limit": peaks,
                "task_limit_1_peak": task_peak,
                "leases_by_limit": served,
                "free_project_leases": RunLease.objects.filter(run__task=free).count(),
                "succeeded": Run.objects.filter(state=RunState.SUCCEEDED).count(),
                "cycles": sum(r["cycles"] for r in reports),
                "claims_won": sum(r["claims_won"] for r in reports),
            }
        ),
    )
    for limit, peak in peaks.items():
        assert 1 <= peak <= limit, (limit, peak)
    assert task_peak == 1
    # Every limited Project was served, not starved behind the others.
    for limit, count in served.items():
        assert count >= 2, (limit, count)
    _consistent()


def _backends_waiting_on_a_lock() -> int:
    """Backends of this database waiting for a row lock (only the children can)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        row = cursor.fetchone()
    assert row is not None
    return int(row[0])


def _kill(children: list[subprocess.Popen[str]]) -> None:
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)
    for child in children:
        child.communicate(timeout=30)


def _release_everything() -> None:
    for run in Run.objects.filter(state__in=(RunState.DISPATCHING, RunState.RUNNING)):
        run_cancel(run=run, actor="test")


def _session_lock_conninfo() -> str:
    db = connection.settings_dict
    return "host={host} port={port} user={user} dbname={name}{password}".format(
        host=db["HOST"] or "127.0.0.1",
        port=db["PORT"] or 5432,
        user=db["USER"] or "postgres",
        name=db["NAME"],
        password=f" password={db['PASSWORD']}" if db["PASSWORD"] else "",
    )


def test_dispatchers_killed_mid_claim_lose_no_slot() -> None:
    limited = testing.make_task(_project(2))
    _enqueue(limited, 40)
    worker, _ = testing.make_worker(slots=8)
    session = testing.open_session(worker).session
    table = WorkerSession._meta.db_table

    # 1. Held at the Session lock: each child has locked its Run, Attempt and
    #    the Project, and waits. Killed there, none of it may remain.
    with psycopg.connect(_session_lock_conninfo()) as holder:
        holder.execute(f"SELECT id FROM {table} WHERE id = %s FOR NO KEY UPDATE", [session.pk])
        children = [_spawn(["global", str(time.time() + 120)]) for _ in range(3)]
        deadline = time.monotonic() + 30
        while _backends_waiting_on_a_lock() < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _backends_waiting_on_a_lock() >= 1, "no child reached the Session lock"
        time.sleep(0.5)  # let the others pile up behind it (Project lock)
        _kill(children)
        holder.rollback()
    time.sleep(0.5)  # the killed clients' backends read EOF and roll back
    assert RunLease.objects.count() == 0
    _consistent()

    # 2. Killed at random moments, again and again.
    rng = random.Random(11)
    for _ in range(6):
        children = [_spawn(["global", str(time.time() + 120)]) for _ in range(3)]
        time.sleep(rng.uniform(0.2, 1.5))
        _kill(children)
        time.sleep(0.3)
        live = RunLease.objects.filter(state=LeaseState.ACTIVE, run__task=limited).count()
        assert live <= 2
        _consistent()
        _release_everything()

    # 3. No slot was lost: the Project fills to exactly its limit again.
    assert RunLease.objects.filter(state=LeaseState.ACTIVE).count() == 0
    assert dispatch_cycle(scope=GLOBAL).counts.claims_won == 2
    assert dispatch_cycle(scope=GLOBAL).counts.claims_won == 0
    assert RunLease.objects.filter(state=LeaseState.ACTIVE, run__task=limited).count() == 2
    by_session: dict[int, int] = defaultdict(int)
    for lease in RunLease.objects.filter(state=LeaseState.ACTIVE):
        by_session[lease.session_id] += 1
    assert by_session == {session.pk: 2}
