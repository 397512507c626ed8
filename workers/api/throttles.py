"""Throttles of the Worker API, keyed by Worker (session open) and Session (pull, heartbeat).

Rates come from REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"] (environment
overridable in settings) and are read per request, so a settings override in a
test or a reload takes effect; counters live in the default cache — Redis in
the cluster, so every web process counts against one limit (README
"Configuration", `QL_CACHE_URL`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

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


class _PrincipalThrottle(SimpleRateThrottle):
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

    def allow_request(self, request: Request, view: Any) -> bool:
        try:
            return bool(super().allow_request(request, view))
        except Exception as err:  # noqa: BLE001  (rate limits must not take the API down)
            # Fail open: a Redis outage costs rate limiting, never Worker calls
            # (a refused heartbeat would take the Session offline).
            _warn_cache_down(err)
            return True


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
