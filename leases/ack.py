"""Worker ACKs: `starting` → `running` → `succeeded`/`failed`, or `start_failed`.

The legal order is the Attempt state machine (`leases.transitions`): each
phase moves the Attempt to the state of the same name, so `starting` is legal
only from `claimed`, `running` only from `starting`, `succeeded`/`failed`
only from `running`, and `start_failed` from `claimed` or `starting`. A repeat
of the phase the Attempt is already in is a no-op (`Outcome.UNCHANGED`).

`ACK_PHASE_FIELDS` is the one table of what each phase's body requires and
may carry; the Worker API's serializer enforces it and its OpenAPI schema is
rendered from it, so neither can drift from the use case.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Final

from django.db import connection, transaction

from dispatch.core.offer import token_digest, tokens_equal
from dispatch.core.policy import spec_matches_lease
from leases import policy
from leases.ack_statement import (
    OneStatementAck,
    ack_in_one_statement,
    decides_in_one_statement,
)
from leases.end import attempt_finish
from leases.errors import (
    IllegalTransition,
    LeaseConflict,
    LeaseError,
    LeaseForbidden,
    LeaseNotFound,
    LostRace,
    Outcome,
)
from leases.locks import LeaseChain, lock_lease_for_ack, lock_leases_for_acks
from leases.models import LeaseState, RunLease
from leases.timeout import attempt_overdue
from leases.transitions import AttemptReport, lease_transition
from leases.writes import AckWrites, Writes
from output.redaction import redact, redaction_values
from qinglong.metrics import LOST_RACES
from runs.models import Attempt, AttemptState, Run, RunState
from workers.models import WorkerSession

__all__ = [
    "ACK_PHASE_DEPENDENT_FIELDS",
    "ACK_PHASE_FIELDS",
    "PHASE_TARGET",
    "AckItem",
    "AckPhase",
    "AckResult",
    "lease_ack",
    "lease_ack_each",
]

logger = logging.getLogger("qinglong.dispatch")


class AckPhase(enum.StrEnum):
    STARTING = "starting"  # the Worker is about to spawn: only now may it run
    RUNNING = "running"  # spawned; carries the executor handle
    START_FAILED = "start_failed"  # could not start (nothing ran)
    SUCCEEDED = "succeeded"  # exited 0
    FAILED = "failed"  # exited non-zero


# The Attempt state each phase moves to.
PHASE_TARGET: Final[Mapping[AckPhase, AttemptState]] = MappingProxyType(
    {
        AckPhase.STARTING: AttemptState.STARTING,
        AckPhase.RUNNING: AttemptState.RUNNING,
        AckPhase.START_FAILED: AttemptState.START_FAILED,
        AckPhase.SUCCEEDED: AttemptState.SUCCEEDED,
        AckPhase.FAILED: AttemptState.FAILED,
    }
)

_TERMINAL_EXTRAS: Final = frozenset({"error_code", "output_tail"})
# The ACK's cross-field rules: phase → (fields it requires, fields it may carry)
# beyond phase, lease_token and spec_sha256.
ACK_PHASE_FIELDS: Final[Mapping[AckPhase, tuple[frozenset[str], frozenset[str]]]] = (
    MappingProxyType(
        {
            AckPhase.STARTING: (frozenset(), frozenset()),
            AckPhase.RUNNING: (frozenset({"executor_handle"}), frozenset()),
            AckPhase.SUCCEEDED: (frozenset({"exit_code"}), _TERMINAL_EXTRAS),
            AckPhase.FAILED: (frozenset({"exit_code"}), _TERMINAL_EXTRAS),
            AckPhase.START_FAILED: (frozenset(), frozenset({"exit_code"}) | _TERMINAL_EXTRAS),
        }
    )
)
ACK_PHASE_DEPENDENT_FIELDS: Final = ("executor_handle", "exit_code", "error_code", "output_tail")


@dataclass(frozen=True)
class AckResult:
    offer_id: str
    attempt_state: AttemptState
    run_state: RunState
    cancel_requested: bool
    outcome: Outcome


def _result(offer_id: str, attempt: Attempt, run: Run, outcome: Outcome) -> AckResult:
    return AckResult(
        offer_id=offer_id,
        attempt_state=AttemptState(attempt.state),
        run_state=RunState(run.state),
        cancel_requested=run.cancel_requested,
        outcome=outcome,
    )


def _authorize(lease: RunLease | None, *, session: WorkerSession, lease_token: str) -> RunLease:
    if lease is None:
        raise LeaseNotFound("no lease with that offer id")
    if lease.session_id != session.pk:
        raise LeaseForbidden("the lease belongs to another session")
    if not tokens_equal(token_digest(lease_token), lease.token_digest):
        raise LeaseForbidden("the lease token does not match", code="lease_token_invalid")
    return lease


def _refused(offer_id: str, session: WorkerSession) -> LeaseError:
    """Why no lease of this Session has that offer id: 404, or 403 for another's."""
    if RunLease.objects.filter(offer_id=offer_id).exists():
        return LeaseForbidden("the lease belongs to another session")
    return LeaseNotFound("no lease with that offer id")


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
    """Apply one Worker ACK as a compare-and-set; a repeat of the same phase is a no-op.

    On PostgreSQL, outside a transaction, a `starting`, `running` or
    `succeeded` (no output tail) is first tried as one statement in
    autocommit (`leases.ack_statement`): it applies the ACK when every check
    below passes on the rows it locked and otherwise writes nothing, and the
    path below decides. That path is two statements in a transaction on
    PostgreSQL (docs/adr/0011): the lease's rows locked in
    one (`leases.locks.lock_lease_for_ack`, found by offer id and this
    Session together, so another Session's request locks nothing), and the
    phase's writes in one (`leases.writes`). A failed start or run (retry
    policy) and the end of a cancelled Run go through `leases.end.attempt_finish`.
    """
    item = AckItem(
        offer_id=offer_id,
        phase=phase,
        lease_token=lease_token,
        spec_sha256=spec_sha256,
        executor_handle=executor_handle,
        exit_code=exit_code,
        error_code=error_code,
        output_tail=output_tail,
    )
    phase = item.phase  # an AckPhase, whatever was passed
    if _outside_transactions():
        try:
            done = _in_one_statement(item, session=session)
        except LostRace:
            LOST_RACES.labels(operation="ack").inc()
            raise _lost_race() from None
        if done is not None:
            _log_applied_ids(done.lease_id, phase, done.attempt_state)
            return _answer(offer_id, done)
        # Not applied, nothing written: the portable path decides and answers.
    try:
        with transaction.atomic(durable=True):
            chain = lock_lease_for_ack(offer_id=offer_id, session_pk=session.pk)
            if chain is None:
                raise _refused(offer_id, session)
            outcome = _ack_in_chain(chain, item, session=session)
    except IllegalTransition as err:
        raise _illegal(phase, err) from None
    except LostRace:
        LOST_RACES.labels(operation="ack").inc()
        raise _lost_race() from None
    if outcome is Outcome.APPLIED:
        _log_applied(chain, phase)
    return _result(offer_id, chain.attempt, chain.run, outcome)


