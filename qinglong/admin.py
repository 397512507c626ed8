"""Admin-wide hardening and helpers shared by every console admin (no side effects).

- DRF's TokenProxy admin lists every operator's API key in plaintext (DRF
  stores keys unhashed): it is unregistered once the admin modules are loaded
  (`qinglong.apps.QinglongAdminConfig.ready`), so no admin page ever shows
  one. Tokens are issued with `manage.py drf_create_token USER`.
- `DigestLookupGuard`: the changelist accepts `?field__lookup=` filters on any
  local field, so `?token_digest__startswith=ab` would let a staff user recover
  a full digest one prefix at a time. Any lookup that touches a digest field,
  directly or across a relation, is refused (Django answers 400).
- Permissions: every admin action declares the one permission it needs
  (`@admin.action(permissions=[name])` with `has_<name>_permission`), so
  Django neither offers nor runs it for a user without it; pages whose fields
  are all read-only grant no change permission at all. The table of who may
  do what is in the README ("Admin permissions").
- Who and why (`ReasonedActions`, a base of every console admin, and of the
  auth User and Group admins): an action runs only with a reason typed beside
  it, and writes one admin LogEntry per selected object naming the user, the
  action and the reason (the object's History page and the index's "Recent
  actions" show it). Deleting is no exception: "delete selected" needs the
  reason before its confirmation page (which carries it on), the delete page
  of one object asks for it, and each deletion's LogEntry (DELETION) says
  "Deleted (reason: …)".
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ActionForm
from django.contrib.admin.models import CHANGE, DELETION, LogEntry
from django.db.models import Model, QuerySet
from django.db.models.constants import LOOKUP_SEP
from django.http import HttpRequest, HttpResponse, HttpResponseBase, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.html import format_html

if TYPE_CHECKING:
    # django-stubs types the admin classes by the model they show, but Django's
    # classes cannot be subscripted at runtime; these bases serve any model.
    ModelAdminBase = admin.ModelAdmin[Any]
    TabularInlineBase = admin.TabularInline[Any, Any]
else:
    ModelAdminBase = admin.ModelAdmin
    TabularInlineBase = admin.TabularInline

# What authenticates a Worker or a lease, or fingerprints a spec: never a filter.
DIGEST_FIELDS: Final = frozenset({"token_digest", "credential_digest", "spec_digest"})


def touches_digest(lookup: str) -> bool:
    return any(part in DIGEST_FIELDS for part in lookup.split(LOOKUP_SEP))


REASON_MAX_LENGTH: Final = 200
# Django's own action: a reason first, then its confirmation page (which carries
# the reason on) and its deletion log (which records it: `log_deletions`).
_DELETE_ACTION: Final = "delete_selected"
_NO_REASON: Final = "Nothing done: an action needs a reason (type it in the Reason box)."

ActionFunc = Callable[[Any, HttpRequest, "QuerySet[Any]"], "HttpResponseBase | None"]


class ReasonActionForm(ActionForm):
    """The changelist's action bar with a reason box: why, for the admin log."""

    reason = forms.CharField(
        label="Reason:",
        required=False,
        max_length=REASON_MAX_LENGTH,
        widget=forms.TextInput(attrs={"placeholder": "why (logged)", "size": 24}),
    )


def action_reason(request: HttpRequest) -> str:
    """The reason posted with an action or a switch, trimmed ('' = none given)."""
    return str(request.POST.get("reason", "")).strip()[:REASON_MAX_LENGTH]


def log_admin_change(
    request: HttpRequest, objects: Iterable[Model], *, what: str, reason: str
) -> None:
    """One admin LogEntry (CHANGE) per object: who (the user), what, and why."""
    rows = list(objects)
    user_id = request.user.pk  # admin views serve staff users only: never None here
    if rows and user_id is not None:
        LogEntry.objects.log_actions(
            user_id=user_id,
            queryset=rows,
            action_flag=CHANGE,
            change_message=f"{what} (reason: {reason})",
        )


def _reasoned(func: ActionFunc, description: str) -> ActionFunc:
    @functools.wraps(func)  # keeps allowed_permissions and short_description
    def action(
        model_admin: Any, request: HttpRequest, queryset: QuerySet[Any]
    ) -> HttpResponseBase | None:
        reason = action_reason(request)
        if not reason:
            model_admin.message_user(request, _NO_REASON, messages.ERROR)
            return None
        # Read before acting: the rows the operator selected, as they were.
        selected = list(queryset)
        response = func(model_admin, request, queryset)
        log_admin_change(request, selected, what=f"Action: {description}", reason=reason)
        return response

    return action


