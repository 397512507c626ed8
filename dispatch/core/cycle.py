"""`dispatch_once`: one bounded dispatch cycle over the ports (docs/adr/0001).

No timers, threads or background lifecycle: the caller (Celery beat, the
`run_dispatcher` loop, a Worker's pull) schedules the next cycle. Every read is
paged and capped by the `DispatchBudget` (`dispatch.core.paging`); every port's
contract is re-checked here and a broken one fails the cycle closed.

Committed claims are real leases: if a later page breaks a port contract, the
cycle is REJECTED but keeps the offers of claims it already won, so the caller
can still notify their Workers. If a port raises anything else, the exception
propagates and those leases are re-delivered by the next cycle's recovery
(docs/adr/0002: the active lease, not the offer, is the authority).

Reading order: `dispatch_once` first, then `_Cycle`'s steps in the order they
run, then the pure per-step helpers, then the result bookkeeping.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Final

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
from dispatch.core.paging import PageReader, PortContractError
from dispatch.core.placement import Placement, normalize_placement, placement_score
from dispatch.core.policy import lease_is_live, spec_matches_lease
from dispatch.core.ports import (
    NEW_CLAIM,
    PULL_CLAIM,
    Candidate,
    ClaimRequest,
    ClaimStatus,
    Clock,
    DispatchPlan,
    DispatchPorts,
    DispatchScope,
    Page,
    PlanUnavailable,
    PullCredential,
    RecoverableLease,
    Scope,
    SessionRef,
    WorkerRecord,
    id_sort_key,
)
from dispatch.core.result import CycleCounts, CycleReason, CycleStatus, DispatchCycleResult
from dispatch.core.spec import PreparedSpec, check_spec_identity, spec_sha256, validate_spec

__all__ = ["dispatch_once"]


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
    """Run one bounded cycle in the fixed authorization order of docs/adr/0001.

    1. `_Cycle.recover`: one `observed_at` from the clock, then this scope's
       recoverable leases (global scope: only past the redelivery backoff),
       each re-materialized from its pinned revision (steps 4, 5 and 9 below).
    2. `_Cycle.claim_new`: only when recovery offered nothing, the first
       candidate page (Attempts eligible at `observed_at`: a `not_before` in
       the future is skipped); no candidate stops the cycle (no Worker read,
       no plan, no claim).
    3. `_Cycle.worker_snapshot`: a bounded Worker snapshot by stable cursor
       (a pull: only the pulling Session).
    4. `_Cycle.plan`: one plan per candidate, from the Run's pinned revision.
    5. `_checked_spec`: the one shared spec validator, a deep copy, and the
       plan's identity must be exactly the persisted candidate's.
    6. `_required_placement`: the placement must require the candidate's
       executor type (added when absent, rejected when it conflicts).
    7. `_Cycle.best_worker`: eligible Workers by placement score (desc), free
       slots (desc), worker id (asc); each candidate of a page is placed on
       the best Worker with a slot no earlier candidate of the page was
       promised (`_Cycle._gather`).
    8. `_Cycle.claim_batch`: claim the page's pairs in one call
       (`ClaimPort.claim_many`) with the chosen Registry records' worker,
       session and generation, never with identities from a request; a
       claim that finds its Worker unavailable is tried on the next Worker
       in the next page.
    9. `_build_offer`: only a recovered lease or a won claim yields an offer.
    """
    started = monotonic()
    _check_arguments(scope=scope, pull=pull, max_offers=max_offers, secret=secret)
    cycle = _Cycle(
        scope=scope,
        budget=budget,
        ports=ports,
        secret=secret,
        pull=pull,
        max_offers=max_offers,
        observed_at=_observed_at(ports.clock),
    )
    try:
        cycle.recover()  # step 1 (4, 5 and 9 for each recovered lease)
        cycle.claim_new()  # steps 2-9, only when recovery offered nothing
    except PortContractError as err:
        cycle.rejected = err.reason
    return cycle.result(duration_ms=max(0, round((monotonic() - started) * 1000)))


def _check_arguments(
    *,
    scope: DispatchScope,
    pull: PullCredential | None,
    max_offers: int | None,
    secret: bytes,
) -> None:
    if scope.kind is Scope.SESSION and pull is None:
        raise ValueError("session scope claims with the Worker's pull credential (docs/adr/0003)")
    if max_offers is not None and (
        isinstance(max_offers, bool) or not isinstance(max_offers, int) or max_offers < 1
    ):
        raise ValueError("max_offers must be a positive integer or None")
    if not isinstance(secret, bytes) or not secret:
        raise ValueError("the lease secret must be non-empty bytes")


def _observed_at(clock: Clock) -> datetime:
    """Step 1: one observed_at for the whole cycle (the database clock)."""
    observed_at = clock.now()
    if observed_at.tzinfo is None or observed_at.utcoffset() is None:
        raise ValueError("the dispatch clock must return tz-aware datetimes")
    return observed_at


class _Cycle:
    """The state of one cycle; its public methods are the steps, in order."""

    def __init__(
        self,
        *,
        scope: DispatchScope,
        budget: DispatchBudget,
        ports: DispatchPorts,
        secret: bytes,
        pull: PullCredential | None,
        max_offers: int | None,
        observed_at: datetime,
    ) -> None:
        self.scope = scope
        self.budget = budget
        self.ports = ports
        self.secret = secret
        self.pull = pull
        self.max_offers = max_offers
        self.observed_at = observed_at
        self.tally = _Tally()
        self.offers: list[ClaimedExecutionOffer] = []
        self.truncation: CycleReason | None = None
        self.rejected: CycleReason | None = None
        self.free_slots: dict[str, int] = {}
        # The Worker snapshot's records with their kinds and sort keys (`best_worker`).
        self._kinds: (
            tuple[list[WorkerRecord], list[tuple[WorkerRecord, int, tuple[int, int, str]]]] | None
        ) = None

    # -- step 1: recovery -------------------------------------------------------

    def recover(self) -> None:
        """Re-deliver this scope's active leases (docs/adr/0002), each as an offer."""
        reader = self._recoverable_leases()
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

    def _recoverable_leases(self) -> PageReader[RecoverableLease]:
        scope, observed_at = self.scope, self.observed_at
        # Global scope re-delivers only after the backoff so undelivered leases
        # never starve new candidates; a Worker's own pull always may.
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
            if not lease_is_live(lease.expires_at, observed_at):
                raise PortContractError(CycleReason.RECOVERY_EXPIRED_LEASE)
            if scope.session is not None and lease.session != scope.session:
                raise PortContractError(CycleReason.RECOVERY_SCOPE_MISMATCH)

        return PageReader(
            fetch,
            page_size=self.budget.recovery_page_size,
            max_pages=self.budget.recovery_max_pages,
            key=lambda lease: lease.attempt_id,
            check=check,
        )

    def _recovered_offer(self, lease: RecoverableLease) -> ClaimedExecutionOffer:
        """Steps 4, 5 and 9 for a recovered lease: any doubt fails the cycle closed."""
        candidate = lease.as_candidate()
        try:
            plan = self.plan(candidate)
        except PlanUnavailable:
            raise PortContractError(CycleReason.RECOVERY_PLAN_MISSING) from None
        try:
            spec, digest = _checked_spec(plan, candidate)
        except SpecError:
            raise PortContractError(CycleReason.RECOVERY_SPEC_DRIFT) from None
        # docs/adr/0002: only the pinned revision, byte for byte, is re-delivered.
        if not spec_matches_lease(digest, lease.spec_sha256):
            raise PortContractError(CycleReason.RECOVERY_SPEC_DRIFT)
        offer_id = _offer_id(candidate, lease.lease_generation, lease.session)
        return _build_offer(
            source=OfferSource.LEASE_RECOVERY,
            offer_id=offer_id,
            candidate=candidate,
            session=lease.session,
            lease=LeaseGrant(
                lease_id=lease.lease_id,
                generation=lease.lease_generation,
                token=self._recovered_token(lease, offer_id),
                expires_at=lease.expires_at,
            ),
            spec=spec,
            digest=digest,
            # Recovery never recomputes the score (docs/adr/0002).
            placement_score=lease.placement_score,
        )

    def _recovered_token(self, lease: RecoverableLease, offer_id: str) -> str | None:
        if lease.source == NEW_CLAIM:
            token = derive_lease_token(self.secret, offer_id)
            # A different secret (rotation, misconfiguration) would hand the
            # Worker a token its ACKs can never match: fail closed instead.
            if not tokens_equal(token_digest(token), lease.token_digest):
                raise PortContractError(CycleReason.RECOVERY_TOKEN_MISMATCH)
            return token
        if lease.source == PULL_CLAIM:
            # docs/adr/0003: the server cannot reproduce a Worker-generated
            # token; it echoes it only to the request that presented that pull.
            pull = self.pull
            if (
                pull is not None
                and lease.pull_id is not None
                and pull.pull_id == lease.pull_id
                and tokens_equal(token_digest(pull.token), lease.token_digest)
            ):
                return pull.token
            return None
        raise PortContractError(CycleReason.RECOVERY_TOKEN_MISMATCH)

    # -- step 2: candidates -------------------------------------------------------

    def claim_new(self) -> None:
        """Steps 2-9, only when recovery produced nothing deliverable and was not
        itself cut short by its budget."""
        if self.offers or self.truncation is not None:
            return
        observed_at = self.observed_at
        candidates = PageReader(
            lambda cursor, limit: self.ports.candidates.candidate_page(
                observed_at=observed_at, cursor=cursor, limit=limit, scope=self.scope
            ),
            page_size=self.budget.candidate_page_size,
            max_pages=self.budget.candidate_max_pages,
            key=lambda candidate: candidate.attempt_id,
        )
        try:
            self._claim_from(candidates)
        finally:
            self.tally.candidates_seen = candidates.rows_read

    def _claim_from(self, candidates: PageReader[Candidate]) -> None:
        candidate = candidates.next()  # step 2
        if candidate is None:
            # No candidate, so no Worker, plan or claim call at all.
            if candidates.budget_exhausted:
                self._truncate(CycleReason.CANDIDATE_BUDGET_EXHAUSTED)
            return
        workers = self.worker_snapshot()  # step 3
        if not workers:
            self.tally.notes.add(CycleReason.NO_WORKERS)
            return
        if not any(self.free_slots.values()):
            self.tally.notes.add(CycleReason.NO_FREE_SLOTS)
            return
        page = _ClaimPage(candidates=candidates, fresh=deque([candidate]))
        while True:
            broken: PortContractError | None = None
            try:
                self._gather(page, workers)  # steps 4-7 for each candidate of the page
            except PortContractError as err:
                # A later candidate page broke its contract: the pairs already
                # chosen came from good pages and are claimed before failing closed.
                broken = err
            claimed = bool(page.batch)
            if page.batch:
                self.claim_batch(page)  # step 8 (and 9)
            if broken is not None:
                raise broken
            if self._offers_full():
                if page.may_have_more:
                    self._truncate(CycleReason.MAX_OFFERS_REACHED)
                return
            if page.stopped:
                # The claim budget is spent; truncated if anything may be left:
                # a candidate sent back by this page, or one not read yet.
                if page.may_have_more:
                    self._truncate(CycleReason.CLAIM_BUDGET_EXHAUSTED)
                return
            if not any(self.free_slots.values()):
                return
            if not claimed:
                if candidates.budget_exhausted:
                    self._truncate(CycleReason.CANDIDATE_BUDGET_EXHAUSTED)
                return

    # -- step 3: the Worker snapshot ----------------------------------------------

    def worker_snapshot(self) -> list[WorkerRecord]:
        scope = self.scope
        sessions_seen: set[str] = set()
        last_key: list[tuple[int, int, str]] = []

        def check(record: WorkerRecord) -> None:
            if record.session_id in sessions_seen:
                raise PortContractError(CycleReason.DUPLICATE_ROW)
            sessions_seen.add(record.session_id)
            key = id_sort_key(record.worker_id)
            if last_key and key <= last_key[0]:
                raise PortContractError(CycleReason.WORKER_ORDER_REGRESSION)
            last_key[:] = [key]
            if len(sessions_seen) > HARD_CAPS["worker_total"]:
                raise PortContractError(CycleReason.WORKER_LIMIT_EXCEEDED)
            # Step 8 claims with the Registry record's identity, so in session
            # scope that record must be exactly the authenticated Session.
            if scope.session is not None and record.session != scope.session:
                raise PortContractError(CycleReason.WORKER_SCOPE_MISMATCH)

        reader = PageReader(
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

    # -- steps 4-8, a page of claims at once --------------------------------------
    #
    # The candidates are placed one after the other, each on the best Worker
    # with a slot not yet promised to an earlier candidate of the page, until
    # no slot, offer or claim is left to promise; then the whole page is
    # claimed with one call (`ClaimPort.claim_many`), which the database
    # writes in one transaction. A claim that finds its Worker unavailable
    # sends its candidate back to the next page with that Worker left out; a
    # candidate whose Workers were all promised away waits for the next page,
    # where the slots that were not won are free again.

    def _gather(self, page: _ClaimPage, workers: list[WorkerRecord]) -> None:
        """Steps 4-7: choose the page's (candidate, Worker) pairs into `page.batch`."""
        page.batch = []
        promised = dict(self.free_slots)
        deferred: list[_Placed] = []
        room = None if self.max_offers is None else self.max_offers - len(self.offers)
        try:
            while any(free > 0 for free in promised.values()):
                # Checked before every read: no page is fetched for candidates
                # that could not be placed anyway (session scope: the Session is full).
                if room is not None and len(page.batch) >= room:
                    return
                if self.tally.claims_attempted + len(page.batch) >= self.budget.max_claim_attempts:
                    # Every claim this cycle may make is spent: no candidate is
                    # read (nor planned) just to find that out (`_claim_from`).
                    page.stopped = True
                    return
                placed = page.next_placed(self)
                if placed is None:
                    return
                best = self.best_worker(placed.placement, workers, promised, placed.tried)
                if best is None:
                    if self.best_worker(placed.placement, workers, self.free_slots, placed.tried):
                        deferred.append(placed)  # its slots were promised to earlier ones
                    elif not placed.tried:
                        self._skip(CycleReason.NO_ELIGIBLE_WORKER)
                    # else: tried everywhere it could go, each loss noted: done.
                    continue
                score, record = best
                page.batch.append((placed, score, record))
                promised[record.worker_id] -= 1
        finally:
            page.waiting.extendleft(reversed(deferred))

    def place(self, candidate: Candidate) -> _Placed | None:
        """Steps 4-6 for one candidate; None when it is skipped (the reason noted)."""
        try:
            plan = self.plan(candidate)  # step 4
        except PlanUnavailable:
            self._skip(CycleReason.PLAN_MISSING)
            return None
        try:
            spec, digest = _checked_spec(plan, candidate)  # step 5
        except SpecError:
            self._skip(CycleReason.INVALID_SPEC)
            return None
        try:
            placement = _required_placement(plan, candidate)  # step 6
        except PlacementError:
            self._skip(CycleReason.PLACEMENT_CONFLICT)
            return None
        return _Placed(candidate=candidate, spec=spec, digest=digest, placement=placement)

    def plan(self, candidate: Candidate) -> DispatchPlan:
        """Step 4: the plan from the Run's pinned revision; raises PlanUnavailable."""
        plan = self.ports.plans.prepare(candidate)
        self.tally.plans_built += 1
        return plan

    # Step 5 is `_checked_spec`, step 6 `_required_placement` (pure, below).

    def best_worker(
        self,
        placement: Placement,
        workers: list[WorkerRecord],
        free_slots: Mapping[str, int],
        excluded: AbstractSet[str],
    ) -> tuple[int, WorkerRecord] | None:
        """Step 7: (score, record) of the best eligible Worker — placement score
        desc, free slots desc, worker id asc — or None when none is eligible."""
        # Workers with the same executor types and labels score the same: each
        # kind is scored once per candidate, not each Worker (`_kinds`).
        scores: dict[int, int | None] = {}
        best: tuple[int, int, tuple[int, int, str]] | None = None
        chosen: tuple[int, WorkerRecord] | None = None
        for record, kind, id_key in self._ranked_workers(workers):
            free = free_slots[record.worker_id]
            if free <= 0 or record.worker_id in excluded:
                continue
            if kind in scores:
                score = scores[kind]
            else:
                score = scores[kind] = placement_score(
                    placement, executor_types=record.executor_types, labels=record.labels
                )
            if score is None:
                continue
            rank = (-score, -free, id_key)
            if best is None or rank < best:
                best, chosen = rank, (score, record)
        return chosen

    def _ranked_workers(
        self, workers: list[WorkerRecord]
    ) -> list[tuple[WorkerRecord, int, tuple[int, int, str]]]:
        """Each Worker with its kind (same executor types and labels: same score)
        and its id's sort key, worked out once per snapshot."""
        if self._kinds is None or self._kinds[0] is not workers:
            kinds: dict[tuple[frozenset[str], frozenset[tuple[str, str]]], int] = {}
            rows = [
                (
                    record,
                    kinds.setdefault(
                        (record.executor_types, frozenset(record.labels.items())), len(kinds)
                    ),
                    id_sort_key(record.worker_id),
                )
                for record in workers
            ]
            self._kinds = (workers, rows)
        return self._kinds[1]

    def claim_batch(self, page: _ClaimPage) -> None:
        """Step 8: claim the page's pairs with the chosen Registry records' worker,
        session and generation, in one call; each won claim becomes an offer (step 9)."""
        batch = page.batch
        made = [self._request(placed, record, score) for placed, score, record in batch]
        requests = [request for request, _ in made]
        self.tally.claims_attempted += len(requests)
        outcomes = tuple(self.ports.claims.claim_many(requests))
        if len(outcomes) != len(requests):
            # Which claims won is unknown: fail, and let recovery re-deliver them.
            raise RuntimeError("the claim port must answer every request of a page")
        retry: list[_Placed] = []
        for (placed, score, record), (request, token), outcome in zip(
            batch, made, outcomes, strict=True
        ):
            if outcome.status is ClaimStatus.WON:
                assert outcome.lease_id is not None and outcome.expires_at is not None
                self.tally.claims_won += 1
                self.free_slots[record.worker_id] -= 1
                self.offers.append(
                    _build_offer(
                        source=OfferSource.NEW_CLAIM,
                        offer_id=request.offer_id,
                        candidate=placed.candidate,
                        session=record.session,
                        lease=LeaseGrant(
                            lease_id=outcome.lease_id,
                            generation=request.lease_generation,
                            token=token,
                            expires_at=outcome.expires_at,
                        ),
                        spec=placed.spec,
                        digest=placed.digest,
                        placement_score=score,
                    )
                )
                continue
            self.tally.claims_lost += 1
            self.tally.notes.add(CycleReason.CLAIMS_LOST)
            if outcome.status is ClaimStatus.WORKER_UNAVAILABLE:
                # Vanished or full since the snapshot: no more claims to it this
                # cycle; the candidate may still go to the next Worker.
                self.free_slots[record.worker_id] = 0
                placed.tried.add(record.worker_id)
                retry.append(placed)
            # Anything else (ATTEMPT_LOST, or an unknown answer, treated as the
            # safe one): someone else owns (or changed) this Attempt, never
            # reassign it to another Worker in this cycle (docs/adr/0001).
        page.waiting.extendleft(reversed(retry))
        page.batch = []

    def _request(
        self, placed: _Placed, record: WorkerRecord, score: int
    ) -> tuple[ClaimRequest, str]:
        """The claim of one pair, and the lease token it grants."""
        candidate = placed.candidate
        generation = candidate.lease_generation + 1
        offer_id = _offer_id(candidate, generation, record.session)
        if self.scope.kind is Scope.GLOBAL:
            token, pull_id, source = derive_lease_token(self.secret, offer_id), None, NEW_CLAIM
        else:
            assert self.pull is not None  # checked by dispatch_once
            token, pull_id, source = self.pull.token, self.pull.pull_id, PULL_CLAIM
        request = ClaimRequest(
            attempt_id=candidate.attempt_id,
            run_id=candidate.run_id,
            expected_version=candidate.attempt_version,
            lease_generation=generation,
            # The Registry record's identity, never a request body's.
            worker_id=record.worker_id,
            session_id=record.session_id,
            session_generation=record.session_generation,
            offer_id=offer_id,
            token_digest=token_digest(token),
            spec_sha256=placed.digest,
            placement_score=score,
            source=source,
            pull_id=pull_id,
            lease_ttl_s=self.budget.lease_ttl_s,
            skip_locked=self.scope.kind is Scope.GLOBAL,
        )
        return request, token

    # -- bookkeeping ----------------------------------------------------------------

    def _truncate(self, reason: CycleReason) -> None:
        # The first budget to run out is the one reported; later ones follow from it.
        if self.truncation is None:
            self.truncation = reason

    def _offers_full(self) -> bool:
        return self.max_offers is not None and len(self.offers) >= self.max_offers

    def _skip(self, reason: CycleReason) -> None:
        """This candidate is passed over; the cycle goes on."""
        self.tally.notes.add(reason)
        if reason in _CANDIDATE_REJECTIONS:
            self.tally.rejected_candidates += 1

    def result(self, *, duration_ms: int) -> DispatchCycleResult:
        tally, rejected = self.tally, self.rejected
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


# ------------------------------------------------------------ pure step helpers


def _checked_spec(plan: DispatchPlan, candidate: Candidate) -> tuple[Mapping[str, object], str]:
    """Step 5: the validated deep copy of the plan's spec and its digest.

    A `PreparedSpec` is validated already (its revision's part once, its
    Run's ids when it was made) and read-only: it is its own copy, its digest
    computed when it was made. Raises SpecError unless spec and plan are for
    exactly the persisted candidate (run, attempt, project, task, revision,
    executor type).
    """
    prepared = plan.spec if isinstance(plan.spec, PreparedSpec) else None
    spec = validate_spec(plan.spec) if prepared is None else prepared
    check_spec_identity(
        spec,
        run_id=candidate.run_id,
        attempt_id=candidate.attempt_id,
        project_id=candidate.project_id,
        task_id=candidate.task_id,
        task_revision=candidate.task_revision,
    )
    for name in ("run_id", "attempt_id", "project_id", "task_id", "task_revision"):
        got, want = getattr(plan, name), getattr(candidate, name)
        if type(got) is not type(want) or got != want:
            raise SpecError(name, "plan does not match the persisted candidate")
    if spec["executor_type"] != candidate.executor_type:
        raise SpecError("executor_type", "does not match the persisted candidate")
    return spec, spec_sha256(spec) if prepared is None else prepared.sha256


def _required_placement(plan: DispatchPlan, candidate: Candidate) -> Placement:
    """Step 6: the plan's placement, requiring the candidate's executor type.

    Raises PlacementError when it is not a Placement or conflicts.
    """
    if not isinstance(plan.placement, Placement):
        raise PlacementError("placement", "the plan carries no Placement")
    return normalize_placement(plan.placement, candidate.executor_type)


def _offer_id(candidate: Candidate, lease_generation: int, session: SessionRef) -> str:
    return offer_id_for(
        attempt_id=candidate.attempt_id,
        lease_generation=lease_generation,
        worker_id=session.worker_id,
        session_id=session.session_id,
        session_generation=session.session_generation,
    )


def _build_offer(
    *,
    source: OfferSource,
    offer_id: str,
    candidate: Candidate,
    session: SessionRef,
    lease: LeaseGrant,
    spec: Mapping[str, object],
    digest: str,
    placement_score: int | None,
) -> ClaimedExecutionOffer:
    """Step 9, the one place an offer is assembled: the candidate's persisted
    identity and ordering facts, the granted Session, the lease, the checked
    spec copy and its digest (docs/adr/0002)."""
    return ClaimedExecutionOffer(
        offer_id=offer_id,
        source=source,
        run_id=candidate.run_id,
        attempt_id=candidate.attempt_id,
        project_id=candidate.project_id,
        task_id=candidate.task_id,
        task_revision=candidate.task_revision,
        priority=candidate.priority,
        queued_at=candidate.queued_at,
        worker_id=session.worker_id,
        session_id=session.session_id,
        session_generation=session.session_generation,
        lease=lease,
        spec=spec,
        spec_sha256=digest,
        placement_score=placement_score,
    )


# ------------------------------------------------------------- a page of claims


@dataclass
class _Placed:
    """A candidate past steps 4-6, and the Workers whose claims found them unavailable."""

    candidate: Candidate
    spec: Mapping[str, object] = field(repr=False)
    digest: str
    placement: Placement
    tried: set[str] = field(default_factory=set)


@dataclass
class _ClaimPage:
    """The candidates of the cycle on their way to claims.

    `fresh`: read (step 2) but not placed yet; `waiting`: placed, to be
    claimed on a later page (sent back by an unavailable Worker, or whose
    slots an earlier candidate of the page was promised); `batch`: the
    pairs of the page being claimed.
    """

    candidates: PageReader[Candidate]
    fresh: deque[Candidate]
    waiting: deque[_Placed] = field(default_factory=deque)
    batch: list[tuple[_Placed, int, WorkerRecord]] = field(default_factory=list)
    stopped: bool = False  # the claim budget is spent: this page is the cycle's last

    def next_placed(self, cycle: _Cycle) -> _Placed | None:
        """The next candidate to claim, in keyset order: a waiting one, else the
        next read and placed (skipped ones are noted and passed over)."""
        if self.waiting:
            return self.waiting.popleft()
        while True:
            candidate = self.fresh.popleft() if self.fresh else self.candidates.next()
            if candidate is None:
                return None
            placed = cycle.place(candidate)
            if placed is not None:
                return placed

    @property
    def may_have_more(self) -> bool:
        return bool(self.waiting or self.fresh) or self.candidates.may_have_more


# ----------------------------------------------------------- result bookkeeping


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
