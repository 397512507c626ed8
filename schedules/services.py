"""Use cases of Schedules: define, pause, resume, run now, and the bounded evaluation step.

`schedules_evaluate` is one bounded step, like the dispatch cycle (docs/adr/0001,
docs/adr/0010): it reads due Schedules in keyset pages over the partial index
`schedule_attention`, at most `max_pages * page_size` of them and at most
`max_fires` fires per call, and reports truncation; the loop is outside it
(`manage.py run_dispatcher` on the embedded default, Celery beat in the
cluster). Each Schedule is evaluated in its own transaction under its row lock
(`FOR UPDATE SKIP LOCKED`: concurrent evaluators pass over each other), and
each fire is one ledger row whose unique (schedule, fire_at) makes it
exactly-once: a second evaluator that somehow reached the same fire fails its
insert, and its whole transaction, the Run included, rolls back.

Every `now` defaults to the database clock (`qinglong.clock.db_now`); tests
pass their own.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Final

from django.db import DatabaseError, IntegrityError, transaction
from django.db.models import Q

from leases.end import run_cancel
from leases.errors import LostRace, Outcome
from leases.quota import quota_blocker
from notifications.models import WebhookEvent
from notifications.services import admin_url, event_emit
from qinglong.clock import db_now
from runs.models import Run, RunState, Task
from runs.services import run_enqueue
from schedules.cron import CronSchedule, ScheduleError
from schedules.definition import (
    MAX_PAUSE_REASON_CHARS,
    ON_TIME_GRACE_S,
    ScheduleDefinition,
    jitter_offset_s,
    validate_name,
    validate_schedule,
)
from schedules.models import FireOutcome, OverlapPolicy, Schedule, ScheduleFire

__all__ = [
    "BUFFER_POLL_S",
    "HARD_CAPS",
    "EvaluationResult",
    "ScheduleError",
    "schedule_create",
    "schedule_cron",
    "schedule_delete",
    "schedule_pause",
    "schedule_resume",
    "schedule_run_now",
    "schedule_update",
    "schedules_evaluate",
]

logger = logging.getLogger("qinglong.schedules")

# One call of the evaluation step (README "Schedules"). Defaults keep a call
# well under a second; the hard caps bound any caller's arguments.
PAGE_SIZE: Final = 32
MAX_PAGES: Final = 4
FIRES_PER_SCHEDULE: Final = 8
MAX_FIRES: Final = 128
HARD_CAPS: Final = {"page_size": 64, "max_pages": 16, "fires_per_schedule": 64, "max_fires": 512}
# A Schedule with a buffered fire is looked at again this often until the Run
# in its way has ended (then the buffered fire is enqueued).
BUFFER_POLL_S: Final = 5
# A Schedule whose evaluation raised is looked at again this much later.
FAILED_RETRY_S: Final = 60
# Fires counted in one missed or paused stretch before the count says "more".
MAX_COUNTED_FIRES: Final = 1_000
# Runs of one Schedule looked at for its overlap policy (skip/buffer/cancel
# keep at most one; `allow` never asks).
_ACTIVE_RUNS_READ: Final = 16
_ACTIVE_RUN_STATES: Final = (RunState.QUEUED, RunState.DISPATCHING, RunState.RUNNING)
_EVALUATOR: Final = "scheduler"
_TICK: Final = timedelta(microseconds=1)


# ---------------------------------------------------------------- helpers


def schedule_cron(schedule: Schedule) -> CronSchedule:
    return CronSchedule(expression=schedule.cron, timezone=schedule.timezone)


def _definition(schedule: Schedule) -> ScheduleDefinition:
    return ScheduleDefinition(
        cron=schedule.cron,
        timezone=schedule.timezone,
        overlap_policy=schedule.overlap_policy,
        catchup_window_s=schedule.catchup_window_s,
        jitter_s=schedule.jitter_s,
        priority=schedule.priority,
    )


def _offset(schedule: Schedule) -> timedelta:
    return timedelta(seconds=jitter_offset_s(schedule.pk, schedule.jitter_s))


def _attention(schedule: Schedule, *, now: datetime, buffered: bool) -> datetime | None:
    """When the evaluator must look at this Schedule next (NULL: nothing to do)."""
    if schedule.paused:
        return schedule.resume_at
    due = None if schedule.next_fire_at is None else schedule.next_fire_at + _offset(schedule)
    if buffered:
        poll = now + timedelta(seconds=BUFFER_POLL_S)
        return poll if due is None else min(due, poll)
    return due


def _has_buffered(schedule: Schedule) -> bool:
    return ScheduleFire.objects.filter(schedule=schedule, outcome=FireOutcome.BUFFERED).exists()


def _save(schedule: Schedule, *, now: datetime, **changes: object) -> None:
    """Write the Schedule by compare-and-set on `version` (under its row lock anyway)."""
    for key, value in changes.items():
        setattr(schedule, key, value)
    schedule.attention_at = _attention(schedule, now=now, buffered=_has_buffered(schedule))
    fields = {key: getattr(schedule, key) for key in changes}
    updated = Schedule.objects.filter(pk=schedule.pk, version=schedule.version).update(
        **fields, attention_at=schedule.attention_at, version=schedule.version + 1, updated_at=now
    )
    if updated != 1:
        raise LostRace(f"schedule {schedule.pk} changed under us")
    schedule.version += 1


def _lock(schedule_id: int, *, skip_locked: bool = False) -> Schedule | None:
    # One Schedule row; its Task, revision and Project read in, never locked.
    return (
        Schedule.objects.select_for_update(skip_locked=skip_locked, of=("self",))
        .select_related("task__project", "task__current_revision")
        .filter(pk=schedule_id)
        .first()
    )


def _record(
    schedule: Schedule,
    *,
    fire_at: datetime,
    outcome: FireOutcome,
    now: datetime,
    run: Run | None = None,
    detail: str = "",
    last_fire_at: datetime | None = None,
    fire_count: int | None = 1,
    manual: bool = False,
    actor: str = _EVALUATOR,
) -> ScheduleFire:
    """Insert one ledger row; a duplicate (schedule, fire_at) raises IntegrityError,
    which rolls back the caller's whole transaction (the fire belongs to another)."""
    return ScheduleFire.objects.create(
        schedule=schedule,
        fire_at=fire_at,
        last_fire_at=last_fire_at,
        fire_count=fire_count,
        outcome=outcome,
        run=run,
        detail=detail[:200],
        manual=manual,
        actor=actor[:80],
        recorded_at=now,
    )


