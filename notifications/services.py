"""Webhook events and subscriptions (README "Webhooks", docs/adr/0006).

`event_emit` is the one way to report an event: inside the caller's
transaction it writes one `WebhookDelivery` (the outbox row) per active
subscription that wants the event, so the delivery commits or rolls back with
the state change it reports; the delivery step sends it later
(`notifications.delivery`). A `subject_key` names the state change, and a
subscription gets at most one delivery per key (a unique index), so a change
reported twice is still delivered once.

Payloads carry ids, states and admin URLs, never a command, env, cwd or token:
the helpers below build them field by field from allow lists.

Callers:
- `run_event_emit`: `leases.transitions.run_transition`, when a Run ends
  `succeeded` or `failed` (`run.timed_out` when its last Attempt timed out).
- `worker_offline_emit`: `workers.services` when a silent Session is marked offline.
- `schedule.missed`: the schedules app calls `event_emit` directly.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import urllib.parse
import uuid
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any, Final

from django.conf import settings
from django.db import transaction
from django.urls import reverse

from notifications.models import (
    SUBSCRIBABLE_EVENTS,
    DeliveryState,
    WebhookDelivery,
    WebhookEvent,
    WebhookSubscription,
)
from notifications.signing import new_secret_nonce, subscription_secret
from qinglong.clock import db_now
from runs.models import Attempt, Project, Run, RunState
from workers.models import WorkerSession

__all__ = [
    "TIMED_OUT_ERROR_CODES",
    "WebhookInputError",
    "admin_url",
    "event_emit",
    "run_event_emit",
    "subscription_create",
    "subscription_rotate_secret",
    "webhook_test_emit",
    "webhook_url_problem",
    "worker_offline_emit",
]

logger = logging.getLogger("qinglong.notifications")

# An Attempt that ended with one of these codes timed out: the control plane's
# timeout (issue 13, `timed_out`) or the reference agent's own (`timeout`).
TIMED_OUT_ERROR_CODES: Final = frozenset({"timed_out", "timeout"})
JsonObject = Mapping[str, Any]


class WebhookInputError(ValueError):
    """A subscription field is invalid; the message names the rule, never a secret."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _time(value: datetime) -> str:
    return value.isoformat().replace("+00:00", "Z")


def admin_url(viewname: str, *args: object) -> str:
    """An admin link for a payload: absolute under QL_PUBLIC_URL, else a path."""
    return str(settings.QINGLONG_PUBLIC_URL) + reverse(viewname, args=args)


# ---------------------------------------------------------------- subscriptions


