"""The fakes' own behaviour (their misbehaving variants: test_misbehaving.py).

That the fakes honour the port contracts is checked by the one contract suite
that also runs against the ORM adapters: dispatch/tests/test_port_contract.py.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from dispatch.core.fakes import DEFAULT_NOW, FakeCandidateSource, FakeClock, FakeStore
from dispatch.core.ports import DispatchScope
from dispatch.tests.core._builders import enqueue, run


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


@pytest.mark.parametrize("limit", [0, -1, 65, True])
def test_fakes_refuse_a_limit_outside_the_hard_cap_like_the_orm(limit: int) -> None:
    with pytest.raises(ValueError):
        FakeCandidateSource(FakeStore()).candidate_page(
            observed_at=DEFAULT_NOW, cursor=None, limit=limit
        )