def _reasoned_delete(func: ActionFunc) -> ActionFunc:
    """Django's "delete selected", once a reason is given; its confirmation page
    posts the reason back with the "yes" (`delete_selected_confirmation.html`)."""

    @functools.wraps(func)
    def action(
        model_admin: Any, request: HttpRequest, queryset: QuerySet[Any]
    ) -> HttpResponseBase | None:
        if not action_reason(request):
            model_admin.message_user(request, _NO_REASON, messages.ERROR)
            return None
        response = func(model_admin, request, queryset)
        if isinstance(response, TemplateResponse) and response.context_data is not None:
            response.context_data["reason"] = action_reason(request)  # the confirmation page
        return response

    return action


class ReasonedActions(ModelAdminBase):
    """Every action of this admin, deleting too, needs a reason and leaves an admin LogEntry."""

    action_form = ReasonActionForm
    delete_selected_confirmation_template = "admin/qinglong/delete_selected_confirmation.html"
    delete_confirmation_template = "admin/qinglong/delete_confirmation.html"

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        # Django has already dropped the actions this user may not run.
        actions: dict[str, Any] = super().get_actions(request)
        wrapped: dict[str, Any] = {}
        for name, (func, action_name, description) in actions.items():
            if name == _DELETE_ACTION:
                func = _reasoned_delete(func)
            else:
                func = _reasoned(func, str(description))
            wrapped[name] = (func, action_name, description)
        return wrapped

    def delete_view(
        self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        # The page asks for a reason; a confirmation without one deletes nothing.
        # (Who may not delete at all gets Django's answer: 403.)
        if (
            request.method == "POST"
            and self.has_delete_permission(request)
            and not action_reason(request)
        ):
            self.message_user(request, "Nothing deleted: deleting needs a reason.", messages.ERROR)
            return HttpResponseRedirect(request.get_full_path())
        response: HttpResponse = super().delete_view(request, object_id, extra_context)
        return response

    def log_deletions(self, request: HttpRequest, queryset: Any) -> Any:
        """One DELETION LogEntry per object: who, and the reason (checked before)."""
        user_id = request.user.pk
        if user_id is None:
            return []
        return LogEntry.objects.log_actions(
            user_id=user_id,
            queryset=list(queryset),
            action_flag=DELETION,
            change_message=f"Deleted (reason: {action_reason(request)})",
        )


class DigestLookupGuard(ReasonedActions):
    """A ModelAdmin whose changelist refuses every lookup on a digest field."""

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest | None = None) -> bool:
        if touches_digest(lookup):
            return False
        return bool(super().lookup_allowed(lookup, value, request))

    def get_search_fields(self, request: HttpRequest) -> Any:
        fields = tuple(super().get_search_fields(request))
        # `?q=` matching is a prefix oracle too: drop a digest search field even
        # if one is ever added by mistake.
        return tuple(field for field in fields if not touches_digest(field.lstrip("^=@")))


def compact_time(value: datetime | None) -> str:
    """A changelist timestamp in 14 characters (MM-DD HH:MM:SS); the full one on hover.

    Changelists must fit a 1400-px window beside the navigation and the filters:
    Django's default "Nov. 30, 2026, 10:03 p.m." takes twice the width.
    """
    if value is None:
        return "-"
    local = timezone.localtime(value)
    return format_html(
        '<time datetime="{}" title="{}">{}</time>',
        local.isoformat(),
        local.strftime("%Y-%m-%d %H:%M:%S %Z"),
        local.strftime("%m-%d %H:%M:%S"),
    )


def holds(request: HttpRequest, permission: str) -> bool:
    """The body of a `has_<name>_permission` method: the user holds `app.codename`."""
    return bool(request.user.has_perm(permission))


class ReadOnlyAdmin(DigestLookupGuard):
    """A view-only console page: state changes only through services (STYLE.md).

    Its actions (each with its own permission) are the only writes. No change
    form either: saving one would write back a whole row read a moment ago over
    whatever a service changed since.
    """

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
