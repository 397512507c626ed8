"""What the lease use cases raise and return (docs/adr/0004).

`IllegalTransition` and `LostRace` are raised inside a use case's transaction
(so every write of the use case rolls back with them); the outermost use case
turns them into an `Outcome` or, for a Worker call, into a `LeaseError` whose
`status` and `code` the API renders.
"""

from __future__ import annotations

import enum

__all__ = [
    "IllegalTransition",
    "LeaseConflict",
    "LeaseError",
    "LeaseForbidden",
    "LeaseNotFound",
    "LostRace",
    "Outcome",
    "TransitionError",
]


class TransitionError(Exception):
    """Base class of transition failures."""


class IllegalTransition(TransitionError):
    """The state machine does not allow this transition from the current state."""

    def __init__(self, entity: str, from_state: str, to_state: str) -> None:
        super().__init__(f"{entity}: {from_state} → {to_state} is not a legal transition")
        self.entity = entity
        self.from_state = from_state
        self.to_state = to_state


class LostRace(TransitionError):
    """Another writer changed the row first (the compare-and-set touched 0 rows)."""


class Outcome(enum.StrEnum):
    APPLIED = "applied"  # this call made the transition
    LOST_RACE = "lost_race"  # another writer got there first; nothing changed here
    UNCHANGED = "unchanged"  # an idempotent repeat: already in the requested state


class LeaseError(Exception):
    """A refused lease call. `code` is low-cardinality; the message has no secrets."""

    status = 409
    code = "lease_conflict"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class LeaseNotFound(LeaseError):
    status = 404
    code = "lease_not_found"


class LeaseForbidden(LeaseError):
    """Another Session's lease, or a wrong lease token: nothing changes."""

    status = 403
    code = "lease_forbidden"


class LeaseConflict(LeaseError):
    """Expired, revoked, released, cancelled, wrong phase or spec digest: stop the Attempt."""

    status = 409
