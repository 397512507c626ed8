"""Sending webhook deliveries: one bounded step, retries with backoff (README "Webhooks").

`webhooks_deliver_due` takes the due outbox rows (pending, `next_attempt_at`
passed) in a bounded batch. Each is claimed by a compare-and-set that counts
the try and pushes `next_attempt_at` past the send timeout, so two senders
(two beats, the embedded loop beside Celery) never send the same try twice,
and a sender that dies mid-send leaves the row due again later (delivery is at
least once; receivers de-duplicate by `X-Qinglong-Delivery`). The result is
recorded by a second compare-and-set on the claimed try.

- 2xx: `succeeded`.
- Anything else (another status, a timeout, a refused connection, a TLS
  error): `pending` again after an exponential backoff with jitter
  (`retry_delay_s`), until `QL_WEBHOOK_MAX_ATTEMPTS` tries; then `failed`.
- A destination refused by the SSRF rules (`webhook_url_problem`, and every
  resolved address must be global unless QL_WEBHOOK_ALLOW_PRIVATE): `failed`
  at once, no request made.

The request goes to the very address that was checked (no second DNS lookup
a rebinding answer could change), redirects are never followed, at most 4 KiB
of the answer is read and none of it is stored.

Called by the Celery beat task `notifications.tasks.deliver_webhooks_task`
(cluster) and by `manage.py run_dispatcher` (embedded default), and once,
right away, by the admin's "send test".
"""

from __future__ import annotations

import http.client
import ipaddress
import logging
import random
import socket
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Final

from django.conf import settings
from django.db import connection

from notifications.models import DeliveryState, WebhookDelivery
from notifications.services import webhook_url_problem
from notifications.signing import SIGNATURE_HEADER, signature_header, subscription_secret
from qinglong.clock import db_now
from qinglong.metrics import WEBHOOK_FAILURES

__all__ = [
    "DeliveryCounts",
    "DestinationRefused",
    "WebhookSender",
    "retry_delay_s",
    "webhook_deliver",
    "webhook_deliveries_prune",
    "webhooks_deliver_due",
    "webhooks_due",
]

logger = logging.getLogger("qinglong.notifications")

DELIVERY_BATCH: Final = 20
# A step stops claiming new deliveries after this long (a Celery task is
# killed at 30 s; one send may still take the timeout on top).
STEP_BUDGET_S: Final = 15.0
RETRY_BASE_S: Final = 30.0
RETRY_CAP_S: Final = 3600.0
# A claimed try is due again this long after the send timeout if its sender
# never recorded a result (it died).
_CLAIM_MARGIN_S: Final = 60
_MAX_ANSWER_BYTES: Final = 4096
PRUNE_BATCH: Final = 500
USER_AGENT: Final = "Qinglong-Webhooks/1"


class DestinationRefused(Exception):
    """The URL or a resolved address is not an allowed destination."""


@dataclass
class DeliveryCounts:
    examined: int = 0
    succeeded: int = 0
    retrying: int = 0
    failed: int = 0
    lost_race: int = 0  # another sender claimed it first
    truncated: bool = False  # the batch or time budget ran out; more may be due

    def as_dict(self) -> dict[str, int | bool]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def retry_delay_s(attempt: int, *, rng: random.Random | None = None) -> float:
    """Wait after failed try number `attempt` (1, 2, …): exponential, capped, jittered.

    30 s, 60 s, 120 s, … up to an hour, each drawn from its upper half so
    receivers that failed together do not get retried together.
    """
    ceiling = min(RETRY_CAP_S, RETRY_BASE_S * 2.0 ** max(0, attempt - 1))
    return ceiling / 2 + (rng or random.Random()).random() * ceiling / 2


