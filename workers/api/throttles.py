"""Throttles of the Worker API, keyed by Worker (session open) and Session (pull, heartbeat).

Rates come from REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"] (environment
overridable in settings) and are read per request, so a settings override in a
test or a reload takes effect; counters live in the default cache — Redis in
the cluster, so every web process counts against one limit (README
"Configuration", `QL_CACHE_URL`).

`N/period` allows N requests per window: the first request of a key opens a
window of one period, and past N the answer is 429 with the window's
remaining seconds as `Retry-After`. A window is one counter: on Redis one
round trip per request (`SET NX EX`, `INCR`, `PTTL` sent together)
instead of DRF's read and rewrite of a list of every request's time in the
period — up to 600 timestamps unpickled and pickled again per pull at the
default rate (issue #12, bench/request_cost.py). Other caches (the per-process
memory of the embedded default) keep `(window end, count)` under the key.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from django.core.cache import DEFAULT_CACHE_ALIAS, caches
from django.core.cache.backends.base import BaseCache
from django.core.cache.backends.redis import RedisCache
from rest_framework.request import Request
from rest_framework.settings import api_settings
from rest_framework.throttling import SimpleRateThrottle

from workers.api.authentication import WorkerPrincipal

logger = logging.getLogger("qinglong.workers.throttle")

# One warning per process and interval while the cache is unreachable, not
# one per request.
_WARN_EVERY_S = 60.0
_last_warning = 0.0


def _warn_cache_down(err: Exception) -> None:
    global _last_warning
    now = time.monotonic()
    if now - _last_warning < _WARN_EVERY_S:
        return
    _last_warning = now
    # The type name only: a cache error may quote its URL (with a password).
    logger.warning(
        "throttle cache unavailable; requests are not rate limited",
        extra={"event": "throttle_cache_unavailable", "error": type(err).__name__},
    )


def _redis_window_hit(cache: RedisCache, key: str, duration: int) -> tuple[int, float]:
    """Counts a request in the key's window on Redis: (count so far, seconds left).

    `SET NX EX` (a new window's counter), `INCR`, `PTTL`, written to one
    pooled connection at once and their three replies read back: one round
    trip. No MULTI/EXEC and no redis-py pipeline object: INCR alone is atomic,
    and the one interleaving that matters (a window ending between SET and
    INCR leaves a counter without expiry) is caught by PTTL below. This costs
    the web process half the CPU of the transactional pipeline it replaces
    (issue #12, bench/README "The fixed cost of a Worker request"). The pool
    hands out a connection it has checked (one the server closed is reopened);
    any error drops the connection, whose unread replies must never answer
    another command, and reaches the caller (which lets the request through).
    """
    # Django's private client, which django-stubs does not declare. The key is
    # ours (ASCII, short): made without the memcached-compatibility checks.
    backend: Any = cache
    redis_key = backend.make_key(key)
    pool = backend._cache.get_client(redis_key, write=True).connection_pool
    conn = pool.get_connection()
    try:
        # A plain integer, as Django's Redis serializer stores ints: INCR-able,
        # and `cache.get` reads it back.
        conn.send_packed_command(
            conn.pack_commands(
                (
                    ("SET", redis_key, 0, "EX", duration, "NX"),
                    ("INCR", redis_key),
                    ("PTTL", redis_key),
                )
            )
        )
        conn.read_response()
        count = int(conn.read_response())
        left_ms = int(conn.read_response())
        if left_ms < 0:
            # A counter without expiry would refuse its key forever: whatever
            # made it (a window that ended between SET and INCR), it ends now +
            # duration.
            conn.send_command("EXPIRE", redis_key, duration)
            conn.read_response()
            left_ms = duration * 1000
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)
    return count, left_ms / 1000


# Wall-clock seconds (window ends are kept across processes' restarts).
_clock = time.time


def _cache_window_hit(cache: BaseCache, key: str, duration: int) -> tuple[int, float]:
    """As `_redis_window_hit` on any cache: read and write `(window end, count)`."""
    now = _clock()
    entry = cache.get(key)
    end, count = entry if isinstance(entry, tuple) and len(entry) == 2 else (0.0, 0)
    if end <= now:
        end, count = now + duration, 0
    count += 1
    cache.set(key, (end, count), max(1, math.ceil(end - now)))
    return count, end - now


class _PrincipalThrottle(SimpleRateThrottle):
    def allow_request(self, request: Request, view: Any) -> bool:
        try:
            return self._window_allows(request, view)
        except Exception as err:  # noqa: BLE001  (rate limits must not take the API down)
            # Fail open: a Redis outage costs rate limiting, never Worker calls
            # (a refused heartbeat would take the Session offline).
            _warn_cache_down(err)
            return True

    def _window_allows(self, request: Request, view: Any) -> bool:
        # DRF builds the throttle per request, reading the rate (`get_rate`).
        if self.rate is None:
            return True
        limit, duration = self.parse_rate(self.rate)
        key = self.get_cache_key(request, view)
        if key is None or limit is None or duration is None:
            return True
        # The backend itself: DRF's `cache` attribute is a proxy to it.
        cache = caches[DEFAULT_CACHE_ALIAS]
        if isinstance(cache, RedisCache):
            count, left = _redis_window_hit(cache, key, duration)
        else:
            count, left = _cache_window_hit(cache, key, duration)
        self._wait = left
        return count <= limit

    def wait(self) -> float | None:
        return max(1.0, getattr(self, "_wait", 1.0))

    def get_rate(self) -> str | None:
        rates = api_settings.DEFAULT_THROTTLE_RATES or {}
        rate = rates.get(self.scope or "")
        return str(rate) if rate else None

    def _ident(self, principal: WorkerPrincipal) -> str | None:
        raise NotImplementedError

    def get_cache_key(self, request: Request, view: object) -> str | None:
        principal = request.user
        if not isinstance(principal, WorkerPrincipal):
            return None
        ident = self._ident(principal)
        if ident is None:
            return None
        return self.cache_format % {"scope": self.scope, "ident": ident}


class SessionOpenThrottle(_PrincipalThrottle):
    scope = "worker_session_open"

    def _ident(self, principal: WorkerPrincipal) -> str | None:
        return f"worker-{principal.worker.pk}"


class _SessionThrottle(_PrincipalThrottle):
    def _ident(self, principal: WorkerPrincipal) -> str | None:
        return None if principal.session is None else f"session-{principal.session.pk}"


class PullThrottle(_SessionThrottle):
    scope = "worker_pull"


class HeartbeatThrottle(_SessionThrottle):
    """Bounds heartbeat requests; their writes are bounded by the service itself."""

    scope = "worker_heartbeat"


class ReconcileThrottle(_SessionThrottle):
    """A restarted agent reports its earlier Sessions' executions once (docs/adr/0005)."""

    scope = "worker_reconcile"
