"""`dispatch_once`: one bounded dispatch cycle over the ports (DESIGN §3, ADR §2).

No timers, threads or background lifecycle: the caller (Celery beat, the
`run_dispatcher` loop, a Worker's pull) schedules the next cycle. Every read is
paged and capped by the `DispatchBudget`; every port's contract is re-checked
here and a broken one fails the cycle closed (ADR §4).

Committed claims are real leases: if a later page breaks a port contract, the
cycle is REJECTED but keeps the offers of claims it already won, so the caller
can still notify their Workers. If a port raises anything else, the exception
propagates and those leases are re-delivered by the next cycle's recovery
(ADR §5: the active lease, not the offer, is the authority).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Final, Generic, TypeVar

from dispatch.core.budget import HARD_CAPS, DispatchBudget
from dispatch.core.errors import PlacementError, SpecError
from dispatch.core.offer import (
    ClaimedExecutionOffer,
    LeaseGrant,
    OfferSource,
    derive_lease_token,
    offer_id_for,
    token_digest,
    tokens_equal,
)
from dispatch.core.placement import Placement, normalize_placement, placement_score
from dispatch.core.ports import (
    NEW_CLAIM,
    PULL_CLAIM,
    Candidate,
    ClaimRequest,
    ClaimStatus,
    DispatchPlan,
    DispatchPorts,
    DispatchScope,
    Page,
    PlanUnavailable,
    PullCredential,
    RecoverableLease,
    Scope,
    WorkerRecord,
    id_sort_key,
)
from dispatch.core.result import CycleCounts, CycleReason, CycleStatus, DispatchCycleResult
from dispatch.core.spec import check_spec_identity, spec_sha256, validate_spec

__all__ = ["dispatch_once"]

T = TypeVar("T")

# When no candidate was offered, the reason reported is the first of these that
# happened: data problems an operator must fix outrank transient contention.
_NO_MATCH_PRECEDENCE: Final = (
    CycleReason.INVALID_SPEC,
    CycleReason.PLACEMENT_CONFLICT,
    CycleReason.PLAN_MISSING,
    CycleReason.CLAIMS_LOST,
    CycleReason.NO_ELIGIBLE_WORKER,
    CycleReason.NO_FREE_SLOTS,
    CycleReason.NO_WORKERS,
)
_CANDIDATE_REJECTIONS: Final = frozenset(
    {CycleReason.INVALID_SPEC, CycleReason.PLACEMENT_CONFLICT, CycleReason.PLAN_MISSING}
)


class _Rejected(Exception):
    """A port broke its contract: the cycle fails closed with this reason (ADR §4)."""

    def __init__(self, reason: CycleReason) -> None:
        super().__init__(str(reason))
        self.reason = reason


class _PageReader(Generic[T]):
    """Lazy keyset paging that re-checks the port contract on every page.

    Rows are read only when the cycle asks for the next one, so no page is
    fetched that the cycle does not need (ADR §2 step 2: "lazily"). Each page
    is checked whole on arrival — size, cursor progress, duplicate keys and the
    caller's per-row check — so a bad page is rejected even if its tail is never
    consumed.
    """

    def __init__(
        self,
        fetch: Callable[[str | None, int], Page[T]],
        *,
        page_size: int,
        max_pages: int,
        key: Callable[[T], str],
        check: Callable[[T], None] | None = None,
    ) -> None:
        self._fetch = fetch
        self._page_size = page_size
        self._max_pages = max_pages
        self._key = key
        self._check = check
        self._buffer: deque[T] = deque()
        self._cursor: str | None = None
        self._cursors_seen: set[str] = set()
        self._keys_seen: set[str] = set()
        self._done = False
        self.pages_read = 0
        self.rows_read = 0

    def next(self) -> T | None:
        while not self._buffer:
            if self._done or self.pages_read >= self._max_pages:
                return None
            self._read_page()
        return self._buffer.popleft()

    @property
    def budget_exhausted(self) -> bool:
        """The page budget ended while the port still had rows (a cursor)."""
        return not self._done and not self._buffer and self.pages_read >= self._max_pages

    @property
    def may_have_more(self) -> bool:
        return bool(self._buffer) or not self._done

    def _read_page(self) -> None:
        previous = self._cursor
        page = self._fetch(previous, self._page_size)
        self.pages_read += 1
        if len(page.items) > self._page_size:
            raise _Rejected(CycleReason.PAGE_OVERSIZE)
        next_cursor = page.next_cursor
        if next_cursor is not None and (
            next_cursor == previous or next_cursor in self._cursors_seen
        ):
            # A cursor that repeats would re-read the same rows forever.
            raise _Rejected(CycleReason.CURSOR_NOT_ADVANCING)
        for item in page.items:
            key = self._key(item)
            if key in self._keys_seen:
                raise _Rejected(CycleReason.DUPLICATE_ROW)
            self._keys_seen.add(key)
            if self._check is not None:
                self._check(item)
        self.rows_read += len(page.items)
        self._buffer.extend(page.items)
        if next_cursor is None:
            self._done = True
        else:
            self._cursors_seen.add(next_cursor)
            self._cursor = next_cursor


@dataclass
class _Tally:
    recovered: int = 0
    candidates_seen: int = 0
    workers_seen: int = 0
    plans_built: int = 0
    claims_attempted: int = 0
    claims_won: int = 0
    claims_lost: int = 0
    rejected_candidates: int = 0
    notes: set[CycleReason] = field(default_factory=set)


def _check_plan_identity(plan: DispatchPlan, candidate: Candidate) -> None:
    """ADR §2 step 5: the plan must be for exactly the persisted candidate."""
    for name in ("run_id", "attempt_id", "project_id", "task_id", "task_revision"):
        got, want = getattr(plan, name), getattr(candidate, name)
        if type(got) is not type(want) or got != want:
            raise SpecError(name, "plan does not match the persisted candidate")


def _checked_spec(plan: DispatchPlan, candidate: Candidate) -> dict[str, object]:
    spec = validate_spec(plan.spec)
    check_spec_identity(
        spec,
        run_id=candidate.run_id,
        attempt_id=candidate.attempt_id,
        project_id=candidate.project_id,
        task_id=candidate.task_id,
        task_revision=candidate.task_revision,
    )
    _check_plan_identity(plan, candidate)
    if spec["executor_type"] != candidate.executor_type:
        raise SpecError("executor_type", "does not match the persisted candidate")
    return spec


def _worker_rank(item: tuple[int, WorkerRecord, int]) -> tuple[int, int, tuple[int, int, str]]:
    score, record, free = item
    # ADR §2 step 7: score desc, free slots desc, worker id asc — deterministic.
    return (-score, -free, id_sort_key(record.worker_id))


class _Cycle:
    def __init__(
        self,
        *,
        scope: DispatchScope,
        budget: DispatchBudget,
        ports: DispatchPorts,
        secret: bytes,
        pull: PullCredential | None,
        max_offers: int | None,
    ) -> None:
        self.scope = scope
        self.budget = budget
        self.ports = ports
        self.secret = secret
        self.pull = pull
        self.max_offers = max_offers
        self.tally = _Tally()
        self.offers: list[ClaimedExecutionOffer] = []
        self.truncation: CycleReason | None = None
        self.observed_at: datetime | None = None
        self.free_slots: dict[str, int] = {}

    # -- shared helpers ---------------------------------------------------------

    def _truncate(self, reason: CycleReason) -> None:
        # The first budget to run out is the one reported; later ones follow from it.
        if self.truncation is None:
            self.truncation = reason

    def _offers_full(self) -> bool:
        return self.max_offers is not None and len(self.offers) >= self.max_offers

    # -- step 1: recovery -------------------------------------------------------

    def recover(self, observed_at: datetime) -> None:
        scope = self.scope
        # Global scope re-delivers only after the backoff so undelivered leases
        # never starve new candidates (DESIGN §3); a Worker's own pull always may.
        due_before = (
            observed_at - timedelta(seconds=self.budget.redelivery_backoff_s)
            if scope.kind is Scope.GLOBAL
            else None
        )

        def fetch(cursor: str | None, limit: int) -> Page[RecoverableLease]:
            return self.ports.recovery.recover_page(
                scope=scope,
                observed_at=observed_at,
                due_before=due_before,
                max_deliveries=self.budget.max_deliveries,
                cursor=cursor,
                limit=limit,
            )

        def check(lease: RecoverableLease) -> None:
            if lease.expires_at <= observed_at:
                raise _Rejected(CycleReason.RECOVERY_EXPIRED_LEASE)
            if scope.session is not None and lease.session != scope.session:
                raise _Rejected(CycleReason.RECOVERY_SCOPE_MISMATCH)

        reader = _PageReader(
            fetch,
            page_size=self.budget.recovery_page_size,
            max_pages=self.budget.recovery_max_pages,
            key=lambda lease: lease.attempt_id,
            check=check,
        )
        while True:
            if self._offers_full():
                if reader.may_have_more:
                    self._truncate(CycleReason.MAX_OFFERS_REACHED)
                return
            lease = reader.next()
            if lease is None:
                if reader.budget_exhausted:
                    self._truncate(CycleReason.RECOVERY_BUDGET_EXHAUSTED)
                return
            self.offers.append(self._recovered_offer(lease))
            self.tally.recovered += 1

    def _recovered_offer(self, lease: RecoverableLease) -> ClaimedExecutionOffer:
        candidate = lease.as_candidate()
        try:
            plan = self.ports.plans.prepare(candidate)
        except PlanUnavailable:
            raise _Rejected(CycleReason.RECOVERY_PLAN_MISSING) from None
        self.tally.plans_built += 1
        try:
            spec = _checked_spec(plan, candidate)
        except SpecError:
            raise _Rejected(CycleReason.RECOVERY_SPEC_DRIFT) from None
        digest = spec_sha256(spec)
        # ADR §5: only the pinned revision, byte for byte, may be re-delivered.
        if not tokens_equal(digest, lease.spec_sha256):
            raise _Rejected(CycleReason.RECOVERY_SPEC_DRIFT)
        offer_id = offer_id_for(
            attempt_id=lease.attempt_id,
            lease_generation=lease.lease_generation,
            worker_id=lease.worker_id,
            session_id=lease.session_id,
            session_generation=lease.session_generation,
        )
        return ClaimedExecutionOffer(
            offer_id=offer_id,
            source=OfferSource.LEASE_RECOVERY,
            run_id=lease.run_id,
            attempt_id=lease.attempt_id,
            project_id=lease.project_id,
            task_id=lease.task_id,
            task_revision=lease.task_revision,
            priority=lease.priority,
            queued_at=lease.queued_at,
            worker_id=lease.worker_id,
            session_id=lease.session_id,
            session_generation=lease.session_generation,
            lease=LeaseGrant(
                lease_id=lease.lease_id,
                generation=lease.lease_generation,
                token=self._recovered_token(lease, offer_id),
                expires_at=lease.expires_at,
            ),
            spec=spec,
            spec_sha256=digest,
            # ADR §3: recovery never recomputes the score.
            placement_score=lease.placement_score,
        )

    def _recovered_token(self, lease: RecoverableLease, offer_id: str) -> str | None:
        if lease.source == NEW_CLAIM:
            token = derive_lease_token(self.secret, offer_id)
            # A different secret (rotation, misconfiguration) would hand the
            # Worker a token its ACKs can never match: fail closed instead.
            if not tokens_equal(token_digest(token), lease.token_digest):
                raise _Rejected(CycleReason.RECOVERY_TOKEN_MISMATCH)
            return token
        if lease.source == PULL_CLAIM:
            # DESIGN §3: the server cannot reproduce a Worker-generated token; it
            # echoes it only to the request that presented that same pull.
            pull = self.pull
            if (
                pull is not None
                and lease.pull_id is not None
                and pull.pull_id == lease.pull_id
                and tokens_equal(token_digest(pull.token), lease.token_digest)
            ):
                return pull.token
            return None
        raise _Rejected(CycleReason.RECOVERY_TOKEN_MISMATCH)

    # -- steps 2-9: new claims --------------------------------------------------

    def claim_new(self) -> None:
        candidates = _PageReader(
            lambda cursor, limit: self.ports.candidates.candidate_page(cursor=cursor, limit=limit),
            page_size=self.budget.candidate_page_size,
            max_pages=self.budget.candidate_max_pages,
            key=lambda candidate: candidate.attempt_id,
        )
        try:
            self._claim_from(candidates)
        finally:
            self.tally.candidates_seen = candidates.rows_read

    def _claim_from(self, candidates: _PageReader[Candidate]) -> None:
        candidate = candidates.next()
        if candidate is None:
            # Step 2: no candidate, so no Worker, plan or claim call at all.
            if candidates.budget_exhausted:
                self._truncate(CycleReason.CANDIDATE_BUDGET_EXHAUSTED)
            return
        workers = self._worker_snapshot()
        if not workers:
            self.tally.notes.add(CycleReason.NO_WORKERS)
            return
        while candidate is not None:
            # Checked before every read: no page is fetched for candidates that
            # could not be placed anyway (session scope: the Session is full).
            if not any(self.free_slots.values()):
                self.tally.notes.add(CycleReason.NO_FREE_SLOTS)
                return
            if not self._dispatch_candidate(candidate, workers):
                return
            if self._offers_full():
                if candidates.may_have_more:
                    self._truncate(CycleReason.MAX_OFFERS_REACHED)
                return
            if not any(self.free_slots.values()):
                return
            candidate = candidates.next()
        if candidates.budget_exhausted:
            self._truncate(CycleReason.CANDIDATE_BUDGET_EXHAUSTED)

    def _worker_snapshot(self) -> list[WorkerRecord]:
        scope = self.scope
        sessions_seen: set[str] = set()
        last_key: list[tuple[int, int, str]] = []

        def check(record: WorkerRecord) -> None:
            if record.session_id in sessions_seen:
                raise _Rejected(CycleReason.DUPLICATE_ROW)
            sessions_seen.add(record.session_id)
            key = id_sort_key(record.worker_id)
            if last_key and key <= last_key[0]:
                raise _Rejected(CycleReason.WORKER_ORDER_REGRESSION)
            last_key[:] = [key]
            if len(sessions_seen) > HARD_CAPS["worker_total"]:
                raise _Rejected(CycleReason.WORKER_LIMIT_EXCEEDED)
            # Step 8 claims with the Registry record's identity, so in session
            # scope that record must be exactly the authenticated Session.
            if scope.session is not None and record.session != scope.session:
                raise _Rejected(CycleReason.WORKER_SCOPE_MISMATCH)

        reader = _PageReader(
            lambda cursor, limit: self.ports.workers.worker_page(
                scope=scope, cursor=cursor, limit=limit
            ),
            page_size=self.budget.worker_page_size,
            max_pages=self.budget.worker_max_pages,
            key=lambda record: record.worker_id,
            check=check,
        )
        workers: list[WorkerRecord] = []
        try:
            while (record := reader.next()) is not None:
                workers.append(record)
        finally:
            self.tally.workers_seen = reader.rows_read
        if reader.budget_exhausted:
            # Proceed with the part read, but never report it as the whole picture.
            self._truncate(CycleReason.WORKER_BUDGET_EXHAUSTED)
        self.free_slots = {record.worker_id: max(0, record.free_slots) for record in workers}
        return workers

    def _skip(self, reason: CycleReason) -> None:
        self.tally.notes.add(reason)
        if reason in _CANDIDATE_REJECTIONS:
            self.tally.rejected_candidates += 1

    def _dispatch_candidate(self, candidate: Candidate, workers: list[WorkerRecord]) -> bool:
        """Steps 4-8 for one candidate; False when the claim budget stops the cycle."""
        try:
            plan = self.ports.plans.prepare(candidate)
        except PlanUnavailable:
            self._skip(CycleReason.PLAN_MISSING)
            return True
        self.tally.plans_built += 1
        try:
            spec = _checked_spec(plan, candidate)
        except SpecError:
            self._skip(CycleReason.INVALID_SPEC)
            return True
        if not isinstance(plan.placement, Placement):
            self._skip(CycleReason.PLACEMENT_CONFLICT)
            return True
        try:
            placement = normalize_placement(plan.placement, candidate.executor_type)
        except PlacementError:
            self._skip(CycleReason.PLACEMENT_CONFLICT)
            return True
        digest = spec_sha256(spec)

        eligible: list[tuple[int, WorkerRecord, int]] = []
        for record in workers:
            free = self.free_slots[record.worker_id]
            if free <= 0:
                continue
            score = placement_score(
                placement, executor_types=record.executor_types, labels=record.labels
            )
            if score is not None:
                eligible.append((score, record, free))
        if not eligible:
            self._skip(CycleReason.NO_ELIGIBLE_WORKER)
            return True
        eligible.sort(key=_worker_rank)

        for score, record, _ in eligible:
            if self.tally.claims_attempted >= self.budget.max_claim_attempts:
                self._truncate(CycleReason.CLAIM_BUDGET_EXHAUSTED)
                return False
            status = self._claim(candidate, record, score, spec, digest)
            if status is ClaimStatus.WON:
                return True
            if status is ClaimStatus.ATTEMPT_LOST:
                # ADR §4: someone else owns (or changed) this Attempt: never
                # reassign it to another Worker in this cycle.
                break
        self.tally.notes.add(CycleReason.CLAIMS_LOST)
        return True

    def _claim(
        self,
        candidate: Candidate,
        record: WorkerRecord,
        score: int,
        spec: dict[str, object],
        digest: str,
    ) -> ClaimStatus:
        """One claim (step 8); returns WON, WORKER_UNAVAILABLE or ATTEMPT_LOST."""
        generation = candidate.lease_generation + 1
        offer_id = offer_id_for(
            attempt_id=candidate.attempt_id,
            lease_generation=generation,
            worker_id=record.worker_id,
            session_id=record.session_id,
            session_generation=record.session_generation,
        )
        is_global = self.scope.kind is Scope.GLOBAL
        if is_global:
            token = derive_lease_token(self.secret, offer_id)
            pull_id = None
        else:
            assert self.pull is not None  # checked by dispatch_once
            token, pull_id = self.pull.token, self.pull.pull_id
        request = ClaimRequest(
            attempt_id=candidate.attempt_id,
            run_id=candidate.run_id,
            expected_version=candidate.attempt_version,
            lease_generation=generation,
            # Step 8: the Registry record's identity, never a request body's.
            worker_id=record.worker_id,
            session_id=record.session_id,
            session_generation=record.session_generation,
            offer_id=offer_id,
            token_digest=token_digest(token),
            spec_sha256=digest,
            placement_score=score,
            source=NEW_CLAIM if is_global else PULL_CLAIM,
            pull_id=pull_id,
            lease_ttl_s=self.budget.lease_ttl_s,
            skip_locked=is_global,
        )
        self.tally.claims_attempted += 1
        outcome = self.ports.claims.claim(request)
        if outcome.status is ClaimStatus.WON:
            assert outcome.lease_id is not None and outcome.expires_at is not None
            self.tally.claims_won += 1
            self.free_slots[record.worker_id] -= 1
            self.offers.append(
                ClaimedExecutionOffer(
                    offer_id=offer_id,
                    source=OfferSource.NEW_CLAIM,
                    run_id=candidate.run_id,
                    attempt_id=candidate.attempt_id,
                    project_id=candidate.project_id,
                    task_id=candidate.task_id,
                    task_revision=candidate.task_revision,
                    priority=candidate.priority,
                    queued_at=candidate.queued_at,
                    worker_id=record.worker_id,
                    session_id=record.session_id,
                    session_generation=record.session_generation,
                    lease=LeaseGrant(
                        lease_id=outcome.lease_id,
                        generation=generation,
                        token=token,
                        expires_at=outcome.expires_at,
                    ),
                    spec=spec,
                    spec_sha256=digest,
                    placement_score=score,
                )
            )
            return ClaimStatus.WON
        self.tally.claims_lost += 1
        if outcome.status is ClaimStatus.WORKER_UNAVAILABLE:
            # Vanished or full since the snapshot: no more claims to it this cycle.
            self.free_slots[record.worker_id] = 0
            return ClaimStatus.WORKER_UNAVAILABLE
        # Anything but the two known losses is treated as the safe one.
        return ClaimStatus.ATTEMPT_LOST

    # -- result -----------------------------------------------------------------

    def result(self, rejected: CycleReason | None, duration_ms: int) -> DispatchCycleResult:
        tally = self.tally
        offers = tuple(self.offers)
        if rejected is not None:
            # Re-deliveries are dropped; won claims are committed leases and stay.
            offers = tuple(o for o in offers if o.source is OfferSource.NEW_CLAIM)
            status, reason = CycleStatus.REJECTED, rejected
        elif offers:
            status = CycleStatus.OFFERED
            if self.truncation is not None:
                reason = self.truncation
            elif tally.recovered:
                reason = CycleReason.RECOVERED
            else:
                reason = CycleReason.CLAIMED
        elif self.truncation is not None:
            status, reason = CycleStatus.TRUNCATED, self.truncation
        elif tally.candidates_seen:
            status = CycleStatus.NO_MATCH
            reason = next(
                (r for r in _NO_MATCH_PRECEDENCE if r in tally.notes),
                CycleReason.NO_ELIGIBLE_WORKER,
            )
        else:
            status, reason = CycleStatus.IDLE, CycleReason.NO_CANDIDATES
        counts = CycleCounts(
            recovered=tally.recovered if rejected is None else 0,
            candidates_seen=tally.candidates_seen,
            workers_seen=tally.workers_seen,
            plans_built=tally.plans_built,
            claims_attempted=tally.claims_attempted,
            claims_won=tally.claims_won,
            claims_lost=tally.claims_lost,
            offers=len(offers),
        )
        return DispatchCycleResult(
            scope=self.scope.kind,
            status=status,
            reason=reason,
            truncated=self.truncation is not None,
            counts=counts,
            observed_at=self.observed_at,
            duration_ms=duration_ms,
            offers=offers,
            rejected_candidates=tally.rejected_candidates,
        )


def dispatch_once(
    *,
    scope: DispatchScope,
    budget: DispatchBudget,
    ports: DispatchPorts,
    secret: bytes,
    pull: PullCredential | None = None,
    max_offers: int | None = None,
    monotonic: Callable[[], float] = time.monotonic,
) -> DispatchCycleResult:
    """Run one bounded cycle in the fixed authorization order of ADR §2."""
    started = monotonic()
    if scope.kind is Scope.SESSION and pull is None:
        raise ValueError("session scope claims with the Worker's pull credential (ADR-0108)")
    if max_offers is not None and (
        isinstance(max_offers, bool) or not isinstance(max_offers, int) or max_offers < 1
    ):
        raise ValueError("max_offers must be a positive integer or None")
    if not isinstance(secret, bytes) or not secret:
        raise ValueError("the lease secret must be non-empty bytes")

    cycle = _Cycle(
        scope=scope, budget=budget, ports=ports, secret=secret, pull=pull, max_offers=max_offers
    )
    rejected: CycleReason | None = None
    # Step 1: one observed_at for the whole cycle (the database clock).
    observed_at = ports.clock.now()
    if observed_at.tzinfo is None or observed_at.utcoffset() is None:
        raise ValueError("the dispatch clock must return tz-aware datetimes")
    cycle.observed_at = observed_at
    try:
        cycle.recover(observed_at)
        # Step 2 runs only when recovery produced nothing deliverable, and not
        # when recovery itself was cut short by its budget.
        if not cycle.offers and cycle.truncation is None:
            cycle.claim_new()
    except _Rejected as err:
        rejected = err.reason
    duration_ms = max(0, round((monotonic() - started) * 1000))
    return cycle.result(rejected, duration_ms)
