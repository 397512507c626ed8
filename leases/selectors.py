"""Read-only questions about leases, asked by the use cases, the pull and the sweeps.

Nothing here writes or locks; the use cases re-check whatever they act on
under their own locks.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime

from django.db.models import F, OuterRef, Q, QuerySet

from dispatch.core.policy import MAX_DELIVERIES_REASON
from leases import policy
from leases.models import LeaseState, RunLease
from runs.models import AttemptState
from workers.models import WorkerSession

__all__ = [
    "MAX_DELIVERIES_REASON",
    "active_lease_count",
    "cancelled_offer_ids",
    "leases_not_held",
    "leases_over_delivered",
    "offers_to_stop",
    "over_delivered_leases",
]

# A heartbeat answer names at most this many cancelled offers (newest work is
# never more than a Session's slots; this only bounds a pathological row count).
_CANCEL_LIST_CAP = 256
# A heartbeat lists at most this many held offers (the Worker API's limit, and
# a Session's most slots): what it reads and answers about them is bounded too.
_HELD_CAP = 256
_STARTED = (AttemptState.STARTING, AttemptState.RUNNING)


def active_lease_count(session_pk: int) -> int:
    """Leases that count against the Session's capacity: every active one."""
    return RunLease.objects.filter(session_id=session_pk, state=LeaseState.ACTIVE).count()


def over_delivered_leases(
    *, max_deliveries: int, session_pk: int | OuterRef | None = None
) -> QuerySet[RunLease]:
    """Claimed-but-never-started leases delivered `max_deliveries` times already
    (of one Session, when given), unordered."""
    qs = RunLease.objects.filter(
        state=LeaseState.ACTIVE,
        delivery_count__gte=max_deliveries,
        attempt__state=AttemptState.CLAIMED,
    )
    if session_pk is not None:
        qs = qs.filter(Q(session_id=session_pk))
    return qs


def leases_over_delivered(
    *, max_deliveries: int, session_pk: int | None = None, limit: int = policy.SWEEP_BATCH
) -> list[int]:
    """The ids of `over_delivered_leases`, oldest first, at most `limit`."""
    qs = over_delivered_leases(max_deliveries=max_deliveries, session_pk=session_pk)
    return list(qs.order_by("id").values_list("id", flat=True)[:limit])


def leases_not_held(
    *, session_pk: int, held: Collection[str], started_before: datetime
) -> list[int]:
    """This Session's started leases a heartbeat did not list (docs/adr/0005).

    Started at or before `started_before`, at the lease's own generation. At
    most a Session's capacity of rows exist (every one holds a slot).
    """
    return list(
        RunLease.objects.filter(
            session_id=session_pk,
            state=LeaseState.ACTIVE,
            attempt__state__in=_STARTED,
            attempt__lease_generation=F("lease_generation"),
            attempt__started_at__lte=started_before,
        )
        .exclude(offer_id__in=list(held))
        .order_by("id")
        .values_list("id", flat=True)[:_HELD_CAP]
    )


def offers_to_stop(session: WorkerSession, held: Collection[str], *, now: datetime) -> list[str]:
    """The ids of `held` this Session's agent must stop now (heartbeat `stop`).

    Every id that is not a live lease of this Session whose Attempt is still
    claimed or started under it: ended, released, revoked, expired (the
    sweep ends it; its ACKs are refused already), stale, unknown, or another
    Worker's — one answer for all, so a heartbeat never tells whether an id
    exists elsewhere. In the order listed, once each.
    """
    listed = list(dict.fromkeys(held))[:_HELD_CAP]
    if not listed:
        return []
    live = set(
        RunLease.objects.filter(
            policy.lease_live_q(now),
            session=session,
            offer_id__in=listed,
            state=LeaseState.ACTIVE,
            attempt__state__in=(AttemptState.CLAIMED, *_STARTED),
            attempt__lease_generation=F("lease_generation"),
        ).values_list("offer_id", flat=True)
    )
    return [offer_id for offer_id in listed if offer_id not in live]


def cancelled_offer_ids(session: WorkerSession) -> list[str]:
    """Offer ids of this Session's active leases whose Run was cancelled."""
    return list(
        RunLease.objects.filter(
            session=session, state=LeaseState.ACTIVE, run__cancel_requested=True
        )
        .order_by("id")
        .values_list("offer_id", flat=True)[:_CANCEL_LIST_CAP]
    )
