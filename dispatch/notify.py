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
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from django.conf import settings

if TYPE_CHECKING:
    from dispatch.core.offer import ClaimedExecutionOffer

__all__ = ["CHANNEL_PREFIX", "RedisOfferNotifier", "offer_channel"]

logger = logging.getLogger("qinglong.dispatch.notify")

CHANNEL_PREFIX = "ql:offers:"
# A dispatch cycle must stay bounded even when Redis hangs.
_SOCKET_TIMEOUT_S = 0.5


def offer_channel(session_id: str) -> str:
    return f"{CHANNEL_PREFIX}{session_id}"


class RedisOfferNotifier:
    """An `OfferNotifier` publishing offer ids per Session; never raises."""

    def __init__(self, url: str | None = None, client: Any | None = None) -> None:
        self._url = url or str(
            getattr(settings, "QINGLONG_NOTIFY_REDIS_URL", "") or settings.CELERY_BROKER_URL
        )
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
