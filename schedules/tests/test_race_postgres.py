"""Four evaluator processes racing on one PostgreSQL database (docs/adr/0010).

Duplicate Celery beats, several `run_dispatcher` processes and restarts all
come down to this: several evaluators calling the bounded step at once. Every
fire must be in the ledger exactly once, with no gap, and every enqueued fire
must have exactly one Run.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection
from django.db.models import Count

from leases.tests.racing import race
from qinglong.clock import db_now
from qinglong.testing import make_task
from runs.models import Run
from schedules.models import FireOutcome, Schedule, ScheduleFire
from schedules.services import schedule_create, schedule_cron

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]
EVALUATORS = 4
SCHEDULES = 24
RUN_FOR_S = 8.0
# After RUN_FOR_S each evaluator goes on until every Schedule's first 20 fires
# (the backlog it was created with) are in the ledger, so the outcome does not
# depend on how fast a loaded box evaluates; this only bounds a hung run.
DRAIN_FOR_S = 90.0
BACKLOG = 20

CHILD = """
import json, sys, time
from datetime import datetime
import django
django.setup()
from schedules.models import Schedule
from schedules.services import schedules_evaluate
backlog_end = datetime.fromisoformat(sys.argv[3])
started = time.monotonic()
totals = {"calls": 0, "fires": 0, "lost_race": 0, "busy": 0}
while time.monotonic() - started < float(sys.argv[2]):
    # Small pages and per-schedule caps: many short transactions interleave.
    result = schedules_evaluate(page_size=4, max_pages=2, fires_per_schedule=3)
    totals["calls"] += 1
    totals["fires"] += result.fires
    totals["lost_race"] += result.lost_race
    totals["busy"] += result.busy
    if time.monotonic() - started >= float(sys.argv[1]):
        if not Schedule.objects.filter(next_fire_at__lte=backlog_end).exists():
            break
