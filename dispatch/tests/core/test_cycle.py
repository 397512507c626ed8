"""dispatch_once over the in-memory fakes: the rules of docs/adr/0001-0003, in order."""

from __future__ import annotations

import copy
import json
import logging
import pickle
from dataclasses import replace
from datetime import timedelta

import pytest

from dispatch.core.budget import DispatchBudget
from dispatch.core.cycle import dispatch_once
from dispatch.core.fakes import FakeClaimPort, FakePlanSource, FakeStore, fake_ports
from dispatch.core.offer import OfferSource, derive_lease_token, offer_id_for, token_digest
from dispatch.core.placement import Placement
from dispatch.core.ports import (
    Candidate,
    ClaimOutcome,
    ClaimRequest,
    DispatchPlan,
    DispatchPorts,
    DispatchScope,
    Page,
    PullCredential,
    RecoverableLease,
    Scope,
)
from dispatch.core.result import CycleReason, CycleStatus, DispatchCycleResult
from dispatch.core.spec import spec_sha256, validate_spec
from dispatch.tests.core._builders import (
    CANARY,
    SECRET,
    definition,
    enqueue,
    run,
    secret_definition,
)
from dispatch.tests.core.misbehaving import (
    MisbehavingCandidateSource,
    MisbehavingClaimPort,
    MisbehavingLeaseRecoverySource,
    MisbehavingPlanSource,
    MisbehavingWorkerSnapshotSource,
    UnfilteredCandidateSource,
)

PULL = PullCredential(pull_id="6f1f7a36-0000-4000-8000-000000000001", token="W" * 43)


def claimed_store(leases: int = 1, **task: object) -> tuple[FakeStore, DispatchCycleResult]:
    """A store whose `leases` Runs were claimed by one global cycle (then 'restart')."""
    store = FakeStore()
    store.add_worker(slots=leases)
    enqueue(store, leases, **task)
    first = run(store.ports())
    assert first.counts.claims_won == leases
    return store, first


def after_backoff(store: FakeStore) -> None:
    store.advance(DispatchBudget().redelivery_backoff_s + 1)


def call_counts(ports: DispatchPorts) -> dict[str, int]:
    return {
        "recovery": len(ports.recovery.calls),  # type: ignore[attr-defined]
        "candidates": len(ports.candidates.calls),  # type: ignore[attr-defined]
        "workers": len(ports.workers.calls),  # type: ignore[attr-defined]
        "plans": len(ports.plans.calls),  # type: ignore[attr-defined]
        "claims": len(ports.claims.calls),  # type: ignore[attr-defined]
    }


def unfiltered(store: FakeStore) -> DispatchPorts:
    """Ports whose candidate read does not skip what cannot be served now
    (docs/adr/0012): the cycle's own checks behind it are what is tested."""
    return fake_ports(store, candidates=UnfilteredCandidateSource(store))


def claims_of(ports: DispatchPorts) -> list[ClaimRequest]:
    return ports.claims.calls  # type: ignore[attr-defined]


# ---------------------------------------------------------------- (1) no candidate


def test_no_candidate_reads_no_workers() -> None:
    store = FakeStore()
    store.add_worker()
    ports = store.ports()
    result = run(ports)
    assert (result.status, result.reason, result.truncated) == (
        CycleStatus.IDLE,
        CycleReason.NO_CANDIDATES,
        False,
    )
    assert call_counts(ports) == {
        "recovery": 1,
        "candidates": 1,
        "workers": 0,
        "plans": 0,
        "claims": 0,
    }
    assert result.offers == ()
    assert result.counts.as_dict() == dict.fromkeys(result.counts.as_dict(), 0)


def test_a_queued_run_is_claimed_with_a_derived_token() -> None:
    store = FakeStore()
    worker = store.add_worker()
    [(run_id, attempt_id)] = enqueue(store)
    result = run(store.ports())
    assert (result.status, result.reason) == (CycleStatus.OFFERED, CycleReason.CLAIMED)
    [offer] = result.offers
    expected_id = offer_id_for(
        attempt_id=attempt_id,
        lease_generation=1,
        worker_id=worker.worker_id,
        session_id=worker.session_id,
        session_generation=worker.session_generation,
    )
    assert (offer.offer_id, offer.source, offer.run_id) == (
        expected_id,
        OfferSource.NEW_CLAIM,
        run_id,
    )
    assert offer.lease.token == derive_lease_token(SECRET, expected_id)
    lease = store.active_lease_for(attempt_id)
    assert lease is not None
    assert lease.token_digest == token_digest(offer.lease.token)
    assert lease.spec_sha256 == offer.spec_sha256 == spec_sha256(offer.spec)
    assert (store.attempts[attempt_id].state, store.runs[run_id].state) == (
        "claimed",
        "dispatching",
    )
    assert result.counts.as_dict() == {
        "recovered": 0,
        "candidates_seen": 1,
        "workers_seen": 1,
        "plans_built": 1,
        "claims_attempted": 1,
        "claims_won": 1,
        "claims_lost": 0,
        "offers": 1,
    }


