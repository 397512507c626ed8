"""Content-free offer notification over Redis pub/sub (DESIGN §3 "Where offers go").

The cluster's global cycle tells a Session "you have offer X" on
`ql:offers:<session_id>`; a long-polling pull wakes up and the Worker fetches
the offer itself, authenticated, where session-scope recovery re-materializes
it. The message is the offer id alone: never a spec, a token or a digest.

Notification is best effort. The committed lease is the authority, and global
recovery re-delivers it after the backoff, so a failed publish is logged and
swallowed — it costs latency, never work, and never fails the cycle.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from django.conf import settings

if TYPE_CHECKING:
    from dispatch.core.offer import ClaimedExecutionOffer

__all__ = [
    "CHANNEL_PREFIX",
    "OfferSubscription",
    "RedisOfferNotifier",
    "notify_redis_url",
    "offer_channel",
    "offer_subscription",
]

logger = logging.getLogger("qinglong.dispatch.notify")

CHANNEL_PREFIX = "ql:offers:"
# A dispatch cycle must stay bounded even when Redis hangs.
_SOCKET_TIMEOUT_S = 0.5


def offer_channel(session_id: str) -> str:
    return f"{CHANNEL_PREFIX}{session_id}"


def notify_redis_url() -> str:
    """Where offer notifications go: QL_NOTIFY_REDIS_URL, else the Celery broker."""
    return str(settings.QINGLONG_NOTIFY_REDIS_URL or settings.CELERY_BROKER_URL)


class OfferSubscription:
    """One Session's offer channel, subscribed for the length of a long-poll pull."""

    def __init__(self, pubsub: Any) -> None:
        self._pubsub = pubsub

    def wait(self, timeout_s: float) -> bool:
        """True as soon as an offer for this Session is announced; False at the timeout."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                message = self._pubsub.get_message(
                    ignore_subscribe_messages=True, timeout=min(left, 1.0)
                )
            except Exception as err:  # noqa: BLE001  (a lost wake-up only costs latency)
                logger.warning(
                    "offer wait failed",
                    extra={"event": "offer_wait_failed", "error": type(err).__name__},
                )
                return False
            if message is not None and message.get("type") == "message":
                return True
        return False


@contextmanager
def offer_subscription(
    session_id: str, *, url: str | None = None
) -> Iterator[OfferSubscription | None]:
    """Subscribe to a Session's offer channel, or yield None if Redis is unreachable.

    The caller subscribes BEFORE its first dispatch cycle, so an offer announced
    between that cycle and the wait is never missed.
    """
    import redis

    client = redis.Redis.from_url(
        url or notify_redis_url(),
        socket_connect_timeout=_SOCKET_TIMEOUT_S,
        # Reads block in get_message(timeout=…), never on the socket itself.
        socket_timeout=None,
    )
    pubsub = client.pubsub()
    try:
        try:
            pubsub.subscribe(offer_channel(session_id))
        except Exception as err:  # noqa: BLE001  (no long-poll is still a correct pull)
            logger.warning(
                "offer subscribe failed",
                extra={"event": "offer_subscribe_failed", "error": type(err).__name__},
            )
            yield None
            return
        yield OfferSubscription(pubsub)
    finally:
        try:
            pubsub.close()
            client.close()
        except Exception as err:  # noqa: BLE001  (closing a connection that already died)
            logger.debug(
                "offer subscription close failed",
                extra={"event": "offer_unsubscribe_failed", "error": type(err).__name__},
            )


class RedisOfferNotifier:
    """An `OfferNotifier` publishing offer ids per Session; never raises."""

    def __init__(self, url: str | None = None, client: Any | None = None) -> None:
        self._url = url or notify_redis_url()
        self._client = client

    def _redis(self) -> Any:
        if self._client is None:
            import redis

            self._client = redis.Redis.from_url(
                self._url,
                socket_connect_timeout=_SOCKET_TIMEOUT_S,
                socket_timeout=_SOCKET_TIMEOUT_S,
            )
        return self._client

    def notify(self, offers: Sequence[ClaimedExecutionOffer]) -> None:
        if not offers:
            return
        try:
            pipe = self._redis().pipeline(transaction=False)
            for offer in offers:
                pipe.publish(offer_channel(offer.session_id), offer.offer_id)
            pipe.execute()
        except Exception as err:  # noqa: BLE001  (best effort, see above)
            # Best effort by design (see the module docstring); the type name is
            # enough to diagnose, and it cannot carry a secret.
            logger.warning(
                "offer notification failed",
                extra={
                    "event": "offer_notify_failed",
                    "offers": len(offers),
                    "error": type(err).__name__,
                },
            )
