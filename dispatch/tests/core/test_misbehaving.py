"""The misbehaviour knobs do what the cycle tests rely on them to do."""

from __future__ import annotations

from dispatch.core.fakes import DEFAULT_NOW, FakeLeaseRecoverySource, FakeStore
from dispatch.core.ports import DispatchScope
from dispatch.tests.core._builders import definition, run
from dispatch.tests.core.misbehaving import (
    MisbehavingCandidateSource,
    MisbehavingLeaseRecoverySource,
    MisbehavingWorkerSnapshotSource,
)


def _store_with(runs: int, workers: int) -> FakeStore:
    store = FakeStore()
    for _ in range(workers):
        store.add_worker()
    _, task_id, _ = store.add_task(definition=definition())
    for _ in range(runs):
        store.add_run(task_id=task_id)
    return store


def test_stuck_cursor_knob_returns_the_cursor_it_was_given() -> None:
    source = MisbehavingCandidateSource(_store_with(5, 0), stuck_cursor=True)
    first = source.candidate_page(observed_at=DEFAULT_NOW, cursor=None, limit=2)
    second = source.candidate_page(observed_at=DEFAULT_NOW, cursor=first.next_cursor, limit=2)
    assert first.next_cursor is not None
    assert second.next_cursor == first.next_cursor


def test_duplicate_rows_knob_repeats_the_previous_last_row() -> None:
    source = MisbehavingWorkerSnapshotSource(_store_with(0, 5), duplicate_rows=True)
    scope = DispatchScope.global_()
    first = source.worker_page(scope=scope, cursor=None, limit=2)
    second = source.worker_page(scope=scope, cursor=first.next_cursor, limit=2)
    assert second.items[0] == first.items[-1]
    assert len(second.items) == 2


def test_oversize_knob_returns_one_row_too_many() -> None:
    source = MisbehavingCandidateSource(_store_with(5, 0), oversize=True)
    assert len(source.candidate_page(observed_at=DEFAULT_NOW, cursor=None, limit=2).items) == 3


def test_order_regression_knob_reverses_a_page() -> None:
    source = MisbehavingWorkerSnapshotSource(_store_with(0, 3), order_regression=True)
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
    broken = MisbehavingLeaseRecoverySource(store, include_expired=True)
    assert (rows(honest), rows(broken)) == (0, 1)
