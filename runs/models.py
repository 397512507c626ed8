"""Projects, Tasks and their immutable revisions, Runs and Attempts (docs/architecture.md).

Models hold data and database-level invariants only. `runs.services` creates
them; every later state change of a Run or an Attempt is one function of the
lease authority (`leases.transitions`, a compare-and-set on `version`, see
docs/adr/0004), never `save()` or a signal.
"""

from __future__ import annotations

from typing import Any

from django.db import models
from django.db.models import Q

from dispatch.core.spec import DEFAULT_RETRY_BACKOFF_MAX_S
from dispatch.core.spec import RetryOn as SpecRetryOn


class Project(models.Model):
    """Namespace that owns Tasks; the unit of fairness and quota."""

    slug = models.SlugField(max_length=64, unique=True)
    name = models.CharField(max_length=200)
    # 0 = no limit; otherwise at most this many Runs dispatching or running.
    max_concurrent_runs = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug


class Task(models.Model):
    """A runnable definition; every edit creates a new immutable TaskRevision."""

    project = models.ForeignKey(Project, on_delete=models.PROTECT, related_name="tasks")
    name = models.SlugField(max_length=100)
    current_revision = models.ForeignKey(
        "runs.TaskRevision",
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="+",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["project_id", "name"]
        constraints = [
            models.UniqueConstraint(
                fields=["project", "name"], name="task_unique_name_per_project"
            ),
        ]

    def __str__(self) -> str:
        # Admin lists select_related the project so this costs no query per row.
        return f"{self.project.slug}/{self.name}"


class ImmutableRevision(Exception):
    """A TaskRevision was about to be changed in place."""


class RetryOn(models.TextChoices):
    """`dispatch.core.spec.RetryOn` as model choices (one vocabulary, checked below)."""

    EXIT_CODE = SpecRetryOn.EXIT_CODE.value  # failed, start_failed, timed_out
    WORKER_LOST = SpecRetryOn.WORKER_LOST.value  # lost: the Worker or its Session went away
    BOTH = SpecRetryOn.BOTH.value  # either (the default)


assert set(RetryOn.values) == {member.value for member in SpecRetryOn}


class TaskRevisionQuerySet(models.QuerySet["TaskRevision"]):
    def update(self, **kwargs: Any) -> int:
        raise ImmutableRevision("TaskRevision rows are immutable; edit the Task instead.")


class TaskRevision(models.Model):
    """The frozen definition a Run is pinned to (revision 1, 2, …)."""

    task = models.ForeignKey(Task, on_delete=models.PROTECT, related_name="revisions")
    revision = models.PositiveIntegerField()
    executor_type = models.CharField(max_length=32)
    command = models.JSONField()
    cwd = models.CharField(max_length=1024, null=True, blank=True)
    env = models.JSONField(default=dict, blank=True)
    timeout_s = models.PositiveIntegerField()
    resources = models.JSONField(default=dict, blank=True)
    placement = models.JSONField(default=dict, blank=True)
    max_attempts = models.PositiveSmallIntegerField(default=1)
    # Run policies (README "Run policies"), validated by dispatch.core.spec:
    # this Task's own concurrency limit besides the Project's (0 = unlimited),
    # counted from live leases in the claim; which failures are retried, and
    # how long a retry waits (doubling from retry_backoff_s up to the cap).
    max_concurrent_runs = models.PositiveIntegerField(default=0)
    retry_on = models.CharField(max_length=16, choices=RetryOn.choices, default=RetryOn.BOTH)
    retry_backoff_s = models.PositiveIntegerField(default=0)
    retry_backoff_max_s = models.PositiveIntegerField(default=DEFAULT_RETRY_BACKOFF_MAX_S)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TaskRevisionQuerySet.as_manager()

    class Meta:
        ordering = ["task_id", "revision"]
        constraints = [
            models.UniqueConstraint(fields=["task", "revision"], name="taskrevision_unique_number"),
            models.CheckConstraint(
                condition=Q(revision__gte=1), name="taskrevision_revision_gte_1"
            ),
            models.CheckConstraint(
                condition=Q(max_attempts__gte=1), name="taskrevision_max_attempts_gte_1"
            ),
            models.CheckConstraint(
                condition=Q(retry_on__in=RetryOn.values), name="taskrevision_retry_on_valid"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.task.name} r{self.revision}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        # Immutability guard, not a transition: a Run pinned to this revision
        # must re-materialize the exact spec it was claimed with (docs/adr/0002).
        if not self._state.adding:
            raise ImmutableRevision("TaskRevision rows are immutable; edit the Task instead.")
        super().save(*args, **kwargs)


class RunState(models.TextChoices):
    QUEUED = "queued"  # waiting for a claim
    DISPATCHING = "dispatching"  # its Attempt is claimed, not yet started
    RUNNING = "running"  # a Worker ACKed starting
    SUCCEEDED = "succeeded"  # terminal
    FAILED = "failed"  # terminal: out of attempts
    CANCELLED = "cancelled"  # terminal: an operator cancelled it


RUN_TERMINAL_STATES = frozenset({RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED})


class Run(models.Model):
    """One requested execution of a Task, pinned to a revision at creation."""

    project = models.ForeignKey(Project, on_delete=models.PROTECT, related_name="runs")
    task = models.ForeignKey(Task, on_delete=models.PROTECT, related_name="runs")
    # No index of its own: a revision is never deleted (immutable, no delete in
    # admin or API), and the one read by revision, the fair candidate read, walks
    # run_queue_group. A Run's every transition rewrites each of its indexes
    # (its indexed state changes, so no HOT update).
    task_revision = models.ForeignKey(
        TaskRevision, on_delete=models.PROTECT, related_name="runs", db_index=False
    )
    state = models.CharField(max_length=16, choices=RunState.choices, default=RunState.QUEUED)
    priority = models.IntegerField(default=0)
    queued_at = models.DateTimeField()
    cancel_requested = models.BooleanField(default=False)
    # The Schedule that fired it, if any: its overlap policy asks "is a Run of
    # mine still queued or running?" through the partial index run_schedule_active.
    # Its own index (run_schedule, for the SET NULL of a Schedule's delete) holds
    # only the Runs a Schedule fired, not a NULL entry per version of every other Run.
    schedule = models.ForeignKey(
        "schedules.Schedule",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="runs",
        db_index=False,
    )
    version = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        constraints = [
            models.CheckConstraint(condition=Q(state__in=RunState.values), name="run_state_valid"),
            models.CheckConstraint(
                condition=Q(priority__gte=-1000, priority__lte=1000), name="run_priority_range"
            ),
        ]
        indexes = [
            models.Index(fields=["state", "-id"], name="run_state_id"),
            models.Index(
                fields=["project", "state"],
                name="run_project_active",
                condition=Q(state__in=["dispatching", "running"]),
            ),
            # The Task's Runs that may hold a live lease: its concurrency limit
            # counts their leases (leases.quota, docs/adr/0012).
            models.Index(
                fields=["task", "state"],
                name="run_task_active",
                condition=Q(state__in=["dispatching", "running"]),
            ),
            # The fair candidate read (docs/adr/0012): one queue per Project and
            # pinned revision, walked one probe per queue, each read in order.
            models.Index(
                "project_id",
                "task_revision_id",
                models.F("priority").desc(),
                "queued_at",
                "id",
                name="run_queue_group",
                condition=Q(state="queued"),
            ),
            # The overview's throughput charts: Runs finished in a time window,
            # by end state (qinglong.console.selectors.runs_finished).
            models.Index(
                fields=["finished_at", "state"],
                name="run_finished",
                condition=Q(finished_at__isnull=False),
            ),
            models.Index(
                fields=["schedule"], name="run_schedule", condition=Q(schedule__isnull=False)
            ),
            models.Index(
                fields=["schedule"],
                name="run_schedule_active",
                condition=Q(state__in=["queued", "dispatching", "running"]),
            ),
        ]

    def __str__(self) -> str:
        return f"run {self.pk} ({self.state})"


class AttemptState(models.TextChoices):
    PENDING = "pending"  # claimable
    CLAIMED = "claimed"  # leased to a Session, spec not yet started
    STARTING = "starting"  # the Worker ACKed starting: it may spawn
    RUNNING = "running"  # the Worker reported an executor handle
    SUCCEEDED = "succeeded"  # terminal
    FAILED = "failed"  # terminal: non-zero exit
    START_FAILED = "start_failed"  # terminal: could not start
    LOST = "lost"  # terminal: lease expired or session gone after starting
    CANCELLED = "cancelled"  # terminal


ATTEMPT_ACTIVE_STATES = (
    AttemptState.PENDING,
    AttemptState.CLAIMED,
    AttemptState.STARTING,
    AttemptState.RUNNING,
)
ATTEMPT_TERMINAL_STATES = frozenset(set(AttemptState) - set(ATTEMPT_ACTIVE_STATES))


class Attempt(models.Model):
    """One try of a Run; only an Attempt is ever claimed."""

    # No index of its own: attempt_unique_number (run, number) serves every
    # lookup by Run (an Attempt's transitions rewrite each of its indexes).
    run = models.ForeignKey(Run, on_delete=models.PROTECT, related_name="attempts", db_index=False)
    number = models.PositiveIntegerField()
    state = models.CharField(
        max_length=16, choices=AttemptState.choices, default=AttemptState.PENDING
    )
    version = models.PositiveIntegerField(default=0)
    lease_generation = models.PositiveIntegerField(default=0)
    # Copied from the Run so the candidate keyset scan is one index range.
    priority = models.IntegerField(default=0)
    queued_at = models.DateTimeField()
    executor_handle = models.CharField(max_length=200, blank=True, default="")
    exit_code = models.IntegerField(null=True, blank=True)
    error_code = models.CharField(max_length=64, blank=True, default="")
    output_tail = models.TextField(blank=True, default="")
    # The one "not yet" of a pending Attempt (docs/adr/0005): no claim before
    # this instant; NULL = eligible now. The candidate read skips it in SQL.
    not_before = models.DateTimeField(null=True, blank=True)
    # Why it waits, for operators and for the one writer that may lift the
    # wait early (a reconcile report lifts only `lost_execution_grace`).
    not_before_reason = models.CharField(max_length=32, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    # started_at + the revision's timeout_s, set by the starting ACK: past it
    # (and a margin) the control plane stops the Attempt and ends it
    # `timed_out`, agent or no agent (leases.timeout, README "Run policies").
    deadline_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["run_id", "number"]
        constraints = [
            models.UniqueConstraint(fields=["run", "number"], name="attempt_unique_number"),
            # At most one non-terminal Attempt per Run.
            models.UniqueConstraint(
                fields=["run"],
                condition=Q(state__in=["pending", "claimed", "starting", "running"]),
                name="attempt_one_active_per_run",
            ),
            models.CheckConstraint(
                condition=Q(state__in=AttemptState.values), name="attempt_state_valid"
            ),
            models.CheckConstraint(condition=Q(number__gte=1), name="attempt_number_gte_1"),
        ]
        indexes = [
            # The candidate keyset order (docs/adr/0001 step 2) over pending rows only.
            models.Index(
                models.F("priority").desc(),
                "queued_at",
                "id",
                name="attempt_candidate_keyset",
                condition=Q(state="pending"),
            ),
            # The timeout sweep: started Attempts by deadline (leases.timeout).
            models.Index(
                fields=["deadline_at", "id"],
                name="attempt_started_deadline",
                condition=Q(state__in=["starting", "running"]),
            ),
        ]

    def __str__(self) -> str:
        return f"attempt {self.pk} #{self.number} ({self.state})"


class AttemptEvent(models.Model):
    """Append-only history of Attempt/Run transitions, for operators."""

    attempt = models.ForeignKey(Attempt, on_delete=models.CASCADE, related_name="events")
    # No index of its own: attemptevent_run (run, id) serves every lookup by Run.
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="events", db_index=False)
    from_state = models.CharField(max_length=16)
    to_state = models.CharField(max_length=16)
    # A small fixed vocabulary ("claim", "ack_starting", "lease_expired", …).
    reason = models.CharField(max_length=48)
    actor = models.CharField(max_length=80, blank=True, default="")
    at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["run", "id"], name="attemptevent_run")]

    def __str__(self) -> str:
        return f"{self.from_state}→{self.to_state} ({self.reason})"
