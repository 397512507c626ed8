"""ClaimedExecutionOffer: the lease-bound capability that carries an ExecutionSpec.

docs/adr/0002: the offer is the only object holding the sanitized
spec and the lease token together. Everything that is not the Worker pull
response (repr, str, logging, summaries, Celery) sees a redacted form, and the
offer refuses to be pickled or copied so it cannot cross a process boundary.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from types import MappingProxyType
from typing import Final, NoReturn

from dispatch.core.ports import to_rfc3339
from dispatch.core.spec import PreparedSpec
from dispatch.core.spec import spec_sha256 as compute_spec_sha256

__all__ = [
    "ClaimedExecutionOffer",
    "LeaseGrant",
    "OfferSource",
    "derive_lease_token",
    "offer_id_for",
    "token_digest",
    "tokens_equal",
]

_OFFER_ID_DOMAIN: Final = "ql-offer-v1"


def offer_id_for(
    *,
    attempt_id: str,
    lease_generation: int,
    worker_id: str,
    session_id: str,
    session_generation: int,
) -> str:
    """docs/adr/0002: the same lease always yields the same id, across restarts.

    NUL-separated parts under a versioned domain tag: no part may contain NUL,
    so two different leases can never encode to the same bytes.
    """
    for name, number in (
        ("lease_generation", lease_generation),
        ("session_generation", session_generation),
    ):
        if isinstance(number, bool) or not isinstance(number, int):
            raise TypeError(f"{name} must be an int")
    parts = (attempt_id, str(lease_generation), worker_id, session_id, str(session_generation))
    for part in parts:
        if not isinstance(part, str) or "\x00" in part:
            raise ValueError("offer id parts must be strings without NUL")
    encoded = "\x00".join((_OFFER_ID_DOMAIN, *parts)).encode("utf-8")
    return hashlib.sha256(encoded).hexdigest()


def derive_lease_token(secret: bytes, offer_id: str) -> str:
    """Global claims: HMAC-SHA256(secret, offer_id), so recovery re-derives it (docs/adr/0003)."""
    if not isinstance(secret, bytes) or not secret:
        raise ValueError("the lease secret must be non-empty bytes")
    mac = hmac.new(secret, offer_id.encode("utf-8"), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode("ascii")


def token_digest(token: str) -> str:
    """What the database stores instead of the token (docs/adr/0003)."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def tokens_equal(a: str, b: str) -> bool:
    """Constant-time comparison, so response timing does not leak a prefix."""
    return hmac.compare_digest(a.encode("utf-8"), b.encode("utf-8"))


class OfferSource(StrEnum):
    NEW_CLAIM = "new_claim"  # a claim won in this cycle
    LEASE_RECOVERY = "lease_recovery"  # an active lease re-materialized (docs/adr/0002)


def _refuse_copy(kind: str) -> NoReturn:
    raise TypeError(f"{kind} holds a lease token and must not be pickled or copied")


@dataclass(frozen=True, repr=False, slots=True)
class LeaseGrant:
    lease_id: str
    generation: int
    # None: a pull-claimed lease re-delivered to a request that did not present
    # the same pull_id + token; the Worker uses the token it generated.
    token: str | None
    expires_at: datetime

    def __repr__(self) -> str:
        return (
            f"LeaseGrant(lease_id={self.lease_id!r}, generation={self.generation}, "
            f"token={'<redacted>' if self.token is not None else None}, "
            f"expires_at={self.expires_at.isoformat()!r})"
        )

    def __reduce__(self) -> NoReturn:
        _refuse_copy("LeaseGrant")


