"""Throttles of the Worker API, keyed by Worker (session open) and Session (pull).

Rates come from REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"] (environment
overridable in settings) and are read per request, so a settings override in a
test or a reload takes effect; counters live in the default cache.
"""

from __future__ import annotations

from rest_framework.request import Request
from rest_framework.settings import api_settings
from rest_framework.throttling import SimpleRateThrottle

from workers.api.authentication import WorkerPrincipal


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


class SessionOpenThrottle(_PrincipalThrottle):
    scope = "worker_session_open"

    def _ident(self, principal: WorkerPrincipal) -> str | None:
        return f"worker-{principal.worker.pk}"


class PullThrottle(_PrincipalThrottle):
    scope = "worker_pull"

    def _ident(self, principal: WorkerPrincipal) -> str | None:
        return None if principal.session is None else f"session-{principal.session.pk}"
