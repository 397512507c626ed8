"""The operator's console for Schedules and their ledger (README "Schedules").

A console, not a backdoor: Schedules are defined through the operator API (the
one validator); here they are shown with their next fire times in their own
time zone and in UTC, and changed only by actions that call the services:
pause and resume (`schedules.pause_schedule`; the reason every console action
needs is the note shown with the pause) and run now (`runs.add_run`, like the
Task's "enqueue a run"). The ledger is
read-only and filterable by outcome, so "why didn't it run at 03:00?" is one
filter away.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from qinglong.admin import ReadOnlyAdmin, action_reason, holds
from schedules.cron import wall_to_instant
from schedules.models import Schedule, ScheduleFire
from schedules.selectors import covering, local_time
from schedules.services import (
    schedule_cron,
    schedule_pause,
    schedule_resume,
    schedule_run_now,
)

_NEXT_FIRES_SHOWN = 5


def _actor(request: HttpRequest) -> str:
    return f"admin:{getattr(request.user, 'username', '')}"


def _utc(value: datetime | None) -> str:
    return "—" if value is None else value.strftime("%Y-%m-%d %H:%M:%S UTC")


@admin.register(Schedule)
class ScheduleAdmin(ReadOnlyAdmin):
    # Fits a 1400-px window beside the filters (issue 14); the overlap policy is
    # a filter and on the Schedule's page.
    list_display = (
        "name",
        "task",
        "cron",
        "timezone",
        "paused",
        "next_fire_local",
        "next_fire_utc",
    )
    list_filter = ("paused", "overlap_policy", "timezone")
    list_select_related = ("task__project",)
    search_fields = ("name", "task__name", "task__project__slug")
    readonly_fields = (
        "task",
        "name",
        "cron",
        "timezone",
        "overlap_policy",
        "catchup_window_s",
        "jitter_s",
        "priority",
        "paused",
        "paused_at",
        "paused_by",
        "pause_reason",
        "resume_at",
        "next_fires",
        "ledger",
        "created_by",
        "created_at",
        "updated_at",
    )
    exclude = ("next_fire_at", "attention_at", "version")
    actions = ("pause_schedules", "resume_schedules", "run_now")

    @admin.display(description="next fire (local)")
    def next_fire_local(self, schedule: Schedule) -> str:
        if schedule.paused:
            return "paused"
        return local_time(schedule.next_fire_at, schedule.timezone) or "—"

    @admin.display(description="next fire (UTC)")
    def next_fire_utc(self, schedule: Schedule) -> str:
        return "paused" if schedule.paused else _utc(schedule.next_fire_at)

    @admin.display(description="next fires (local / UTC)")
    def next_fires(self, schedule: Schedule) -> SafeString:
        if schedule.paused or schedule.next_fire_at is None:
            return format_html("{}", "paused" if schedule.paused else "never again")
        fires = [schedule.next_fire_at]
        fires += schedule_cron(schedule).fires(schedule.next_fire_at, limit=_NEXT_FIRES_SHOWN - 1)
        return format_html(
            "<ul>{}</ul>",
            format_html_join(
                "",
                "<li>{} &nbsp;/&nbsp; {}</li>",
                ((local_time(fire, schedule.timezone), _utc(fire)) for fire in fires),
            ),
        )

    @admin.display(description="ledger")
    def ledger(self, schedule: Schedule) -> SafeString:
        url = reverse("admin:schedules_schedulefire_changelist")
        return format_html(
            '<a href="{}?schedule__id__exact={}">every fire</a> — its search box takes a time '
            "in {} (e.g. 2026-12-01 03:00) and shows the row that accounts for it",
            url,
            schedule.pk,
            schedule.timezone,
        )

    def has_pause_schedule_permission(self, request: HttpRequest) -> bool:
        return holds(request, "schedules.pause_schedule")

    def has_run_now_permission(self, request: HttpRequest) -> bool:
        return holds(request, "runs.add_run")

    @admin.action(
        description="Pause selected schedules (the note is shown as why)",
        permissions=["pause_schedule"],
    )
    def pause_schedules(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        paused = 0
        for schedule in queryset.filter(paused=False):
            # The reason typed beside the action (every console action needs
            # one, qinglong.admin.ReasonedActions) is the pause's why.
            schedule_pause(
                schedule_id=schedule.pk, actor=_actor(request), reason=action_reason(request)
            )
            paused += 1
        self.message_user(request, f"Paused {paused} schedule(s).", messages.SUCCESS)

    @admin.action(description="Resume selected schedules", permissions=["pause_schedule"])
    def resume_schedules(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        resumed = 0
        for schedule in queryset.filter(paused=True):
            schedule_resume(schedule_id=schedule.pk, actor=_actor(request))
            resumed += 1
        self.message_user(request, f"Resumed {resumed} schedule(s).", messages.SUCCESS)

    @admin.action(
        description="Run now (enqueue a Run from each selected schedule)",
        permissions=["run_now"],
    )
    def run_now(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        enqueued = 0
        for schedule in queryset:
            schedule_run_now(schedule_id=schedule.pk, actor=_actor(request))
            enqueued += 1
        self.message_user(request, f"Enqueued {enqueued} run(s).", messages.SUCCESS)


@admin.register(ScheduleFire)
class ScheduleFireAdmin(ReadOnlyAdmin):
    # Fits a 1400-px window beside the filters (issue 14); the local time and
    # the fire count are on the fire's page.
    list_display = ("fire_at_utc", "schedule", "outcome", "run_link", "detail", "manual")
    list_filter = ("outcome", "manual")
    list_select_related = ("schedule",)
    search_fields = ("schedule__name",)
    search_help_text = (
        "A schedule name, or a time — 2026-12-01 03:00 (in the schedule's time zone when "
        "the ledger shows one schedule, else UTC) or with an offset (…T03:00:00+01:00, …Z): "
        "the row that accounts for that instant (its fire, or the missed/paused stretch "
        "covering it)."
    )
    readonly_fields = (
        "schedule",
        "fire_at",
        "last_fire_at",
        "fire_count",
        "outcome",
        "run",
        "detail",
        "manual",
        "actor",
        "recorded_at",
        "updated_at",
    )
    show_full_result_count = False

    @admin.display(description="fire time (UTC)", ordering="fire_at")
    def fire_at_utc(self, fire: ScheduleFire) -> str:
        shown = _utc(fire.fire_at)
        return shown if fire.last_fire_at is None else f"{shown} … {_utc(fire.last_fire_at)}"

    @admin.display(description="fire time (local)")
    def fire_at_local(self, fire: ScheduleFire) -> str:
        return local_time(fire.fire_at, fire.schedule.timezone) or ""

    @admin.display(description="run")
    def run_link(self, fire: ScheduleFire) -> SafeString | str:
        if fire.run_id is None:
            return "—"
        url = reverse("admin:runs_run_change", args=[fire.run_id])
        return format_html('<a href="{}">run {}</a>', url, fire.run_id)

    def get_queryset(self, request: HttpRequest) -> Any:
        return super().get_queryset(request).select_related("schedule")

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[ScheduleFire], search_term: str
    ) -> tuple[QuerySet[ScheduleFire], bool]:
        """A time searches the ledger by instant ("why didn't it run at 03:00?")."""
        instant = _search_instant(request, search_term)
        if instant is None:
            return super().get_search_results(request, queryset, search_term)
        return queryset.filter(covering(instant)), False


def _search_instant(request: HttpRequest, term: str) -> datetime | None:
    """The instant a search term names, or None when it is not a time."""
    text = term.strip()
    if not text[:4].isdigit() or len(text) > 40:
        return None
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        return None
    if value.tzinfo is not None:
        return value.astimezone(UTC)
    zone = "UTC"
    schedule_id = request.GET.get("schedule__id__exact", "")
    if schedule_id.isdigit():
        found = Schedule.objects.filter(pk=int(schedule_id)).values_list("timezone", flat=True)
        zone = next(iter(found), "UTC")
    # A local time's first occurrence, as the timetable reads it (schedules.cron).
    return wall_to_instant(value, ZoneInfo(zone))