def _ip_refused(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_unspecified or ip.is_multicast:
        return True
    return not ip.is_global and not settings.QINGLONG_WEBHOOK_ALLOW_PRIVATE


def webhook_url_problem(url: str) -> str | None:
    """Why this URL can never be a webhook destination, or None.

    https:// only; plain http:// only to a loopback host and only with
    QL_WEBHOOK_ALLOW_PRIVATE (development, tests). No credentials in the URL
    (the admin shows it). A literal address that is not global (private,
    loopback, link-local, …) is refused unless QL_WEBHOOK_ALLOW_PRIVATE; a
    host name is resolved and checked again before every send
    (`notifications.delivery`), so DNS cannot point it inward later.
    """
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        return "not a valid URL"
    host = parts.hostname or ""
    if parts.scheme not in ("https", "http") or not host:
        return "must be an https:// URL"
    if parts.username is not None or parts.password is not None:
        return "must not carry credentials"
    if parts.fragment:
        return "must not have a fragment"
    if port == 0:
        return "port 0 is not a destination"
    try:
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    loopback = host.lower() == "localhost" or (ip is not None and ip.is_loopback)
    if parts.scheme == "http" and not (loopback and settings.QINGLONG_WEBHOOK_ALLOW_PRIVATE):
        return "must be an https:// URL (http:// only to loopback with QL_WEBHOOK_ALLOW_PRIVATE)"
    if loopback and not settings.QINGLONG_WEBHOOK_ALLOW_PRIVATE:
        return "private and loopback destinations need QL_WEBHOOK_ALLOW_PRIVATE"
    if ip is not None and _ip_refused(ip):
        return "private and loopback destinations need QL_WEBHOOK_ALLOW_PRIVATE"
    return None


def events_problem(events: object) -> str | None:
    if not isinstance(events, list) or not events:
        return "choose at least one event"
    if any(e not in SUBSCRIBABLE_EVENTS for e in events) or len(set(events)) != len(events):
        return "unknown or repeated event"
    return None


def subscription_validate(*, url: str, events: object) -> None:
    problem = webhook_url_problem(url)
    if problem is not None:
        raise WebhookInputError("url", problem)
    problem = events_problem(events)
    if problem is not None:
        raise WebhookInputError("events", problem)


def subscription_create(
    *, project: Project, name: str, url: str, events: Iterable[str], active: bool = True
) -> tuple[WebhookSubscription, str]:
    """A new subscription and its signing secret (shown once; never stored)."""
    wanted = [str(e) for e in events]
    subscription_validate(url=url, events=wanted)
    with transaction.atomic(durable=True):
        subscription = WebhookSubscription.objects.create(
            project=project,
            name=name,
            url=url,
            events=wanted,
            active=active,
            secret_nonce=new_secret_nonce(),
            secret_rotated_at=db_now(),
        )
    return subscription, subscription_secret(
        subscription_id=subscription.pk, nonce=subscription.secret_nonce
    )


def subscription_rotate_secret(*, subscription: WebhookSubscription) -> str:
    """A new signing secret (shown once): the old one stops signing at once."""
    nonce = new_secret_nonce()
    WebhookSubscription.objects.filter(pk=subscription.pk).update(
        secret_nonce=nonce, secret_rotated_at=db_now()
    )
    subscription.secret_nonce = nonce
    return subscription_secret(subscription_id=subscription.pk, nonce=nonce)


# ----------------------------------------------------------------------- events


def _subscriptions(
    *, project_id: int | None, events: Iterable[WebhookEvent]
) -> list[WebhookSubscription]:
    qs = WebhookSubscription.objects.filter(active=True).select_related("project")
    if project_id is not None:
        qs = qs.filter(project_id=project_id)
    wanted = {str(e) for e in events}
    # Few rows (operators make them by hand); the event list is matched here
    # because SQLite has no JSON containment lookup.
    return [
        s
        for s in qs.only("id", "name", "events", "project__id", "project__slug")
        if wanted & set(s.events)
    ]


def _record(
    subscriptions: Iterable[WebhookSubscription],
    *,
    event: WebhookEvent,
    subject_key: str,
    data: JsonObject,
) -> int:
    now = db_now()
    rows = []
    for subscription in subscriptions:
        delivery_id = uuid.uuid4()
        body = {
            "id": str(delivery_id),
            "event": str(event),
            "created_at": _time(now),
            "project": {
                "id": str(subscription.project.pk),
                "slug": subscription.project.slug,
            },
            "subscription": {"id": str(subscription.pk), "name": subscription.name},
            **data,
        }
        rows.append(
            WebhookDelivery(
                delivery_id=delivery_id,
                subscription=subscription,
                event=event,
                subject_key=subject_key[:200],
                body=json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False),
                state=DeliveryState.PENDING,
                next_attempt_at=now,
            )
        )
    if not rows:
        return 0
    # A second report of the same change finds the unique index and adds nothing.
    WebhookDelivery.objects.bulk_create(rows, ignore_conflicts=True)
    logger.info(
        "webhook event",
        extra={"event": "webhook_event", "webhook_event": str(event), "deliveries": len(rows)},
    )
    return len(rows)