def _record_stretch(
    schedule: Schedule,
    *,
    first: datetime,
    last: datetime,
    outcome: FireOutcome,
    detail: str,
    now: datetime,
    actor: str = _EVALUATOR,
) -> None:
    """One row for consecutive missed or paused fires, first through last.

    A missed stretch is reported to the Project's webhooks (`schedule.missed`)
    in this same transaction: the delivery exists exactly when the row does.
    """
    count = schedule_cron(schedule).count_between(first, last, cap=MAX_COUNTED_FIRES)
    fire = _record(
        schedule,
        fire_at=first,
        last_fire_at=None if last == first else last,
        fire_count=count,
        outcome=outcome,
        detail=detail,
        now=now,
        actor=actor,
    )
    if outcome == FireOutcome.MISSED:
        event_emit(
            event=WebhookEvent.SCHEDULE_MISSED,
            project_id=schedule.task.project_id,
            # One delivery per ledger row (the row is unique per schedule and first fire).
            subject_key=f"schedule:{schedule.pk}:missed:{first.isoformat()}",
            data={
                "schedule": {
                    "id": str(schedule.pk),
                    "name": schedule.name,
                    "task_id": str(schedule.task_id),
                    "first_missed_at": first.isoformat(),
                    "last_missed_at": last.isoformat(),
                    "missed": count,
                    "ledger_id": str(fire.pk),
                    "admin_url": admin_url("admin:schedules_schedule_change", schedule.pk),
                }
            },
        )


def _active_runs(schedule: Schedule) -> list[Run]:
    # The partial index run_schedule_active: queued/dispatching/running only.
    return list(
        Run.objects.filter(schedule_id=schedule.pk, state__in=_ACTIVE_RUN_STATES)
        .only("id", "state", "cancel_requested")
        .order_by("id")[:_ACTIVE_RUNS_READ]
    )


def _enqueue(schedule: Schedule) -> Run:
    return run_enqueue(task=schedule.task, priority=schedule.priority, schedule_id=schedule.pk)


# ------------------------------------------------------------ definitions