@dataclass(frozen=True)
class AckItem:
    """One ACK of several sent together (`lease_ack_each`): `lease_ack`'s arguments."""

    offer_id: str
    phase: AckPhase
    lease_token: str
    spec_sha256: str
    executor_handle: str = ""
    exit_code: int | None = None
    error_code: str = ""
    output_tail: str = ""

    def __post_init__(self) -> None:
        # Phases are compared by identity below (`phase is AckPhase.STARTING`):
        # a plain "starting" would compare unequal to every member and take the
        # ending path. A text that is no phase is a ValueError here.
        if type(self.phase) is not AckPhase:
            object.__setattr__(self, "phase", AckPhase(self.phase))


def _in_one_statement(item: AckItem, *, session: WorkerSession) -> OneStatementAck | None:
    """`leases.ack_statement`: the ACK applied in one statement, or None (nothing written)."""
    if not decides_in_one_statement(item.phase, output_tail=item.output_tail):
        return None
    return ack_in_one_statement(
        session=session,
        offer_id=item.offer_id,
        phase=item.phase,
        lease_token=item.lease_token,
        spec_sha256=item.spec_sha256,
        executor_handle=item.executor_handle,
        exit_code=item.exit_code,
        error_code=item.error_code,
    )


def _answer(offer_id: str, done: OneStatementAck) -> AckResult:
    return AckResult(
        offer_id=offer_id,
        attempt_state=done.attempt_state,
        run_state=done.run_state,
        cancel_requested=done.cancel_requested,
        outcome=Outcome.APPLIED,
    )