def test_one_observed_at_and_global_backoff_go_to_recovery() -> None:
    store = FakeStore()
    ports = store.ports()
    ticks = iter([10.0, 10.25])
    result = dispatch_once(
        scope=DispatchScope.global_(),
        budget=DispatchBudget(),
        ports=ports,
        secret=SECRET,
        monotonic=lambda: next(ticks),
    )
    now = store.clock.now()
    [call] = ports.recovery.calls  # type: ignore[attr-defined]
    assert call["observed_at"] == now == result.observed_at
    assert call["due_before"] == now - timedelta(seconds=5)
    assert call["max_deliveries"] == 5
    assert result.duration_ms == 250


# ---------------------------------------------------------------- (2) placement


def test_placement_picks_the_best_worker_and_claims_with_its_record_identity() -> None:
    store = FakeStore()
    store.add_worker(labels={"zone": "b", "disk": "ssd"}, slots=4)  # fails required
    store.add_worker(labels={"zone": "a"}, slots=4)  # eligible, score 0
    best = store.add_worker(labels={"zone": "a", "disk": "ssd"}, slots=1)
    best = store.replace_session(best.worker_id)  # generation 2: it must come from the record
    enqueue(
        store,
        placement={
            "required_labels": {"zone": "a"},
            "preferred": [{"labels": {"disk": "ssd"}, "weight": 10}],
        },
    )
    ports = store.ports()
    result = run(ports)
    [request] = claims_of(ports)
    assert (request.worker_id, request.session_id, request.session_generation) == (
        best.worker_id,
        best.session_id,
        2,
    )
    assert request.placement_score == 10
    assert (request.source, request.pull_id, request.skip_locked) == ("new_claim", None, True)
    [offer] = result.offers
    assert (offer.worker_id, offer.session_id, offer.session_generation) == (
        best.worker_id,
        best.session_id,
        2,
    )
    assert offer.placement_score == 10


def test_equal_scores_prefer_more_free_slots_then_numeric_worker_id() -> None:
    store = FakeStore()
    store.add_worker(worker_id="10", slots=1)
    store.add_worker(worker_id="9", slots=1)
    enqueue(store)
    ports = store.ports()
    run(ports)
    assert [c.worker_id for c in claims_of(ports)] == ["9"]  # 9 < 10 numerically

    store = FakeStore()
    store.add_worker(worker_id="10", slots=3)
    store.add_worker(worker_id="9", slots=1)
    enqueue(store)
    ports = store.ports()
    run(ports)
    assert [c.worker_id for c in claims_of(ports)] == ["10"]


def test_workers_of_one_kind_are_scored_once_per_candidate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Issue #12: ranking 64 alike Workers per candidate scored each of them;
    # Workers with the same executor types and labels score the same.
    from dispatch.core.placement import placement_score as original

    scored: list[frozenset[str]] = []

    def counting(placement: Placement, **record: object) -> int | None:
        scored.append(frozenset(record))
        return original(placement, **record)  # type: ignore[arg-type]

    monkeypatch.setattr("dispatch.core.cycle.placement_score", counting)
    store = FakeStore()
    for _ in range(5):
        store.add_worker(labels={"zone": "a"}, slots=1)
    ssd = [store.add_worker(labels={"zone": "a", "disk": "ssd"}, slots=1) for _ in range(2)]
    enqueue(store, 3, placement={"preferred": [{"labels": {"disk": "ssd"}, "weight": 5}]})
    ports = store.ports()
    result = run(ports)
    # Two kinds, three candidates: six scores, not 3 x 7 (fewer once slots fill).
    assert len(scored) <= 6
    # And still the best first: the two ssd Workers, then the lowest id.
    assert [c.worker_id for c in claims_of(ports)][:2] == [ssd[0].worker_id, ssd[1].worker_id]
    assert [c.placement_score for c in claims_of(ports)] == [5, 5, 0]
    assert result.counts.claims_won == 3


def test_absent_placement_executor_type_is_required_of_workers() -> None:
    store = FakeStore()
    store.add_worker(executor_types=("docker",))
    enqueue(store)
    ports = unfiltered(store)
    result = run(ports)
    assert (result.status, result.reason) == (CycleStatus.NO_MATCH, CycleReason.NO_ELIGIBLE_WORKER)
    assert call_counts(ports)["claims"] == 0
    assert result.offers == ()


def test_conflicting_plan_placement_skips_the_candidate() -> None:
    store = FakeStore()
    store.add_worker(executor_types=("process", "docker"))
    enqueue(store)
    ports = fake_ports(
        store, plans=MisbehavingPlanSource(store, placement_override=Placement("docker", {}, ()))
    )
    result = run(ports)
    assert (result.status, result.reason) == (CycleStatus.NO_MATCH, CycleReason.PLACEMENT_CONFLICT)
    assert result.rejected_candidates == 1
    assert call_counts(ports)["claims"] == 0


# ---------------------------------------------------------------- (3) paging and fail closed


def test_candidate_paging_stops_at_the_page_budget() -> None:
    store = FakeStore()
    store.add_worker(slots=10)
    enqueue(store, 5)
    ports = store.ports()
    result = run(ports, budget={"candidate_page_size": 2, "candidate_max_pages": 2})
    assert [c["limit"] for c in ports.candidates.calls] == [2, 2]  # type: ignore[attr-defined]
    assert (result.status, result.reason, result.truncated) == (
        CycleStatus.OFFERED,
        CycleReason.CANDIDATE_BUDGET_EXHAUSTED,
        True,
    )
    assert result.counts.candidates_seen == 4
    assert len(result.offers) == 4


