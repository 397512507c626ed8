"""Lease use cases: claim, ACK, renew, expire, revoke, delivery telemetry.

`lease_claim` is the only writer of a new RunLease (DESIGN §3 "Claim"). Every
other change to a lease is a compare-and-set on (state, version), so a sweeper
can never overwrite a completion, nor a late ACK resurrect an expired lease.

Lock order, everywhere, so that PostgreSQL never deadlocks two use cases:
Run → Attempt → WorkerSession → RunLease.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import IntegrityError, connection, transaction
from django.db.models import F

from dispatch.core.offer import token_digest, tokens_equal
from dispatch.core.ports import ClaimOutcome, ClaimRequest, ClaimStatus
from leases.models import LeaseSource, LeaseState, RunLease
from qinglong.clock import db_now
from runs.models import Attempt, AttemptState, Project, Run, RunState
from runs.services import (
    IllegalTransition,
    LostRace,
    Outcome,
    attempt_finish,
    attempt_transition,
    run_transition,
)
from workers.models import SESSION_CURRENT_STATES, WorkerAdminState, WorkerSession

logger = logging.getLogger("qinglong.dispatch")

MAX_DELIVERIES_REASON = "max_deliveries"


# ------------------------------------------------------------------------ claim


def _skip_locked(request: ClaimRequest) -> bool:
    # SKIP LOCKED lets racing global dispatchers pass over each other's rows;
    # SQLite serializes writers and has no row locks.
    return request.skip_locked and connection.features.has_select_for_update_skip_locked


def lease_claim(request: ClaimRequest) -> ClaimOutcome:
    """Claim an Attempt for one Worker Session: the only path that creates a lease."""
    lost = ClaimOutcome(status=ClaimStatus.ATTEMPT_LOST)
    unavailable = ClaimOutcome(status=ClaimStatus.WORKER_UNAVAILABLE)
    try:
        with transaction.atomic(durable=True):
            skip = _skip_locked(request)
            # Lock the Run then the Attempt: their transitions commit together.
            # of=self: lock the Run row only, never the Project or revision
            # joined in (other Runs of the same Task must stay claimable).
            run = (
                Run.objects.select_for_update(skip_locked=skip, of=("self",))
                .select_related("task_revision", "project")
                .filter(pk=request.run_id)
                .first()
            )
            if run is None or run.state != RunState.QUEUED or run.cancel_requested:
                return lost
            attempt = (
                Attempt.objects.select_for_update(skip_locked=skip)
                .filter(pk=request.attempt_id, run_id=run.pk)
                .first()
            )
            if (
                attempt is None
                or attempt.state != AttemptState.PENDING
                or attempt.version != request.expected_version
                or attempt.lease_generation + 1 != request.lease_generation
            ):
                return lost
            if run.project.max_concurrent_runs and not _project_has_room(
                run.project_id, limit=run.project.max_concurrent_runs
            ):
                return lost
            # Lock the Session: slot accounting must see every committed lease
            # of this Session, and a replacement must wait for this claim.
            # No-key lock: a lease insert's foreign-key check (KEY SHARE) and a
            # Session open's Worker lock never wait on it.
            session = (
                WorkerSession.objects.select_for_update(of=("self",), no_key=True)
                .select_related("worker")
                .filter(session_id=request.session_id)
                .first()
            )
            if (
                session is None
                or str(session.worker_id) != request.worker_id
                or session.generation != request.session_generation
                or session.state != "online"
                or session.worker.admin_state != WorkerAdminState.ACTIVE
            ):
                return unavailable
            if (
                request.pull_id is not None
                and RunLease.objects.filter(session=session, pull_id=request.pull_id)
                .exclude(token_digest=request.token_digest)
                .exists()
            ):
                # ADR-0108: one pull id, one token. Checked under the Session
                # lock, so two racing pulls reusing an id cannot both claim.
                return unavailable
            if RunLease.objects.filter(
                attempt=attempt, session=session, end_reason=MAX_DELIVERIES_REASON
            ).exists():
                # DESIGN §4: an Attempt this Session was handed max_deliveries
                # times without starting it goes to another Worker (or to a
                # later Session of this one), never back to the same Session.
                return lost
            capacity = min(session.slots, session.worker.slots)
            if (
                RunLease.objects.filter(session=session, state=LeaseState.ACTIVE).count()
                >= capacity
            ):
                return unavailable
            now = db_now()
            attempt_transition(
                attempt,
                AttemptState.CLAIMED,
                reason="claim",
                actor=f"worker:{session.worker_id}",
                lease_generation=request.lease_generation,
            )
            run_transition(run, RunState.DISPATCHING)
            lease = RunLease.objects.create(
                attempt=attempt,
                run=run,
                worker_id=session.worker_id,
                session=session,
                session_generation=session.generation,
                lease_generation=request.lease_generation,
                offer_id=request.offer_id,
                token_digest=request.token_digest,
                spec_digest=request.spec_sha256,
                placement_score=request.placement_score,
                source=request.source,
                pull_id=request.pull_id,
                claimed_at=now,
                expires_at=now + timedelta(seconds=request.lease_ttl_s),
            )
    except (LostRace, IntegrityError):
        # Another dispatcher changed the Attempt or inserted its lease first.
        return lost
    logger.info(
        "lease claimed",
        extra={
            "event": "lease_claimed",
            "lease_id": lease.pk,
            "attempt_id": attempt.pk,
            "worker_id": session.worker_id,
            "lease_generation": lease.lease_generation,
        },
    )
    return ClaimOutcome(status=ClaimStatus.WON, lease_id=str(lease.pk), expires_at=lease.expires_at)


def _project_has_room(project_id: int, *, limit: int) -> bool:
    """Quota check for `Project.max_concurrent_runs`, inside the claim transaction.

    The Project row is locked (no-key, so Run inserts still pass) so that two
    claims in one Project cannot both take its last slot.
    """
    Project.objects.select_for_update(no_key=True).filter(pk=project_id).values_list(
        "pk", flat=True
    ).first()
    active = Run.objects.filter(
        project_id=project_id, state__in=(RunState.DISPATCHING, RunState.RUNNING)
    ).count()
    return active < limit


class DatabaseClaimPort:
    """The `ClaimPort` of `dispatch.core` over `lease_claim`."""

    def claim(self, request: ClaimRequest) -> ClaimOutcome:
        return lease_claim(request)


# ----------------------------------------------------------------- lease ending


def _lease_close(lease: RunLease, to_state: str, *, reason: str, now: datetime) -> None:
    updated = RunLease.objects.filter(
        pk=lease.pk, version=lease.version, state=LeaseState.ACTIVE
    ).update(state=to_state, version=lease.version + 1, ended_at=now, end_reason=reason)
    if updated != 1:
        raise LostRace(f"lease {lease.pk} changed under us")
    lease.state = to_state
    lease.version += 1
    lease.ended_at = now
    lease.end_reason = reason


def lease_end_for_attempt(attempt: Attempt, *, reason: str, now: datetime) -> None:
    """Revoke the Attempt's active lease (inside the caller's transaction)."""
    lease = (
        RunLease.objects.select_for_update()
        .filter(attempt=attempt, state=LeaseState.ACTIVE)
        .first()
    )
    if lease is not None:
        _lease_close(lease, LeaseState.REVOKED, reason=reason, now=now)


def _return_or_lose(attempt: Attempt, run: Run, *, reason: str, now: datetime) -> None:
    """What an ended lease does to its Attempt (DESIGN §2).

    Still `claimed`: nothing ran, so the Attempt goes back to `pending` and the
    next claim uses lease_generation + 1. `starting`/`running`: the Worker may
    have run it, so the Attempt is `lost` and the retry policy decides.
    """
    if attempt.state == AttemptState.CLAIMED:
        attempt_transition(attempt, AttemptState.PENDING, reason=reason, actor="control-plane")
        run_transition(run, RunState.QUEUED)
    elif attempt.state in (AttemptState.STARTING, AttemptState.RUNNING):
        attempt_finish(
            attempt, run, AttemptState.LOST, reason=reason, actor="control-plane", now=now
        )


def _lock_chain(
    lease_id: int, *, session: bool = False
) -> tuple[Run, Attempt, WorkerSession | None, RunLease] | None:
    """Lock Run → Attempt → (WorkerSession) → RunLease of one lease, in the global lock order."""
    ids = RunLease.objects.filter(pk=lease_id).values("run_id", "attempt_id", "session_id").first()
    if ids is None:
        return None
    # of=self everywhere: never lock the Task revision joined in for reading.
    run = (
        Run.objects.select_for_update(of=("self",))
        .select_related("task_revision")
        .get(pk=ids["run_id"])
    )
    attempt = Attempt.objects.select_for_update().get(pk=ids["attempt_id"])
    locked_session = (
        WorkerSession.objects.select_for_update(no_key=True).get(pk=ids["session_id"])
        if session
        else None
    )
    lease = RunLease.objects.select_for_update().get(pk=lease_id)
    return run, attempt, locked_session, lease


class EndKind(enum.StrEnum):
    EXPIRE = "expire"  # only if past expires_at by the database clock
    REVOKE = "revoke"  # regardless of expiry


def lease_end(
    lease_id: int,
    *,
    kind: EndKind,
    reason: str,
    only_if_attempt_state: str | None = None,
) -> Outcome:
    """Expire or revoke one active lease and return/lose its Attempt.

    `only_if_attempt_state` re-checks, under the row locks, the condition a
    sweeper selected the lease by (e.g. "still claimed"), so a starting ACK that
    committed in between is never turned into a lost Attempt.
    """
    try:
        with transaction.atomic(durable=True):
            chain = _lock_chain(lease_id)
            if chain is None:
                return Outcome.UNCHANGED
            run, attempt, _, lease = chain
            if lease.state != LeaseState.ACTIVE:
                return Outcome.UNCHANGED
            if only_if_attempt_state is not None and (
                attempt.state != only_if_attempt_state
                or attempt.lease_generation != lease.lease_generation
            ):
                return Outcome.UNCHANGED
            now = db_now()
            if kind is EndKind.EXPIRE and lease.expires_at > now:
                return Outcome.UNCHANGED
            to_state = LeaseState.EXPIRED if kind is EndKind.EXPIRE else LeaseState.REVOKED
            _lease_close(lease, to_state, reason=reason, now=now)
            if attempt.lease_generation == lease.lease_generation:
                _return_or_lose(attempt, run, reason=reason, now=now)
    except LostRace:
        return Outcome.LOST_RACE
    logger.info(
        "lease ended",
        extra={"event": f"lease_{to_state}", "lease_id": lease_id, "reason": reason},
    )
    return Outcome.APPLIED


def lease_expire(lease_id: int) -> Outcome:
    return lease_end(lease_id, kind=EndKind.EXPIRE, reason="lease_expired")


def lease_revoke(
    lease_id: int, *, reason: str, only_if_attempt_state: str | None = None
) -> Outcome:
    return lease_end(
        lease_id, kind=EndKind.REVOKE, reason=reason, only_if_attempt_state=only_if_attempt_state
    )


def leases_end_for_session(session_pk: int, *, reason: str) -> int:
    """Revoke every active lease of a Session that is no longer current."""
    ended = 0
    ids = list(
        RunLease.objects.filter(session_id=session_pk, state=LeaseState.ACTIVE)
        .order_by("id")
        .values_list("id", flat=True)
    )
    for lease_id in ids:
        if lease_revoke(lease_id, reason=reason) is Outcome.APPLIED:
            ended += 1
    return ended


# ------------------------------------------------------------------------- ACKs


class AckPhase(enum.StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    START_FAILED = "start_failed"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


_PHASE_TARGET = {
    AckPhase.STARTING: AttemptState.STARTING,
    AckPhase.RUNNING: AttemptState.RUNNING,
    AckPhase.START_FAILED: AttemptState.START_FAILED,
    AckPhase.SUCCEEDED: AttemptState.SUCCEEDED,
    AckPhase.FAILED: AttemptState.FAILED,
}


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


@dataclass(frozen=True)
class AckResult:
    offer_id: str
    attempt_state: str
    run_state: str
    cancel_requested: bool
    outcome: Outcome


def _authorize(lease: RunLease | None, *, session: WorkerSession, lease_token: str) -> RunLease:
    if lease is None:
        raise LeaseNotFound("no lease with that offer id")
    if lease.session_id != session.pk:
        raise LeaseForbidden("the lease belongs to another session")
    if not tokens_equal(token_digest(lease_token), lease.token_digest):
        raise LeaseForbidden("the lease token does not match", code="lease_token_invalid")
    return lease


def lease_ack(
    *,
    session: WorkerSession,
    offer_id: str,
    phase: AckPhase,
    lease_token: str,
    spec_sha256: str,
    executor_handle: str = "",
    exit_code: int | None = None,
    error_code: str = "",
    output_tail: str = "",
) -> AckResult:
    """Apply one Worker ACK as a compare-and-set; a repeat of the same phase is a no-op."""
    # Checked before any lock (a stranger's call touches no row), and again
    # under the locks below.
    seen = _authorize(
        RunLease.objects.filter(offer_id=offer_id).first(), session=session, lease_token=lease_token
    )
    try:
        with transaction.atomic(durable=True):
            chain = _lock_chain(seen.pk, session=True)
            assert chain is not None
            run, attempt, locked_session, lease = chain
            _authorize(lease, session=session, lease_token=lease_token)
            assert locked_session is not None
            if (
                locked_session.state not in SESSION_CURRENT_STATES
                or locked_session.generation != lease.session_generation
            ):
                # Fenced between authentication and this lock: the replacement
                # ends this lease, so nothing may start or finish under it.
                raise LeaseConflict(
                    "the session is no longer current", code=f"session_{locked_session.state}"
                )
            if not tokens_equal(spec_sha256, lease.spec_digest):
                raise LeaseConflict("spec_sha256 differs from the lease", code="spec_mismatch")
            target = _PHASE_TARGET[phase]
            if attempt.lease_generation == lease.lease_generation and attempt.state == target:
                return AckResult(
                    offer_id, attempt.state, run.state, run.cancel_requested, Outcome.UNCHANGED
                )
            if lease.state != LeaseState.ACTIVE:
                raise LeaseConflict(f"the lease is {lease.state}", code=f"lease_{lease.state}")
            now = db_now()
            if lease.expires_at <= now:
                raise LeaseConflict("the lease has expired", code="lease_expired")
            if attempt.lease_generation != lease.lease_generation:
                raise LeaseConflict("the lease is stale", code="lease_stale")
            actor = f"worker:{session.worker_id}"
            ttl = timedelta(seconds=_lease_ttl_s())
            if phase is AckPhase.STARTING:
                if run.cancel_requested:
                    raise LeaseConflict("the run was cancelled", code="run_cancelled")
                attempt_transition(
                    attempt,
                    AttemptState.STARTING,
                    reason="ack_starting",
                    actor=actor,
                    started_at=now,
                )
                run_transition(run, RunState.RUNNING)
                _lease_touch(lease, expires_at=now + ttl)
            elif phase is AckPhase.RUNNING:
                attempt_transition(
                    attempt,
                    AttemptState.RUNNING,
                    reason="ack_running",
                    actor=actor,
                    executor_handle=executor_handle[:200],
                )
                _lease_touch(lease, expires_at=now + ttl)
            else:
                _lease_close(lease, LeaseState.RELEASED, reason=f"ack_{phase}", now=now)
                attempt_finish(
                    attempt,
                    run,
                    target,
                    reason=f"ack_{phase}",
                    actor=actor,
                    now=now,
                    exit_code=exit_code,
                    error_code=error_code[:64],
                    output_tail=output_tail,
                )
    except IllegalTransition as err:
        raise LeaseConflict(
            f"{phase} is not allowed after {err.from_state}", code="illegal_phase"
        ) from None
    except LostRace:
        raise LeaseConflict("the lease changed concurrently", code="lease_conflict") from None
    logger.info(
        "lease ack",
        extra={
            "event": "lease_ack",
            "lease_id": lease.pk,
            "phase": str(phase),
            "attempt_state": attempt.state,
        },
    )
    return AckResult(offer_id, attempt.state, run.state, run.cancel_requested, Outcome.APPLIED)


def _lease_touch(lease: RunLease, *, expires_at: datetime) -> None:
    updated = RunLease.objects.filter(
        pk=lease.pk, version=lease.version, state=LeaseState.ACTIVE
    ).update(expires_at=expires_at, version=lease.version + 1)
    if updated != 1:
        raise LostRace(f"lease {lease.pk} changed under us")
    lease.expires_at = expires_at
    lease.version += 1


def _lease_ttl_s() -> int:
    from django.conf import settings

    return int(settings.QINGLONG_DISPATCH["lease_ttl_s"])


# -------------------------------------------------------- renewals & deliveries


def leases_renew_for_session(session: WorkerSession, *, now: datetime) -> int:
    """Renew the unexpired leases of this Session's starting/running Attempts."""
    ids = list(
        RunLease.objects.filter(
            session=session,
            state=LeaseState.ACTIVE,
            expires_at__gt=now,
            attempt__state__in=(AttemptState.STARTING, AttemptState.RUNNING),
        ).values_list("id", flat=True)
    )
    if not ids:
        return 0
    # The compare-and-set lives in this UPDATE's own WHERE (not in a joined
    # subquery), so PostgreSQL re-checks it on a row a revoke or expiry changed
    # while we waited: an ended lease is never renewed.
    return RunLease.objects.filter(
        pk__in=ids, session=session, state=LeaseState.ACTIVE, expires_at__gt=now
    ).update(expires_at=now + timedelta(seconds=_lease_ttl_s()), version=F("version") + 1)


