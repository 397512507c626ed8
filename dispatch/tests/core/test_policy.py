"""The kernel's execution-state rules (dispatch.core.policy), at their boundaries."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from dispatch.core.policy import capacity, free_slots, lease_is_live, spec_matches_lease

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def test_a_lease_is_live_strictly_before_its_expiry():
    assert lease_is_live(NOW + timedelta(microseconds=1), NOW)
    assert not lease_is_live(NOW, NOW)  # at expires_at it has expired
    assert not lease_is_live(NOW - timedelta(seconds=1), NOW)


def test_capacity_is_the_smaller_of_session_and_worker_slots():
    assert capacity(4, 2) == 2
    assert capacity(1, 8) == 1
    assert capacity(3, 3) == 3


def test_free_slots_never_go_negative():
    assert free_slots(3, 1) == 2
    assert free_slots(2, 2) == 0
    assert free_slots(1, 5) == 0


def test_a_spec_matches_only_its_own_digest():
    digest = "ab" * 32
    assert spec_matches_lease(digest, digest)
    assert not spec_matches_lease(digest, "ac" + digest[2:])
    assert not spec_matches_lease(digest, digest[:-1])
