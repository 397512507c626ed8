"""The evaluation step (schedules.services, docs/adr/0010): fires, catch-up, overlap,
pause, jitter, quotas, bounds, and the ledger's exactly-once row."""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine
from django.db import IntegrityError, transaction
from django.utils import timezone

from leases.ack import AckPhase, lease_ack
from leases.end import run_cancel
from qinglong.testing import make_project, make_task
from runs.models import Run, RunState
from runs.services import project_create, task_create
from schedules.definition import jitter_offset_s
from schedules.models import FireOutcome, Schedule, ScheduleFire
from schedules.services import (
    BUFFER_POLL_S,
    schedule_delete,
    schedule_pause,
    schedule_resume,
    schedule_run_now,
    schedule_update,
    schedules_evaluate,
)
from schedules.tests.helpers import T0, at, ledger, make_schedule, start

pytestmark = pytest.mark.django_db

E, S, M, P, B, BUF = (
    FireOutcome.ENQUEUED,
    FireOutcome.SKIPPED_OVERLAP,
    FireOutcome.MISSED,
    FireOutcome.PAUSED,
    FireOutcome.BLOCKED,
    FireOutcome.BUFFERED,
)


def runs_of(schedule: Schedule) -> list[Run]:
    return list(Run.objects.filter(schedule=schedule).order_by("id"))


# ------------------------------------------------------------------ fires


def test_a_due_fire_enqueues_one_run_and_one_ledger_row() -> None:
    schedule = make_schedule(overlap_policy="allow")
    assert schedule.next_fire_at == at(minutes=1)
    assert schedules_evaluate(now=at(seconds=59)).fires == 0
    result = schedules_evaluate(now=at(minutes=1))
    assert result.summary()["fires"] == {"enqueued": 1}
    assert ledger(schedule) == [(E, at(minutes=1))]
    fire = ScheduleFire.objects.get(schedule=schedule)
    assert runs_of(schedule) == [fire.run]
    # Evaluating the same instant again fires nothing: the cursor moved on.
    assert schedules_evaluate(now=at(minutes=1)).fires == 0
    schedule.refresh_from_db()
    assert schedule.next_fire_at == at(minutes=2)
    assert schedule.attention_at == at(minutes=2)


def test_a_fire_already_in_the_ledger_is_never_enqueued_twice() -> None:
    # Another evaluator recorded this fire (e.g. the cursor was restored from a
    # backup): the unique row refuses ours and the Run we enqueued rolls back.
    schedule = make_schedule(overlap_policy="allow")
    ScheduleFire.objects.create(schedule=schedule, fire_at=at(minutes=1), outcome=S, recorded_at=T0)
    result = schedules_evaluate(now=at(minutes=1))
    assert (result.lost_race, result.fires) == (1, 0)
    assert not Run.objects.filter(schedule=schedule).exists()
    with pytest.raises(IntegrityError), transaction.atomic():
        ScheduleFire.objects.create(
            schedule=schedule, fire_at=at(minutes=1), outcome=M, recorded_at=T0
        )


def test_a_run_from_a_schedule_is_pinned_to_the_current_revision_with_its_priority() -> None:
    schedule = make_schedule(overlap_policy="allow", priority=7)
    schedules_evaluate(now=at(minutes=1))
    (run,) = runs_of(schedule)
    assert (run.priority, run.task_revision_id, run.state) == (
        7,
        schedule.task.current_revision_id,
        RunState.QUEUED,
    )


def test_dst_through_the_evaluator_new_york_spring_forward() -> None:
    start_at = at(days=-86)  # 2026-03-07 12:00 UTC
    schedule = make_schedule(cron="30 2 * * *", timezone="America/New_York", now=start_at)
    fire = schedule.next_fire_at
    assert fire is not None and fire.isoformat() == "2026-03-08T07:00:00+00:00"  # 03:00 EDT
    schedules_evaluate(now=fire)
    schedule.refresh_from_db()
    assert ledger(schedule) == [(E, fire)]
    assert schedule.next_fire_at is not None
    assert schedule.next_fire_at.isoformat() == "2026-03-09T06:30:00+00:00"  # 02:30 EDT


# --------------------------------------------------------------- catch-up