def _outside_transactions() -> bool:
    """No transaction of the caller's is open: the one statement is its own.

    Django's own rule for `atomic(durable=True)`: a test case's transactions
    (`TestCase`) do not count, so the path below raises where this is false.
    """
    return all(getattr(block, "_from_testcase", False) for block in connection.atomic_blocks)


def _illegal(phase: AckPhase, err: IllegalTransition) -> LeaseConflict:
    return LeaseConflict(f"{phase} is not allowed after {err.from_state}", code="illegal_phase")


def _lost_race() -> LeaseConflict:
    return LeaseConflict("the lease changed concurrently", code="lease_conflict")


def _log_applied(chain: LeaseChain, phase: AckPhase) -> None:
    _log_applied_ids(chain.lease.pk, phase, chain.attempt.state)


def _log_applied_ids(lease_id: int, phase: AckPhase, attempt_state: str) -> None:
    if not logger.isEnabledFor(logging.INFO):
        return  # nothing to build for a line nobody writes
    logger.info(
        "lease ack",
        extra={
            "event": "lease_ack",
            "lease_id": lease_id,
            "phase": str(phase),
            "attempt_state": attempt_state,
        },
    )


def _log_applied_batch(applied: Sequence[tuple[int, AckPhase, str]]) -> None:
    """One line for the ACKs a batch applied: `lease_ack`'s three facts of
    each, in the order applied, as lists of the same length (one record per
    batch instead of one per ACK: formatting and writing a record cost about
    as much as applying an ACK's checks, issue #12)."""
    if not applied or not logger.isEnabledFor(logging.INFO):
        return
    logger.info(
        "lease acks",
        extra={
            "event": "lease_acks",
            "count": len(applied),
            "lease_ids": [lease_id for lease_id, _, _ in applied],
            "phases": [str(phase) for _, phase, _ in applied],
            "attempt_states": [attempt_state for _, _, attempt_state in applied],
        },
    )


def _ack_in_chain(
    chain: LeaseChain, item: AckItem, *, session: WorkerSession, sink: AckWrites | None = None
) -> Outcome:
    """One ACK under its chain's locks: every check, then the phase's writes
    (handed to `sink` when given, see `_apply`).

    Raises `LeaseError` (always before anything is written),
    `IllegalTransition` or `LostRace` (see `_writes_in_steps`).
    """
    assert chain.session is not None and chain.now is not None
    attempt, lease, now = chain.attempt, chain.lease, chain.now
    _authorize(lease, session=session, lease_token=item.lease_token)
    if not policy.session_may_act(chain.session, generation=lease.session_generation):
        # Fenced between authentication and this lock: the replacement
        # ends this lease, so nothing may start or finish under it.
        raise LeaseConflict(
            "the session is no longer current", code=f"session_{chain.session.state}"
        )
    if not spec_matches_lease(item.spec_sha256, lease.spec_digest):
        raise LeaseConflict("spec_sha256 differs from the lease", code="spec_mismatch")
    target = PHASE_TARGET[item.phase]
    if attempt.lease_generation == lease.lease_generation and attempt.state == target:
        return Outcome.UNCHANGED
    if lease.state != LeaseState.ACTIVE:
        raise LeaseConflict(f"the lease is {lease.state}", code=f"lease_{lease.state}")
    if not policy.lease_is_live(lease, now=now):
        raise LeaseConflict("the lease has expired", code="lease_expired")
    if attempt.lease_generation != lease.lease_generation:
        raise LeaseConflict("the lease is stale", code="lease_stale")
    _apply(
        item.phase,
        chain,
        now=now,
        actor=f"worker:{session.worker_id}",
        executor_handle=item.executor_handle,
        exit_code=item.exit_code,
        error_code=item.error_code,
        output_tail=item.output_tail,
        sink=sink,
    )
    return Outcome.APPLIED


