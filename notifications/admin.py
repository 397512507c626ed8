"""Webhooks in the operator's console (README "Webhooks", "Admin permissions").

- Subscriptions: add, edit and delete with the model's own permissions. The
  signing secret is shown once, in the message after the subscription is
  created or its secret rotated (action "rotate secret",
  `notifications.change_webhooksubscription`), and never again: it is not
  stored (`notifications.signing`). A user who may only view sees the
  destination's scheme and host, not the full URL (a URL path can be a
  credential, e.g. a chat service's incoming-webhook URL).
- "Send test" (`notifications.send_test_webhook`) records a `webhook.test`
  delivery and tries it once right away; the message says how it went.
- Deliveries: the delivery log, read-only — event, state, tries, last
  response code and error, next retry, the payload (ids, states, admin URLs).
"""

from __future__ import annotations

import urllib.parse
from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from notifications.delivery import webhook_deliver
from notifications.models import (
    SUBSCRIBABLE_EVENTS,
    DeliveryState,
    WebhookDelivery,
    WebhookSubscription,
)
from notifications.services import (
    events_problem,
    subscription_rotate_secret,
    webhook_test_emit,
    webhook_url_problem,
)
from notifications.signing import new_secret_nonce, subscription_secret
from qinglong.admin import DigestLookupGuard, ReadOnlyAdmin, compact_time, holds
from qinglong.clock import db_now


def _destination(url: str) -> str:
    """scheme://host[:port] only: what a viewer may see of a webhook URL."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"


if TYPE_CHECKING:  # django-stubs types forms by model; Django's class is not subscriptable
    _SubscriptionFormBase = forms.ModelForm[WebhookSubscription]
else:
    _SubscriptionFormBase = forms.ModelForm


class WebhookSubscriptionForm(_SubscriptionFormBase):
    url = forms.URLField(
        max_length=2000,
        assume_scheme="https",
        help_text="https:// only; private, loopback and link-local addresses are refused "
        "unless QL_WEBHOOK_ALLOW_PRIVATE is on (then http:// to loopback too).",
    )
    events = forms.MultipleChoiceField(
        choices=[(str(e), str(e)) for e in SUBSCRIBABLE_EVENTS],
        widget=forms.CheckboxSelectMultiple,
        help_text="Sent only when the state changes. worker.offline concerns every Project.",
    )

    class Meta:
        model = WebhookSubscription
        fields = ("project", "name", "url", "events", "active")

    def clean_url(self) -> str:
        url = str(self.cleaned_data["url"])
        problem = webhook_url_problem(url)
        if problem is not None:
            raise forms.ValidationError(problem)
        return url

    def clean_events(self) -> list[str]:
        events = list(self.cleaned_data["events"])
        problem = events_problem(events)
        if problem is not None:
            raise forms.ValidationError(problem)
        return events


def _show_secret(request: HttpRequest, subscription: WebhookSubscription, secret: str) -> None:
    # Shown once, to this operator, in this response (session message storage).
    messages.warning(
        request,
        f"Signing secret of webhook {subscription.name!r} (shown once, store it now): {secret}",
    )


@admin.register(WebhookSubscription)
class WebhookSubscriptionAdmin(DigestLookupGuard):
    form = WebhookSubscriptionForm
    list_display = ("name", "project", "destination", "events", "active", "created_at")
    list_filter = ("active", "project")
    list_select_related = ("project",)
    search_fields = ("name", "project__slug")
    readonly_fields = ("destination", "secret_rotated_at", "created_at")
    actions = ("send_test", "rotate_secret")

    @admin.display(description="destination")
    def destination(self, obj: WebhookSubscription) -> str:
        return _destination(obj.url)

    def get_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        if obj is not None and not self.has_change_permission(request, obj):
            return ("project", "name", "destination", "events", "active", "secret_rotated_at")
        return ("project", "name", "url", "events", "active", "secret_rotated_at")

    def save_model(
        self, request: HttpRequest, obj: WebhookSubscription, form: Any, change: bool
    ) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        obj.secret_nonce = new_secret_nonce()
        obj.secret_rotated_at = db_now()
        super().save_model(request, obj, form, change)
        _show_secret(
            request, obj, subscription_secret(subscription_id=obj.pk, nonce=obj.secret_nonce)
        )

    def get_deleted_objects(self, objs: Any, request: HttpRequest) -> Any:
        # A subscription's delivery log goes with it: deleting the subscription
        # needs its own delete permission only, not one on the (read-only) log.
        deleted, counts, perms_needed, protected = super().get_deleted_objects(objs, request)
        log_name = str(WebhookDelivery._meta.verbose_name)
        return deleted, counts, {p for p in perms_needed if p != log_name}, protected

    def has_send_test_permission(self, request: HttpRequest) -> bool:
        return holds(request, "notifications.send_test_webhook")

    def has_rotate_secret_permission(self, request: HttpRequest) -> bool:
        return holds(request, "notifications.change_webhooksubscription")

    @admin.action(description="Send a test delivery", permissions=["send_test"])
    def send_test(self, request: HttpRequest, queryset: QuerySet[WebhookSubscription]) -> None:
        actor = f"admin:{getattr(request.user, 'username', '')}"
        for subscription in queryset:
            delivery = webhook_deliver(webhook_test_emit(subscription=subscription, actor=actor))
            outcome = (
                f"answered {delivery.last_status_code}"
                if delivery.last_status_code is not None
                else f"failed ({delivery.last_error})"
            )
            level = (
                messages.SUCCESS if delivery.state == DeliveryState.SUCCEEDED else messages.ERROR
            )
            self.message_user(
                request,
                f"Test delivery {delivery.delivery_id} to {subscription.name}: {outcome}"
                + ("" if delivery.state != DeliveryState.PENDING else "; it will be retried"),
                level,
            )

    @admin.action(
        description="Rotate the signing secret (shown once)", permissions=["rotate_secret"]
    )
    def rotate_secret(self, request: HttpRequest, queryset: QuerySet[WebhookSubscription]) -> None:
        for subscription in queryset:
            _show_secret(
                request, subscription, subscription_rotate_secret(subscription=subscription)
            )


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(ReadOnlyAdmin):
    """The delivery log: what was sent where, how often, with what answer."""

    # Fits a 1400-px window beside the filters (issue 14): "answer" is the last
    # status code, else the last error; the next try and the body are on the
    # delivery's page.
    list_display = ("id", "event", "subscription", "state", "attempts", "answer", "created")
    list_filter = ("state", "event")
    list_select_related = ("subscription",)
    search_fields = ("=delivery_id", "subscription__name")
    fields = (
        "delivery_id",
        "subscription",
        "event",
        "subject_key",
        "state",
        "attempts",
        "last_attempt_at",
        "last_status_code",
        "last_error",
        "next_attempt_at",
        "delivered_at",
        "created_at",
        "body",
    )
    readonly_fields = fields
    show_full_result_count = False

    @admin.display(description="answer")
    def answer(self, delivery: WebhookDelivery) -> str:
        if delivery.last_status_code is not None:
            return str(delivery.last_status_code)
        return delivery.last_error or "-"

    @admin.display(description="created", ordering="created_at")
    def created(self, delivery: WebhookDelivery) -> str:
        return compact_time(delivery.created_at)