def test_catch_up_inside_and_outside_the_window_after_an_outage() -> None:
    with time_machine.travel(T0, tick=False) as clock:
        schedule = make_schedule(
            cron="*/5 * * * *", catchup_window_s=900, overlap_policy="allow", now=timezone.now()
        )
        clock.shift(timedelta(minutes=1))
        assert schedules_evaluate(now=timezone.now()).fires == 0
        # The control plane is down until 14:00.
        clock.shift(timedelta(hours=1, minutes=59))
        result = schedules_evaluate(now=timezone.now())
    # 12:05 … 13:40 are older than the 15-minute window: one missed row for all
    # twenty; 13:45, 13:50, 13:55 and 14:00 are inside it: enqueued.
    assert result.summary()["fires"] == {"enqueued": 4, "missed": 1}
    missed = ScheduleFire.objects.get(schedule=schedule, outcome=M)
    assert (missed.fire_at, missed.last_fire_at, missed.fire_count) == (
        at(minutes=5),
        at(hours=1, minutes=40),
        20,
    )
    assert "catch-up window" in missed.detail
    assert [fire_at for outcome, fire_at in ledger(schedule) if outcome == E] == [
        at(hours=1, minutes=45),
        at(hours=1, minutes=50),
        at(hours=1, minutes=55),
        at(hours=2),
    ]
    assert len(runs_of(schedule)) == 4


def test_without_a_window_only_the_fire_that_is_on_time_runs_after_an_outage() -> None:
    with time_machine.travel(T0, tick=False) as clock:
        schedule = make_schedule(cron="*/5 * * * *", catchup_window_s=0, now=timezone.now())
        clock.shift(timedelta(hours=1, seconds=10))
        result = schedules_evaluate(now=timezone.now())
    assert result.summary()["fires"] == {"enqueued": 1, "missed": 1}
    assert ledger(schedule) == [(M, at(minutes=5)), (E, at(hours=1))]
    missed = ScheduleFire.objects.get(schedule=schedule, outcome=M)
    assert (missed.last_fire_at, missed.fire_count) == (at(minutes=55), 11)


def test_a_short_delay_is_on_time_whatever_the_window() -> None:
    schedule = make_schedule(catchup_window_s=0)
    schedules_evaluate(now=at(minutes=1, seconds=20))
    assert ledger(schedule) == [(E, at(minutes=1))]


# ---------------------------------------------------------------- overlap


def test_skip_records_skipped_overlap_while_a_run_is_queued_or_running() -> None:
    schedule = make_schedule(overlap_policy="skip")
    schedules_evaluate(now=at(minutes=1))
    (first,) = runs_of(schedule)
    schedules_evaluate(now=at(minutes=2))
    start(first)
    schedules_evaluate(now=at(minutes=3))
    assert ledger(schedule) == [(E, at(minutes=1)), (S, at(minutes=2)), (S, at(minutes=3))]
    details = list(
        ScheduleFire.objects.filter(outcome=S).order_by("fire_at").values_list("detail", flat=True)
    )
    assert details == [f"run {first.pk} is still queued", f"run {first.pk} is still running"]
    run_cancel(run=first, actor="test")  # running: cancel requested, still running
    lease_ack_cancelled(first)
    schedules_evaluate(now=at(minutes=4))
    assert ledger(schedule)[-1] == (E, at(minutes=4))
    assert len(runs_of(schedule)) == 2


def lease_ack_cancelled(run: Run) -> None:
    """The Worker stops the cancelled Run and ACKs `failed`: the Run ends cancelled."""
    from leases.models import LeaseState, RunLease

    lease = RunLease.objects.get(run=run, state=LeaseState.ACTIVE)
    # The token of helpers.start's claim is derived from the offer id.
    from dispatch.core.offer import derive_lease_token
    from qinglong.testing import lease_secret

    session = lease.session
    lease_ack(
        session=session,
        offer_id=lease.offer_id,
        phase=AckPhase.RUNNING,
        lease_token=derive_lease_token(lease_secret(), lease.offer_id),
        spec_sha256=lease.spec_digest,
        executor_handle="pid:1",
    )
    lease_ack(
        session=session,
        offer_id=lease.offer_id,
        phase=AckPhase.FAILED,
        lease_token=derive_lease_token(lease_secret(), lease.offer_id),
        spec_sha256=lease.spec_digest,
        exit_code=-15,
    )
    run.refresh_from_db()
    assert run.state in (RunState.CANCELLED, RunState.FAILED)