class _Unsure(Exception):
    """An ACK of a batch failed among its writes (a lost race, an illegal
    transition found after a first write): the rows it read may no longer be
    what the later ACKs should be decided on, so the batch rolls back and
    every ACK is applied again on its own."""


def lease_ack_each(
    *, session: WorkerSession, items: Sequence[AckItem]
) -> Iterator[AckResult | LeaseError]:
    """Apply several ACKs of one Session in the order given, each exactly as
    `lease_ack` applies one — its own authorization (this Session's lease, its
    own lease token), its own checks, compare-and-sets and history rows, its
    own answer; a refused one (a `LeaseError`, yielded, not raised) changes
    nothing and stops no other (docs/adr/0013).

    On PostgreSQL the ACKs share one transaction: every lease's rows locked in
    one statement in the lock order (`leases.locks.lock_leases_for_acks`: all
    Runs and Attempts sorted by Run id, then the Session, then the leases
    sorted by id — never one lease's Session before another's Run), then each
    ACK's checks on the rows in memory, its writes handed to one
    `leases.writes.AckWrites` and applied set-based (one statement per wave:
    ACKs of different offers share one, `running` then `succeeded` of one
    offer are two), then one commit. A refusal is decided before its ACK
    writes anything. Should an ACK fail among its writes (a lost race,
    which the locks exclude, or an illegal transition an ending through
    `attempt_finish` finds after its first write), the whole transaction rolls
    back and every ACK is applied again on its own, as on SQLite (which
    serializes writers anyway) or for a single ACK.

    A database error stops the iteration: with one transaction nothing was
    applied; one by one, the ACKs yielded before it were. The ACKs a shared
    transaction applied are logged after its commit in one INFO line
    (`lease_acks`: lease ids, phases and the Attempt states they left, in
    order); applied one by one, each is `lease_ack`'s own line.
    """
    if len(items) < 2 or connection.vendor != "postgresql":
        yield from _each_alone(session, items)
        return
    try:
        answers, applied = _all_in_one_transaction(session, items)
    except _Unsure:
        LOST_RACES.labels(operation="ack").inc()
        yield from _each_alone(session, items)
        return
    _log_applied_batch(applied)
    yield from answers


def _each_alone(
    session: WorkerSession, items: Sequence[AckItem]
) -> Iterator[AckResult | LeaseError]:
    for item in items:
        try:
            yield lease_ack(session=session, **asdict(item))
        except LeaseError as err:
            yield err


def _writes_in_steps(item: AckItem, chain: LeaseChain) -> bool:
    """Whether `_apply` ends this ACK through `attempt_finish`: statement after
    statement, so an `IllegalTransition` may come after a first write. Every
    other phase checks its transitions before its one writing statement."""
    if item.phase in (AckPhase.FAILED, AckPhase.START_FAILED):
        return True
    return item.phase is AckPhase.SUCCEEDED and chain.run.cancel_requested


