"""Leases, dispatch cycles and the kill switch in the operator's console (README, admin).

Leases are redacted: the token digest appears as an 8-character prefix, the
spec never (it is not stored; only its digest is, shown as a prefix too).
Revocation is an action over `lease_revoke`. DispatchCycle is a big, append-
only table: read-only, with a capped paginator. The "dispatch paused" kill
switch is a single DispatchControl row changed only through
`dispatch_set_paused`, and every cycle honours it.

Revoking needs `leases.revoke_lease`; the switch (its actions and its form)
needs `dispatch.pause_dispatch` — `change_dispatchcontrol` alone flips nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from django.contrib import admin, messages
from django.core.paginator import Paginator
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils.functional import cached_property
from django.utils.html import format_html

from dispatch.core.result import CycleStatus
from dispatch.cycles import dispatch_paused, dispatch_set_paused
from dispatch.models import DispatchControl, DispatchCycle
from leases.end import lease_revoke
from leases.errors import Outcome
from leases.models import LeaseState, RunLease
from qinglong.admin import DigestLookupGuard, ReadOnlyAdmin, action_reason, compact_time, holds

COUNT_CAP: Final = 10_000


def _actor(request: HttpRequest) -> str:
    return f"admin:{getattr(request.user, 'username', '')}"


if TYPE_CHECKING:
    # Generic in django-stubs only: Django's Paginator is not subscriptable.
    _PaginatorBase = Paginator[Any]
else:
    _PaginatorBase = Paginator


class CappedPaginator(_PaginatorBase):
    """Counts at most COUNT_CAP rows: a COUNT(*) over a big table is not free."""

    @cached_property
    def count(self) -> int:
        object_list: Any = self.object_list
        if isinstance(object_list, QuerySet):
            return object_list[:COUNT_CAP].count()
        return len(object_list)


class ViewOnlyAdmin(ReadOnlyAdmin):
    show_full_result_count = False
    paginator = CappedPaginator


@admin.register(RunLease)
class RunLeaseAdmin(ViewOnlyAdmin):
    # Fits a 1400-px window beside the navigation and the filters; the rest
    # (generations, deliveries, token prefix) is on the lease's page.
    list_display = ("id", "run_id_link", "worker", "state", "expires", "end_reason")
    list_filter = ("state", "source")
    list_select_related = ("worker",)
    search_fields = ("id", "offer_id", "run__id")
    # Never token_digest or spec_digest in full, and no spec at all.
    fields = (
        "offer_id",
        "run",
        "attempt",
        "worker",
        "session",
        "session_generation",
        "lease_generation",
        "state",
        "source",
        "token_prefix",
        "spec_digest_prefix",
        "placement_score",
        "claimed_at",
        "expires_at",
        "delivery_count",
        "last_delivered_at",
        "ended_at",
        "end_reason",
        # docs/adr/0005: a restarted Worker's report that the execution is gone.
        "execution_confirmed_at",
        "execution_outcome",
        "execution_exit_code",
        "execution_confirmed_by",
    )
    readonly_fields = fields
    actions = ("revoke_leases",)

    def has_revoke_lease_permission(self, request: HttpRequest) -> bool:
        return holds(request, "leases.revoke_lease")

    @admin.display(description="run", ordering="run_id")
    def run_id_link(self, lease: RunLease) -> str:
        url = reverse("admin:runs_run_change", args=[lease.run_id])
        return format_html('<a href="{}">{}</a>', url, lease.run_id)

    @admin.display(description="expires", ordering="expires_at")
    def expires(self, lease: RunLease) -> str:
        return compact_time(lease.expires_at)

    @admin.display(description="token digest")
    def token_prefix(self, lease: RunLease) -> str:
        return f"{lease.token_digest[:8]}…"

    @admin.display(description="spec digest")
    def spec_digest_prefix(self, lease: RunLease) -> str:
        return f"{lease.spec_digest[:8]}…"

    @admin.action(description="Revoke selected active leases", permissions=["revoke_lease"])
    def revoke_leases(self, request: HttpRequest, queryset: QuerySet[RunLease]) -> None:
        revoked = 0
        for lease_id in queryset.filter(state=LeaseState.ACTIVE).values_list("id", flat=True):
            if lease_revoke(lease_id, reason="operator_revoke") is Outcome.APPLIED:
                revoked += 1
        self.message_user(request, f"Revoked {revoked} lease(s).", messages.SUCCESS)


class CycleOutcomeFilter(admin.SimpleListFilter):
    """The cycle list opens on cycles that did something; idle ones on request.

    Idle cycles are summed into few rows already (`dispatch.cycles.CycleRecorder`);
    they still say nothing an operator looks for. A status picked in the status
    filter wins over the default.
    """

    title = "outcome"
    parameter_name = "outcome"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("idle", "Idle only"), ("all", "All, idle included")]

    def choices(self, changelist: Any) -> Any:
        yield {
            "selected": self.value() is None,
            "query_string": changelist.get_query_string(remove=[self.parameter_name]),
            "display": "Not idle (default)",
        }
        for lookup, title in self.lookup_choices:
            yield {
                "selected": self.value() == lookup,
                "query_string": changelist.get_query_string({self.parameter_name: lookup}),
                "display": title,
            }

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        idle = CycleStatus.IDLE.value
        if self.value() == "all" or "status__exact" in request.GET:
            return queryset
        if self.value() == "idle":
            return queryset.filter(status=idle)
        return queryset.exclude(status=idle)


@admin.register(DispatchCycle)
class DispatchCycleAdmin(ViewOnlyAdmin):
    # Fits a 1400-px window beside the filters; the counts are on the cycle's page.
    list_display = (
        "id",
        "started",
        "scope",
        "status",
        "reason",
        "cycles",
        "duration_ms",
        "claims_won",
        "offers",
    )
    list_filter = (CycleOutcomeFilter, "scope", "status", "truncated")
    fields = (
        "started_at",
        "observed_at",
        "duration_ms",
        "scope",
        "session_id",
        "status",
        "reason",
        "cycles",
        "truncated",
        "counts",
    )
    readonly_fields = fields

    @admin.display(description="started", ordering="started_at")
    def started(self, cycle: DispatchCycle) -> str:
        return compact_time(cycle.started_at)

    @admin.display(description="won")
    def claims_won(self, cycle: DispatchCycle) -> int:
        return int(cycle.counts.get("claims_won", 0))

    @admin.display(description="offers")
    def offers(self, cycle: DispatchCycle) -> int:
        return int(cycle.counts.get("offers", 0))

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        _warn_if_paused(self, request)
        return super().changelist_view(request, extra_context)


def _warn_if_paused(model_admin: admin.ModelAdmin[Any], request: HttpRequest) -> None:
    if dispatch_paused():
        control = DispatchControl.objects.filter(pk=1).first()
        reason = f" ({control.reason})" if control and control.reason else ""
        model_admin.message_user(
            request,
            f"Dispatch is PAUSED{reason}: every cycle records status 'paused' and claims nothing.",
            messages.WARNING,
        )


@admin.register(DispatchControl)
class DispatchControlAdmin(DigestLookupGuard):
    list_display = ("__str__", "paused", "reason", "updated_by", "updated_at")
    fields = ("paused", "reason", "updated_by", "updated_at")
    readonly_fields = ("updated_by", "updated_at")
    actions = ("pause_dispatch", "resume_dispatch")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_pause_dispatch_permission(self, request: HttpRequest) -> bool:
        return holds(request, "dispatch.pause_dispatch")

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # The form is the switch too: the same permission as the actions.
        return self.has_pause_dispatch_permission(request)

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        # The switch is a singleton: make sure its one row exists to act on,
        # but only for someone who may act (looking writes nothing; no row =
        # running).
        if (
            self.has_pause_dispatch_permission(request)
            and not DispatchControl.objects.filter(pk=1).exists()
        ):
            dispatch_set_paused(paused=False, reason="", actor=_actor(request))
        _warn_if_paused(self, request)
        return super().changelist_view(request, extra_context)

    def save_model(
        self, request: HttpRequest, obj: DispatchControl, form: Any, change: bool
    ) -> None:
        # The form is a toggle; the service is the one writer of the switch.
        dispatch_set_paused(paused=obj.paused, reason=obj.reason, actor=_actor(request))

    def log_change(self, request: HttpRequest, obj: DispatchControl, message: Any) -> Any:
        # Who (the entry's user) and why (the switch's reason) in the admin log.
        what = "Paused dispatch" if obj.paused else "Resumed dispatch"
        return super().log_change(request, obj, f"{what} (reason: {obj.reason or '-'})")

    @admin.action(description="Pause dispatch (kill switch)", permissions=["pause_dispatch"])
    def pause_dispatch(self, request: HttpRequest, queryset: QuerySet[DispatchControl]) -> None:
        # The action's reason (required, qinglong.admin) is the switch's reason.
        dispatch_set_paused(paused=True, reason=action_reason(request), actor=_actor(request))
        self.message_user(request, "Dispatch paused (1 switch).", messages.WARNING)

    @admin.action(description="Resume dispatch", permissions=["pause_dispatch"])
    def resume_dispatch(self, request: HttpRequest, queryset: QuerySet[DispatchControl]) -> None:
        dispatch_set_paused(paused=False, reason="", actor=_actor(request))
        self.message_user(request, "Dispatch resumed (1 switch).", messages.SUCCESS)
