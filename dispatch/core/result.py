"""DispatchCycleResult: what one cycle did, in low-cardinality terms.

docs/adr/0001: failures, lost races, no-match and exhausted budgets return only a
status, a reason and counts — never an ExecutionSpec. `summary()` is the only
form that leaves the process (logs, the DispatchCycle row, Celery results,
admin, `manage.py dispatch_once --json`); offers stay in memory.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime
from enum import StrEnum
from typing import NoReturn

from dispatch.core.offer import ClaimedExecutionOffer
from dispatch.core.ports import Scope, to_rfc3339

__all__ = ["CycleCounts", "CycleReason", "CycleStatus", "DispatchCycleResult"]


class CycleStatus(StrEnum):
    IDLE = "idle"  # nothing to recover, no candidate
    OFFERED = "offered"  # at least one offer (recovered lease or won claim)
    NO_MATCH = "no_match"  # candidates seen, none claimed
    TRUNCATED = "truncated"  # a budget ran out before anything was offered
    REJECTED = "rejected"  # a port broke its contract; the cycle failed closed
    PAUSED = "paused"  # operator kill switch (set by the Django layer)


class CycleReason(StrEnum):
    NONE = "none"
    NO_CANDIDATES = "no_candidates"
    RECOVERED = "recovered"
    CLAIMED = "claimed"
    NO_ELIGIBLE_WORKER = "no_eligible_worker"
    NO_WORKERS = "no_workers"
    CLAIMS_LOST = "claims_lost"
    CLAIM_BUDGET_EXHAUSTED = "claim_budget_exhausted"
    CANDIDATE_BUDGET_EXHAUSTED = "candidate_budget_exhausted"
    WORKER_BUDGET_EXHAUSTED = "worker_budget_exhausted"
    RECOVERY_BUDGET_EXHAUSTED = "recovery_budget_exhausted"
    MAX_OFFERS_REACHED = "max_offers_reached"
    NO_FREE_SLOTS = "no_free_slots"
    DUPLICATE_ROW = "duplicate_row"
    CURSOR_NOT_ADVANCING = "cursor_not_advancing"
    PAGE_OVERSIZE = "page_oversize"
    WORKER_ORDER_REGRESSION = "worker_order_regression"
    WORKER_LIMIT_EXCEEDED = "worker_limit_exceeded"
    WORKER_SCOPE_MISMATCH = "worker_scope_mismatch"
    RECOVERY_EXPIRED_LEASE = "recovery_expired_lease"
    RECOVERY_SCOPE_MISMATCH = "recovery_scope_mismatch"
    RECOVERY_PLAN_MISSING = "recovery_plan_missing"
    RECOVERY_SPEC_DRIFT = "recovery_spec_drift"
    # The lease's stored token digest cannot be re-established (docs/adr/0003).
    RECOVERY_TOKEN_MISMATCH = "recovery_token_mismatch"
    INVALID_SPEC = "invalid_spec"
    PLACEMENT_CONFLICT = "placement_conflict"
    PLAN_MISSING = "plan_missing"
    DISPATCH_PAUSED = "dispatch_paused"


@dataclass(frozen=True)
class CycleCounts:
    recovered: int = 0
    candidates_seen: int = 0
    workers_seen: int = 0
    plans_built: int = 0
    claims_attempted: int = 0
    claims_won: int = 0
    claims_lost: int = 0
    offers: int = 0

    def as_dict(self) -> dict[str, int]:
        return {field.name: getattr(self, field.name) for field in fields(self)}


@dataclass(frozen=True, repr=False, slots=True)
class DispatchCycleResult:
    scope: Scope
    status: CycleStatus
    reason: CycleReason
    truncated: bool
    counts: CycleCounts
    observed_at: datetime | None
    duration_ms: int
    offers: tuple[ClaimedExecutionOffer, ...] = ()
    # Candidates skipped for a missing plan, an invalid spec or a placement
    # conflict; in memory only (not part of the fixed summary shape).
    rejected_candidates: int = 0

    @classmethod
    def paused(cls, scope: Scope) -> DispatchCycleResult:
        return cls(
            scope=scope,
            status=CycleStatus.PAUSED,
            reason=CycleReason.DISPATCH_PAUSED,
            truncated=False,
            counts=CycleCounts(),
            observed_at=None,
            duration_ms=0,
        )

    def summary(self) -> dict[str, object]:
        return {
            "scope": str(self.scope),
            "status": str(self.status),
            "reason": str(self.reason),
            "truncated": self.truncated,
            "observed_at": None if self.observed_at is None else to_rfc3339(self.observed_at),
            "duration_ms": self.duration_ms,
            "counts": self.counts.as_dict(),
        }

    def __repr__(self) -> str:
        return f"DispatchCycleResult({self.summary()!r})"

    def __str__(self) -> str:
        return self.__repr__()

    def __reduce__(self) -> NoReturn:
        # Offers hold specs and tokens; only summary() may leave the process.
        raise TypeError("DispatchCycleResult must not be pickled or copied; use summary()")
