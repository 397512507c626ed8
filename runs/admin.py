"""The operator's console for Projects, Tasks, Runs and Attempts (README "Admin permissions").

A console, not a backdoor: state fields are read-only, Attempts and their
history cannot be added or deleted, and every action calls a service and
reports how many rows it changed. Task definitions are shown (an operator owns
them), but never from a Run/Attempt page where lease facts are listed.

Actions need the same model permissions as the operator API: enqueueing a Run
(also a retry) `runs.add_run`, cancelling one `runs.change_run`.
"""

from __future__ import annotations

import shlex
from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponseRedirect
from django.urls import reverse

from dispatch.adapters.waiting import placement_unmatched, run_waiting
from leases.end import run_cancel
from leases.errors import Outcome
from qinglong.admin import (
    DigestLookupGuard,
    ReadOnlyAdmin,
    TabularInlineBase,
    compact_time,
    holds,
)
from runs.models import (
    RUN_TERMINAL_STATES,
    Attempt,
    AttemptEvent,
    Project,
    Run,
    RunState,
    Task,
    TaskRevision,
)
from runs.services import DefinitionError, run_enqueue


class ReadOnlyInline(TabularInlineBase):
    extra = 0
    can_delete = False
    show_change_link = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Project)
class ProjectAdmin(DigestLookupGuard):
    list_display = ("slug", "name", "max_concurrent_runs", "created_at")
    search_fields = ("slug", "name")


class TaskRevisionInline(ReadOnlyInline):
    model = TaskRevision
    fields = ("revision", "executor_type", "timeout_s", "max_attempts", "created_at")
    readonly_fields = fields
    ordering = ("-revision",)


def _actor(request: HttpRequest) -> str:
    return f"admin:{getattr(request.user, 'username', '')}"


def _warn_if_unplaceable(
    model_admin: admin.ModelAdmin[Any], request: HttpRequest, run: Run
) -> None:
    """docs/adr/0012: a Run no enrolled Worker can take is enqueued, and said so."""
    reason = placement_unmatched(run.task_revision)
    if reason is not None:
        model_admin.message_user(
            request,
            f"Run {run.pk} is unplaceable now: {reason['message']} It is queued all the same.",
            messages.WARNING,
        )


def _may_enqueue(request: HttpRequest) -> bool:
    return holds(request, "runs.add_run")


@admin.register(Task)
class TaskAdmin(ReadOnlyAdmin):
    list_display = ("name", "project", "current_revision", "updated")
    list_filter = ("project",)
    list_select_related = ("project", "current_revision__task")
    search_fields = ("name", "project__slug")
    # Revisions are immutable and made by the task services (API/commands); the
    # admin shows them and enqueues Runs, it never edits a definition in place.
    # The current revision's command is shown (operators own it); of its
    # environment only the names, never a value (values are often secrets).
    readonly_fields = (
        "project",
        "name",
        "current_revision",
        "command",
        "environment",
        "created_at",
        "updated_at",
    )
    inlines = (TaskRevisionInline,)
    actions = ("enqueue_run",)
    # ReadOnlyAdmin: a Task is never deleted here (its revisions PROTECT it).

    def has_enqueue_run_permission(self, request: HttpRequest) -> bool:
        return _may_enqueue(request)

    @admin.display(description="updated", ordering="updated_at")
    def updated(self, task: Task) -> str:
        return compact_time(task.updated_at)

    @admin.display(description="command (current revision)")
    def command(self, task: Task) -> str:
        revision = task.current_revision
        if revision is None:
            return "-"
        return shlex.join(str(part) for part in revision.command)

    @admin.display(description="environment (current revision)")
    def environment(self, task: Task) -> str:
        revision = task.current_revision
        if revision is None or not revision.env:
            return "-"
        return f"{', '.join(sorted(revision.env))} (values hidden)"

    @admin.action(description="Enqueue a run of the current revision", permissions=["enqueue_run"])
    def enqueue_run(self, request: HttpRequest, queryset: QuerySet[Task]) -> None:
        enqueued = 0
        for task in queryset:
            try:
                run = run_enqueue(task=task)
            except DefinitionError:
                continue
            enqueued += 1
            _warn_if_unplaceable(self, request, run)
        self.message_user(request, f"Enqueued {enqueued} run(s).", messages.SUCCESS)


class AttemptInline(ReadOnlyInline):
    model = Attempt
    # Each Attempt's own page (its output, events) is a click away from the Run's.
    show_change_link = True
    fields = (
        "number",
        "state",
        "lease_generation",
        "executor_handle",
        "exit_code",
        "error_code",
        "not_before",
        "not_before_reason",
        "started_at",
        "finished_at",
    )
    readonly_fields = fields


