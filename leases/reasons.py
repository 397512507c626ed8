"""Why an Attempt or a lease ended, and why a pending Attempt waits (docs/adr/0005).

Operator-readable codes, stored as the lease's `end_reason`, the AttemptEvent
`reason` and, on an Attempt that ended because its execution was lost or
never delivered, its `error_code`. One vocabulary for every app (the heartbeat,
the sweeps, the audit, the admin and the APIs name an ending the same way).
"""

from __future__ import annotations

import enum
from typing import Final

from dispatch.core.policy import MAX_DELIVERIES_REASON, UNDELIVERABLE_REASON

__all__ = ["GRACE_FREE_LOSSES", "EndReason", "WaitReason"]


class EndReason(enum.StrEnum):
    """Why the control plane ended a lease (and lost or returned its Attempt)."""

    # The Worker's Session went offline (missed heartbeats).
    WORKER_LOST = "worker_lost"
    # A newer Session of the same Worker opened (the agent restarted).
    WORKER_RESTARTED = "worker_restarted"
    # The Worker's credential was rotated: its Sessions are fenced.
    CREDENTIAL_ROTATED = "credential_rotated"
    # An operator disabled the Worker.
    WORKER_DISABLED = "worker_disabled"
    # A heartbeat listing what the agent holds did not list this offer.
    NOT_HELD = "not_held"
    # Pulled `max_deliveries` times without a starting ACK.
    MAX_DELIVERIES = MAX_DELIVERIES_REASON
    # Over-delivered `max_delivery_rounds` times: the Run fails.
    UNDELIVERABLE = UNDELIVERABLE_REASON
    # Past expires_at (the expiry sweep or the audit).
    LEASE_EXPIRED = "lease_expired"
    # Started and past its Task's timeout_s (+ QL_TIMEOUT_MARGIN_S): the
    # control plane stopped it (leases.timeout, README "Run policies").
    TIMED_OUT = "timed_out"


# A lost execution whose retry may start at once: the agent itself said it
# holds no process for the offer (docs/adr/0005). Every other loss of a
# started Attempt holds its retry back for the lost-execution grace, since a
# process may still run where the control plane cannot see it.
GRACE_FREE_LOSSES: Final = frozenset({EndReason.NOT_HELD})


class WaitReason(enum.StrEnum):
    """`Attempt.not_before_reason`: why a pending Attempt may not be claimed yet."""

    # The previous Attempt's execution may still run (lost, unconfirmed).
    LOST_EXECUTION_GRACE = "lost_execution_grace"
    # Its offer was over-delivered; it waits one redelivery backoff.
    REDELIVERY_BACKOFF = "redelivery_backoff"
    # The Task's retry policy: retry n waits retry_backoff_s * 2**(n-1), capped.
    RETRY_BACKOFF = "retry_backoff"
