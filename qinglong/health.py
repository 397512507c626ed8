"""`GET /healthz`: is this node able to serve (database) and to trigger cycles (broker)?

The database is the authority for every lease, so it alone decides the status
code. The broker is informational: the embedded default dispatches with
`run_dispatcher` and no broker at all (docs/adr/0003), so a missing Redis must not
take a healthy control plane out of a load balancer.
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

from django.conf import settings
from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

logger = logging.getLogger("qinglong.health")

# A probe must answer quickly even when a dependency hangs.
_BROKER_TIMEOUT_S = 0.5


def database_status() -> str:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Exception as err:  # noqa: BLE001  (any failure means "cannot serve")
        logger.warning("health: database unreachable", extra={"error": type(err).__name__})
        return "error"
    return "ok"


def broker_status() -> str:
    url = str(getattr(settings, "CELERY_BROKER_URL", "") or "")
    if not url:
        return "not_configured"
    try:
        if urlsplit(url).scheme in ("redis", "rediss", "unix"):
            import redis

            client = redis.Redis.from_url(
                url,
                socket_connect_timeout=_BROKER_TIMEOUT_S,
                socket_timeout=_BROKER_TIMEOUT_S,
            )
            try:
                client.ping()
            finally:
                client.close()
        else:
            from kombu import Connection

            with Connection(url, connect_timeout=_BROKER_TIMEOUT_S) as conn:
                conn.ensure_connection(max_retries=1)
    except Exception as err:  # noqa: BLE001  (informational; never echo the URL)
        logger.info("health: broker unreachable", extra={"error": type(err).__name__})
        return "error"
    return "ok"


@never_cache
@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    database = database_status()
    broker = broker_status()
    healthy = database == "ok"
    return JsonResponse(
        {"status": "ok" if healthy else "error", "database": database, "broker": broker},
        status=200 if healthy else 503,
    )
