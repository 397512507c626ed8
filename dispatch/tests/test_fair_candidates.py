"""The fair candidate read (docs/adr/0012), one contract for the fakes and the ORM.

Run against `dispatch.core.fakes` and the ORM adapters on whichever database
this pass uses (SQLite, then PostgreSQL), like `test_port_contract.py`:
Projects come round-robin, a Project's own Runs in priority order; with a
scope, what cannot be claimed now is never a candidate (a full Project or
Task, a placement no free Session in scope matches); the turn carries over to
the next cycle.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime

import pytest

from dispatch.core.fairness import WALK_CAP
from dispatch.core.ports import Candidate, DispatchPorts, DispatchScope, Page
from dispatch.tests.stores import (
    FakeStoreBuilder,
    OrmStoreBuilder,
    StoreBuilder,
    claim,
    seconds,
)

pytestmark = pytest.mark.django_db

GLOBAL = DispatchScope.global_()


@pytest.fixture(params=["fakes", "orm"])
def store(request: pytest.FixtureRequest) -> StoreBuilder:
    if request.param == "fakes":
        return FakeStoreBuilder()
    return OrmStoreBuilder()


def pages(
    ports: DispatchPorts,
    *,
    limit: int,
    scope: DispatchScope | None = GLOBAL,
    observed_at: datetime | None = None,
) -> Iterator[Page[Candidate]]:
    """Every page of one cycle's read, checking the paging contract on the way."""
    at = ports.clock.now() if observed_at is None else observed_at
    cursor: str | None = None
    seen_cursors: set[str] = set()
    seen: set[str] = set()
    for _ in range(200):
        page = ports.candidates.candidate_page(
            observed_at=at, cursor=cursor, limit=limit, scope=scope
        )
        assert len(page.items) <= limit
        for item in page.items:
            assert item.attempt_id not in seen, "an Attempt came twice in one cycle"
            seen.add(item.attempt_id)
        yield page
        if page.next_cursor is None:
            return
        assert page.next_cursor != cursor and page.next_cursor not in seen_cursors
        seen_cursors.add(page.next_cursor)
        cursor = page.next_cursor
    raise AssertionError("paging did not end")


def read(
    ports: DispatchPorts, *, limit: int = 64, scope: DispatchScope | None = GLOBAL
) -> list[str]:
    return [
        item.attempt_id for page in pages(ports, limit=limit, scope=scope) for item in page.items
    ]


def queued(store: StoreBuilder, task: str, count: int, *, start: int = 0) -> list[str]:
    t0 = store.now() - seconds(1000)
    return [store.add_run(task, queued_at=t0 + seconds(start + i))[1] for i in range(count)]


# ------------------------------------------------------------------- the order


def test_projects_come_round_robin_whatever_the_page_size(store: StoreBuilder) -> None:
    big, small, one = store.add_task(), store.add_task(), store.add_task()
    a = queued(store, big, 5)
    b = queued(store, small, 2, start=100)
    c = queued(store, one, 1, start=200)
    store.add_worker(slots=64)
    # One of each Project in turn, then the next round: the big Project's
    # older Runs do not go first.
    expected = [a[0], b[0], c[0], a[1], b[1], a[2], a[3], a[4]]
    for limit in (1, 2, 3, 4, 8, 64):
        assert read(store.ports(), limit=limit) == expected, limit


def test_priority_orders_runs_within_a_project_across_its_revisions(store: StoreBuilder) -> None:
    task = store.add_task()
    other = store.add_task()
    t0 = store.now() - seconds(100)
    low = store.add_run(task, priority=0, queued_at=t0)[1]
    store.edit_task(task)  # later Runs pin revision 2: another queue group
    high = store.add_run(task, priority=5, queued_at=t0 + seconds(10))[1]
    tie = store.add_run(task, priority=5, queued_at=t0 + seconds(10))[1]
    elsewhere = store.add_run(other, priority=-5, queued_at=t0 + seconds(50))[1]
    store.add_worker(slots=8)
    assert read(store.ports(), limit=8) == [high, elsewhere, tie, low]
    assert read(store.ports(), limit=1) == [high, elsewhere, tie, low]


def test_the_highest_and_lowest_priorities_are_read_in_order(
    store: StoreBuilder,
) -> None:
    # The PostgreSQL read starts each group after a key that sorts before
    # every Run (a priority above any a Run may have): the highest and lowest
    # priorities an enqueue accepts are read, in order.
    task = store.add_task()
    t0 = store.now() - seconds(100)
    lowest = store.add_run(task, priority=-1000, queued_at=t0)[1]
    highest = store.add_run(task, priority=1000, queued_at=t0 + seconds(5))[1]
    tie = store.add_run(task, priority=1000, queued_at=t0 + seconds(5))[1]
    store.add_worker(slots=8)
    for limit in (1, 2, 8):
        assert read(store.ports(), limit=limit) == [highest, tie, lowest], limit


def test_without_a_scope_every_queued_run_is_listed_in_the_same_order(store: StoreBuilder) -> None:
    full = store.add_task(max_concurrent_runs=1)
    nowhere = store.add_task(placement={"required_labels": {"gpu": "a100"}})
    a = queued(store, full, 2)
    b = queued(store, nowhere, 1, start=10)
    # No Worker at all: with a scope nothing can be served.
    assert read(store.ports()) == []
    assert read(store.ports(), scope=None) == [a[0], b[0], a[1]]


# ----------------------------------------------------------- what is skipped


