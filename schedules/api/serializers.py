"""Operator API bodies of Schedules (README "Schedules").

Schedule settings are validated only by `schedules.definition` (the one
validator); the request serializers here document their shape for OpenAPI.
Responses are built field by field (`schedules.api.selectors`): no spec,
command or env of the Task ever appears.
"""

from __future__ import annotations

from rest_framework import serializers

from qinglong.api_common import BodySerializer, StrictCharField, StrictSerializer
from schedules.cron import MAX_CRON_CHARS, MAX_TIMEZONE_CHARS
from schedules.definition import (
    MAX_CATCHUP_WINDOW_S,
    MAX_JITTER_S,
    MAX_PAUSE_REASON_CHARS,
    OVERLAP_POLICIES,
)
from schedules.models import FireOutcome

_CRON_HELP = (
    "5 fields (minute hour day-of-month month day-of-week) or 6 with seconds first "
    "(`*/5 * * * * *`); names (MON, JAN), ranges, steps, lists, `L`, `#n`. Evaluated as "
    "wall-clock time in `timezone`: a skipped local time fires once at the next valid "
    "instant, a repeated one once (its first occurrence)."
)


class _ScheduleFields(BodySerializer):
    cron = serializers.CharField(max_length=MAX_CRON_CHARS, help_text=_CRON_HELP)
    timezone = serializers.CharField(
        max_length=MAX_TIMEZONE_CHARS,
        required=False,
        help_text="IANA time zone name (default `UTC`); an unknown one is a 400.",
    )
    overlap_policy = serializers.ChoiceField(
        choices=list(OVERLAP_POLICIES),
        required=False,
        help_text="While a Run from this Schedule is queued or running: `allow` enqueues "
        "anyway, `skip` (default) records `skipped_overlap`, `buffer_one` keeps one fire "
        "waiting until the Run ends, `cancel_running` cancels the Run and this fire waits "
        "for it to end.",
    )
    catchup_window_s = serializers.IntegerField(
        min_value=0,
        max_value=MAX_CATCHUP_WINDOW_S,
        required=False,
        help_text="A fire evaluated later than this (the control plane was down) is "
        f"recorded `missed` (default 300; at most {MAX_CATCHUP_WINDOW_S}, more is a 400). "
        "30 s late is always on time.",
    )
    jitter_s = serializers.IntegerField(
        min_value=0,
        max_value=MAX_JITTER_S,
        required=False,
        help_text="A fixed delay in [0, jitter_s] after each fire time, the same for every "
        "fire of this Schedule (derived from its id).",
    )
    priority = serializers.IntegerField(
        min_value=-1000, max_value=1000, required=False, help_text="Of the Runs it enqueues."
    )


class ScheduleCreateRequestSerializer(_ScheduleFields):
    project = serializers.CharField(max_length=64, help_text="Project slug.")
    task = serializers.CharField(max_length=100, help_text="Task name.")
    name = serializers.CharField(max_length=100, help_text="Unique per Task.")


class ScheduleUpdateRequestSerializer(_ScheduleFields):
    """PATCH: any subset of the settings; a new cron, time zone or jitter starts from now."""

    cron = serializers.CharField(max_length=MAX_CRON_CHARS, required=False, help_text=_CRON_HELP)


class SchedulePauseRequestSerializer(StrictSerializer):
    reason = StrictCharField(
        max_length=MAX_PAUSE_REASON_CHARS, allow_blank=True, required=False, default=""
    )
    resume_at = serializers.DateTimeField(
        required=False,
        allow_null=True,
        default=None,
        help_text="Resume by itself at this instant (RFC 3339, in the future).",
    )


class ScheduleResumeRequestSerializer(StrictSerializer):
    """An empty object (or no body at all)."""


class ScheduleSerializer(BodySerializer):
    id = serializers.CharField()
    project = serializers.CharField()
    task = serializers.CharField()
    name = serializers.CharField()
    cron = serializers.CharField()
    timezone = serializers.CharField()
    overlap_policy = serializers.ChoiceField(choices=list(OVERLAP_POLICIES))
    catchup_window_s = serializers.IntegerField()
    jitter_s = serializers.IntegerField()
    priority = serializers.IntegerField()
    paused = serializers.BooleanField()
    paused_at = serializers.DateTimeField(allow_null=True)
    paused_by = serializers.CharField(allow_blank=True)
    pause_reason = serializers.CharField(allow_blank=True)
    resume_at = serializers.DateTimeField(allow_null=True)
    next_fire_at = serializers.DateTimeField(
        allow_null=True, help_text="UTC; null while paused or when it never fires again."
    )
    next_fire_local = serializers.CharField(
        allow_null=True, help_text="The same instant in the Schedule's time zone."
    )
    created_by = serializers.CharField(allow_blank=True)
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()


class SchedulePageSerializer(BodySerializer):
    results = ScheduleSerializer(many=True)
    next_cursor = serializers.CharField(allow_null=True)


class FireSerializer(BodySerializer):
    id = serializers.CharField()
    fire_at = serializers.DateTimeField(help_text="The fire time (UTC).")
    fire_local = serializers.CharField(help_text="The fire time in the Schedule's time zone.")
    last_fire_at = serializers.DateTimeField(
        allow_null=True, help_text="A stretch of missed or paused fires ends here."
    )
    fire_count = serializers.IntegerField(
        allow_null=True, help_text="Fires in the stretch (null: more than 1,000)."
    )
    outcome = serializers.ChoiceField(choices=FireOutcome.choices)
    run_id = serializers.CharField(allow_null=True)
    detail = serializers.CharField(allow_blank=True)
    manual = serializers.BooleanField(help_text="An operator's run now.")
    actor = serializers.CharField(allow_blank=True)
    recorded_at = serializers.DateTimeField()


class FirePageSerializer(BodySerializer):
    results = FireSerializer(many=True)
    next_cursor = serializers.CharField(allow_null=True)