def schedule_create(
    *,
    task: Task,
    name: object,
    definition: Mapping[str, object],
    actor: str = "",
    now: datetime | None = None,
) -> Schedule:
    """A Schedule of `task`; its first fire is the first one after now.

    Validation happens before any write (`ScheduleError`, a 400 at the API).
    """
    valid_name = validate_name(name)
    valid = validate_schedule(definition)
    with transaction.atomic(durable=True):
        moment = db_now() if now is None else now
        schedule = Schedule.objects.create(
            task=task,
            name=valid_name,
            cron=valid.cron,
            timezone=valid.timezone,
            overlap_policy=valid.overlap_policy,
            catchup_window_s=valid.catchup_window_s,
            jitter_s=valid.jitter_s,
            priority=valid.priority,
            created_by=actor[:80],
        )
        # The jitter offset hashes the id, known only now.
        _save(schedule, now=moment, next_fire_at=schedule_cron(schedule).next_after(moment))
    logger.info("schedule created", extra={"event": "schedule_created", "schedule_id": schedule.pk})
    return schedule


def schedule_update(
    *, schedule_id: int, changes: Mapping[str, object], now: datetime | None = None
) -> Schedule:
    """Change some settings; a new cron, time zone or jitter starts from now
    (the old timetable's unevaluated fires up to now become one ledger row)."""
    with transaction.atomic(durable=True):
        schedule = _lock(schedule_id)
        if schedule is None:
            raise Schedule.DoesNotExist
        valid = validate_schedule(changes, base=_definition(schedule))
        moment = db_now() if now is None else now
        timing = (valid.cron, valid.timezone, valid.jitter_s) != (
            schedule.cron,
            schedule.timezone,
            schedule.jitter_s,
        )
        update: dict[str, object] = {
            "cron": valid.cron,
            "timezone": valid.timezone,
            "overlap_policy": valid.overlap_policy,
            "catchup_window_s": valid.catchup_window_s,
            "jitter_s": valid.jitter_s,
            "priority": valid.priority,
        }
        if timing:
            _close_timetable(schedule, now=moment)
            update["next_fire_at"] = CronSchedule(valid.cron, valid.timezone).next_after(moment)
        _save(schedule, now=moment, **update)
    return schedule


def _close_timetable(schedule: Schedule, *, now: datetime) -> None:
    """Before a new cron, time zone or jitter starts from `now`: the old
    timetable's fires from the cursor through `now` that nobody evaluated yet
    (the evaluator was behind, or the Schedule paused) are one ledger row, so
    every fire stays accounted for (docs/adr/0010)."""
    first = schedule.next_fire_at
    if first is None or first > now:
        return
    last = schedule_cron(schedule).previous_before(now + _TICK)
    if last is None or last < first:
        last = first
    if schedule.paused:
        who = schedule.paused_by or "an operator"
        why = f": {schedule.pause_reason}" if schedule.pause_reason else ""
        outcome, detail = FireOutcome.PAUSED, f"paused by {who}{why}"
    else:
        outcome = FireOutcome.MISSED
        detail = "not evaluated before the schedule's timetable was changed"
    _record_stretch(schedule, first=first, last=last, outcome=outcome, detail=detail, now=now)


def schedule_pause(
    *,
    schedule_id: int,
    actor: str,
    reason: str,
    resume_at: datetime | None = None,
    now: datetime | None = None,
) -> Schedule:
    """Pause (who, why, optional resume-at). Fires meanwhile are recorded `paused`."""
    if not isinstance(reason, str) or len(reason) > MAX_PAUSE_REASON_CHARS:
        raise ScheduleError("reason", f"must be a string of at most {MAX_PAUSE_REASON_CHARS}")
    with transaction.atomic(durable=True):
        schedule = _lock(schedule_id)
        if schedule is None:
            raise Schedule.DoesNotExist
        moment = db_now() if now is None else now
        if resume_at is not None and resume_at <= moment:
            raise ScheduleError("resume_at", "must be in the future")
        _save(
            schedule,
            now=moment,
            paused=True,
            paused_at=schedule.paused_at if schedule.paused else moment,
            paused_by=actor[:80],
            pause_reason=reason,
            resume_at=resume_at,
        )
    logger.info("schedule paused", extra={"event": "schedule_paused", "schedule_id": schedule_id})
    return schedule