def test_a_project_at_its_limit_is_skipped_and_its_room_caps_the_page(
    store: StoreBuilder,
) -> None:
    limited = store.add_task(max_concurrent_runs=2)
    free = store.add_task()
    runs = queued(store, limited, 6)
    other = queued(store, free, 3, start=100)
    ref = store.add_worker(slots=16)
    # Room for two: never more of its Runs in a cycle than it may claim.
    assert read(store.ports(), limit=64) == [runs[0], other[0], runs[1], other[1], other[2]]
    claim(store, runs[0], ref)
    claimed = claim(store, runs[1], ref)
    # At its limit: none of its Runs is a candidate; the other Project is.
    assert read(store.ports()) == other
    store.start(runs[1], claimed)  # a running Run still holds its slot
    assert read(store.ports()) == other
    store.revoke(claimed.lease_id)  # its lease is gone (the Run lost): one slot again
    assert read(store.ports()) == [runs[2], other[0], other[1], other[2]]


def test_a_task_at_its_limit_is_skipped_but_not_its_projects_other_tasks(
    store: StoreBuilder,
) -> None:
    limited = store.add_task(task_limit=1)
    sibling = store.add_task(beside=limited)
    runs = queued(store, limited, 3)
    others = queued(store, sibling, 2, start=100)
    ref = store.add_worker(slots=8)
    claim(store, runs[0], ref)
    assert read(store.ports()) == others


def test_a_placement_no_free_session_matches_is_skipped(store: StoreBuilder) -> None:
    gpu = store.add_task(placement={"required_labels": {"gpu": "a100"}})
    docker = store.add_task(executor_type="docker")
    plain = store.add_task()
    needs_gpu = queued(store, gpu, 16)
    needs_docker = queued(store, docker, 2, start=100)
    anyone = queued(store, plain, 1, start=200)
    store.add_worker(slots=4, labels={"gpu": "t4"})  # the wrong GPU, process only
    # Sixteen unplaceable Runs queued first take no candidate place at all.
    assert read(store.ports(), limit=8) == anyone
    matching = store.add_worker(slots=1, labels={"gpu": "a100", "zone": "eu"})
    assert read(store.ports(), limit=8)[:2] == [needs_gpu[0], anyone[0]]
    # Its only slot taken: the GPU Runs wait again, nothing else changes.
    claim(store, needs_gpu[0], matching)
    assert read(store.ports(), limit=8) == anyone
    assert needs_docker[0] not in read(store.ports())


def test_session_scope_serves_only_what_that_session_can_take(store: StoreBuilder) -> None:
    gpu = store.add_task(placement={"required_labels": {"gpu": "a100"}})
    plain = store.add_task()
    needs_gpu = queued(store, gpu, 2)
    anyone = queued(store, plain, 1, start=100)
    small = store.add_worker(slots=2)
    big = store.add_worker(slots=2, labels={"gpu": "a100"})
    assert read(store.ports(), scope=DispatchScope.for_session(small)) == anyone
    assert read(store.ports(), scope=DispatchScope.for_session(big)) == [
        needs_gpu[0],
        anyone[0],
        needs_gpu[1],
    ]
    claim(store, anyone[0], big)
    claim(store, needs_gpu[0], big)
    # Full: nothing for it, whatever is queued.
    assert read(store.ports(), scope=DispatchScope.for_session(big)) == []


def test_a_full_fleet_walks_nothing_pages_nothing_and_keeps_the_turn(store: StoreBuilder) -> None:
    """No Session in scope with a free slot: the read ends at once (no page
    after the first, however many groups are queued) and no Project loses
    its turn to a full fleet: once a slot is free, the read starts where it
    would have."""
    runs = [queued(store, store.add_task(), 1, start=i)[0] for i in range(WALK_CAP + 6)]
    worker = store.add_worker(slots=1)

    def first_page() -> Page[Candidate]:
        return store.ports().candidates.candidate_page(
            observed_at=store.now(), cursor=None, limit=8, scope=GLOBAL
        )

    assert [item.attempt_id for item in first_page().items] == runs[:8]
    claim(store, runs[0], worker)
    for _ in range(3):  # a full fleet's cycles, one after the other
        page = first_page()
        assert (page.items, page.next_cursor) == ((), None)
    store.add_worker(slots=1)
    assert [item.attempt_id for item in first_page().items] == runs[1:9]


def test_held_back_and_cancelled_runs_are_stepped_over_inside_their_project(
    store: StoreBuilder,
) -> None:
    task = store.add_task()
    runs = queued(store, task, 4)
    store.add_worker(slots=8)
    now = store.now()
    store.hold_back(runs[0], now + seconds(60))
    run_id = (
        store.ports()
        .candidates.candidate_page(observed_at=now, cursor=None, limit=8, scope=GLOBAL)
        .items[1]
        .run_id
    )
    store.cancel_run(run_id)
    assert read(store.ports()) == [runs[1], runs[3]] or read(store.ports()) == [runs[2], runs[3]]
    assert runs[0] not in read(store.ports())


# ----------------------------------------------------------------- the turn


def test_the_next_cycle_starts_after_the_project_last_planned(store: StoreBuilder) -> None:
    first, second, third = store.add_task(), store.add_task(), store.add_task()
    a = queued(store, first, 3)
    b = queued(store, second, 3, start=100)
    c = queued(store, third, 3, start=200)
    store.add_worker(slots=64)
    ports = store.ports()
    assert read(ports, limit=2) == [a[0], b[0], c[0], a[1], b[1], c[1], a[2], b[2], c[2]]
    # A cycle plans the first two candidates (the slots it had), then ends.
    page = ports.candidates.candidate_page(
        observed_at=store.now(), cursor=None, limit=2, scope=GLOBAL
    )
    assert [c.attempt_id for c in page.items] == [a[0], b[0]]
    for candidate in page.items:
        ports.plans.prepare(candidate)
    # The next cycle (new ports, same process) starts with the third Project.
    assert read(store.ports(), limit=64)[:3] == [c[0], a[0], b[0]]