def test_allow_enqueues_while_another_run_is_queued() -> None:
    schedule = make_schedule(overlap_policy="allow")
    schedules_evaluate(now=at(minutes=1))
    schedules_evaluate(now=at(minutes=2))
    assert ledger(schedule) == [(E, at(minutes=1)), (E, at(minutes=2))]
    assert [run.state for run in runs_of(schedule)] == [RunState.QUEUED, RunState.QUEUED]


def test_buffer_one_keeps_one_fire_waiting_and_enqueues_it_when_the_run_ends() -> None:
    schedule = make_schedule(overlap_policy="buffer_one")
    schedules_evaluate(now=at(minutes=1))
    (first,) = runs_of(schedule)
    schedules_evaluate(now=at(minutes=2))
    schedules_evaluate(now=at(minutes=3))
    assert ledger(schedule) == [(E, at(minutes=1)), (BUF, at(minutes=2)), (S, at(minutes=3))]
    schedule.refresh_from_db()
    # A buffered fire is polled for (its Run's end is not pushed to the scheduler).
    assert schedule.attention_at == at(minutes=3, seconds=BUFFER_POLL_S)
    assert schedules_evaluate(now=at(minutes=3, seconds=1)).fires == 0
    run_cancel(run=first, actor="test")  # queued: cancelled at once
    schedules_evaluate(now=at(minutes=3, seconds=BUFFER_POLL_S))
    assert ledger(schedule) == [(E, at(minutes=1)), (E, at(minutes=2)), (S, at(minutes=3))]
    buffered = ScheduleFire.objects.get(schedule=schedule, fire_at=at(minutes=2))
    assert buffered.run is not None and buffered.run.state == RunState.QUEUED
    assert "enqueued" in buffered.detail


def test_cancel_running_cancels_a_queued_run_and_enqueues_at_once() -> None:
    schedule = make_schedule(overlap_policy="cancel_running")
    schedules_evaluate(now=at(minutes=1))
    (first,) = runs_of(schedule)
    result = schedules_evaluate(now=at(minutes=2))
    first.refresh_from_db()
    assert first.state == RunState.CANCELLED
    assert result.cancelled == 1
    assert ledger(schedule) == [(E, at(minutes=1)), (E, at(minutes=2))]
    assert runs_of(schedule)[1].state == RunState.QUEUED


def test_cancel_running_stops_a_running_run_and_the_fire_waits_for_its_end() -> None:
    schedule = make_schedule(overlap_policy="cancel_running")
    schedules_evaluate(now=at(minutes=1))
    (first,) = runs_of(schedule)
    start(first)
    schedules_evaluate(now=at(minutes=2))
    first.refresh_from_db()
    # Started: the cancel is a request the Worker hears on its next heartbeat/ACK.
    assert (first.state, first.cancel_requested) == (RunState.RUNNING, True)
    assert ledger(schedule) == [(E, at(minutes=1)), (BUF, at(minutes=2))]
    lease_ack_cancelled(first)
    schedules_evaluate(now=at(minutes=2, seconds=BUFFER_POLL_S))
    assert ledger(schedule) == [(E, at(minutes=1)), (E, at(minutes=2))]
    assert len(runs_of(schedule)) == 2


# ------------------------------------------------------------------ pause


def test_pause_and_resume_record_the_paused_fires_as_one_row() -> None:
    schedule = make_schedule()
    schedule_pause(
        schedule_id=schedule.pk, actor="ops:alice", reason="db migration", now=at(seconds=30)
    )
    schedule.refresh_from_db()
    assert (schedule.paused, schedule.paused_by, schedule.pause_reason, schedule.attention_at) == (
        True,
        "ops:alice",
        "db migration",
        None,
    )
    assert schedules_evaluate(now=at(minutes=5)).examined == 0
    schedule_resume(schedule_id=schedule.pk, actor="ops:bob", now=at(minutes=5, seconds=30))
    schedule.refresh_from_db()
    assert not schedule.paused and schedule.next_fire_at == at(minutes=6)
    paused = ScheduleFire.objects.get(schedule=schedule)
    assert (paused.outcome, paused.fire_at, paused.last_fire_at, paused.fire_count) == (
        P,
        at(minutes=1),
        at(minutes=5),
        5,
    )
    assert paused.detail == "paused by ops:alice: db migration"
    schedules_evaluate(now=at(minutes=6))
    assert ledger(schedule)[-1] == (E, at(minutes=6))


