"""System checks that make a bad configuration refuse to start.

`manage.py check` runs them, and so does every `manage.py` command, the web
server and the Celery worker (they call `django.setup()` + checks): a dispatch
budget over a hard cap (docs/adr/0001) is an Error, never a warning.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, register

from dispatch.core.budget import budget_violations


@register("qinglong")
def check_dispatch_budget(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    values = getattr(settings, "QINGLONG_DISPATCH", {})
    return [
        Error(
            f"QINGLONG_DISPATCH[{violation.key!r}]: {violation.message}",
            hint=f"Lower it (environment: QL_DISPATCH_{violation.key.upper()}).",
            id="qinglong.E001",
        )
        for violation in budget_violations(values)
    ]


@register("qinglong")
def check_lease_secret(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    secret = getattr(settings, "QINGLONG_LEASE_SECRET", "")
    if not isinstance(secret, str) or len(secret) < 32:
        return [
            Error(
                "QINGLONG_LEASE_SECRET must be a string of at least 32 characters.",
                id="qinglong.E002",
            )
        ]
    return []
