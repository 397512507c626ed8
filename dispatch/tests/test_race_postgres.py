"""Many dispatcher processes racing on one PostgreSQL database (README "Running it").

Four OS processes run global-scope `dispatch_cycle` in a loop while two more
act as the Workers of 20 small Sessions: they pull (session scope, with a
PullCredential, claiming for themselves too) and ACK `starting` + `succeeded`,
so slots free up and the global dispatchers keep claiming. Afterwards the
lease authority must be intact (docs/adr/0002).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.db.models import Count, F, Q

from dispatch.models import DispatchCycle
from leases.models import LeaseState, RunLease
from qinglong import testing
from qinglong.clock import db_now
from runs.models import Attempt, AttemptState, Run, RunState
from workers.models import WorkerSession

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]
RUNS = 500
SESSIONS = 20
SLOTS = 2
GLOBAL_PROCESSES = 4
PULLER_PROCESSES = 2
RUN_FOR_S = 30.0


def seed_backlog(count: int) -> None:
    """Bulk-insert queued Runs with their pending Attempt #1 (as run_enqueue would)."""
    task = testing.make_task()
    revision = task.current_revision
    assert revision is not None
    start = db_now()
    runs = Run.objects.bulk_create(
        Run(
            project_id=task.project_id,
            task=task,
            task_revision=revision,
            priority=i % 5,
            queued_at=start,
        )
        for i in range(count)
    )
    Attempt.objects.bulk_create(
        Attempt(run=run, number=1, priority=run.priority, queued_at=run.queued_at) for run in runs
    )


def child_env() -> dict[str, str]:
    db = connection.settings_dict
    url = "postgres://{user}{password}@{host}:{port}/{name}".format(
        user=db["USER"] or "postgres",
        password=f":{db['PASSWORD']}" if db["PASSWORD"] else "",
        host=db["HOST"] or "127.0.0.1",
        port=db["PORT"] or 5432,
        # The test database this test runs in, not the configured one.
        name=db["NAME"],
    )
    return {
        **os.environ,
        "DATABASE_URL": url,
        "DJANGO_SETTINGS_MODULE": "qinglong.settings_test",
        "LOG_LEVEL": "WARNING",
    }


def child_reports(children: list[subprocess.Popen[str]], *, timeout: float) -> list[Any]:
    """Each child's last stdout line as JSON, once every child has exited.

    All are waited for (and killed past the timeout) before any is judged,
    so one that failed leaves no other running or with its pipes open.
    """
    done: list[tuple[int, str, str]] = []
    for child in children:
        try:
            out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            out, err = child.communicate()
            err += "\n(killed: still running past the test's timeout)"
        done.append((child.returncode, out, err))
    for returncode, _, err in done:
        assert returncode == 0, err[-4000:]
    return [json.loads(out.strip().splitlines()[-1]) for _, out, _ in done]


def test_many_dispatcher_processes_never_break_the_lease_authority() -> None:
    seed_backlog(RUNS)
    sessions = [testing.open_session(slots=SLOTS).session for _ in range(SESSIONS)]
    pks = [str(s.pk) for s in sessions]
    deadline = str(time.time() + RUN_FOR_S)
    env = child_env()
    commands = [["global", deadline] for _ in range(GLOBAL_PROCESSES)] + [
        ["puller", deadline, *pks[i::PULLER_PROCESSES]] for i in range(PULLER_PROCESSES)
    ]
    started = time.monotonic()
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "dispatch.tests._race_child", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in commands
    ]
    reports = child_reports(children, timeout=RUN_FOR_S + 30)
    wall = time.monotonic() - started
    print("\nchildren:", reports)

    # ------------------------------------------------------------ invariants
    leases = RunLease.objects.count()
    active = RunLease.objects.filter(state=LeaseState.ACTIVE)
    dup_generation = (
        RunLease.objects.values("attempt_id", "lease_generation")
        .annotate(n=Count("id"))
        .filter(n__gt=1)
        .count()
    )
    dup_active = active.values("attempt_id").annotate(n=Count("id")).filter(n__gt=1).count()
    over_slots = [
        s.pk
        for s in WorkerSession.objects.annotate(
            n=Count("leases", filter=Q(leases__state=LeaseState.ACTIVE))
        )
        if s.n > s.slots
    ]
    claimed = Attempt.objects.filter(state=AttemptState.CLAIMED)
    claimed_without_one_lease = (
        claimed.annotate(n=Count("leases", filter=Q(leases__state=LeaseState.ACTIVE)))
        .exclude(n=1)
        .count()
    )
    stale_active = active.exclude(attempt__lease_generation=F("lease_generation")).count()
    cycle_claims = sum(
        int(c.get("claims_won", 0)) for c in DispatchCycle.objects.values_list("counts", flat=True)
    )
    reported_claims = sum(r["claims_won"] for r in reports)
    succeeded = Run.objects.filter(state=RunState.SUCCEEDED).count()

    print(
        "\nrace:",
        json.dumps(
            {
                "wall_s": round(wall, 1),
                "processes": len(children),
                "runs": RUNS,
                "sessions": SESSIONS,
                "slots": SLOTS,
                "leases_inserted": leases,
                "claims_won_reported": reported_claims,
                "claims_won_recorded": cycle_claims,
                "runs_succeeded": succeeded,
                "cycles": sum(r["cycles"] for r in reports),
                "acked": sum(r["acked"] for r in reports),
                "ack_refused": sum(r["ack_refused"] for r in reports),
                "active_leases_left": active.count(),
                "dup_generation": dup_generation,
                "dup_active": dup_active,
                "over_slots": len(over_slots),
                "claimed_without_one_lease": claimed_without_one_lease,
            }
        ),
    )
    assert dup_generation == 0
    assert dup_active == 0
    assert over_slots == []
    assert claimed_without_one_lease == 0
    assert stale_active == 0
    assert reported_claims == cycle_claims == leases
    assert leases >= SESSIONS * SLOTS, "the race must actually have claimed work"
    assert wall < 60
