"""Execution-state rules that need no database, each defined once.

The kernel's own checks, the in-memory fakes and every Django path (through
`leases.policy`, which turns these into querysets and settings) use these
functions, so the ORM, the fakes and the cycle cannot disagree on when a lease
has expired, how many claims a Session may hold, or which spec a lease granted
(docs/adr/0004).
"""

from __future__ import annotations

from datetime import datetime
from typing import Final

from dispatch.core.offer import tokens_equal

__all__ = [
    "MAX_DELIVERIES_REASON",
    "UNDELIVERABLE_REASON",
    "capacity",
    "free_slots",
    "lease_is_live",
    "spec_matches_lease",
]


# The end reason of a lease revoked after max_deliveries pulls without a
# `starting` ACK; its Attempt waits one redelivery backoff (docs/adr/0005).
MAX_DELIVERIES_REASON: Final = "max_deliveries"
# The reason an Attempt over-delivered `max_delivery_rounds` times ends with
# (its Run fails instead of going back to the queue once more).
UNDELIVERABLE_REASON: Final = "undeliverable"


def lease_is_live(expires_at: datetime, now: datetime) -> bool:
    """A lease is live strictly before its expiry: at `expires_at` it has expired.

    `now` is one clock for the whole decision (the database clock in the
    cluster, `observed_at` in a cycle): never mix it with another process's.
    """
    return expires_at > now


def capacity(session_slots: int, worker_slots: int) -> int:
    """Claims one Session may hold at once: its own slots, never more than its Worker's."""
    return min(session_slots, worker_slots)


def free_slots(capacity: int, busy: int) -> int:
    """What is left of `capacity` once `busy` leases count against it (never negative)."""
    return max(0, capacity - busy)


def spec_matches_lease(spec_digest: str, lease_digest: str) -> bool:
    """docs/adr/0002: a lease covers exactly the spec it was granted, byte for byte.

    Compared in constant time: the digest of a lease is never leaked by timing.
    """
    return tokens_equal(spec_digest, lease_digest)
