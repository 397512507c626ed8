"""The fakes' own behaviour and misbehaviour knobs.

That the fakes honour the port contracts is checked by the one contract suite
that also runs against the ORM adapters: dispatch/tests/test_port_contract.py.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from dispatch.core.fakes import (
    FakeCandidateSource,
    FakeClock,
    FakeLeaseRecoverySource,
    FakeStore,
    FakeWorkerSnapshotSource,
)
from dispatch.core.ports import DispatchScope
from dispatch.tests.core._builders import definition, enqueue, run


def test_fake_clock_moves_only_when_told() -> None:
    clock = FakeClock(datetime(2026, 1, 1, tzinfo=UTC))
    assert clock.now() == clock.now() == datetime(2026, 1, 1, tzinfo=UTC)
    assert clock.advance(1.5) == datetime(2026, 1, 1, 0, 0, 1, 500000, tzinfo=UTC)
    assert clock.calls == 2
    with pytest.raises(ValueError):
        FakeClock(datetime(2026, 1, 1))


def test_fresh_ports_share_the_store() -> None:
    store = FakeStore()
    store.add_worker()
    enqueue(store)
    run(store.ports())
    leases = store.ports().recovery.recover_page(
        scope=DispatchScope.global_(),
        observed_at=store.clock.now(),
        due_before=None,
        max_deliveries=5,
        cursor=None,
        limit=8,
    )
    assert len(leases.items) == 1


def _store_with(runs: int, workers: int) -> FakeStore:
    store = FakeStore()
    for _ in range(workers):
        store.add_worker()
    _, task_id, _ = store.add_task(definition=definition())
    for _ in range(runs):
        store.add_run(task_id=task_id)
    return store


def test_stuck_cursor_knob_returns_the_cursor_it_was_given() -> None:
    source = FakeCandidateSource(_store_with(5, 0), stuck_cursor=True)
    first = source.candidate_page(cursor=None, limit=2)
    second = source.candidate_page(cursor=first.next_cursor, limit=2)
    assert first.next_cursor is not None
    assert second.next_cursor == first.next_cursor


def test_duplicate_rows_knob_repeats_the_previous_last_row() -> None:
    source = FakeWorkerSnapshotSource(_store_with(0, 5), duplicate_rows=True)
    scope = DispatchScope.global_()
    first = source.worker_page(scope=scope, cursor=None, limit=2)
    second = source.worker_page(scope=scope, cursor=first.next_cursor, limit=2)
    assert second.items[0] == first.items[-1]
    assert len(second.items) == 2


def test_oversize_knob_returns_one_row_too_many() -> None:
    source = FakeCandidateSource(_store_with(5, 0), oversize=True)
    assert len(source.candidate_page(cursor=None, limit=2).items) == 3


def test_order_regression_knob_reverses_a_page() -> None:
    source = FakeWorkerSnapshotSource(_store_with(0, 3), order_regression=True)
    page = source.worker_page(scope=DispatchScope.global_(), cursor=None, limit=3)
    assert [r.worker_id for r in page.items] == ["3", "2", "1"]


def test_include_expired_knob_returns_expired_leases() -> None:
    store = _store_with(1, 1)
    run(store.ports())
    store.advance(3600)

    def rows(source: FakeLeaseRecoverySource) -> int:
        page = source.recover_page(
            scope=DispatchScope.global_(),
            observed_at=store.clock.now(),
            due_before=None,
            max_deliveries=5,
            cursor=None,
            limit=8,
        )
        return len(page.items)

    honest = FakeLeaseRecoverySource(store)
    broken = FakeLeaseRecoverySource(store, include_expired=True)
    assert (rows(honest), rows(broken)) == (0, 1)


def test_fakes_refuse_a_non_positive_limit() -> None:
    with pytest.raises(ValueError):
        FakeCandidateSource(FakeStore()).candidate_page(cursor=None, limit=0)
