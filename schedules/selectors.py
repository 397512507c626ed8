"""Reads of Schedules for the operator API, the admin and `manage.py schedules`: plain
JSON-able dicts built field by field from an allow list (no Task definition ever)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from django.db.models import Q, QuerySet

from dispatch.core.ports import to_rfc3339
from schedules.models import FireOutcome, Schedule, ScheduleFire

MAX_PAGE = 100
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _time(value: datetime | None) -> str | None:
    return None if value is None else to_rfc3339(value)


def local_time(value: datetime | None, zone: str) -> str | None:
    """An instant in the Schedule's time zone, e.g. 2026-03-08T03:00:00-04:00."""
    return None if value is None else value.astimezone(ZoneInfo(zone)).isoformat()


def _schedules() -> QuerySet[Schedule]:
    return Schedule.objects.select_related("task__project").only(
        *(f.name for f in Schedule._meta.concrete_fields if f.name != "task"),
        "task__name",
        "task__project__slug",
    )


def schedule_json(schedule: Schedule) -> dict[str, Any]:
    return {
        "id": str(schedule.pk),
        "project": schedule.task.project.slug,
        "task": schedule.task.name,
        "name": schedule.name,
        "cron": schedule.cron,
        "timezone": schedule.timezone,
        "overlap_policy": schedule.overlap_policy,
        "catchup_window_s": schedule.catchup_window_s,
        "jitter_s": schedule.jitter_s,
        "priority": schedule.priority,
        "paused": schedule.paused,
        "paused_at": _time(schedule.paused_at),
        "paused_by": schedule.paused_by,
        "pause_reason": schedule.pause_reason,
        "resume_at": _time(schedule.resume_at),
        "next_fire_at": None if schedule.paused else _time(schedule.next_fire_at),
        "next_fire_local": None
        if schedule.paused
        else local_time(schedule.next_fire_at, schedule.timezone),
        "created_by": schedule.created_by,
        "created_at": _time(schedule.created_at),
        "updated_at": _time(schedule.updated_at),
    }


def schedule_detail(schedule_id: int) -> dict[str, Any] | None:
    schedule = _schedules().filter(pk=schedule_id).first()
    return None if schedule is None else schedule_json(schedule)


def schedule_page(*, cursor: int | None, limit: int) -> tuple[list[dict[str, Any]], str | None]:
    """Keyset page by id, oldest first."""
    qs = _schedules().order_by("id")
    if cursor is not None:
        qs = qs.filter(id__gt=cursor)
    rows = list(qs[: limit + 1])
    more = len(rows) > limit
    rows = rows[:limit]
    return [schedule_json(s) for s in rows], (str(rows[-1].pk) if more and rows else None)


def fire_json(fire: ScheduleFire, zone: str) -> dict[str, Any]:
    return {
        "id": str(fire.pk),
        "fire_at": _time(fire.fire_at),
        "fire_local": local_time(fire.fire_at, zone),
        "last_fire_at": _time(fire.last_fire_at),
        "fire_count": fire.fire_count,
        "outcome": fire.outcome,
        "run_id": None if fire.run_id is None else str(fire.run_id),
        "detail": fire.detail,
        "manual": fire.manual,
        "actor": fire.actor,
        "recorded_at": _time(fire.recorded_at),
    }


FIRE_CURSOR_RE = r"^[0-9]{1,20}-[0-9]{1,18}$"


def _fire_cursor(fire: ScheduleFire) -> str:
    micros = (fire.fire_at - _EPOCH) // timedelta(microseconds=1)
    return f"{micros}-{fire.pk}"


def parse_fire_cursor(cursor: str) -> tuple[datetime, int]:
    micros, pk = cursor.split("-")
    return _EPOCH + timedelta(microseconds=int(micros)), int(pk)


def covering(at: datetime) -> Q:
    """The ledger rows that account for the instant `at`: a fire at it, or the
    missed/paused stretch (`fire_at` … `last_fire_at`) that covers it. Every
    fire time of a Schedule's timetable matches exactly one of its rows
    (schedules/tests/test_ledger_accounting.py)."""
    return Q(fire_at__lte=at) & (Q(fire_at=at) | Q(last_fire_at__gte=at))


def fire_page(
    *,
    schedule: Schedule,
    outcome: FireOutcome | None,
    at: datetime | None,
    cursor: str | None,
    limit: int,
) -> tuple[list[dict[str, Any]], str | None]:
    """The ledger, newest fire first: a keyset over (fire_at, id) on the index
    schedulefire_ledger. `at`: the row that accounts for that instant (a fire
    at it, or the missed/paused stretch that covers it)."""
    qs = ScheduleFire.objects.filter(schedule=schedule)
    if outcome is not None:
        qs = qs.filter(outcome=outcome)
    if at is not None:
        qs = qs.filter(covering(at))
    if cursor is not None:
        fire_at, pk = parse_fire_cursor(cursor)
        qs = qs.filter(Q(fire_at__lt=fire_at) | Q(fire_at=fire_at, id__lt=pk))
    rows = list(qs.order_by("-fire_at", "-id")[: limit + 1])
    more = len(rows) > limit
    rows = rows[:limit]
    return (
        [fire_json(f, schedule.timezone) for f in rows],
        _fire_cursor(rows[-1]) if more and rows else None,
    )