def test_candidate_pages_are_read_only_while_needed() -> None:
    store = FakeStore()
    store.add_worker(slots=1)
    enqueue(store, 3)
    ports = store.ports()
    result = run(ports, budget={"candidate_page_size": 1, "candidate_max_pages": 3})
    assert call_counts(ports)["candidates"] == 1
    assert (result.status, result.reason, result.truncated) == (
        CycleStatus.OFFERED,
        CycleReason.CLAIMED,
        False,
    )


def test_candidates_are_dispatched_in_keyset_order() -> None:
    store = FakeStore()
    store.add_worker(slots=10)
    _, task_id, _ = store.add_task(definition=definition())
    low = store.add_run(task_id=task_id, priority=0)
    store.advance(1)
    high_late = store.add_run(task_id=task_id, priority=5)
    store.advance(1)
    high_later = store.add_run(task_id=task_id, priority=5)
    result = run(store.ports())
    assert [o.attempt_id for o in result.offers] == [high_late[1], high_later[1], low[1]]


def test_worker_paging_stops_at_the_budget_and_says_truncated_not_no_match() -> None:
    store = FakeStore()
    for _ in range(4):
        store.add_worker(labels={"zone": "a"})
    store.add_worker(labels={"zone": "z"})  # the only match, beyond the budget
    enqueue(store, placement={"required_labels": {"zone": "z"}})
    ports = store.ports()
    result = run(ports, budget={"worker_page_size": 2, "worker_max_pages": 2})
    assert call_counts(ports)["workers"] == 2
    assert result.counts.workers_seen == 4
    assert (result.status, result.reason, result.truncated) == (
        CycleStatus.TRUNCATED,
        CycleReason.WORKER_BUDGET_EXHAUSTED,
        True,
    )


def _three_workers_two_runs(store: FakeStore) -> None:
    for _ in range(3):
        store.add_worker()
    enqueue(store, 2)


@pytest.mark.parametrize(
    ("knob", "reason"),
    [
        ({"duplicate_rows": True}, CycleReason.DUPLICATE_ROW),
        ({"stuck_cursor": True}, CycleReason.CURSOR_NOT_ADVANCING),
        ({"oversize": True}, CycleReason.PAGE_OVERSIZE),
        ({"order_regression": True}, CycleReason.WORKER_ORDER_REGRESSION),
    ],
)
def test_a_broken_worker_snapshot_rejects_the_cycle_before_any_claim(
    knob: dict[str, bool], reason: CycleReason
) -> None:
    store = FakeStore()
    for _ in range(5):
        store.add_worker()
    enqueue(store)
    ports = fake_ports(store, workers=MisbehavingWorkerSnapshotSource(store, **knob))
    result = run(ports, budget={"worker_page_size": 2, "worker_max_pages": 3})
    assert (result.status, result.reason) == (CycleStatus.REJECTED, reason)
    assert call_counts(ports)["plans"] == call_counts(ports)["claims"] == 0
    assert result.offers == ()


def test_worker_outside_the_session_scope_rejects_the_cycle() -> None:
    store = FakeStore()
    store.add_worker()
    me = store.add_worker()
    enqueue(store)
    ports = fake_ports(store, workers=MisbehavingWorkerSnapshotSource(store, ignore_scope=True))
    result = run(ports, scope=DispatchScope.for_session(me), pull=PULL)
    assert (result.status, result.reason) == (
        CycleStatus.REJECTED,
        CycleReason.WORKER_SCOPE_MISMATCH,
    )
    assert call_counts(ports)["claims"] == 0


@pytest.mark.parametrize(
    ("knob", "reason"),
    [
        ({"stuck_cursor": True}, CycleReason.CURSOR_NOT_ADVANCING),
        ({"duplicate_rows": True}, CycleReason.DUPLICATE_ROW),
    ],
)
def test_a_broken_later_candidate_page_rejects_but_keeps_committed_claims(
    knob: dict[str, bool], reason: CycleReason
) -> None:
    store = FakeStore()
    store.add_worker(slots=10)
    enqueue(store, 5)
    ports = fake_ports(store, candidates=MisbehavingCandidateSource(store, **knob))
    result = run(ports, budget={"candidate_page_size": 2, "candidate_max_pages": 3})
    assert (result.status, result.reason) == (CycleStatus.REJECTED, reason)
    # The first page's claims are committed leases: their offers are kept so the
    # caller can notify the Workers (and recovery would re-deliver them anyway).
    assert len(result.offers) == result.counts.claims_won == 2
    assert all(o.source is OfferSource.NEW_CLAIM for o in result.offers)


def test_an_over_size_candidate_page_rejects_before_reading_workers() -> None:
    store = FakeStore()
    store.add_worker(slots=10)
    enqueue(store, 5)
    ports = fake_ports(store, candidates=MisbehavingCandidateSource(store, oversize=True))
    result = run(ports, budget={"candidate_page_size": 2})
    assert (result.status, result.reason) == (CycleStatus.REJECTED, CycleReason.PAGE_OVERSIZE)
    assert call_counts(ports)["workers"] == call_counts(ports)["claims"] == 0


# ---------------------------------------------------------------- (4) races


