"""Schedules and their per-fire ledger (README "Schedules", docs/adr/0010).

Models hold data and database-level invariants only; `schedules.services`
writes them. The ledger's unique (schedule, fire_at) row is what makes a fire
exactly-once under duplicate beats, several `run_dispatcher` processes and
restarts: whoever inserts it first owns the fire.
"""

from __future__ import annotations

from django.db import models
from django.db.models import Q


class OverlapPolicy(models.TextChoices):
    """What a fire does while a Run from the same Schedule is queued or running."""

    ALLOW = "allow"  # enqueue anyway: several may run at once
    SKIP = "skip"  # record skipped_overlap, enqueue nothing
    BUFFER_ONE = "buffer_one"  # keep one fire waiting; it is enqueued when the Run ends
    CANCEL_RUNNING = "cancel_running"  # cancel the Run; this fire waits for it to end


class FireOutcome(models.TextChoices):
    """What became of one fire (or of one stretch of missed or paused fires)."""

    ENQUEUED = "enqueued"  # a Run was enqueued (`run`)
    SKIPPED_OVERLAP = "skipped_overlap"  # a Run from this Schedule was still queued/running
    MISSED = "missed"  # evaluated later than the catch-up window allows
    PAUSED = "paused"  # the Schedule was paused at the time
    BLOCKED = "blocked"  # the Task or its Project was at its concurrency limit
    BUFFERED = "buffered"  # waiting for the Run in its way to end (becomes enqueued)


class Schedule(models.Model):
    """A Task's cron timetable in one time zone, with its policies and cursor."""

    task = models.ForeignKey("runs.Task", on_delete=models.PROTECT, related_name="schedules")
    name = models.SlugField(max_length=100)
    cron = models.CharField(max_length=120)
    timezone = models.CharField(max_length=64)
    overlap_policy = models.CharField(
        max_length=16, choices=OverlapPolicy.choices, default=OverlapPolicy.SKIP
    )
    # A fire evaluated later than this after its time (the control plane was
    # down) is recorded missed instead of enqueued.
    catchup_window_s = models.PositiveIntegerField(default=300)
    # Up to this many seconds after each fire time, the same offset for every
    # fire of this Schedule (derived from its id), so Schedules sharing a
    # cron line do not all enqueue in the same second.
    jitter_s = models.PositiveIntegerField(default=0)
    priority = models.IntegerField(default=0)
    paused = models.BooleanField(default=False)
    paused_at = models.DateTimeField(null=True, blank=True)
    paused_by = models.CharField(max_length=80, blank=True, default="")
    pause_reason = models.CharField(max_length=200, blank=True, default="")
    resume_at = models.DateTimeField(null=True, blank=True)
    # The cursor: the first fire time not yet in the ledger (NULL: never again).
    next_fire_at = models.DateTimeField(null=True, blank=True)
    # When the evaluator must look at it next (the fire plus its jitter, a
    # resume-at, a buffered fire's poll); NULL = nothing to do. The due scan
    # is a keyset over (attention_at, id) on a partial index: its cost does
    # not grow with the number of Schedules that are not due.
    attention_at = models.DateTimeField(null=True, blank=True)
    version = models.PositiveIntegerField(default=0)
    created_by = models.CharField(max_length=80, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["task_id", "name"]
        permissions = [("pause_schedule", "Can pause and resume a schedule")]
        constraints = [
            models.UniqueConstraint(fields=["task", "name"], name="schedule_unique_name_per_task"),
            models.CheckConstraint(
                condition=Q(overlap_policy__in=OverlapPolicy.values),
                name="schedule_overlap_policy_valid",
            ),
            models.CheckConstraint(
                condition=Q(priority__gte=-1000, priority__lte=1000),
                name="schedule_priority_range",
            ),
        ]
        indexes = [
            models.Index(
                fields=["attention_at", "id"],
                name="schedule_attention",
                condition=Q(attention_at__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.cron} {self.timezone})"


class ScheduleFire(models.Model):
    """The ledger: one row per (schedule, fire time), with what became of it.

    A stretch of consecutive missed or paused fires is one row from `fire_at`
    through `last_fire_at` (`fire_count` fires; NULL = more than the counting
    cap), so an outage or a long pause costs one row, not one per second.
    Every fire that could have run has its own row.
    """

    schedule = models.ForeignKey(Schedule, on_delete=models.CASCADE, related_name="fires")
    fire_at = models.DateTimeField()
    last_fire_at = models.DateTimeField(null=True, blank=True)
    fire_count = models.PositiveIntegerField(null=True, blank=True, default=1)
    outcome = models.CharField(max_length=16, choices=FireOutcome.choices)
    run = models.ForeignKey(
        "runs.Run", on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )
    # Operator-readable why: "run 12 is running", "task at its limit (2)".
    detail = models.CharField(max_length=200, blank=True, default="")
    # "run now" from an operator: not a fire of the timetable.
    manual = models.BooleanField(default=False)
    actor = models.CharField(max_length=80, blank=True, default="")
    recorded_at = models.DateTimeField()
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-fire_at", "-id"]
        constraints = [
            # Exactly-once: the first evaluator to insert a fire owns it.
            models.UniqueConstraint(
                fields=["schedule", "fire_at"],
                condition=Q(manual=False),
                name="schedulefire_once",
            ),
            models.CheckConstraint(
                condition=Q(outcome__in=FireOutcome.values), name="schedulefire_outcome_valid"
            ),
            models.CheckConstraint(
                condition=Q(outcome="enqueued", run__isnull=False) | ~Q(outcome="enqueued"),
                name="schedulefire_enqueued_has_run",
            ),
        ]
        indexes = [
            models.Index(fields=["schedule", "-fire_at", "-id"], name="schedulefire_ledger"),
            models.Index(fields=["outcome", "-id"], name="schedulefire_outcome"),
            models.Index(
                fields=["schedule"],
                name="schedulefire_buffered",
                condition=Q(outcome="buffered"),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.schedule_id} @ {self.fire_at:%Y-%m-%d %H:%M:%S}Z: {self.outcome}"
