"""Content-free offer notification over Redis pub/sub (docs/adr/0003).

The cluster's global cycle tells a Session "you have offer X" on
`ql:offers:<session_id>`; a long-polling pull wakes up and the Worker fetches
the offer itself, authenticated, where session-scope recovery re-materializes
it. The message is the offer id alone: never a spec, a token or a digest.

The same subscription carries `ql:pull-waiters:<session_id>`, which keeps one
waiting pull per Session: a waiter announces its number there, and an older
waiter that hears a higher number (or "fenced", after a replacement or a
credential rotation) answers at once. Its messages are numbers, nothing else.

Notification is best effort. The committed lease is the authority, and global
recovery re-delivers it after the backoff, so a failed publish is logged and
swallowed — it costs latency, never work, and never fails the cycle.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from django.conf import settings

if TYPE_CHECKING:
    from dispatch.core.offer import ClaimedExecutionOffer

__all__ = [
    "CHANNEL_PREFIX",
    "WAITERS_CHANNEL_PREFIX",
    "OfferSubscription",
    "RedisOfferNotifier",
    "Wake",
    "announce_sessions_fenced",
    "notify_redis_url",
    "offer_channel",
    "offer_subscription",
    "waiters_channel",
]

logger = logging.getLogger("qinglong.dispatch.notify")

CHANNEL_PREFIX = "ql:offers:"
# One waiting pull per Session (README "long poll"): each waiter takes the
# next number of its Session's counter and announces it here; a waiter that
# hears a higher number (or "fenced") stops waiting at once. Numbers only.
WAITERS_CHANNEL_PREFIX = "ql:pull-waiters:"
_WAITERS_KEY_PREFIX = "ql:pull-waiter-seq:"
_FENCED = b"fenced"
# Longer than any wait (views.MAX_PULL_WAIT_S), refreshed by every waiter: the
# counter only disappears once no waiter of the Session can be alive.
_WAITERS_KEY_TTL_S = 300
# A dispatch cycle must stay bounded even when Redis hangs.
_SOCKET_TIMEOUT_S = 0.5


def offer_channel(session_id: str) -> str:
    return f"{CHANNEL_PREFIX}{session_id}"


def waiters_channel(session_id: str) -> str:
    return f"{WAITERS_CHANNEL_PREFIX}{session_id}"


def notify_redis_url() -> str:
    """Where offer notifications go: QL_NOTIFY_REDIS_URL, else the Celery broker."""
    return str(settings.QINGLONG_NOTIFY_REDIS_URL or settings.CELERY_BROKER_URL)


_command_clients: dict[str, Any] = {}
_command_clients_lock = threading.Lock()


def _command_client(url: str) -> Any:
    """One thread-safe client (connection pool) per URL and process, with socket timeouts."""
    with _command_clients_lock:
        client = _command_clients.get(url)
        if client is None:
            import redis

            client = redis.Redis.from_url(
                url,
                socket_connect_timeout=_SOCKET_TIMEOUT_S,
                socket_timeout=_SOCKET_TIMEOUT_S,
            )
            _command_clients[url] = client
        return client


class Wake(enum.StrEnum):
    OFFER = "offer"  # an offer was announced for this Session: pull again
    TIMEOUT = "timeout"
    SUPERSEDED = "superseded"  # a newer pull of the Session waits now, or it was fenced
    FAILED = "failed"  # Redis failed; a lost wake-up only costs latency


class OfferSubscription:
    """One Session's offer and waiter channels, for the length of a long-poll pull."""

    def __init__(self, pubsub: Any, *, session_id: str, url: str) -> None:
        self._pubsub = pubsub
        self._session_id = session_id
        self._url = url
        self._number: int | None = None

    def take_over(self) -> bool:
        """Become the Session's one waiting pull; an earlier waiter (any process) stops.

        Every waiter subscribed to the waiters channel before taking its
        number, so each earlier waiter hears the later number. False if Redis
        failed (the caller then answers at once instead of waiting).
        """
        try:
            client = _command_client(self._url)
            pipe = client.pipeline(transaction=True)
            pipe.incr(f"{_WAITERS_KEY_PREFIX}{self._session_id}")
            pipe.expire(f"{_WAITERS_KEY_PREFIX}{self._session_id}", _WAITERS_KEY_TTL_S)
            number, _ = pipe.execute()
            client.publish(waiters_channel(self._session_id), str(number))
        except Exception as err:  # noqa: BLE001  (no wait is still a correct pull)
            logger.warning(
                "pull waiter registration failed",
                extra={"event": "pull_wait_register_failed", "error": type(err).__name__},
            )
            return False
        self._number = int(number)
        return True

    def _superseded_by(self, data: Any) -> bool:
        if data == _FENCED:
            return True
        try:
            other = int(data)
        except (TypeError, ValueError):
            return False
        return self._number is not None and other > self._number

    def wait(self, timeout_s: float) -> Wake:
        """Until an offer is announced, a newer waiter takes over, or the timeout."""
        offers = offer_channel(self._session_id).encode()
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
                return Wake.FAILED
            if message is None or message.get("type") != "message":
                continue
            if message.get("channel") == offers:
                return Wake.OFFER
            if self._superseded_by(message.get("data")):
                return Wake.SUPERSEDED
        return Wake.TIMEOUT


@contextmanager
def offer_subscription(
    session_id: str, *, url: str | None = None
) -> Iterator[OfferSubscription | None]:
    """Subscribe to a Session's offer and waiter channels, or yield None if Redis is unreachable.

    The caller subscribes BEFORE its first dispatch cycle, so an offer announced
    between that cycle and the wait is never missed.
    """
    import redis

    redis_url = url or notify_redis_url()
    client = redis.Redis.from_url(
        redis_url,
        socket_connect_timeout=_SOCKET_TIMEOUT_S,
        # Reads block in get_message(timeout=…), never on the socket itself.
        socket_timeout=None,
    )
    pubsub = client.pubsub()
    try:
        try:
            pubsub.subscribe(offer_channel(session_id), waiters_channel(session_id))
        except Exception as err:  # noqa: BLE001  (no long-poll is still a correct pull)
            logger.warning(
                "offer subscribe failed",
                extra={"event": "offer_subscribe_failed", "error": type(err).__name__},
            )
            yield None
            return
        yield OfferSubscription(pubsub, session_id=session_id, url=redis_url)
    finally:
        try:
            pubsub.close()
            client.close()
        except Exception as err:  # noqa: BLE001  (closing a connection that already died)
            logger.debug(
                "offer subscription close failed",
                extra={"event": "offer_unsubscribe_failed", "error": type(err).__name__},
            )


def announce_sessions_fenced(session_ids: Sequence[str], *, url: str | None = None) -> None:
    """Wake the waiting pulls of fenced Sessions (they answer at once); never raises."""
    if not session_ids:
        return
    try:
        pipe = _command_client(url or notify_redis_url()).pipeline(transaction=False)
        for session_id in session_ids:
            pipe.publish(waiters_channel(session_id), _FENCED)
        pipe.execute()
    except Exception as err:  # noqa: BLE001  (best effort: the waiter times out anyway)
        logger.warning(
            "fence announcement failed",
            extra={
                "event": "fence_announce_failed",
                "sessions": len(session_ids),
                "error": type(err).__name__,
            },
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