def event_emit(
    *,
    event: WebhookEvent,
    project_id: int | None,
    subject_key: str,
    data: JsonObject,
) -> int:
    """Record one delivery of `event` per active subscription that wants it.

    Call it inside the transaction of the state change (the rows commit or roll
    back with it). `project_id` None: every Project's subscriptions (events
    that belong to no Project, like `worker.offline`). `subject_key` names the
    state change ("schedule:3:2026-11-30T10:00:00Z"): a subscription gets one
    delivery per key. `data` is merged into the payload: ids, states, admin
    URLs only — never a command, env, cwd or token. Returns how many
    deliveries were recorded.
    """
    subscriptions = _subscriptions(project_id=project_id, events=[event])
    return _record(subscriptions, event=event, subject_key=subject_key, data=data)


def run_event_emit(*, run: Run) -> int:
    """Report a Run that just ended `succeeded` or `failed` (other states: nothing)."""
    if run.state == RunState.SUCCEEDED:
        candidates = [WebhookEvent.RUN_SUCCEEDED]
    elif run.state == RunState.FAILED:
        candidates = [WebhookEvent.RUN_FAILED, WebhookEvent.RUN_TIMED_OUT]
    else:
        return 0
    subscriptions = _subscriptions(project_id=run.project_id, events=candidates)
    if not subscriptions:
        return 0  # the common case: one indexed read, nothing else
    attempt = (
        Attempt.objects.filter(run_id=run.pk)
        .order_by("-number")
        .values("id", "number", "state", "exit_code", "error_code")
        .first()
    )
    event = candidates[0]
    failed = run.state == RunState.FAILED
    if failed and attempt is not None and attempt["error_code"] in TIMED_OUT_ERROR_CODES:
        event = WebhookEvent.RUN_TIMED_OUT
    task_name, revision = Run.objects.filter(pk=run.pk).values_list(
        "task__name", "task_revision__revision"
    ).first() or (None, None)
    data = {
        "run": {
            "id": str(run.pk),
            "state": str(run.state),
            "task": task_name,
            "task_revision": revision,
            "finished_at": None if run.finished_at is None else _time(run.finished_at),
            "admin_url": admin_url("admin:runs_run_change", run.pk),
            "attempt": None
            if attempt is None
            else {
                "id": str(attempt["id"]),
                "number": attempt["number"],
                "state": attempt["state"],
                "exit_code": attempt["exit_code"],
                "error_code": attempt["error_code"],
                "admin_url": admin_url("admin:runs_attempt_change", attempt["id"]),
            },
        }
    }
    wanted = [s for s in subscriptions if str(event) in s.events]
    return _record(wanted, event=event, subject_key=f"run:{run.pk}:{run.state}", data=data)


def worker_offline_emit(*, session_pk: int) -> int:
    """Report a Worker whose current Session just went offline (every Project's subscribers)."""
    session = (
        WorkerSession.objects.select_related("worker")
        .only("session_id", "generation", "worker__id", "worker__name")
        .filter(pk=session_pk)
        .first()
    )
    if session is None:
        return 0
    worker = session.worker
    return event_emit(
        event=WebhookEvent.WORKER_OFFLINE,
        project_id=None,
        subject_key=f"session:{session.session_id}:offline",
        data={
            "worker": {
                "id": str(worker.pk),
                "name": worker.name,
                "admin_url": admin_url("admin:workers_worker_change", worker.pk),
            },
            "session": {
                "id": str(session.session_id),
                "generation": session.generation,
                "state": "offline",
            },
        },
    )


def webhook_test_emit(*, subscription: WebhookSubscription, actor: str) -> WebhookDelivery:
    """A `webhook.test` delivery to one subscription (the admin's "send test")."""
    subscription = WebhookSubscription.objects.select_related("project").get(pk=subscription.pk)
    key = f"test:{uuid.uuid4()}"
    with transaction.atomic(durable=True):
        _record(
            [subscription],
            event=WebhookEvent.TEST,
            subject_key=key,
            data={"test": {"requested_by": actor[:80]}},
        )
    return WebhookDelivery.objects.get(subscription=subscription, subject_key=key)