def test_a_worker_gone_after_the_snapshot_lets_the_next_matched_worker_be_tried() -> None:
    store = FakeStore()
    first = store.add_worker(labels={"disk": "ssd"})
    second = store.add_worker()
    enqueue(store, placement={"preferred": [{"labels": {"disk": "ssd"}, "weight": 1}]})
    ports = fake_ports(
        store, claims=MisbehavingClaimPort(store, vanished_workers={first.worker_id})
    )
    result = run(ports)
    assert [c.worker_id for c in claims_of(ports)] == [first.worker_id, second.worker_id]
    assert (result.status, result.counts.claims_lost, result.counts.claims_won) == (
        CycleStatus.OFFERED,
        1,
        1,
    )
    assert result.offers[0].worker_id == second.worker_id


def test_a_full_worker_gets_no_further_claims_this_cycle() -> None:
    store = FakeStore()
    full = store.add_worker(slots=2)
    other = store.add_worker(slots=1)
    enqueue(store, 2)

    class FilledBySomeoneElse(FakeClaimPort):
        def _claim(self, request: ClaimRequest) -> ClaimOutcome:
            # Another dispatcher fills `full` between our snapshot and our claim.
            store.workers[full.worker_id].slots = 0
            return super()._claim(request)

    ports = fake_ports(store, claims=FilledBySomeoneElse(store))
    result = run(ports)
    # The first page promised both of `full`'s slots; the next leaves it out.
    assert [c.worker_id for c in claims_of(ports)] == [
        full.worker_id,
        full.worker_id,
        other.worker_id,
    ]
    assert [o.worker_id for o in result.offers] == [other.worker_id]


def test_worker_retries_stay_within_the_claim_budget() -> None:
    store = FakeStore()
    gone = [store.add_worker().worker_id for _ in range(3)]
    enqueue(store)
    ports = fake_ports(store, claims=MisbehavingClaimPort(store, vanished_workers=set(gone)))
    result = run(ports, budget={"max_claim_attempts": 2})
    assert call_counts(ports)["claims"] == 2
    assert (result.status, result.reason, result.truncated) == (
        CycleStatus.TRUNCATED,
        CycleReason.CLAIM_BUDGET_EXHAUSTED,
        True,
    )


def test_a_lost_attempt_is_not_reassigned() -> None:
    store = FakeStore()
    store.add_worker()
    store.add_worker()
    [(_, lost), (_, other)] = enqueue(store, 2)
    ports = fake_ports(store, claims=MisbehavingClaimPort(store, lost_attempts={lost}))
    result = run(ports)
    assert [c.attempt_id for c in claims_of(ports)] == [lost, other]
    assert [o.attempt_id for o in result.offers] == [other]
    assert result.counts.claims_lost == 1


class _RivalCommitsFirst(FakeClaimPort):
    """Another dispatcher bumps the Attempt's version just before our CAS."""

    def _claim(self, request: ClaimRequest) -> ClaimOutcome:
        self.store.attempts[request.attempt_id].version += 1
        return super()._claim(request)


def test_a_cas_version_conflict_stops_the_candidate() -> None:
    store = FakeStore()
    store.add_worker()
    store.add_worker()
    enqueue(store)
    ports = fake_ports(store, claims=_RivalCommitsFirst(store))
    result = run(ports)
    assert len(claims_of(ports)) == 1
    assert (result.status, result.reason, result.offers) == (
        CycleStatus.NO_MATCH,
        CycleReason.CLAIMS_LOST,
        (),
    )


# ---------------------------------------- (5) budgets: truncated, never idle


def test_claim_budget_exhausted_is_truncated_with_offers() -> None:
    store = FakeStore()
    store.add_worker(slots=5)
    enqueue(store, 3)
    ports = store.ports()
    result = run(ports, budget={"max_claim_attempts": 2})
    assert call_counts(ports)["claims"] == 2
    assert (result.status, result.reason, result.truncated, len(result.offers)) == (
        CycleStatus.OFFERED,
        CycleReason.CLAIM_BUDGET_EXHAUSTED,
        True,
        2,
    )


def test_exactly_using_the_claim_budget_is_not_truncated() -> None:
    store = FakeStore()
    store.add_worker(slots=5)
    enqueue(store, 2)
    result = run(store.ports(), budget={"max_claim_attempts": 2})
    assert (result.status, result.reason, result.truncated) == (
        CycleStatus.OFFERED,
        CycleReason.CLAIMED,
        False,
    )


def test_candidate_budget_exhausted_without_a_match_is_truncated_not_idle() -> None:
    store = FakeStore()
    store.add_worker()
    enqueue(store, 3, placement={"required_labels": {"zone": "nowhere"}})
    result = run(unfiltered(store), budget={"candidate_page_size": 1, "candidate_max_pages": 2})
    assert (result.status, result.reason, result.truncated) == (
        CycleStatus.TRUNCATED,
        CycleReason.CANDIDATE_BUDGET_EXHAUSTED,
        True,
    )


def test_recovery_budget_exhausted_offers_what_it_read_and_reads_no_candidates() -> None:
    store, _ = claimed_store(3)
    enqueue(store)
    after_backoff(store)
    ports = store.ports()
    result = run(ports, budget={"recovery_page_size": 1, "recovery_max_pages": 2})
    assert (result.status, result.reason, result.truncated) == (
        CycleStatus.OFFERED,
        CycleReason.RECOVERY_BUDGET_EXHAUSTED,
        True,
    )
    assert result.counts.recovered == len(result.offers) == 2
    assert call_counts(ports)["candidates"] == 0


