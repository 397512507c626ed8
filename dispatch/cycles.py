"""The Django entry point of the dispatcher: one bounded cycle, recorded.

`dispatch_cycle` is what the Worker pull endpoint (session scope), the Celery
beat task and `manage.py dispatch_once` / `run_dispatcher` (global scope) call.
It wraps the pure `dispatch_once` (docs/adr/0001) with what only Django can do:
the operator kill switch, max-delivery revocation, delivery telemetry on the
leases, the content-free notification of Sessions, and the redacted
`DispatchCycle` record. Only `DispatchCycleResult.summary()` is ever logged or
stored — never an offer, a spec or a token (docs/adr/0003).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Protocol

from django.conf import settings
from django.db import connection
from django.utils import timezone

from dispatch.adapters.orm import orm_ports
from dispatch.core.budget import DispatchBudget
from dispatch.core.cycle import dispatch_once
from dispatch.core.offer import ClaimedExecutionOffer
from dispatch.core.ports import DispatchScope, PullCredential, Scope
from dispatch.core.result import DispatchCycleResult
from dispatch.models import DispatchControl, DispatchCycle
from leases.end import leases_revoke_over_delivered
from leases.errors import Outcome
from leases.renew import leases_record_delivery
from qinglong.clock import db_now
from workers.models import WorkerSession

__all__ = [
    "NullOfferNotifier",
    "OfferNotifier",
    "dispatch_budget",
    "dispatch_cycle",
    "dispatch_paused",
    "dispatch_set_paused",
]

logger = logging.getLogger("qinglong.dispatch")

_CONTROL_PK = 1


class OfferNotifier(Protocol):
    """Tells each target Session that it has an offer; never carries content.

    docs/adr/0003: in global scope nothing pushes a spec or token
    anywhere. An implementation may send only ids (session id, offer id); the
    Worker then pulls, and session-scope recovery re-materializes the offer.
    """

    def notify(self, offers: Sequence[ClaimedExecutionOffer]) -> None: ...


class NullOfferNotifier:
    """The embedded default: Workers poll `pull` on their own cadence."""

    def notify(self, offers: Sequence[ClaimedExecutionOffer]) -> None:
        return None


def dispatch_budget() -> DispatchBudget:
    """The budget from `settings.QINGLONG_DISPATCH` (validated again here: fail loudly)."""
    return DispatchBudget.from_mapping(settings.QINGLONG_DISPATCH)


def dispatch_paused() -> bool:
    """The operator kill switch (DispatchControl pk=1; no row = running)."""
    paused = DispatchControl.objects.filter(pk=_CONTROL_PK).values_list("paused", flat=True).first()
    return bool(paused)


def dispatch_set_paused(*, paused: bool, reason: str = "", actor: str = "") -> None:
    DispatchControl.objects.update_or_create(
        pk=_CONTROL_PK,
        defaults={"paused": paused, "reason": reason[:200], "updated_by": actor[:150]},
    )
    logger.info(
        "dispatch paused" if paused else "dispatch resumed",
        extra={"event": "dispatch_paused" if paused else "dispatch_resumed", "actor": actor[:150]},
    )


def _ensure_no_outer_transaction() -> None:
    # lease_claim commits each claim on its own (atomic(durable=True)): inside
    # an outer transaction a rollback would erase leases whose offers were
    # already handed out. Test-case wrappers are the one allowed exception,
    # exactly as Django's durable check allows them.
    blocks = getattr(connection, "atomic_blocks", [])
    if connection.in_atomic_block and not all(
        getattr(block, "_from_testcase", False) for block in blocks
    ):
        raise RuntimeError("dispatch_cycle must not run inside a transaction")


def _session_pk(scope: DispatchScope, session_pk: int | None) -> int | None:
    if session_pk is not None or scope.session is None:
        return session_pk
    try:
        session_uuid = uuid.UUID(scope.session.session_id)
    except ValueError:
        return None
    return (
        WorkerSession.objects.filter(session_id=session_uuid).values_list("pk", flat=True).first()
    )


def _revoke_over_delivered(*, session_pk: int, max_deliveries: int) -> int:
    """Before a pull: past max_deliveries without a starting ACK, this Session's
    lease is revoked and the Attempt returns to pending for another Worker."""
    outcomes = leases_revoke_over_delivered(max_deliveries=max_deliveries, session_pk=session_pk)
    return sum(outcome is Outcome.APPLIED for outcome in outcomes)


def _record(result: DispatchCycleResult, *, scope: DispatchScope) -> dict[str, object]:
    summary = result.summary()
    DispatchCycle.objects.create(
        # observed_at is the database clock at cycle start; a paused cycle
        # never read it, so the process clock stands in.
        started_at=result.observed_at or timezone.now(),
        observed_at=result.observed_at,
        duration_ms=result.duration_ms,
        scope=str(result.scope),
        status=str(result.status),
        reason=str(result.reason),
        truncated=result.truncated,
        counts=result.counts.as_dict(),
        session_id=None if scope.session is None else uuid.UUID(scope.session.session_id),
    )
    logger.info("dispatch cycle", extra={"event": "dispatch_cycle", **summary})
    return summary


def dispatch_cycle(
    *,
    scope: DispatchScope,
    pull: PullCredential | None = None,
    max_offers: int | None = None,
    session_pk: int | None = None,
    notifier: OfferNotifier | None = None,
) -> DispatchCycleResult:
    """Run and record one bounded dispatch cycle (docs/adr/0001).

    Session scope (a Worker's pull) needs `pull`; its offers are the pull
    response. Global scope hands its offers, content-free, to `notifier`.
    Must not be called inside a transaction: each claim commits on its own.
    """
    _ensure_no_outer_transaction()
    if dispatch_paused():
        paused = DispatchCycleResult.paused(scope.kind)
        _record(paused, scope=scope)
        return paused
    budget = dispatch_budget()
    if scope.kind is Scope.SESSION:
        pk = _session_pk(scope, session_pk)
        if pk is not None:
            _revoke_over_delivered(session_pk=pk, max_deliveries=budget.max_deliveries)
    result = dispatch_once(
        scope=scope,
        budget=budget,
        ports=orm_ports(),
        secret=str(settings.QINGLONG_LEASE_SECRET).encode(),
        pull=pull,
        max_offers=max_offers,
    )
    if result.offers:
        # Telemetry (never authority), on the database clock: a pull counts
        # toward max_deliveries; a global announcement only restarts the
        # redelivery backoff (docs/adr/0002).
        leases_record_delivery(
            (offer.lease.lease_id for offer in result.offers),
            now=db_now(),
            count=scope.kind is Scope.SESSION,
        )
    _record(result, scope=scope)
    if scope.kind is Scope.GLOBAL and result.offers:
        _notify(notifier or NullOfferNotifier(), result.offers)
    return result


def _notify(notifier: OfferNotifier, offers: Sequence[ClaimedExecutionOffer]) -> None:
    try:
        notifier.notify(offers)
    except Exception:
        # The leases are committed and recovery re-delivers them once the
        # backoff passes (docs/adr/0002), so a failed nudge costs latency, not work.
        logger.exception(
            "offer notification failed",
            extra={"event": "offer_notify_failed", "offers": len(offers)},
        )