def test_a_pause_with_resume_at_resumes_by_itself() -> None:
    schedule = make_schedule()
    schedule_pause(
        schedule_id=schedule.pk,
        actor="ops",
        reason="",
        resume_at=at(minutes=3, seconds=30),
        now=at(seconds=1),
    )
    schedule.refresh_from_db()
    assert schedule.attention_at == at(minutes=3, seconds=30)
    schedules_evaluate(now=at(minutes=3, seconds=30))
    schedule.refresh_from_db()
    assert not schedule.paused
    assert ledger(schedule) == [(P, at(minutes=1))]
    schedules_evaluate(now=at(minutes=4))
    assert ledger(schedule) == [(P, at(minutes=1)), (E, at(minutes=4))]


# ----------------------------------------------------------------- jitter


def test_jitter_is_a_fixed_offset_per_schedule() -> None:
    schedule = make_schedule(jitter_s=40)
    offset = jitter_offset_s(schedule.pk, 40)
    assert offset == jitter_offset_s(schedule.pk, 40)  # deterministic
    assert 0 <= offset <= 40
    assert schedule.attention_at == at(minutes=1, seconds=offset)
    if offset:
        assert schedules_evaluate(now=at(minutes=1, seconds=offset - 1)).fires == 0
    schedules_evaluate(now=at(minutes=1, seconds=offset))
    # The ledger keeps the nominal fire time.
    assert ledger(schedule) == [(E, at(minutes=1))]
    offsets = {jitter_offset_s(pk, 40) for pk in range(1, 50)}
    assert len(offsets) > 10  # schedules on one cron line spread out


# ----------------------------------------------------------------- quotas


def test_a_task_at_its_concurrency_limit_records_blocked() -> None:
    task = make_task(max_concurrent_runs=1)
    schedule = make_schedule(task, overlap_policy="allow")
    schedules_evaluate(now=at(minutes=1))
    (first,) = runs_of(schedule)
    start(first)  # a live lease: the Task's one slot
    schedules_evaluate(now=at(minutes=2))
    assert ledger(schedule) == [(E, at(minutes=1)), (B, at(minutes=2))]
    blocked = ScheduleFire.objects.get(schedule=schedule, outcome=B)
    assert blocked.detail == "the task is at its concurrency limit (1)"
    assert blocked.run is None


def test_a_project_at_its_limit_records_blocked() -> None:
    project = project_create(slug="limited", name="Limited", max_concurrent_runs=1)
    task = task_create(
        project=project, name="t", definition={"executor_type": "process", "command": ["true"]}
    )
    schedule = make_schedule(task, overlap_policy="allow")
    schedules_evaluate(now=at(minutes=1))
    start(runs_of(schedule)[0])
    schedules_evaluate(now=at(minutes=2))
    assert ledger(schedule)[-1] == (B, at(minutes=2))
    assert (
        ScheduleFire.objects.get(outcome=B).detail == "the project is at its concurrency limit (1)"
    )


# ---------------------------------------------------------------- bounds


def test_one_step_is_bounded_by_pages_and_reports_truncation() -> None:
    task = make_task()
    schedules = [make_schedule(task) for _ in range(7)]
    result = schedules_evaluate(now=at(minutes=1), page_size=3, max_pages=2)
    assert (result.examined, result.fires, result.truncated, result.reason) == (
        6,
        6,
        True,
        "max_pages",
    )
    rest = schedules_evaluate(now=at(minutes=1), page_size=3, max_pages=2)
    assert (rest.examined, rest.truncated) == (1, False)
    assert all(len(ledger(s)) == 1 for s in schedules)


def test_fires_per_schedule_and_per_call_are_capped() -> None:
    schedule = make_schedule(cron="* * * * * *", catchup_window_s=3600, overlap_policy="allow")
    result = schedules_evaluate(now=at(seconds=20), fires_per_schedule=8)
    assert (result.fires, result.truncated, result.reason) == (8, True, "fires_per_schedule")
    schedule.refresh_from_db()
    assert schedule.next_fire_at == at(seconds=9)
    result = schedules_evaluate(now=at(seconds=20), fires_per_schedule=64, max_fires=5)
    assert (result.fires, result.truncated) == (5, True)
    with pytest.raises(ValueError, match="page_size"):
        schedules_evaluate(now=T0, page_size=65)


