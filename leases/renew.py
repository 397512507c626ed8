"""Heartbeat renewals and delivery telemetry of leases.

Neither is a state transition: a renewal moves `expires_at` of a started
lease, a delivery record counts pulls. Both are single UPDATEs whose WHERE
carries the whole condition, so a row changed meanwhile is left alone.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from datetime import datetime

from django.db.models import F, Q

from leases import policy
from leases.models import LeaseState, RunLease
from runs.models import AttemptState
from workers.models import WorkerSession

__all__ = ["leases_record_delivery", "leases_renew_for_session"]


def leases_renew_for_session(
    session: WorkerSession, *, now: datetime, held: Collection[str] | None = None
) -> int:
    """Renew the live leases of this Session's starting/running Attempts.

    `held` (the heartbeat's list of what the agent holds, docs/adr/0005)
    narrows it to those offer ids; None renews every one (older agents).
    A claimed lease keeps its claim TTL either way: it is an offer in hand.
    """
    qs = RunLease.objects.filter(
        policy.lease_live_q(now),
        session=session,
        state=LeaseState.ACTIVE,
        attempt__state__in=(AttemptState.STARTING, AttemptState.RUNNING),
    )
    if held is not None:
        if not held:
            return 0
        qs = qs.filter(offer_id__in=list(held))
    ids = list(qs.values_list("id", flat=True))
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

    Telemetry for the backoff and over-delivery, never authority
    (docs/adr/0002). Only a Worker's pull counts toward `max_deliveries`, and
    only once per redelivery backoff (docs/adr/0005): a pull that re-delivers
    a lease delivered less than one backoff ago is a re-poll (an agent
    pulling again before it ACKed what it holds), not a delivery, and
    changes nothing. A global cycle's content-free notification just
    restarts the backoff. Returns how many leases it changed.
    """
    ids = [int(i) for i in lease_ids]
    if not ids:
        return 0
    if count:
        due = Q(last_delivered_at__isnull=True) | Q(
            last_delivered_at__lte=now - policy.redelivery_backoff()
        )
        return RunLease.objects.filter(due, pk__in=ids, state=LeaseState.ACTIVE).update(
            last_delivered_at=now, delivery_count=F("delivery_count") + 1
        )
    return RunLease.objects.filter(pk__in=ids, state=LeaseState.ACTIVE).update(
        last_delivered_at=now
    )