def _unpause(
    schedule: Schedule, *, now: datetime, actor: str, ended: datetime | None = None
) -> None:
    """Resume under the row lock: the fires of the pause become one `paused` row.

    `ended` is when the pause ended (default now): a resume-at the evaluator
    reaches late ended at resume-at, so the fires after it were due, not
    paused, and the caller evaluates them like any others (catch-up window).
    """
    cron = schedule_cron(schedule)
    until = now if ended is None else min(ended, now)
    first = schedule.next_fire_at
    last = cron.previous_before(until)
    if first is not None and last is not None and last >= first:
        who = schedule.paused_by or "an operator"
        why = f": {schedule.pause_reason}" if schedule.pause_reason else ""
        _record_stretch(
            schedule,
            first=first,
            last=last,
            outcome=FireOutcome.PAUSED,
            detail=f"paused by {who}{why}",
            now=now,
            actor=actor,
        )
    _save(
        schedule,
        now=now,
        paused=False,
        paused_at=None,
        paused_by="",
        pause_reason="",
        resume_at=None,
        next_fire_at=cron.next_after(until - _TICK),
    )


def schedule_resume(*, schedule_id: int, actor: str, now: datetime | None = None) -> Schedule:
    """Resume a paused Schedule; its next fire is the first one from now."""
    with transaction.atomic(durable=True):
        schedule = _lock(schedule_id)
        if schedule is None:
            raise Schedule.DoesNotExist
        if schedule.paused:
            _unpause(schedule, now=db_now() if now is None else now, actor=actor)
    logger.info("schedule resumed", extra={"event": "schedule_resumed", "schedule_id": schedule_id})
    return schedule


def schedule_delete(*, schedule_id: int) -> bool:
    """Delete a Schedule and its ledger; its Runs stay (their `schedule` becomes NULL)."""
    with transaction.atomic(durable=True):
        schedule = _lock(schedule_id)
        if schedule is None:
            return False
        schedule.delete()
    logger.info("schedule deleted", extra={"event": "schedule_deleted", "schedule_id": schedule_id})
    return True


def schedule_run_now(*, schedule_id: int, actor: str, now: datetime | None = None) -> ScheduleFire:
    """An operator's "run now": enqueue a Run from this Schedule at once.

    Recorded in the ledger as a manual fire; the overlap policy does not
    apply (the operator asked for this Run), the claim's quotas still do.
    """
    with transaction.atomic(durable=True):
        schedule = _lock(schedule_id)
        if schedule is None:
            raise Schedule.DoesNotExist
        moment = db_now() if now is None else now
        run = _enqueue(schedule)
        fire = _record(
            schedule,
            fire_at=moment,
            outcome=FireOutcome.ENQUEUED,
            run=run,
            detail="run now",
            manual=True,
            actor=actor,
            now=moment,
        )
    return fire


# ---------------------------------------------------------------- evaluation


@dataclass
class _Evaluated:
    outcomes: list[FireOutcome] = field(default_factory=list)
    cancel: list[int] = field(default_factory=list)
    more: bool = False  # fires still due after its per-Schedule cap
    busy: bool = False  # another evaluator holds it


@dataclass
class EvaluationResult:
    """The redacted summary of one evaluation step (counts only)."""

    examined: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    busy: int = 0
    lost_race: int = 0
    failed: int = 0  # a Schedule whose evaluation raised: deferred, logged
    cancelled: int = 0
    truncated: bool = False
    reason: str = ""

    @property
    def fires(self) -> int:
        return sum(self.outcomes.values())

    def summary(self) -> dict[str, object]:
        return {
            "examined": self.examined,
            "fires": {str(key): value for key, value in sorted(self.outcomes.items())},
            "busy": self.busy,
            "lost_race": self.lost_race,
            "failed": self.failed,
            "cancelled": self.cancelled,
            "truncated": self.truncated,
            "reason": self.reason,
        }


def _quota_detail(schedule: Schedule) -> str | None:
    task = schedule.task
    revision = task.current_revision
    limit = 0 if revision is None else revision.max_concurrent_runs
    blocker = quota_blocker(project=task.project, task_id=task.pk, task_limit=limit, lock=False)
    if blocker is None:
        return None
    shown = task.project.max_concurrent_runs if blocker == "project" else limit
    return f"the {blocker} is at its concurrency limit ({shown})"