class _EmptyPagesForever:
    def __init__(self) -> None:
        self.calls: list[str | None] = []

    def recover_page(
        self, *, cursor: str | None, limit: int, **_: object
    ) -> Page[RecoverableLease]:
        self.calls.append(cursor)
        return Page((), f"c{len(self.calls)}")


def test_recovery_budget_exhausted_without_offers_is_truncated_and_reads_no_candidates() -> None:
    store = FakeStore()
    store.add_worker()
    enqueue(store)
    ports = fake_ports(store, recovery=_EmptyPagesForever())
    result = run(ports)
    assert (result.status, result.reason, result.truncated) == (
        CycleStatus.TRUNCATED,
        CycleReason.RECOVERY_BUDGET_EXHAUSTED,
        True,
    )
    assert len(ports.recovery.calls) == 2  # type: ignore[attr-defined]
    assert call_counts(ports)["candidates"] == 0


def test_session_max_offers_stops_and_says_so() -> None:
    store = FakeStore()
    me = store.add_worker(slots=3)
    enqueue(store, 3)
    ports = store.ports()
    result = run(ports, scope=DispatchScope.for_session(me), pull=PULL, max_offers=1)
    assert (result.status, result.reason, result.truncated, len(result.offers)) == (
        CycleStatus.OFFERED,
        CycleReason.MAX_OFFERS_REACHED,
        True,
        1,
    )
    assert call_counts(ports)["plans"] == 1


# ---------------------------------------------------------------- (6) invalid specs never claimed


def _drop_command(_: Candidate, spec: dict[str, object]) -> dict[str, object]:
    return {**spec, "command": []}


def _other_run(_: Candidate, spec: dict[str, object]) -> dict[str, object]:
    return {**spec, "run_id": "999"}


def _other_revision(_: Candidate, spec: dict[str, object]) -> dict[str, object]:
    return {**spec, "task_revision": 2}


def _other_executor(_: Candidate, spec: dict[str, object]) -> dict[str, object]:
    return {**spec, "executor_type": "docker"}


def _secret_in_command(_: Candidate, spec: dict[str, object]) -> dict[str, object]:
    return {**spec, "command": ["echo", CANARY * 5000]}


@pytest.mark.parametrize(
    "patch",
    [_drop_command, _other_run, _other_revision, _other_executor, _secret_in_command],
    ids=[
        "empty-command",
        "run-id-mismatch",
        "revision-mismatch",
        "executor-mismatch",
        "oversize-item",
    ],
)
def test_an_invalid_or_mismatched_spec_is_rejected_before_any_claim(patch: object) -> None:
    store = FakeStore()
    store.add_worker(executor_types=("process", "docker"))
    enqueue(store)
    ports = fake_ports(store, plans=MisbehavingPlanSource(store, spec_patch=patch))  # type: ignore[arg-type]
    result = run(ports)
    assert (result.status, result.reason, result.offers) == (
        CycleStatus.NO_MATCH,
        CycleReason.INVALID_SPEC,
        (),
    )
    assert call_counts(ports)["claims"] == 0
    assert result.rejected_candidates == 1


def test_a_plan_whose_own_ids_differ_from_the_candidate_is_rejected() -> None:
    store = FakeStore()
    store.add_worker()
    [(_, attempt_id)] = enqueue(store)

    class WrongAttemptPlans(FakePlanSource):
        def prepare(self, candidate: Candidate) -> DispatchPlan:
            return replace(super().prepare(candidate), attempt_id="1")

    ports = fake_ports(store, plans=WrongAttemptPlans(store))
    result = run(ports)
    assert (result.status, result.reason) == (CycleStatus.NO_MATCH, CycleReason.INVALID_SPEC)
    assert call_counts(ports)["claims"] == 0
    assert store.active_lease_for(attempt_id) is None


def test_a_missing_plan_skips_the_candidate() -> None:
    store = FakeStore()
    store.add_worker()
    [(run_id, _)] = enqueue(store)
    ports = fake_ports(store, plans=MisbehavingPlanSource(store, unavailable_runs={run_id}))
    result = run(ports)
    assert (result.status, result.reason, result.counts.plans_built) == (
        CycleStatus.NO_MATCH,
        CycleReason.PLAN_MISSING,
        0,
    )
    assert call_counts(ports)["claims"] == 0


def test_a_bad_candidate_does_not_block_the_next_one() -> None:
    store = FakeStore()
    store.add_worker()
    [(bad_run, _), (_, good_attempt)] = enqueue(store, 2)
    ports = fake_ports(store, plans=MisbehavingPlanSource(store, unavailable_runs={bad_run}))
    result = run(ports)
    assert [o.attempt_id for o in result.offers] == [good_attempt]


def test_unknown_spec_fields_are_stripped_from_the_offer_and_digest() -> None:
    store = FakeStore()
    store.add_worker()
    [(_, attempt_id)] = enqueue(store)

    def add_debug(_: Candidate, spec: dict[str, object]) -> dict[str, object]:
        return {**spec, "debug": CANARY}

    result = run(fake_ports(store, plans=MisbehavingPlanSource(store, spec_patch=add_debug)))
    [offer] = result.offers
    assert "debug" not in offer.spec
    lease = store.active_lease_for(attempt_id)
    assert lease is not None and lease.spec_sha256 == spec_sha256(offer.spec)


# ---------------------------------------------------------------- (7) nothing leaks