def _freeze(value: object) -> object:
    """Deep copy into read-only containers: no caller can reach a mutable part."""
    if isinstance(value, Mapping):
        return MappingProxyType({str(key): _freeze(item) for key, item in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_freeze(item) for item in value)
    if value is None or isinstance(value, str | int):
        return value
    raise TypeError("an ExecutionSpec holds only objects, lists, strings and integers")


def _thaw(value: object) -> object:
    if isinstance(value, Mapping):
        return {key: _thaw(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return [_thaw(item) for item in value]
    return value


@dataclass(frozen=True, repr=False, slots=True)
class ClaimedExecutionOffer:
    offer_id: str
    source: OfferSource
    run_id: str
    attempt_id: str
    project_id: str
    task_id: str
    task_revision: int
    priority: int
    queued_at: datetime
    worker_id: str
    session_id: str
    session_generation: int
    lease: LeaseGrant
    # Stored as a deep, read-only copy (nested lists become tuples): mutating the
    # plan source's data later cannot change the offer (docs/adr/0002).
    spec: Mapping[str, object]
    spec_sha256: str
    placement_score: int | None

    def __post_init__(self) -> None:
        if isinstance(self.spec, PreparedSpec):
            # Read-only already, its digest taken from its content when it was
            # made (dispatch.core.spec.SpecTemplate: a revision's part once).
            frozen: object = self.spec
            digest = self.spec.sha256
        else:
            frozen = _freeze(self.spec)
            if not isinstance(frozen, Mapping):
                raise TypeError("an ExecutionSpec must be an object")
            object.__setattr__(self, "spec", frozen)
            digest = compute_spec_sha256(frozen)
        # The digest is what the Worker and the lease check against; an offer
        # whose spec does not hash to it would be refused at ACK time anyway.
        if digest != self.spec_sha256:
            raise ValueError("spec_sha256 does not match the offer's spec")

    def summary(self) -> dict[str, object]:
        """Redacted: ids, ordering facts and lease facts; no spec, no token."""
        return {
            "offer_id": self.offer_id,
            "source": str(self.source),
            "run_id": self.run_id,
            "attempt_id": self.attempt_id,
            "project_id": self.project_id,
            "task_id": self.task_id,
            "task_revision": self.task_revision,
            "priority": self.priority,
            "queued_at": to_rfc3339(self.queued_at),
            "worker_id": self.worker_id,
            "session_id": self.session_id,
            "session_generation": self.session_generation,
            "lease": {
                "lease_id": self.lease.lease_id,
                "generation": self.lease.generation,
                "expires_at": to_rfc3339(self.lease.expires_at),
            },
            "spec_sha256": self.spec_sha256,
            "placement_score": self.placement_score,
        }

    def to_wire(self) -> dict[str, object]:
        """The offer JSON of the pull response (OpenAPI schema), and only for it:
        it carries the spec and (when this request may see it) the lease token."""
        return {
            "offer_id": self.offer_id,
            "source": str(self.source),
            "run_id": self.run_id,
            "attempt_id": self.attempt_id,
            "project_id": self.project_id,
            "task_id": self.task_id,
            "task_revision": self.task_revision,
            "priority": self.priority,
            "queued_at": to_rfc3339(self.queued_at),
            "worker_id": self.worker_id,
            "session_id": self.session_id,
            "session_generation": self.session_generation,
            "lease": {
                "lease_id": self.lease.lease_id,
                "generation": self.lease.generation,
                "token": self.lease.token,
                "expires_at": to_rfc3339(self.lease.expires_at),
            },
            "spec": _thaw(self.spec),
            "spec_sha256": self.spec_sha256,
            "placement_score": self.placement_score,
        }

    def __repr__(self) -> str:
        return (
            f"ClaimedExecutionOffer(offer_id={self.offer_id!r}, source={str(self.source)!r}, "
            f"run_id={self.run_id!r}, attempt_id={self.attempt_id!r}, "
            f"worker_id={self.worker_id!r}, session_id={self.session_id!r}, "
            f"session_generation={self.session_generation}, "
            f"lease_generation={self.lease.generation}, "
            f"spec_sha256={self.spec_sha256[:12]!r}…)"
        )

    def __str__(self) -> str:
        return self.__repr__()

    def __reduce__(self) -> NoReturn:
        _refuse_copy("ClaimedExecutionOffer")