def _all_in_one_transaction(
    session: WorkerSession, items: Sequence[AckItem]
) -> tuple[list[AckResult | LeaseError], list[tuple[int, AckPhase, str]]]:
    answers: list[AckResult | LeaseError] = []
    # (lease id, phase, the Attempt's state that ACK left) of each applied
    # one: several ACKs of one offer share a chain, whose rows end in the last one's state.
    applied: list[tuple[int, AckPhase, str]] = []
    sink = AckWrites()
    with transaction.atomic(durable=True):
        chains = lock_leases_for_acks(
            offer_ids=[item.offer_id for item in items], session_pk=session.pk
        )
        for item in items:
            chain = chains.get(item.offer_id)
            if chain is None:
                answers.append(_refused(item.offer_id, session))
                continue
            try:
                outcome = _ack_in_chain(chain, item, session=session, sink=sink)
            except LeaseError as err:
                answers.append(err)  # decided before anything was written
                continue
            except IllegalTransition as err:
                if _writes_in_steps(item, chain):
                    raise _Unsure from None  # perhaps found among its writes
                answers.append(_illegal(item.phase, err))  # checked before writing
                continue
            except LostRace:
                raise _Unsure from None
            if outcome is Outcome.APPLIED:
                applied.append((chain.lease.pk, item.phase, str(chain.attempt.state)))
            answers.append(_result(item.offer_id, chain.attempt, chain.run, outcome))
        try:
            sink.flush()
        except LostRace:
            raise _Unsure from None
    return answers, applied


def _apply(
    phase: AckPhase,
    chain: LeaseChain,
    *,
    now: datetime,
    actor: str,
    executor_handle: str,
    exit_code: int | None,
    error_code: str,
    output_tail: str,
    sink: AckWrites | None = None,
) -> None:
    """The writes of one accepted phase, under the chain's locks.

    With a `sink` (a batch, `lease_ack_each`), the one-statement phases hand
    their writes to it instead of applying them; an ending through
    `attempt_finish`, which writes statement after statement, first has the
    sink apply what it holds."""
    run, attempt, lease = chain.run, chain.attempt, chain.lease
    writes = Writes()
    if phase is AckPhase.STARTING:
        if run.cancel_requested:
            raise LeaseConflict("the run was cancelled", code="run_cancelled")
        writes.attempt(
            attempt,
            AttemptState.STARTING,
            reason="ack_starting",
            actor=actor,
            started_at=now,
            # README "Run policies": past this (and a margin) the control
            # plane stops it and ends it `timed_out`.
            deadline_at=now + timedelta(seconds=run.task_revision.timeout_s),
        )
        writes.run(run, RunState.RUNNING)
        writes.lease_extend(lease, expires_at=now + policy.lease_ttl())
        _write(writes, sink)
        return
    if phase is AckPhase.RUNNING:
        if attempt_overdue(attempt, now=now):
            # README "Run policies": past its timeout and the margin, the
            # control plane's verdict is stop (the sweep ends it).
            raise LeaseConflict("the attempt ran past its timeout", code="timed_out")
        writes.attempt(
            attempt,
            AttemptState.RUNNING,
            reason="ack_running",
            actor=actor,
            executor_handle=executor_handle[:200],
        )
        writes.lease_extend(lease, expires_at=now + policy.lease_ttl())
        _write(writes, sink)
        return
    target = PHASE_TARGET[phase]
    report: AttemptReport = {
        "exit_code": exit_code,
        "error_code": error_code[:64],
        # Stored redacted of the pinned revision's env values, like live
        # output (output.redaction; the revision is read in by the lock).
        "output_tail": redact(output_tail, redaction_values(run.task_revision.env)),
    }
    if phase is AckPhase.SUCCEEDED and not run.cancel_requested:
        # A success ends its Run `succeeded`: no retry policy applies
        # (leases.end.attempt_finish decides every other ending).
        writes.lease_end(lease, LeaseState.RELEASED, reason=f"ack_{phase}", now=now)
        writes.attempt(
            attempt, target, reason=f"ack_{phase}", actor=actor, finished_at=now, **report
        )
        writes.run(run, RunState.SUCCEEDED, finished_at=now)
        _write(writes, sink)
        return
    if sink is not None:
        sink.flush()
    lease_transition(lease, LeaseState.RELEASED, reason=f"ack_{phase}", now=now)
    attempt_finish(attempt, run, target, reason=f"ack_{phase}", actor=actor, now=now, **report)


def _write(writes: Writes, sink: AckWrites | None) -> None:
    if sink is None:
        writes.apply()
    else:
        sink.add(writes)
