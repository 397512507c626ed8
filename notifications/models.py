"""Webhook subscriptions and their deliveries (README "Webhooks", docs/adr/0006).

A subscription belongs to a Project and names the events it wants. Its signing
secret is never stored: it is derived from the server's webhook key and the
row's random `secret_nonce` (`notifications.signing`), shown once when the
subscription is created or its secret rotated, and re-derived to sign.

A delivery is an outbox row: written in the same transaction as the state
change it reports (`notifications.services.event_emit`), then sent by the
delivery step (`notifications.delivery`) with retries and exponential backoff.
It is also the delivery log the admin shows: state, attempts, last response
code, next retry — never the secret.
"""

from __future__ import annotations

import uuid

from django.db import models
from django.db.models import Q


class WebhookEvent(models.TextChoices):
    # Labelled with their wire names: what the admin shows is what receivers get.
    RUN_FAILED = "run.failed", "run.failed"  # a Run ended failed (out of attempts)
    RUN_SUCCEEDED = "run.succeeded", "run.succeeded"  # a Run ended succeeded
    # a Run ended failed because its last Attempt timed out
    RUN_TIMED_OUT = "run.timed_out", "run.timed_out"
    SCHEDULE_MISSED = "schedule.missed", "schedule.missed"  # a schedule's slot passed without a Run
    WORKER_OFFLINE = "worker.offline", "worker.offline"  # a Worker's Session stopped heartbeating
    # Not subscribable: the admin's "send test" action sends it to one subscription.
    TEST = "webhook.test", "webhook.test"


SUBSCRIBABLE_EVENTS = tuple(e for e in WebhookEvent if e is not WebhookEvent.TEST)


class WebhookSubscription(models.Model):
    """Where a Project's events are POSTed, signed with a per-subscription secret."""

    project = models.ForeignKey(
        "runs.Project", on_delete=models.CASCADE, related_name="webhook_subscriptions"
    )
    name = models.CharField(max_length=100)
    url = models.URLField(max_length=2000)
    # A list of WebhookEvent values (validated by notifications.services).
    events = models.JSONField(default=list)
    active = models.BooleanField(default=True)
    # Random; the secret is HMAC(QL_WEBHOOK_SECRET, id + nonce) (notifications.signing).
    secret_nonce = models.CharField(max_length=64, editable=False)
    secret_rotated_at = models.DateTimeField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["project_id", "name"]
        indexes = [
            models.Index(fields=["project"], name="webhooksub_active", condition=Q(active=True))
        ]
        permissions = [("send_test_webhook", "Can send a test delivery to a webhook")]

    def __str__(self) -> str:
        return self.name


class DeliveryState(models.TextChoices):
    PENDING = "pending"  # due at next_attempt_at (also while one try is in flight)
    SUCCEEDED = "succeeded"  # the receiver answered 2xx
    FAILED = "failed"  # out of attempts, or the destination was refused


class WebhookDelivery(models.Model):
    """One event for one subscription: the outbox row and its delivery log."""

    delivery_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    subscription = models.ForeignKey(
        WebhookSubscription, on_delete=models.CASCADE, related_name="deliveries"
    )
    event = models.CharField(max_length=32, choices=WebhookEvent.choices)
    # "one delivery per state change": the change's identity (e.g. "run:7:failed").
    subject_key = models.CharField(max_length=200)
    # The exact JSON body sent (and signed) on every try.
    body = models.TextField()
    state = models.CharField(
        max_length=16, choices=DeliveryState.choices, default=DeliveryState.PENDING
    )
    attempts = models.PositiveSmallIntegerField(default=0)
    next_attempt_at = models.DateTimeField()
    last_attempt_at = models.DateTimeField(null=True, blank=True)
    last_status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    # A short code ("timeout", "connection_refused", "destination_refused", "http_500").
    last_error = models.CharField(max_length=64, blank=True, default="")
    delivered_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-id"]
        verbose_name_plural = "webhook deliveries"
        constraints = [
            models.UniqueConstraint(
                fields=["subscription", "subject_key"], name="webhookdelivery_once_per_change"
            ),
            models.CheckConstraint(
                condition=Q(state__in=DeliveryState.values), name="webhookdelivery_state_valid"
            ),
        ]
        indexes = [
            # The delivery step's read: pending rows by due time.
            models.Index(
                fields=["next_attempt_at", "id"],
                name="webhookdelivery_due",
                condition=Q(state="pending"),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.event} #{self.pk}"