class AttemptEventInline(ReadOnlyInline):
    model = AttemptEvent
    fields = ("at", "attempt", "from_state", "to_state", "reason", "actor")
    readonly_fields = fields


@admin.register(Run)
class RunAdmin(ReadOnlyAdmin):
    # Fits a 1400-px window beside the filters; the rest is on the Run's page.
    list_display = ("id", "task_and_revision", "run_state", "priority", "queued", "finished")
    list_filter = ("state", "project", "cancel_requested")
    list_select_related = ("project", "task__project", "task_revision__task")
    search_fields = ("id", "task__name", "project__slug")
    readonly_fields = (
        "project",
        "task",
        "task_revision",
        "state",
        "priority",
        "queued_at",
        "cancel_requested",
        "version",
        "created_at",
        "finished_at",
        "waiting_now",
        "unplaceable_now",
    )
    inlines = (AttemptInline, AttemptEventInline)
    actions = ("cancel_runs", "retry_failed_runs")
    show_full_result_count = False

    def has_cancel_run_permission(self, request: HttpRequest) -> bool:
        return holds(request, "runs.change_run")

    @admin.display(description="task", ordering="task")
    def task_and_revision(self, run: Run) -> str:
        return f"{run.task} r{run.task_revision.revision}"

    @admin.display(description="state", ordering="state")
    def run_state(self, run: Run) -> str:
        label = RunState(run.state).label
        return f"{label}, cancel requested" if run.cancel_requested else label

    @admin.display(description="queued", ordering="queued_at")
    def queued(self, run: Run) -> str:
        return compact_time(run.queued_at)

    @admin.display(description="why it waits")
    def waiting_now(self, run: Run) -> str:
        """docs/adr/0012: the first rule holding a queued Run back, asked now."""
        if run.pk is None or run.state != RunState.QUEUED:
            return "-"
        answer = run_waiting(run.pk)
        return "-" if answer is None else f"{answer['reason']}: {answer['message']}"

    @admin.display(description="unplaceable now")
    def unplaceable_now(self, run: Run) -> str:
        """Whether any enrolled Worker has its executor type and required labels."""
        if run.pk is None or run.state in RUN_TERMINAL_STATES:
            return "-"
        reason = placement_unmatched(run.task_revision)
        return "no" if reason is None else f"yes: {reason['message']}"

    @admin.display(description="finished", ordering="finished_at")
    def finished(self, run: Run) -> str:
        return compact_time(run.finished_at)

    def has_enqueue_run_permission(self, request: HttpRequest) -> bool:
        return _may_enqueue(request)

    @admin.action(description="Cancel selected runs", permissions=["cancel_run"])
    def cancel_runs(
        self, request: HttpRequest, queryset: QuerySet[Run]
    ) -> HttpResponseRedirect | None:
        cancelled = 0
        for run in queryset.exclude(state__in=RUN_TERMINAL_STATES):
            if run_cancel(run=run, actor=_actor(request)) is Outcome.APPLIED:
                cancelled += 1
        self.message_user(request, f"Cancelled {cancelled} run(s).", messages.SUCCESS)
        # The Run page's cancel button (output.templatetags) posts this action
        # for its one Run: the operator goes back to that page, not the list.
        if request.POST.get("_return_to_run"):
            selected = list(queryset.values_list("pk", flat=True)[:2])
            if len(selected) == 1:
                return HttpResponseRedirect(reverse("admin:runs_run_change", args=selected))
        return None

    @admin.action(
        description="Retry failed runs (enqueue a new run of the task's current revision)",
        permissions=["enqueue_run"],
    )
    def retry_failed_runs(self, request: HttpRequest, queryset: QuerySet[Run]) -> None:
        # A finished Run is history and never reopened: a retry is a new Run,
        # pinned to whatever revision is current now (the fix is usually there).
        retried = 0
        for run in queryset.filter(state=RunState.FAILED).select_related("task"):
            try:
                retry = run_enqueue(task=run.task, priority=run.priority)
            except DefinitionError:
                continue
            retried += 1
            _warn_if_unplaceable(self, request, retry)
        self.message_user(request, f"Enqueued {retried} retry run(s).", messages.SUCCESS)


@admin.register(Attempt)
class AttemptAdmin(ReadOnlyAdmin):
    list_display = ("id", "run", "number", "state", "lease_generation", "exit_code", "finished")
    list_filter = ("state",)
    list_select_related = ("run",)
    # output_tail is the Worker's own report of its process output: shown on
    # the change page only, never in lists.
    readonly_fields = [f.name for f in Attempt._meta.fields]
    inlines = (AttemptEventInline,)
    show_full_result_count = False

    @admin.display(description="finished", ordering="finished_at")
    def finished(self, attempt: Attempt) -> str:
        return compact_time(attempt.finished_at)
