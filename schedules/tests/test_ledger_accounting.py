"""Every fire time is accounted for by exactly one ledger row (docs/adr/0010).

A stretch of missed or paused fires is one row (`fire_at` … `last_fire_at`,
`fire_count`); every other fire has its own. These tests walk the cron
timetable fire by fire and ask the ledger's one lookup (`?at=`, the same
selector the admin's time search uses) which row accounts for each: exactly
one, always — through outages, pauses, a late resume-at and DST nights.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from qinglong.testing import make_task
from schedules.models import FireOutcome, Schedule, ScheduleFire
from schedules.selectors import fire_page
from schedules.services import (
    schedule_cron,
    schedule_pause,
    schedule_resume,
    schedules_evaluate,
)
from schedules.tests.helpers import T0, at, ledger, make_schedule, start

pytestmark = pytest.mark.django_db

E, S, M, P, B = (
    FireOutcome.ENQUEUED,
    FireOutcome.SKIPPED_OVERLAP,
    FireOutcome.MISSED,
    FireOutcome.PAUSED,
    FireOutcome.BLOCKED,
)


def rows_at(schedule: Schedule, instant: datetime) -> list[dict[str, object]]:
    results, _ = fire_page(schedule=schedule, outcome=None, at=instant, cursor=None, limit=10)
    return results


def assert_every_fire_accounted_once(schedule: Schedule, *, since: datetime) -> int:
    """Each fire from `since` up to the cursor is covered by exactly one row."""
    schedule.refresh_from_db()
    assert schedule.next_fire_at is not None
    cron = schedule_cron(schedule)
    fires = cron.fires(since, limit=5000)
    fires = [fire for fire in fires if fire < schedule.next_fire_at]
    for fire in fires:
        found = rows_at(schedule, fire)
        assert len(found) == 1, (fire, found)
    # And the rows' own counts add up to the timetable (no fire in two rows).
    timetable = ScheduleFire.objects.filter(schedule=schedule, manual=False)
    assert sum(row.fire_count or 0 for row in timetable) == len(fires)
    return len(fires)


def test_a_history_with_every_outcome_accounts_for_each_fire_once() -> None:
    task = make_task(max_concurrent_runs=1)
    schedule = make_schedule(task, cron="* * * * *", catchup_window_s=120, overlap_policy="skip")
    schedules_evaluate(now=at(minutes=1))  # 12:01 enqueued
    schedules_evaluate(now=at(minutes=2))  # 12:02 skipped: 12:01's Run is queued
    other = make_schedule(task, cron="0 0 1 1 *", overlap_policy="allow")
    from schedules.services import schedule_run_now

    held = schedule_run_now(schedule_id=other.pk, actor="test", now=at(minutes=2))
    assert held.run is not None
    start(held.run)  # the Task's one slot is taken by another Schedule's Run
    from leases.end import run_cancel

    first = ScheduleFire.objects.get(schedule=schedule, fire_at=at(minutes=1)).run
    assert first is not None
    run_cancel(run=first, actor="test")  # queued: cancelled at once
    schedules_evaluate(now=at(minutes=3))  # 12:03 blocked: the Task is at its limit
    # The control plane is down from 12:03 to 12:30: 12:04 … 12:27 missed,
    # 12:28 … 12:30 inside the window (blocked: the slot is still taken).
    schedules_evaluate(now=at(minutes=30))
    schedule_pause(
        schedule_id=schedule.pk, actor="ops", reason="maint", now=at(minutes=30, seconds=5)
    )
    schedule_resume(schedule_id=schedule.pk, actor="ops", now=at(minutes=45, seconds=5))
    schedules_evaluate(now=at(minutes=46))
    outcomes = {outcome for outcome, _ in ledger(schedule)}
    assert {E, S, M, P, B} <= outcomes
    assert assert_every_fire_accounted_once(schedule, since=T0) == 46
    # The stretches, as an operator reads them.
    missed = ScheduleFire.objects.get(schedule=schedule, outcome=M)
    paused = ScheduleFire.objects.get(schedule=schedule, outcome=P)
    assert (missed.fire_at, missed.last_fire_at, missed.fire_count) == (
        at(minutes=4),
        at(minutes=27),
        24,
    )
    assert (paused.fire_at, paused.last_fire_at, paused.fire_count) == (
        at(minutes=31),
        at(minutes=45),
        15,
    )
    # "Why didn't it run at 12:10?" finds the missed stretch; at 12:40, the pause.
    assert [r["id"] for r in rows_at(schedule, at(minutes=10))] == [str(missed.pk)]
    assert [r["id"] for r in rows_at(schedule, at(minutes=40))] == [str(paused.pk)]
    # Between two single fires, no row claims the instant.
    assert rows_at(schedule, at(minutes=1, seconds=30)) == []


def test_a_stretch_too_long_to_count_still_accounts_for_every_fire() -> None:
    schedule = make_schedule(cron="* * * * * *", catchup_window_s=0)
    # Down for two hours: 7,200 fires, more than the counting cap.
    schedules_evaluate(now=at(hours=2))
    missed = ScheduleFire.objects.get(schedule=schedule, outcome=M)
    assert missed.fire_count is None  # "more than 1,000"
    for instant in (at(seconds=1), at(minutes=59, seconds=59), at(hours=1, minutes=59)):
        assert [r["id"] for r in rows_at(schedule, instant)] == [str(missed.pk)]


# ------------------------------------------------------------- resume-at


def test_a_resume_at_evaluated_late_catches_up_like_any_outage() -> None:
    """The pause ended at resume-at: fires after it were due, not paused."""
    schedule = make_schedule(cron="* * * * *", catchup_window_s=300, overlap_policy="allow")
    schedule_pause(
        schedule_id=schedule.pk,
        actor="ops",
        reason="vendor window",
        resume_at=at(minutes=3, seconds=30),
        now=at(seconds=1),
    )
    # Nobody evaluates until 12:10 (the control plane was down).
    result = schedules_evaluate(now=at(minutes=10))
    assert result.summary()["fires"] == {"enqueued": 6, "missed": 1}
    assert ledger(schedule) == [
        (P, at(minutes=1)),  # 12:01 … 12:03, while paused
        (M, at(minutes=4)),  # due after the pause ended, older than the window
        (E, at(minutes=5)),
        (E, at(minutes=6)),
        (E, at(minutes=7)),
        (E, at(minutes=8)),
        (E, at(minutes=9)),
        (E, at(minutes=10)),
    ]
    paused = ScheduleFire.objects.get(schedule=schedule, outcome=P)
    assert (paused.last_fire_at, paused.fire_count) == (at(minutes=3), 3)
    assert paused.detail == "paused by ops: vendor window"
    schedule.refresh_from_db()
    assert not schedule.paused and schedule.next_fire_at == at(minutes=11)
    assert_every_fire_accounted_once(schedule, since=T0)


def test_a_fire_at_the_resume_at_instant_fires() -> None:
    schedule = make_schedule(cron="* * * * *", overlap_policy="allow")
    schedule_pause(
        schedule_id=schedule.pk, actor="ops", reason="", resume_at=at(minutes=3), now=at(seconds=1)
    )
    schedules_evaluate(now=at(minutes=3, seconds=2))
    assert ledger(schedule) == [(P, at(minutes=1)), (E, at(minutes=3))]


# -------------------------------------------------------------------- DST


NIGHTS = [
    # zone, expression, evaluation window (UTC), expected local fire times
    (
        "America/New_York",
        "30 2 * * *",
        (datetime(2026, 3, 8, 5, tzinfo=UTC), datetime(2026, 3, 8, 9, tzinfo=UTC)),
        ["03-08 03:00 -0400"],  # 02:30 does not exist: once, at the next valid instant
    ),
    (
        "America/New_York",
        "30 1 * * *",
        (datetime(2026, 11, 1, 4, tzinfo=UTC), datetime(2026, 11, 1, 8, tzinfo=UTC)),
        ["11-01 01:30 -0400"],  # 01:30 happens twice: once, at the first
    ),
    (
        "Europe/Berlin",
        "30 2 * * *",
        (datetime(2026, 3, 28, 23, tzinfo=UTC), datetime(2026, 3, 29, 3, tzinfo=UTC)),
        ["03-29 03:00 +0200"],
    ),
    (
        "Europe/Berlin",
        "30 2 * * *",
        (datetime(2026, 10, 24, 23, tzinfo=UTC), datetime(2026, 10, 25, 3, tzinfo=UTC)),
        ["10-25 02:30 +0200"],
    ),
    (
        "Europe/Berlin",
        "0 * * * *",
        (datetime(2026, 10, 24, 23, 30, tzinfo=UTC), datetime(2026, 10, 25, 3, 30, tzinfo=UTC)),
        # Hourly through the repeated 02:00-03:00: each local hour once (the
        # second 02:00, at 01:00 UTC, does not fire again).
        ["10-25 02:00 +0200", "10-25 03:00 +0100", "10-25 04:00 +0100"],
    ),
]


@pytest.mark.parametrize(("zone", "expression", "window", "expected"), NIGHTS)
def test_dst_nights_through_the_evaluator_fire_once_per_local_time(
    zone: str, expression: str, window: tuple[datetime, datetime], expected: list[str]
) -> None:
    begin, end = window
    schedule = make_schedule(cron=expression, timezone=zone, overlap_policy="allow", now=begin)
    # An evaluator every 5 minutes of real time through the night.
    moment = begin
    while moment <= end:
        schedules_evaluate(now=moment)
        moment += timedelta(minutes=5)
    fires = ScheduleFire.objects.filter(schedule=schedule).order_by("fire_at")
    shown = [f.fire_at.astimezone(ZoneInfo(zone)).strftime("%m-%d %H:%M %z") for f in fires]
    assert shown == expected
    assert {f.outcome for f in fires} == {E}
    assert len({f.run_id for f in fires}) == len(expected)


# ------------------------------------------------------------------ update


def test_an_update_accounts_for_the_old_timetables_unevaluated_fires() -> None:
    from schedules.services import schedule_update

    schedule = make_schedule(cron="* * * * *", overlap_policy="allow")
    schedules_evaluate(now=at(minutes=1))
    # The evaluator falls behind; the cron changes at 12:05:30.
    schedule_update(
        schedule_id=schedule.pk, changes={"cron": "0 * * * *"}, now=at(minutes=5, seconds=30)
    )
    missed = ScheduleFire.objects.get(schedule=schedule, outcome=M)
    assert (missed.fire_at, missed.last_fire_at, missed.fire_count) == (
        at(minutes=2),
        at(minutes=5),
        4,
    )
    assert "timetable was changed" in missed.detail
    schedule.refresh_from_db()
    assert schedule.next_fire_at == at(hours=1)
    schedules_evaluate(now=at(hours=1))
    assert ledger(schedule)[-1] == (E, at(hours=1))
    # Each old fire is found by its time, and nothing new claims 12:02-12:05.
    for minute in range(1, 6):
        assert len(rows_at(schedule, at(minutes=minute))) == 1


def test_an_update_while_paused_keeps_the_old_fires_in_the_pause() -> None:
    from schedules.services import schedule_update

    schedule = make_schedule(cron="* * * * *")
    schedule_pause(schedule_id=schedule.pk, actor="ops", reason="maint", now=at(seconds=30))
    schedule_update(
        schedule_id=schedule.pk, changes={"cron": "*/5 * * * *"}, now=at(minutes=10, seconds=30)
    )
    schedule_resume(schedule_id=schedule.pk, actor="ops", now=at(minutes=20, seconds=30))
    assert [
        (f.outcome, f.fire_at, f.last_fire_at, f.fire_count)
        for f in ScheduleFire.objects.filter(schedule=schedule).order_by("fire_at")
    ] == [
        (P, at(minutes=1), at(minutes=10), 10),  # the old timetable, every minute
        (P, at(minutes=15), at(minutes=20), 2),  # the new one
    ]


def test_an_update_without_a_timing_change_records_nothing() -> None:
    from schedules.services import schedule_update

    schedule = make_schedule(cron="* * * * *")
    schedule_update(schedule_id=schedule.pk, changes={"priority": 4}, now=at(minutes=5))
    assert not ScheduleFire.objects.exists()
    schedule.refresh_from_db()
    assert schedule.next_fire_at == at(minutes=1)  # still due: the evaluator fires them