def _fire(
    schedule: Schedule,
    *,
    fire_at: datetime,
    now: datetime,
    active: list[Run],
    state: _Evaluated,
) -> None:
    """Decide one fire by the overlap policy and the quotas, and record it."""
    policy = schedule.overlap_policy
    if active and policy != OverlapPolicy.ALLOW:
        blocking = active[0]
        if policy == OverlapPolicy.SKIP:
            outcome = FireOutcome.SKIPPED_OVERLAP
            detail = f"run {blocking.pk} is still {blocking.state}"
        elif _has_buffered(schedule):
            outcome = FireOutcome.SKIPPED_OVERLAP
            detail = f"a fire is already waiting for run {blocking.pk}"
        else:
            outcome = FireOutcome.BUFFERED
            detail = f"waits for run {blocking.pk} to end"
        if policy == OverlapPolicy.CANCEL_RUNNING:
            state.cancel.extend(run.pk for run in active if not run.cancel_requested)
            detail += " (cancel requested)"
        _record(schedule, fire_at=fire_at, outcome=outcome, detail=detail, now=now)
        state.outcomes.append(outcome)
        return
    blocked = _quota_detail(schedule)
    if blocked is not None:
        _record(schedule, fire_at=fire_at, outcome=FireOutcome.BLOCKED, detail=blocked, now=now)
        state.outcomes.append(FireOutcome.BLOCKED)
        return
    run = _enqueue(schedule)
    _record(schedule, fire_at=fire_at, outcome=FireOutcome.ENQUEUED, run=run, now=now)
    active.append(run)
    state.outcomes.append(FireOutcome.ENQUEUED)


def _release_buffered(schedule: Schedule, *, now: datetime, active: list[Run]) -> bool:
    """Enqueue the buffered fire once nothing of this Schedule is queued or running."""
    buffered = (
        ScheduleFire.objects.filter(schedule=schedule, outcome=FireOutcome.BUFFERED)
        .order_by("fire_at")
        .first()
    )
    if buffered is None or active:
        return False
    run = _enqueue(schedule)
    updated = ScheduleFire.objects.filter(pk=buffered.pk, outcome=FireOutcome.BUFFERED).update(
        outcome=FireOutcome.ENQUEUED, run=run, detail=f"{buffered.detail}; enqueued"[:200]
    )
    if updated != 1:
        raise LostRace(f"buffered fire {buffered.pk} changed under us")
    active.append(run)
    return True


def _evaluate_one(
    schedule_id: int, *, now: datetime, fires_cap: int, force: bool = False
) -> _Evaluated:
    state = _Evaluated()
    with transaction.atomic(durable=True):
        schedule = _lock(schedule_id, skip_locked=True)
        if schedule is None:
            # Locked by another evaluator (SKIP LOCKED), or deleted meanwhile.
            state.busy = Schedule.objects.filter(pk=schedule_id).exists()
            return state
        if not force and (schedule.attention_at is None or schedule.attention_at > now):
            return state  # someone else handled it since our page was read
        if schedule.paused:
            if schedule.resume_at is None or schedule.resume_at > now:
                _save(schedule, now=now)
                return state
            _unpause(schedule, now=now, actor="scheduler:resume_at", ended=schedule.resume_at)
        cron = schedule_cron(schedule)
        offset = _offset(schedule)
        active = [] if schedule.overlap_policy == OverlapPolicy.ALLOW else _active_runs(schedule)
        if _release_buffered(schedule, now=now, active=active):
            state.outcomes.append(FireOutcome.ENQUEUED)
        elif (
            active
            and schedule.overlap_policy == OverlapPolicy.CANCEL_RUNNING
            and _has_buffered(schedule)
        ):
            # A cancel that did not go through last time is asked for again.
            state.cancel.extend(run.pk for run in active if not run.cancel_requested)
        cursor = schedule.next_fire_at
        window_s = max(schedule.catchup_window_s, ON_TIME_GRACE_S)
        # Fires due before this are outside the catch-up window: missed.
        boundary = now - timedelta(seconds=window_s) - offset
        if cursor is not None and cursor < boundary:
            last = cron.previous_before(boundary)
            if last is None or last < cursor:
                last = cursor  # the cursor is a fire of this expression; never reached
            _record_stretch(
                schedule,
                first=cursor,
                last=last,
                outcome=FireOutcome.MISSED,
                detail=f"not evaluated within the catch-up window ({window_s} s): "
                "the control plane was down or behind",
                now=now,
            )
            state.outcomes.append(FireOutcome.MISSED)
            cursor = cron.next_after(boundary - _TICK)
        done = 0
        while cursor is not None and cursor + offset <= now and done < fires_cap:
            _fire(schedule, fire_at=cursor, now=now, active=active, state=state)
            cursor = cron.next_after(cursor)
            done += 1
        state.more = cursor is not None and cursor + offset <= now
        _save(schedule, now=now, next_fire_at=cursor)
    return state