def _checked_address(url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, address) of a destination that passed every rule."""
    problem = webhook_url_problem(url)
    if problem is not None:
        raise DestinationRefused(problem)
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise DestinationRefused("dns_error") from None
    addresses = [str(info[4][0]) for info in infos]
    if not addresses:
        raise DestinationRefused("dns_error")
    allow_private = bool(settings.QINGLONG_WEBHOOK_ALLOW_PRIVATE)
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if ip.is_unspecified or ip.is_multicast:
            raise DestinationRefused("destination_refused")
        # Every address must pass: a name with one public and one private
        # record must not reach the private one on a later try.
        if not ip.is_global and not allow_private:
            raise DestinationRefused("destination_refused")
        if parts.scheme == "http" and not ip.is_loopback:
            raise DestinationRefused("destination_refused")
    return parts.scheme, host, port, addresses[0]


def _connection(scheme: str, host: str, port: int, address: str) -> http.client.HTTPConnection:
    timeout = float(settings.QINGLONG_WEBHOOK_TIMEOUT_S)
    connection: http.client.HTTPConnection
    if scheme == "https":
        # Certificate and host name checked against `host` (SNI), as usual.
        connection = http.client.HTTPSConnection(
            host, port, timeout=timeout, context=ssl.create_default_context()
        )
    else:
        connection = http.client.HTTPConnection(host, port, timeout=timeout)

    def connect_checked(
        _address: tuple[str, int], timeout: float | None = None, source: Any = None
    ) -> socket.socket:
        # The checked address, not a second lookup of `host`.
        return socket.create_connection((address, port), timeout, source)

    connection._create_connection = connect_checked  # type: ignore[attr-defined]
    return connection


def _post(url: str, body: bytes, headers: dict[str, str]) -> int:
    scheme, host, port, address = _checked_address(url)
    parts = urllib.parse.urlsplit(url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    connection = _connection(scheme, host, port, address)
    try:
        connection.request("POST", target, body=body, headers=headers)
        answer = connection.getresponse()
        answer.read(_MAX_ANSWER_BYTES)
        return int(answer.status)
    finally:
        connection.close()


def _error_code(err: BaseException) -> str:
    if isinstance(err, TimeoutError | socket.timeout):
        return "timeout"
    if isinstance(err, ConnectionRefusedError):
        return "connection_refused"
    if isinstance(err, ssl.SSLError | ssl.CertificateError):
        return "tls_error"
    if isinstance(err, http.client.HTTPException):
        return "bad_response"
    return "connection_error"


def _send(delivery: WebhookDelivery) -> tuple[int | None, str]:
    """One try: (status code or None, error code or "")."""
    subscription = delivery.subscription
    if not subscription.active:
        return None, "subscription_inactive"
    body = delivery.body.encode("utf-8")
    secret = subscription_secret(subscription_id=subscription.pk, nonce=subscription.secret_nonce)
    headers = {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        "X-Qinglong-Event": delivery.event,
        "X-Qinglong-Delivery": str(delivery.delivery_id),
        SIGNATURE_HEADER: signature_header(secret=secret, body=body),
    }
    try:
        status = _post(subscription.url, body, headers)
    except DestinationRefused as err:
        return None, "destination_refused" if str(err) != "dns_error" else "dns_error"
    except (OSError, http.client.HTTPException) as err:
        return None, _error_code(err)
    return status, "" if 200 <= status < 300 else f"http_{status}"


def _claim(delivery_id: int, *, attempts: int, due: Any) -> WebhookDelivery | None:
    now = db_now()
    hold = timedelta(seconds=int(settings.QINGLONG_WEBHOOK_TIMEOUT_S) + _CLAIM_MARGIN_S)
    claimed = WebhookDelivery.objects.filter(
        pk=delivery_id, state=DeliveryState.PENDING, attempts=attempts, next_attempt_at=due
    ).update(attempts=attempts + 1, next_attempt_at=now + hold, last_attempt_at=now)
    if claimed != 1:
        return None
    return WebhookDelivery.objects.select_related("subscription").get(pk=delivery_id)


def _record(delivery: WebhookDelivery, status: int | None, error: str) -> DeliveryState:
    now = db_now()
    changes: dict[str, Any] = {"last_status_code": status, "last_error": error[:64]}
    if not error:
        state = DeliveryState.SUCCEEDED
        changes["delivered_at"] = now
    elif error in ("destination_refused", "subscription_inactive") or delivery.attempts >= int(
        settings.QINGLONG_WEBHOOK_MAX_ATTEMPTS
    ):
        state = DeliveryState.FAILED
    else:
        state = DeliveryState.PENDING
        changes["next_attempt_at"] = now + timedelta(seconds=retry_delay_s(delivery.attempts))
    if error:
        WEBHOOK_FAILURES.labels(event=delivery.event).inc()
    # Only the claimed try may record (compare-and-set on its attempt count).
    WebhookDelivery.objects.filter(
        pk=delivery.pk, state=DeliveryState.PENDING, attempts=delivery.attempts
    ).update(state=state, **changes)
    logger.info(
        "webhook delivery",
        extra={
            "event": "webhook_delivery",
            "delivery_id": str(delivery.delivery_id),
            "webhook_event": delivery.event,
            "attempt": delivery.attempts,
            "state": str(state),
            "status_code": status,
            "error": error,
        },
    )
    return state


def _deliver_claimed(delivery: WebhookDelivery, counts: DeliveryCounts) -> None:
    status, error = _send(delivery)
    state = _record(delivery, status, error)
    if state == DeliveryState.SUCCEEDED:
        counts.succeeded += 1
    elif state == DeliveryState.FAILED:
        counts.failed += 1
    else:
        counts.retrying += 1


def webhooks_deliver_due(
    *, limit: int = DELIVERY_BATCH, budget_s: float = STEP_BUDGET_S
) -> DeliveryCounts:
    """Send up to `limit` due deliveries (one try each); bounded in time too."""
    counts = DeliveryCounts()
    started = time.monotonic()
    due = list(
        WebhookDelivery.objects.filter(state=DeliveryState.PENDING, next_attempt_at__lte=db_now())
        .order_by("next_attempt_at", "id")
        .values_list("id", "attempts", "next_attempt_at")[: limit + 1]
    )
    counts.truncated = len(due) > limit
    for delivery_id, attempts, next_attempt_at in due[:limit]:
        if time.monotonic() - started > budget_s:
            counts.truncated = True
            break
        counts.examined += 1
        delivery = _claim(delivery_id, attempts=attempts, due=next_attempt_at)
        if delivery is None:
            counts.lost_race += 1
            continue
        _deliver_claimed(delivery, counts)
    return counts


def webhook_deliver(delivery: WebhookDelivery) -> WebhookDelivery:
    """Try one pending delivery now (the admin's "send test"); returns it re-read."""
    fresh = WebhookDelivery.objects.get(pk=delivery.pk)
    if fresh.state == DeliveryState.PENDING:
        claimed = _claim(fresh.pk, attempts=fresh.attempts, due=fresh.next_attempt_at)
        if claimed is not None:
            _deliver_claimed(claimed, DeliveryCounts())
    return WebhookDelivery.objects.get(pk=delivery.pk)


def webhook_deliveries_prune(*, days: int | None = None) -> int:
    """Delete finished deliveries older than QL_WEBHOOK_RETENTION_DAYS (bounded batch)."""
    keep = int(settings.QINGLONG_WEBHOOK_RETENTION_DAYS if days is None else days)
    cutoff = db_now() - timedelta(days=keep)
    ids = list(
        WebhookDelivery.objects.filter(created_at__lt=cutoff)
        .exclude(state=DeliveryState.PENDING)
        .order_by("id")
        .values_list("id", flat=True)[:PRUNE_BATCH]
    )
    if not ids:
        return 0
    deleted, _ = WebhookDelivery.objects.filter(pk__in=ids).delete()
    return int(deleted)


def webhooks_due() -> bool:
    """Whether a delivery is due now (one read of the partial index)."""
    return WebhookDelivery.objects.filter(
        state=DeliveryState.PENDING, next_attempt_at__lte=db_now()
    ).exists()


class WebhookSender:
    """The embedded default's sender (`manage.py run_dispatcher`): one thread at a time.

    `kick()` is cheap and called once per loop iteration: when deliveries are
    due and no sender thread is alive, it starts one that sends until nothing
    is due (bounded steps) and exits. A slow or dead receiver therefore never
    holds up a dispatch cycle, and no thread exists while nothing is due.
    Finished deliveries are pruned at most every `PRUNE_EVERY_S`.
    """

    PRUNE_EVERY_S: Final = 300.0

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._last_prune = time.monotonic()

    def kick(self) -> bool:
        """Start a sender thread if one is needed; True if one was started."""
        if self._thread is not None and self._thread.is_alive():
            return False
        prune = time.monotonic() - self._last_prune >= self.PRUNE_EVERY_S
        if not prune and not webhooks_due():
            return False
        if prune:
            self._last_prune = time.monotonic()
        self._thread = threading.Thread(
            target=self._drain, kwargs={"prune": prune}, name="webhooks", daemon=True
        )
        self._thread.start()
        return True

    def _drain(self, *, prune: bool) -> None:
        try:
            if prune:
                webhook_deliveries_prune()
            while not self._stop.is_set() and webhooks_deliver_due().examined:
                pass
        except Exception:
            logger.exception("webhook delivery failed", extra={"event": "webhook_sender_failed"})
        finally:
            # This thread's own database connection.
            connection.close()

    def stop(self, *, timeout_s: float | None = None) -> None:
        """Stop after the send in progress (at most one request timeout)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(
                float(settings.QINGLONG_WEBHOOK_TIMEOUT_S) + 1 if timeout_s is None else timeout_s
            )
