"""Heartbeat renewals and delivery telemetry of leases.

Neither is a state transition: a renewal moves `expires_at` of a started
lease, a delivery record counts pulls. Both are single UPDATEs whose WHERE
carries the whole condition, so a row changed meanwhile is left alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from django.db.models import F

from leases import policy
from leases.models import LeaseState, RunLease
from runs.models import AttemptState
from workers.models import WorkerSession

__all__ = ["leases_record_delivery", "leases_renew_for_session"]


def leases_renew_for_session(session: WorkerSession, *, now: datetime) -> int:
    """Renew the live leases of this Session's starting/running Attempts."""
    ids = list(
        RunLease.objects.filter(
            policy.lease_live_q(now),
            session=session,
            state=LeaseState.ACTIVE,
            attempt__state__in=(AttemptState.STARTING, AttemptState.RUNNING),
        ).values_list("id", flat=True)
    )
    if not ids:
        return 0
    # The compare-and-set lives in this UPDATE's own WHERE (not in a joined
    # subquery), so PostgreSQL re-checks it on a row a revoke or expiry changed
    # while we waited: an ended lease is never renewed.
    return RunLease.objects.filter(
        policy.lease_live_q(now), pk__in=ids, session=session, state=LeaseState.ACTIVE
    ).update(expires_at=now + policy.lease_ttl(), version=F("version") + 1)


def leases_record_delivery(
    lease_ids: Iterable[str | int], *, now: datetime, count: bool = True
) -> int:
    """Record that leases were delivered (a pull) or announced (`count=False`).

    Telemetry only, never authority (docs/adr/0002). Only a Worker's pull counts
    toward `max_deliveries`; a global cycle's content-free notification just
    restarts the redelivery backoff.
    """
    ids = [int(i) for i in lease_ids]
    if not ids:
        return 0
    if count:
        return RunLease.objects.filter(pk__in=ids, state=LeaseState.ACTIVE).update(
            last_delivered_at=now, delivery_count=F("delivery_count") + 1
        )
    return RunLease.objects.filter(pk__in=ids, state=LeaseState.ACTIVE).update(
        last_delivered_at=now
    )