def test_results_without_a_claim_carry_no_offer() -> None:
    store = FakeStore()
    store.add_worker(executor_types=("docker",))
    enqueue(store)
    result = run(unfiltered(store))
    assert result.status is CycleStatus.NO_MATCH
    assert result.offers == ()
    assert result.counts.offers == 0


def test_nothing_secret_leaks_from_results_offers_or_logs(caplog: pytest.LogCaptureFixture) -> None:
    store = FakeStore()
    me = store.add_worker(slots=2)
    _, task_id, _ = store.add_task(definition=secret_definition())
    store.add_run(task_id=task_id)
    store.add_run(task_id=task_id)
    plans = FakePlanSource(store)
    global_result = run(fake_ports(store, plans=plans), max_offers=1)
    pull = PullCredential(pull_id="p-1", token=f"PULLTOKEN-{CANARY}-xxxxxxxxxxxxxxxxxxxxxxxx")
    session_result = run(
        store.ports(), scope=DispatchScope.for_session(me), pull=pull, max_offers=1
    )
    assert global_result.offers and session_result.offers
    offers = [*global_result.offers, *session_result.offers]
    tokens = [o.lease.token for o in offers]
    assert all(tokens)
    texts: list[str] = []
    for result in (global_result, session_result):
        texts += [repr(result), str(result), f"{result}", json.dumps(result.summary())]
    for offer in offers:
        texts += [repr(offer), str(offer), json.dumps(offer.summary()), repr(offer.lease)]
    texts.append(repr(pull))
    texts.append(repr(plans.prepared))
    with caplog.at_level(logging.DEBUG):
        log = logging.getLogger("qinglong.dispatch.test")
        for result in (global_result, session_result):
            log.info("cycle %s", result)
            log.info("cycle %r %s", result, result.summary())
            for offer in result.offers:
                log.info("offer %s %r", offer, offer)
    texts.append(caplog.text)
    for text in texts:
        assert CANARY not in text
        for token in tokens:
            assert token is not None and token not in text
    # ... while the Worker's own pull response does carry them.
    wire = json.dumps([o.to_wire() for o in offers])
    assert CANARY in wire
    assert all(t in wire for t in tokens if t)


def test_summary_has_exactly_the_documented_shape() -> None:
    store = FakeStore()
    store.add_worker()
    enqueue(store)
    summary = run(store.ports()).summary()
    assert summary == {
        "scope": "global",
        "status": "offered",
        "reason": "claimed",
        "truncated": False,
        "observed_at": "2026-07-18T12:00:00Z",
        "duration_ms": summary["duration_ms"],
        "counts": {
            "recovered": 0,
            "candidates_seen": 1,
            "workers_seen": 1,
            "plans_built": 1,
            "claims_attempted": 1,
            "claims_won": 1,
            "claims_lost": 0,
            "offers": 1,
        },
    }
    assert isinstance(summary["duration_ms"], int)


def test_a_result_cannot_be_pickled_or_copied() -> None:
    store = FakeStore()
    store.add_worker()
    enqueue(store)
    result = run(store.ports())
    with pytest.raises(TypeError):
        pickle.dumps(result)
    with pytest.raises(TypeError):
        copy.deepcopy(result)


def test_paused_result_has_zero_counts() -> None:
    summary = DispatchCycleResult.paused(Scope.SESSION).summary()
    assert (summary["status"], summary["reason"], summary["truncated"], summary["observed_at"]) == (
        "paused",
        "dispatch_paused",
        False,
        None,
    )
    assert set(summary["counts"].values()) == {0}  # type: ignore[attr-defined]


# ---------------------------------------------------------------- (8) deep copy


def test_mutating_the_plan_sources_data_later_does_not_change_the_offer() -> None:
    store = FakeStore()
    store.add_worker()
    _, task_id, _ = store.add_task(definition=secret_definition())
    store.add_run(task_id=task_id)
    plans = FakePlanSource(store)
    result = run(fake_ports(store, plans=plans))
    [offer] = result.offers
    before = offer.to_wire()
    [plan] = plans.prepared
    plan.spec["command"].append("--evil")  # type: ignore[attr-defined]
    plan.spec["env"]["API_TOKEN"] = "swapped"  # type: ignore[index]
    plan.spec["resources"]["memory_mb"] = 1  # type: ignore[index]
    store.tasks[task_id].revisions[1].env["API_TOKEN"] = "swapped"  # type: ignore[index]
    assert offer.to_wire() == before
    assert spec_sha256(offer.spec) == offer.spec_sha256
    assert validate_spec(offer.spec) == before["spec"]


# ---------------------------------------- (9) recovery first, stable across restarts


def test_active_leases_are_recovered_before_any_candidate_is_read() -> None:
    store, first = claimed_store(1)
    enqueue(store)  # a fresh candidate that must wait
    after_backoff(store)
    ports = store.ports()  # a restarted dispatcher: new port objects, same store
    result = run(ports)
    assert (result.status, result.reason) == (CycleStatus.OFFERED, CycleReason.RECOVERED)
    assert call_counts(ports) == {
        "recovery": 1,
        "candidates": 0,
        "workers": 0,
        "plans": 1,
        "claims": 0,
    }
    [before], [after] = first.offers, result.offers
    assert after.source is OfferSource.LEASE_RECOVERY
    assert (after.offer_id, after.lease.token, after.spec_sha256) == (
        before.offer_id,
        before.lease.token,
        before.spec_sha256,
    )
    assert after.to_wire()["spec"] == before.to_wire()["spec"]
    assert (after.lease.lease_id, after.lease.generation, after.placement_score) == (
        before.lease.lease_id,
        before.lease.generation,
        before.placement_score,
    )
    assert result.counts.recovered == 1


