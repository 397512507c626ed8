"""The fakes' own behaviour (their misbehaving variants: test_misbehaving.py).

That the fakes honour the port contracts is checked by the one contract suite
that also runs against the ORM adapters: dispatch/tests/test_port_contract.py.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from dispatch.core.fakes import (
    DEFAULT_NOW,
    FakeCandidateSource,
    FakeClaimPort,
    FakeClock,
    FakeStore,
)
from dispatch.core.ports import NEW_CLAIM, ClaimRequest, ClaimStatus, DispatchScope, SessionRef
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


@pytest.mark.parametrize("limit", [0, -1, 65, True])
def test_fakes_refuse_a_limit_outside_the_hard_cap_like_the_orm(limit: int) -> None:
    with pytest.raises(ValueError):
        FakeCandidateSource(FakeStore()).candidate_page(
            observed_at=DEFAULT_NOW, cursor=None, limit=limit
        )


def _claim(store: FakeStore, attempt_id: str, ref: SessionRef, *, ttl_s: int) -> str:
    attempt = store.attempts[attempt_id]
    request = ClaimRequest(
        attempt_id=attempt_id,
        run_id=attempt.run_id,
        expected_version=attempt.version,
        lease_generation=attempt.lease_generation + 1,
        worker_id=ref.worker_id,
        session_id=ref.session_id,
        session_generation=ref.session_generation,
        offer_id=f"offer-{attempt_id}-{attempt.lease_generation + 1}",
        token_digest="0" * 64,
        spec_sha256="0" * 64,
        placement_score=0,
        source=NEW_CLAIM,
        pull_id=None,
        lease_ttl_s=ttl_s,
        skip_locked=False,
    )
    return str(FakeClaimPort(store).claim(request).status)


def test_an_expired_lease_frees_its_task_slot_before_any_sweep() -> None:
    """The fake counts a Task's slots from live leases, like `leases.quota`
    (the ORM side: leases/tests/test_task_quota.py)."""
    store = FakeStore()
    ref = store.add_worker(slots=4)
    _, task_id, _ = store.add_task(definition=definition(max_concurrent_runs=1))
    _, first = store.add_run(task_id=task_id)
    _, second = store.add_run(task_id=task_id)
    assert _claim(store, first, ref, ttl_s=10) == ClaimStatus.WON
    assert _claim(store, second, ref, ttl_s=10) == ClaimStatus.ATTEMPT_LOST
    store.clock.advance(10)  # at expires_at the lease is no longer live
    assert [lease.state for lease in store.leases.values()] == ["active"]  # not swept
    assert _claim(store, second, ref, ttl_s=10) == ClaimStatus.WON