def test_cost_per_call_does_not_depend_on_schedules_that_are_not_due(
    django_assert_max_num_queries,
) -> None:
    task = make_task()
    for _ in range(40):
        make_schedule(task, cron="0 0 1 1 *")  # next year
    with django_assert_max_num_queries(1):
        assert schedules_evaluate(now=at(minutes=1)).examined == 0


# ---------------------------------------------------------- operator uses


def test_run_now_enqueues_a_manual_fire() -> None:
    schedule = make_schedule(overlap_policy="skip")
    schedules_evaluate(now=at(minutes=1))
    fire = schedule_run_now(
        schedule_id=schedule.pk, actor="admin:ops", now=at(minutes=1, seconds=5)
    )
    assert (fire.manual, fire.outcome, fire.actor) == (True, E, "admin:ops")
    assert fire.run is not None and fire.run.schedule_id == schedule.pk
    assert len(runs_of(schedule)) == 2  # the operator asked: overlap does not apply


def test_update_recomputes_the_next_fire_and_bad_input_changes_nothing() -> None:
    schedule = make_schedule()
    before = Schedule.objects.filter(pk=schedule.pk).values().get()
    with pytest.raises(Exception, match="cron"):
        schedule_update(schedule_id=schedule.pk, changes={"cron": "99 * * * *"}, now=T0)
    assert Schedule.objects.filter(pk=schedule.pk).values().get() == before
    schedule_update(
        schedule_id=schedule.pk,
        changes={"cron": "0 9 * * *", "timezone": "Asia/Shanghai"},
        now=T0,
    )
    schedule.refresh_from_db()
    assert schedule.next_fire_at is not None
    assert schedule.next_fire_at.isoformat() == "2026-06-02T01:00:00+00:00"  # 09:00 CST
    schedule_update(schedule_id=schedule.pk, changes={"overlap_policy": "allow"}, now=at(hours=5))
    schedule.refresh_from_db()
    assert schedule.next_fire_at.isoformat() == "2026-06-02T01:00:00+00:00"


def test_delete_keeps_the_runs() -> None:
    schedule = make_schedule()
    schedules_evaluate(now=at(minutes=1))
    (run,) = runs_of(schedule)
    assert schedule_delete(schedule_id=schedule.pk)
    assert not ScheduleFire.objects.exists()
    run.refresh_from_db()
    assert run.schedule_id is None and run.state == RunState.QUEUED
    assert not schedule_delete(schedule_id=schedule.pk)


def test_a_schedule_of_another_project_is_independent() -> None:
    one = make_schedule(make_task(make_project()), overlap_policy="skip")
    two = make_schedule(make_task(make_project()), overlap_policy="skip")
    schedules_evaluate(now=at(minutes=1))
    schedules_evaluate(now=at(minutes=2))
    assert ledger(one) == ledger(two) == [(E, at(minutes=1)), (S, at(minutes=2))]


def test_a_schedule_that_cannot_be_evaluated_does_not_stall_the_others(monkeypatch) -> None:
    import schedules.services as services

    broken, healthy = make_schedule(), make_schedule()
    real_fire = services._fire

    def fire(schedule, **kwargs):
        if schedule.pk == broken.pk:
            raise RuntimeError("a bug")
        return real_fire(schedule, **kwargs)

    monkeypatch.setattr(services, "_fire", fire)
    result = schedules_evaluate(now=at(minutes=1))
    assert (result.failed, result.summary()["fires"]) == (1, {"enqueued": 1})
    assert ledger(healthy) == [(E, at(minutes=1))] and ledger(broken) == []
    broken.refresh_from_db()
    # Its transaction rolled back (no Run, cursor unchanged); it waits a minute.
    assert broken.next_fire_at == at(minutes=1)
    assert broken.attention_at == at(minutes=2)
    assert not Run.objects.filter(schedule=broken).exists()
    monkeypatch.setattr(services, "_fire", real_fire)
    schedules_evaluate(now=at(minutes=2))
    # Fixed: both its fires are accounted for (the second overlaps the first, skip).
    assert ledger(broken) == [(E, at(minutes=1)), (S, at(minutes=2))]