print(json.dumps(totals))
"""


def child_env() -> dict[str, str]:
    db = connection.settings_dict
    url = "postgres://{user}{password}@{host}:{port}/{name}".format(
        user=db["USER"] or "postgres",
        password=f":{db['PASSWORD']}" if db["PASSWORD"] else "",
        host=db["HOST"] or "127.0.0.1",
        port=db["PORT"] or 5432,
        name=db["NAME"],  # the test database
    )
    return {
        **os.environ,
        "DATABASE_URL": url,
        "DJANGO_SETTINGS_MODULE": "qinglong.settings_test",
        "LOG_LEVEL": "WARNING",
    }


def test_four_evaluator_processes_fire_every_second_exactly_once() -> None:
    task = make_task()
    # Every second, created 20 s ago: each Schedule starts 20 fires behind and
    # gains one per second while the evaluators race.
    started = db_now() - timedelta(seconds=BACKLOG)
    policies = ("allow", "skip", "buffer_one")
    for index in range(SCHEDULES):
        schedule_create(
            task=task,
            name=f"race{index}",
            definition={
                "cron": "* * * * * *",
                "catchup_window_s": 3600,
                "overlap_policy": policies[index % len(policies)],
            },
            now=started,
        )
    children = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                CHILD,
                str(RUN_FOR_S),
                str(DRAIN_FOR_S),
                (started + timedelta(seconds=BACKLOG)).isoformat(),
            ],
            cwd=ROOT,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(EVALUATORS)
    ]
    totals = []
    for child in children:
        out, err = child.communicate(timeout=DRAIN_FOR_S + 60)
        assert child.returncode == 0, err[-3000:]
        totals.append(json.loads(out.strip().splitlines()[-1]))
    assert all(t["calls"] > 0 for t in totals), totals
    fired = sum(t["fires"] for t in totals)
    # Each Schedule started 20 fires behind, and that backlog was drained.
    assert fired >= SCHEDULES * BACKLOG, totals

    # Exactly once: no (schedule, fire_at) twice (the unique row), and per
    # Schedule an unbroken second-by-second sequence up to its cursor.
    duplicates = (
        ScheduleFire.objects.values("schedule_id", "fire_at")
        .annotate(n=Count("id"))
        .filter(n__gt=1)
    )
    assert not duplicates.exists()
    for schedule in Schedule.objects.all():
        fires = list(
            ScheduleFire.objects.filter(schedule=schedule)
            .order_by("fire_at")
            .values_list("fire_at", "last_fire_at", "outcome")
        )
        assert not [f for f in fires if f[2] == FireOutcome.MISSED], schedule.name
        expected = schedule_cron(schedule).fires(started, limit=len(fires))
        assert [f[0] for f in fires] == expected, schedule.name
        assert schedule.next_fire_at == schedule_cron(schedule).next_after(fires[-1][0])
    # Every enqueued fire has exactly one Run, and every Run of a Schedule one fire.
    enqueued = ScheduleFire.objects.filter(outcome=FireOutcome.ENQUEUED)
    run_ids = list(enqueued.values_list("run_id", flat=True))
    assert len(run_ids) == len(set(run_ids))
    assert set(run_ids) == set(
        Run.objects.filter(schedule__isnull=False).values_list("id", flat=True)
    )
    assert ScheduleFire.objects.count() >= SCHEDULES * BACKLOG


def _covering(schedule: Schedule, instant) -> int:
    from schedules.selectors import covering

    return ScheduleFire.objects.filter(covering(instant), schedule=schedule, manual=False).count()


def test_a_manual_resume_racing_the_resume_at_records_the_pause_once() -> None:
    from schedules.services import schedule_pause, schedule_resume, schedules_evaluate

    task = make_task()
    for round_no in range(4):
        base = db_now()
        schedule = schedule_create(
            task=task,
            name=f"resume{round_no}",
            definition={"cron": "* * * * * *", "overlap_policy": "allow"},
            now=base,
        )
        resume_at = base + timedelta(seconds=5)
        schedule_pause(
            schedule_id=schedule.pk, actor="ops", reason="r", resume_at=resume_at, now=base
        )
        moment = resume_at + timedelta(seconds=2)
        by_hand, by_itself = race(
            functools.partial(schedule_resume, schedule_id=schedule.pk, actor="ops", now=moment),
            functools.partial(schedules_evaluate, now=moment),
        )
        assert not isinstance(by_hand, Exception), by_hand
        assert not isinstance(by_itself, Exception), by_itself
        schedule.refresh_from_db()
        assert not schedule.paused
        paused = list(ScheduleFire.objects.filter(schedule=schedule, outcome=FireOutcome.PAUSED))
        assert len(paused) == 1
        # Whoever won, every fire up to the cursor is accounted for once.
        for fire in schedule_cron(schedule).fires(base, limit=100):
            if schedule.next_fire_at is None or fire >= schedule.next_fire_at:
                break
            assert _covering(schedule, fire) == 1, fire


def test_a_pause_racing_the_evaluation_of_a_due_fire_decides_it_once() -> None:
    from schedules.services import schedule_pause, schedule_resume, schedules_evaluate

    task = make_task()
    for round_no in range(4):
        base = db_now()
        schedule = schedule_create(
            task=task,
            name=f"pause{round_no}",
            definition={"cron": "* * * * * *", "overlap_policy": "allow"},
            now=base,
        )
        due = schedule.next_fire_at
        assert due is not None
        moment = due + timedelta(milliseconds=500)
        paused, evaluated = race(
            functools.partial(
                schedule_pause, schedule_id=schedule.pk, actor="ops", reason="r", now=moment
            ),
            functools.partial(schedules_evaluate, now=moment),
        )
        assert not isinstance(paused, Exception), paused
        assert not isinstance(evaluated, Exception), evaluated
        schedule_resume(schedule_id=schedule.pk, actor="ops", now=moment + timedelta(seconds=3))
        # The due fire is either enqueued (the evaluator first) or part of
        # the paused stretch (the pause first): exactly one row covers it.
        assert _covering(schedule, due) == 1
        rows = ScheduleFire.objects.filter(schedule=schedule).order_by("fire_at")
        assert rows[0].fire_at == due
        assert rows[0].outcome in (FireOutcome.ENQUEUED, FireOutcome.PAUSED)
        runs = Run.objects.filter(schedule=schedule).count()
        assert runs == (1 if rows[0].outcome == FireOutcome.ENQUEUED else 0)