def test_global_scope_waits_for_the_redelivery_backoff() -> None:
    store, first = claimed_store(1)
    store.record_delivery(first.offers[0].lease.lease_id)
    [(_, newcomer)] = enqueue(store)
    store.add_worker()
    waiting = run(store.ports())
    assert [o.attempt_id for o in waiting.offers] == [newcomer]  # not starved by the lease
    after_backoff(store)
    later = run(store.ports())
    assert [o.source for o in later.offers] == [OfferSource.LEASE_RECOVERY] * 2


def test_recovery_stops_after_max_deliveries() -> None:
    store, first = claimed_store(1)
    lease_id = first.offers[0].lease.lease_id
    for _ in range(DispatchBudget().max_deliveries):
        store.record_delivery(lease_id)
    after_backoff(store)
    assert run(store.ports()).status is CycleStatus.IDLE


def test_a_repeated_pull_rebuilds_the_same_offer_with_its_token() -> None:
    store = FakeStore()
    me = store.add_worker()
    enqueue(store)
    scope = DispatchScope.for_session(me)
    first = run(store.ports(), scope=scope, pull=PULL, max_offers=1)
    [claimed] = first.offers
    assert claimed.lease.token == PULL.token
    ports = store.ports()
    again = run(ports, scope=scope, pull=PULL, max_offers=1)
    assert ports.recovery.calls[0]["due_before"] is None  # type: ignore[attr-defined]
    [repeat] = again.offers
    assert (repeat.offer_id, repeat.lease.token, repeat.source) == (
        claimed.offer_id,
        PULL.token,
        OfferSource.LEASE_RECOVERY,
    )
    other = run(
        store.ports(), scope=scope, pull=PullCredential("another-pull", "Z" * 43), max_offers=1
    )
    assert other.offers[0].offer_id == claimed.offer_id
    assert other.offers[0].lease.token is None
    wrong_token = run(store.ports(), scope=scope, pull=PullCredential(PULL.pull_id, "Z" * 43))
    assert wrong_token.offers[0].lease.token is None
    global_view = run(store.ports())
    assert global_view.offers[0].lease.token is None


def test_session_claims_use_the_pull_token_and_no_skip_locked() -> None:
    store = FakeStore()
    store.add_worker(labels={"disk": "ssd"})
    me = store.add_worker()
    [(_, attempt_id)] = enqueue(
        store, placement={"preferred": [{"labels": {"disk": "ssd"}, "weight": 9}]}
    )
    ports = store.ports()
    result = run(ports, scope=DispatchScope.for_session(me), pull=PULL)
    [request] = claims_of(ports)
    assert (request.worker_id, request.session_id, request.session_generation) == (
        me.worker_id,
        me.session_id,
        me.session_generation,
    )
    assert (request.source, request.pull_id, request.skip_locked) == (
        "pull_claim",
        PULL.pull_id,
        False,
    )
    assert request.token_digest == token_digest(PULL.token)
    assert result.offers[0].lease.token == PULL.token
    lease = store.active_lease_for(attempt_id)
    assert lease is not None and (lease.source, lease.pull_id) == ("pull_claim", PULL.pull_id)


def test_session_scope_requires_a_pull_credential() -> None:
    store = FakeStore()
    me = store.add_worker()
    with pytest.raises(ValueError, match="pull"):
        run(store.ports(), scope=DispatchScope.for_session(me))


def test_a_full_session_builds_no_plans() -> None:
    store, first = claimed_store(1)
    store.start_attempt(first.offers[0].attempt_id)  # its lease still holds the slot
    enqueue(store)
    me = store.session_ref(first.offers[0].worker_id)
    ports = unfiltered(store)
    result = run(ports, scope=DispatchScope.for_session(me), pull=PULL)
    assert (result.status, result.reason) == (CycleStatus.NO_MATCH, CycleReason.NO_FREE_SLOTS)
    assert call_counts(ports)["plans"] == 0


def test_no_online_worker_is_no_match_without_plans() -> None:
    store = FakeStore()
    enqueue(store)
    ports = unfiltered(store)
    result = run(ports)
    assert (result.status, result.reason) == (CycleStatus.NO_MATCH, CycleReason.NO_WORKERS)
    assert call_counts(ports)["plans"] == 0


# ---------------------------------------------------------------- (10) recovery eligibility


def test_recovery_uses_the_pinned_revision_after_an_edit() -> None:
    store, first = claimed_store(1)
    [before] = first.offers
    store.edit_task(before.task_id, definition(command=["echo", "v2"]))
    after_backoff(store)
    [after] = run(store.ports()).offers
    assert (after.task_revision, after.spec_sha256) == (1, before.spec_sha256)


