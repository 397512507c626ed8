"""The rules every execution-state path shares, each defined once (docs/adr/0004).

- Lease liveness: a lease is live strictly before `expires_at`, on one clock
  (`dispatch.core.policy.lease_is_live`; here also as queryset filters).
- Capacity: a Session holds at most min(Session slots, Worker slots) leases.
- Lease TTL: `QINGLONG_DISPATCH["lease_ttl_s"]` (the dispatch budget).
- Delivery accounting and lost executions (docs/adr/0005): the redelivery
  backoff, the over-delivery rounds, the lost-execution grace.
- Caps: a sweep or a pre-pull check reads at most `SWEEP_BATCH` ids at once,
  the same hard cap as one dispatch page (`dispatch.core.budget.HARD_CAPS`).
- Fencing: which Session may act. Only the Worker's current Session, at the
  generation a lease was granted to, may deliver, start or finish it; only an
  online Session of an active Worker takes new claims.

The kernel's own checks (`dispatch.core`) stay pure and use
`dispatch.core.policy`; the ORM adapters, the use cases of this package, the
Worker registry and `audit_leases` use this module.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Final

from django.conf import settings
from django.db.models import F, Q

from dispatch.core import policy as kernel
from dispatch.core.budget import HARD_CAPS
from leases.models import RunLease
from workers.models import SESSION_CURRENT_STATES, SessionState, WorkerAdminState, WorkerSession

__all__ = [
    "SWEEP_BATCH",
    "claimable_sessions_q",
    "lease_expired_q",
    "lease_is_live",
    "lease_live_q",
    "lease_session_current_q",
    "lease_ttl",
    "lost_execution_grace",
    "max_deliveries",
    "max_delivery_rounds",
    "not_held_min_age",
    "redelivery_backoff",
    "session_capacity",
    "session_is_current",
    "session_may_act",
    "session_takes_claims",
]

# The most ids a sweep, or the over-delivery check before a pull, handles per
# call: one dispatch page at its hard cap, so no path reads more at once.
SWEEP_BATCH: Final = HARD_CAPS["page_size"]


# ------------------------------------------------------------------ liveness


def lease_is_live(lease: RunLease, *, now: datetime) -> bool:
    return kernel.lease_is_live(lease.expires_at, now)


def lease_live_q(now: datetime) -> Q:
    """Leases still live at `now` (the filter form of `lease_is_live`)."""
    return Q(expires_at__gt=now)


def lease_expired_q(now: datetime) -> Q:
    """Leases expired at `now`: exactly the ones `lease_live_q` leaves out.

    Written as `<=` rather than as a negation: a plain range condition, as the
    expiry sweep's keyset over (expires_at, id) reads it.
    """
    return Q(expires_at__lte=now)


def lease_ttl() -> timedelta:
    """How long a claim, a starting/running ACK or a heartbeat renewal keeps a lease."""
    return timedelta(seconds=int(settings.QINGLONG_DISPATCH["lease_ttl_s"]))


# ---------------------------------------------------------- delivery, loss


def redelivery_backoff() -> timedelta:
    """A re-delivery counts only this long after the last counted one (docs/adr/0005).

    It is also how long an over-delivered Attempt waits before any Worker,
    the same one included, may claim it again.
    """
    return timedelta(seconds=int(settings.QINGLONG_DISPATCH["redelivery_backoff_s"]))


def max_deliveries() -> int:
    """Counted deliveries of a claimed lease before it is revoked (`max_deliveries`)."""
    return int(settings.QINGLONG_DISPATCH["max_deliveries"])


def max_delivery_rounds() -> int:
    """Over-delivery revokes an Attempt survives; the next one fails its Run `undeliverable`."""
    return int(settings.QINGLONG_DISPATCH["max_delivery_rounds"])


def lost_execution_grace() -> timedelta:
    """How long the retry of a lost execution waits unless the Worker confirms it gone.

    `QL_LOST_EXECUTION_GRACE_S` (docs/adr/0005): a process the control plane
    lost sight of may still run; no retry of its Run starts before this has
    passed or the Worker's reconcile report says the process is gone.
    """
    return timedelta(seconds=int(settings.QINGLONG_LOST_EXECUTION_GRACE_S))


def not_held_min_age() -> timedelta:
    """A started Attempt younger than this is never ended as `not_held`.

    The heartbeat that omits it may have been put together while its
    starting ACK was still on the wire; the next heartbeat lists it (one
    heartbeat interval later) or ends it.
    """
    return timedelta(seconds=int(settings.QINGLONG_HEARTBEAT_INTERVAL_S))


# ------------------------------------------------------------------ capacity


def session_capacity(session: WorkerSession) -> int:
    """Leases this Session may hold at once (its Worker read in with it)."""
    return kernel.capacity(session.slots, session.worker.slots)


# ------------------------------------------------------------------- fencing


def session_is_current(session: WorkerSession) -> bool:
    """The Worker's current Session (online or draining): its token works."""
    return session.state in SESSION_CURRENT_STATES


def session_may_act(session: WorkerSession, *, generation: int) -> bool:
    """May this Session deliver, start or finish a lease granted at `generation`?"""
    return session_is_current(session) and session.generation == generation


def session_takes_claims(session: WorkerSession, *, worker_id: str, generation: int) -> bool:
    """May a new claim go to this Session, as the dispatcher saw it (worker, generation)?

    Draining Sessions and Workers keep their leases but take no new claims.
    """
    return (
        str(session.worker_id) == worker_id
        and session.generation == generation
        and session.state == SessionState.ONLINE
        and session.worker.admin_state == WorkerAdminState.ACTIVE
    )


def claimable_sessions_q() -> Q:
    """WorkerSessions that take new claims (the filter form of `session_takes_claims`)."""
    return Q(state=SessionState.ONLINE, worker__admin_state=WorkerAdminState.ACTIVE)


def lease_session_current_q() -> Q:
    """RunLeases whose Session may still act on them (the filter form of `session_may_act`)."""
    return Q(session__state__in=SESSION_CURRENT_STATES, session__generation=F("session_generation"))