def leases_record_delivery(
    lease_ids: Iterable[str | int], *, now: datetime, count: bool = True
) -> int:
    """Record that leases were delivered (a pull) or announced (`count=False`).

    Telemetry only, never authority (DESIGN §2). Only a Worker's pull counts
    toward `max_deliveries` (DESIGN §4); a global cycle's content-free
    notification just restarts the redelivery backoff.
    """
    ids = [int(i) for i in lease_ids]
    if not ids:
        return 0
    changes: dict[str, object] = {"last_delivered_at": now}
    if count:
        changes["delivery_count"] = F("delivery_count") + 1
    return RunLease.objects.filter(pk__in=ids, state=LeaseState.ACTIVE).update(**changes)


def leases_over_delivered(*, max_deliveries: int, session_pk: int | None = None) -> list[int]:
    """Claimed-but-never-started leases delivered `max_deliveries` times already."""
    qs = RunLease.objects.filter(
        state=LeaseState.ACTIVE,
        delivery_count__gte=max_deliveries,
        attempt__state=AttemptState.CLAIMED,
    )
    if session_pk is not None:
        qs = qs.filter(session_id=session_pk)
    return list(qs.order_by("id").values_list("id", flat=True)[:64])


def cancelled_offer_ids(session: WorkerSession) -> list[str]:
    """Offer ids of this Session's active leases whose Run was cancelled."""
    return list(
        RunLease.objects.filter(
            session=session, state=LeaseState.ACTIVE, run__cancel_requested=True
        )
        .order_by("id")
        .values_list("offer_id", flat=True)[:256]
    )


__all__ = [
    "AckPhase",
    "AckResult",
    "DatabaseClaimPort",
    "LeaseConflict",
    "LeaseError",
    "LeaseForbidden",
    "LeaseNotFound",
    "LeaseSource",
    "lease_ack",
    "lease_claim",
    "lease_end_for_attempt",
    "lease_expire",
    "lease_revoke",
    "leases_end_for_session",
    "leases_record_delivery",
    "leases_renew_for_session",
]