@pytest.mark.parametrize(
    "change", ["cancel", "replace_session", "session_offline", "started", "expired"]
)
def test_a_lease_that_lost_eligibility_is_not_delivered_again(change: str) -> None:
    store, first = claimed_store(1)
    [offer] = first.offers
    if change == "cancel":
        store.cancel_run(offer.run_id)
    elif change == "replace_session":
        store.replace_session(offer.worker_id)
    elif change == "session_offline":
        store.set_session_state(offer.worker_id, "offline")
    elif change == "started":
        store.start_attempt(offer.attempt_id)
    else:
        store.advance(DispatchBudget().lease_ttl_s + 1)
    after_backoff(store)
    result = run(store.ports())
    assert result.offers == ()
    assert result.counts.recovered == 0


def test_a_draining_session_still_gets_its_lease_back() -> None:
    store, first = claimed_store(1)
    store.set_session_state(first.offers[0].worker_id, "draining")
    after_backoff(store)
    assert run(store.ports()).counts.recovered == 1


def test_an_expired_lease_from_the_port_rejects_the_cycle() -> None:
    store, _ = claimed_store(1)
    store.advance(DispatchBudget().lease_ttl_s + 1)
    ports = fake_ports(store, recovery=MisbehavingLeaseRecoverySource(store, include_expired=True))
    result = run(ports)
    assert (result.status, result.reason, result.offers) == (
        CycleStatus.REJECTED,
        CycleReason.RECOVERY_EXPIRED_LEASE,
        (),
    )
    assert call_counts(ports)["candidates"] == 0


def test_another_sessions_lease_in_session_scope_rejects_the_cycle() -> None:
    store, _ = claimed_store(1)
    me = store.add_worker()
    ports = fake_ports(store, recovery=MisbehavingLeaseRecoverySource(store, ignore_scope=True))
    result = run(ports, scope=DispatchScope.for_session(me), pull=PULL)
    assert (result.status, result.reason) == (
        CycleStatus.REJECTED,
        CycleReason.RECOVERY_SCOPE_MISMATCH,
    )
    assert call_counts(ports)["plans"] == 0


def test_an_expired_lease_can_be_claimed_again_with_the_next_generation() -> None:
    store, first = claimed_store(1)
    [before] = first.offers
    store.advance(DispatchBudget().lease_ttl_s + 1)
    assert store.expire_leases() == 1
    [after] = run(store.ports()).offers
    assert (after.source, after.lease.generation) == (OfferSource.NEW_CLAIM, 2)
    assert after.offer_id != before.offer_id
    assert after.lease.token != before.lease.token


# ---------------------------------------------------------------- (11) recovery fails closed


def test_recovery_with_a_missing_plan_fails_closed() -> None:
    store, first = claimed_store(1)
    store.drop_revision(first.offers[0].task_id, 1)
    after_backoff(store)
    ports = store.ports()
    result = run(ports)
    assert (result.status, result.reason, result.offers) == (
        CycleStatus.REJECTED,
        CycleReason.RECOVERY_PLAN_MISSING,
        (),
    )
    assert call_counts(ports)["candidates"] == 0


def test_recovery_with_a_rewritten_revision_fails_closed() -> None:
    store, first = claimed_store(1)
    store.rewrite_revision(first.offers[0].task_id, 1, definition(command=["echo", "tampered"]))
    after_backoff(store)
    result = run(store.ports())
    assert (result.status, result.reason, result.offers) == (
        CycleStatus.REJECTED,
        CycleReason.RECOVERY_SPEC_DRIFT,
        (),
    )


def test_recovery_with_an_identity_drift_fails_closed() -> None:
    store, _ = claimed_store(1)
    after_backoff(store)
    result = run(fake_ports(store, plans=MisbehavingPlanSource(store, spec_patch=_other_revision)))
    assert (result.status, result.reason) == (CycleStatus.REJECTED, CycleReason.RECOVERY_SPEC_DRIFT)


def test_recovery_with_a_rotated_secret_fails_closed() -> None:
    store, _ = claimed_store(1)
    after_backoff(store)
    result = run(store.ports(), secret=b"a-different-secret")
    assert (result.status, result.reason, result.offers) == (
        CycleStatus.REJECTED,
        CycleReason.RECOVERY_TOKEN_MISMATCH,
        (),
    )


@pytest.mark.parametrize(
    ("knob", "reason"),
    [
        ({"duplicate_rows": True}, CycleReason.DUPLICATE_ROW),
        ({"stuck_cursor": True}, CycleReason.CURSOR_NOT_ADVANCING),
        ({"oversize": True}, CycleReason.PAGE_OVERSIZE),
    ],
)
def test_a_broken_recovery_page_fails_closed_without_offers(
    knob: dict[str, bool], reason: CycleReason
) -> None:
    store, _ = claimed_store(5)
    after_backoff(store)
    ports = fake_ports(store, recovery=MisbehavingLeaseRecoverySource(store, **knob))
    result = run(ports, budget={"recovery_page_size": 2, "recovery_max_pages": 3})
    assert (result.status, result.reason, result.offers) == (CycleStatus.REJECTED, reason, ())
    assert result.counts.recovered == 0
    assert call_counts(ports)["candidates"] == 0


# ---------------------------------------------------------------- argument checks


@pytest.mark.parametrize("max_offers", [0, -1, True])
def test_bad_max_offers_is_refused(max_offers: int) -> None:
    with pytest.raises(ValueError, match="max_offers"):
        run(FakeStore().ports(), max_offers=max_offers)


def test_an_empty_secret_is_refused() -> None:
    with pytest.raises(ValueError, match="secret"):
        run(FakeStore().ports(), secret=b"")
