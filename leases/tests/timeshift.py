"""Let time pass in a test: every recorded instant of execution state moves back.

The lease rules compare stored instants with the database clock (`db_now`),
which a test cannot move on PostgreSQL; moving the stored instants back by
the same amount is the same as that much time passing.
"""

from __future__ import annotations

from datetime import timedelta

from django.db.models import F

from leases.models import RunLease
from runs.models import Attempt
from workers.models import WorkerSession


def rewind(seconds: float) -> None:
    """As if `seconds` passed: waits, starts, leases, deliveries and heartbeats age."""
    delta = timedelta(seconds=seconds)
    Attempt.objects.filter(not_before__isnull=False).update(not_before=F("not_before") - delta)
    Attempt.objects.filter(started_at__isnull=False).update(started_at=F("started_at") - delta)
    RunLease.objects.update(claimed_at=F("claimed_at") - delta, expires_at=F("expires_at") - delta)
    RunLease.objects.filter(last_delivered_at__isnull=False).update(
        last_delivered_at=F("last_delivered_at") - delta
    )
    WorkerSession.objects.update(heartbeat_at=F("heartbeat_at") - delta)
