"""dispatch_once claims a page of (candidate, Worker) pairs at once (issue #12).

Each candidate is placed on the best Worker with a slot no earlier candidate
of the page was promised; the whole page goes to `ClaimPort.claim_many` in
one call; a claim that finds its Worker unavailable sends the candidate to
the next Worker in the next page; a candidate whose slots were promised to
earlier ones waits for the next page.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from dispatch.core.fakes import FakeClaimPort, FakeStore, fake_ports
from dispatch.core.ports import ClaimOutcome, ClaimRequest, DispatchScope
from dispatch.core.result import CycleReason, CycleStatus
from dispatch.tests.core._builders import enqueue, run
from dispatch.tests.core.misbehaving import MisbehavingClaimPort
from dispatch.tests.core.test_cycle import PULL


class PageCounting(FakeClaimPort):
    """The honest fake, recording the size of each `claim_many` call."""

    def __init__(self, store: FakeStore, **_: object) -> None:
        super().__init__(store)
        self.pages: list[int] = []

    def claim_many(self, requests: Sequence[ClaimRequest]) -> tuple[ClaimOutcome, ...]:
        self.pages.append(len(requests))
        return super().claim_many(requests)


def test_a_global_cycle_claims_its_page_in_one_call() -> None:
    store = FakeStore()
    store.add_worker(slots=4)
    store.add_worker(slots=4)
    enqueue(store, 12)
    claims = PageCounting(store)
    result = run(fake_ports(store, claims=claims))
    assert claims.pages == [8]  # the claim budget, in one call
    assert (result.status, result.counts.claims_won, len(result.offers)) == (
        CycleStatus.OFFERED,
        8,
        8,
    )
    # Spread as one claim at a time would: the Worker with more free slots first.
    assert sorted(o.worker_id for o in result.offers).count(result.offers[0].worker_id) == 4


def test_a_pull_claims_up_to_its_free_slots_in_one_call() -> None:
    store = FakeStore()
    me = store.add_worker(slots=3)
    enqueue(store, 5)
    claims = PageCounting(store)
    result = run(
        fake_ports(store, claims=claims),
        scope=DispatchScope.for_session(me),
        pull=PULL,
        max_offers=3,
    )
    assert claims.pages == [3]
    assert [c.pull_id for c in claims.calls] == [PULL.pull_id] * 3
    assert (result.reason, len(result.offers)) == (CycleReason.MAX_OFFERS_REACHED, 3)


def test_a_candidate_whose_slot_was_promised_away_waits_for_the_next_page() -> None:
    store = FakeStore()
    store.add_worker(slots=1, labels={"gpu": "yes"})
    store.add_worker(slots=4)
    gpu = {"required_labels": {"gpu": "yes"}}
    [(_, lost), (_, waiting)] = enqueue(store, 2, placement=gpu)
    claims = MisbehavingClaimPort(store, lost_attempts={lost})
    result = run(fake_ports(store, claims=claims))
    # The first page promised the one gpu slot to `lost`; it lost its Attempt,
    # so the next page gives the slot to `waiting`, as one claim at a time would.
    assert [c.attempt_id for c in claims.calls] == [lost, waiting]
    assert [o.attempt_id for o in result.offers] == [waiting]


def test_a_candidate_with_no_slot_left_after_its_page_is_not_eligible() -> None:
    store = FakeStore()
    gpu_worker = store.add_worker(slots=1, labels={"gpu": "yes"})
    store.add_worker(slots=4)
    gpu = {"required_labels": {"gpu": "yes"}}
    enqueue(store, 2, placement=gpu)
    claims = PageCounting(store)
    result = run(fake_ports(store, claims=claims))
    assert claims.pages == [1]
    assert [o.worker_id for o in result.offers] == [gpu_worker.worker_id]
    assert result.reason is CycleReason.CLAIMED


def test_an_unavailable_worker_sends_the_candidate_to_the_next_one_in_the_next_page() -> None:
    store = FakeStore()
    first = store.add_worker(slots=2, labels={"disk": "ssd"})
    second = store.add_worker(slots=2)
    prefer_ssd = {"preferred": [{"labels": {"disk": "ssd"}, "weight": 1}]}
    enqueue(store, 2, placement=prefer_ssd)
    claims = MisbehavingClaimPort(store, vanished_workers={first.worker_id})
    result = run(fake_ports(store, claims=claims))
    assert [c.worker_id for c in claims.calls] == [first.worker_id] * 2 + [second.worker_id] * 2
    assert [o.worker_id for o in result.offers] == [second.worker_id] * 2
    assert (result.counts.claims_lost, result.counts.claims_won) == (2, 2)


def test_a_pull_whose_session_is_gone_reports_the_lost_claims() -> None:
    store = FakeStore()
    me = store.add_worker(slots=2)
    enqueue(store, 2)
    claims = MisbehavingClaimPort(store, vanished_workers={me.worker_id})
    result = run(fake_ports(store, claims=claims), scope=DispatchScope.for_session(me), pull=PULL)
    assert (result.status, result.reason, result.offers) == (
        CycleStatus.NO_MATCH,
        CycleReason.CLAIMS_LOST,
        (),
    )


class WrongCount(FakeClaimPort):
    def claim_many(self, requests: Sequence[ClaimRequest]) -> tuple[ClaimOutcome, ...]:
        return super().claim_many(requests)[:-1]


def test_a_claim_port_that_does_not_answer_every_request_fails_the_cycle() -> None:
    store = FakeStore()
    store.add_worker(slots=4)
    enqueue(store, 2)
    with pytest.raises(RuntimeError, match="every request"):
        run(fake_ports(store, claims=WrongCount(store)))
    # What the port did commit is a lease; recovery re-delivers it later.
    assert sum(lease.state == "active" for lease in store.leases.values()) == 2


def test_the_claim_budget_counts_every_request_of_a_page() -> None:
    store = FakeStore()
    store.add_worker(slots=10)
    enqueue(store, 5)
    claims = PageCounting(store)
    result = run(fake_ports(store, claims=claims), budget={"max_claim_attempts": 3})
    assert claims.pages == [3]
    assert (result.reason, result.truncated, result.counts.claims_attempted) == (
        CycleReason.CLAIM_BUDGET_EXHAUSTED,
        True,
        3,
    )
    assert result.counts.claims_won == 3


def test_a_spent_claim_budget_reads_no_further_candidate() -> None:
    store = FakeStore()
    store.add_worker(slots=20)
    enqueue(store, 20)
    claims = PageCounting(store)
    ports = fake_ports(store, claims=claims)
    result = run(ports)  # budget: 8 claims, pages of 8 candidates
    assert claims.pages == [8]
    # The ninth candidate is neither read nor planned to learn that it must wait.
    assert len(ports.candidates.calls) == 1  # type: ignore[attr-defined]
    assert result.counts.plans_built == 8
    assert (result.reason, result.truncated) == (CycleReason.CLAIM_BUDGET_EXHAUSTED, True)