def _cancel_runs(run_ids: list[int]) -> int:
    """cancel_running: the leases cancel use case, after the fire's transaction."""
    cancelled = 0
    for run in Run.objects.filter(pk__in=run_ids):
        if run_cancel(run=run, actor=_EVALUATOR) is Outcome.APPLIED:
            cancelled += 1
    return cancelled


def _check_caps(**values: int) -> None:
    for key, value in values.items():
        if not 1 <= value <= HARD_CAPS[key]:
            raise ValueError(f"{key} must be between 1 and {HARD_CAPS[key]}")


def schedules_evaluate(
    *,
    now: datetime | None = None,
    page_size: int = PAGE_SIZE,
    max_pages: int = MAX_PAGES,
    fires_per_schedule: int = FIRES_PER_SCHEDULE,
    max_fires: int = MAX_FIRES,
) -> EvaluationResult:
    """One bounded evaluation step over the Schedules due at `now` (module docstring)."""
    _check_caps(
        page_size=page_size,
        max_pages=max_pages,
        fires_per_schedule=fires_per_schedule,
        max_fires=max_fires,
    )
    moment = db_now() if now is None else now
    result = EvaluationResult()
    after: tuple[datetime, int] | None = None
    for _ in range(max_pages):
        due = Schedule.objects.filter(attention_at__lte=moment)
        if after is not None:
            due = due.filter(
                Q(attention_at__gt=after[0]) | Q(attention_at=after[0], id__gt=after[1])
            )
        rows = list(
            due.order_by("attention_at", "id").values_list("attention_at", "id")[: page_size + 1]
        )
        for attention_at, schedule_id in rows[:page_size]:
            assert attention_at is not None  # the filter above: attention_at <= now
            budget = max_fires - result.fires
            if budget <= 0:
                result.truncated, result.reason = True, "max_fires"
                return result
            _evaluate_into(
                result, schedule_id, now=moment, fires_cap=min(fires_per_schedule, budget)
            )
            after = (attention_at, schedule_id)
        if len(rows) <= page_size:
            return result
    result.truncated, result.reason = True, "max_pages"
    return result


def _evaluate_into(
    result: EvaluationResult, schedule_id: int, *, now: datetime, fires_cap: int
) -> None:
    result.examined += 1
    try:
        one = _evaluate_one(schedule_id, now=now, fires_cap=fires_cap)
    except (LostRace, IntegrityError):
        # Another evaluator recorded this fire first (docs/adr/0010): ours,
        # and the Run it enqueued, rolled back with the transaction.
        result.lost_race += 1
        return
    except DatabaseError:
        raise  # the database itself: the loop outside backs off
    except Exception:
        # One Schedule that cannot be evaluated (a bug, a search over its
        # bound) must not stall the others behind it in the due order: its
        # transaction rolled back; look at it again later.
        logger.exception(
            "schedule evaluation failed",
            extra={"event": "schedule_evaluation_failed", "schedule_id": schedule_id},
        )
        result.failed += 1
        Schedule.objects.filter(pk=schedule_id, attention_at__lte=now).update(
            attention_at=now + timedelta(seconds=FAILED_RETRY_S)
        )
        return
    result.busy += int(one.busy)
    result.outcomes.update(str(outcome) for outcome in one.outcomes)
    if one.more and not result.truncated:
        result.truncated, result.reason = True, "fires_per_schedule"
    if one.cancel:
        result.cancelled += _cancel_runs(one.cancel)
        # A queued Run is cancelled at once: the buffered fire need not wait a poll.
        try:
            again = _evaluate_one(schedule_id, now=now, fires_cap=0, force=True)
        except (LostRace, IntegrityError):
            result.lost_race += 1
            return
        result.outcomes.update(str(outcome) for outcome in again.outcomes)
