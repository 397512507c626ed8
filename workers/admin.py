"""The Worker Registry in the operator's console (docs/architecture.md "Worker API and operations").

Drain, disable, activate and credential rotation are actions over the worker
services. The credential digest is never shown — only the prefix an operator
needs to tell two credentials apart — and a rotated credential is shown once,
in the action's message, exactly like `manage.py enroll_worker` prints it.

Drain, disable and activate need `workers.change_worker`; rotation needs its
own `workers.rotate_credential`, because the credential it shows opens a
Session. The change page itself is read-only for everyone.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from qinglong.admin import ReadOnlyAdmin, TabularInlineBase, compact_time, holds
from workers.models import Worker, WorkerAdminState, WorkerSession
from workers.services import worker_rotate_credential, worker_set_admin_state

_SESSION_FIELDS = (
    "session_id",
    "generation",
    "state",
    "slots",
    "executor_types",
    "labels",
    "agent_version",
    "heartbeat_at",
    "created_at",
    "ended_at",
)


class WorkerSessionInline(TabularInlineBase):
    model = WorkerSession
    fields = ("generation", "state", "slots", "heartbeat_at", "created_at", "ended_at")
    readonly_fields = fields
    ordering = ("-generation",)
    extra = 0
    max_num = 0
    can_delete = False

    def get_queryset(self, request: HttpRequest) -> QuerySet[WorkerSession]:
        # Only the newest few: a long-lived Worker accumulates many Sessions.
        qs = super().get_queryset(request)
        newest = list(qs.order_by("-generation").values_list("pk", flat=True)[:10])
        return qs.filter(pk__in=newest)

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Worker)
class WorkerAdmin(ReadOnlyAdmin):
    # Fits a 1400-px window beside the filters; the rest is on the Worker's page.
    list_display = ("name", "admin_state", "slots", "executors", "label_list", "credential_prefix")
    list_filter = ("admin_state",)
    search_fields = ("name",)
    # Never `credential_digest`: it is what authenticates the Worker.
    fields = (
        "name",
        "admin_state",
        "slots",
        "executor_types",
        "labels",
        "credential_prefix",
        "last_generation",
        "created_at",
        "credential_rotated_at",
    )
    readonly_fields = fields
    inlines = (WorkerSessionInline,)
    actions = ("drain_workers", "disable_workers", "activate_workers", "rotate_credentials")

    # ReadOnlyAdmin: no add page (enrollment prints a credential once:
    # `manage.py enroll_worker`), no delete (its Sessions and leases are history).

    def has_set_admin_state_permission(self, request: HttpRequest) -> bool:
        return holds(request, "workers.change_worker")

    @admin.display(description="executors")
    def executors(self, worker: Worker) -> str:
        return ", ".join(str(t) for t in worker.executor_types)

    @admin.display(description="labels")
    def label_list(self, worker: Worker) -> str:
        # key=value, one space apart: the column wraps instead of widening.
        return ", ".join(f"{k}={v}" for k, v in sorted(worker.labels.items())) or "-"

    def has_rotate_credential_permission(self, request: HttpRequest) -> bool:
        return holds(request, "workers.rotate_credential")

    def _set_state(
        self, request: HttpRequest, queryset: QuerySet[Worker], state: WorkerAdminState
    ) -> None:
        changed = 0
        for worker in queryset.exclude(admin_state=state):
            worker_set_admin_state(worker=worker, admin_state=state)
            changed += 1
        self.message_user(request, f"{changed} worker(s) now {state}.", messages.SUCCESS)

    @admin.action(
        description="Drain: keep leases, take no new claims", permissions=["set_admin_state"]
    )
    def drain_workers(self, request: HttpRequest, queryset: QuerySet[Worker]) -> None:
        self._set_state(request, queryset, WorkerAdminState.DRAINING)

    @admin.action(
        description="Disable: end Sessions and their leases", permissions=["set_admin_state"]
    )
    def disable_workers(self, request: HttpRequest, queryset: QuerySet[Worker]) -> None:
        self._set_state(request, queryset, WorkerAdminState.DISABLED)

    @admin.action(description="Activate", permissions=["set_admin_state"])
    def activate_workers(self, request: HttpRequest, queryset: QuerySet[Worker]) -> None:
        self._set_state(request, queryset, WorkerAdminState.ACTIVE)

    @admin.action(description="Rotate credential (shown once)", permissions=["rotate_credential"])
    def rotate_credentials(self, request: HttpRequest, queryset: QuerySet[Worker]) -> None:
        rotated = 0
        for worker in queryset:
            credential = worker_rotate_credential(worker=worker)
            rotated += 1
            # Shown once, to this operator, in this response; never stored.
            self.message_user(
                request,
                f"New credential for {worker.name} (shown once): {credential}",
                messages.WARNING,
            )
        self.message_user(request, f"Rotated {rotated} credential(s).", messages.SUCCESS)


@admin.register(WorkerSession)
class WorkerSessionAdmin(ReadOnlyAdmin):
    """View only: a Session's state changes through the worker services."""

    list_display = ("worker", "generation", "state", "slots", "heartbeat", "ended")
    list_filter = ("state",)
    list_select_related = ("worker",)
    search_fields = ("worker__name", "session_id")
    # Never `token_digest`.
    fields = ("worker", *_SESSION_FIELDS)
    readonly_fields = fields
    show_full_result_count = False

    @admin.display(description="last heartbeat", ordering="heartbeat_at")
    def heartbeat(self, session: WorkerSession) -> str:
        return compact_time(session.heartbeat_at)

    @admin.display(description="ended", ordering="ended_at")
    def ended(self, session: WorkerSession) -> str:
        return compact_time(session.ended_at)
