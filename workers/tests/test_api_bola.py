"""Object-level authorization: a Worker can never touch another Session's lease.

Every lease-scoped call made with another Worker's offer id or lease token is
refused (403, or 409 for a stale lease) and changes no row at all.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import Client

from leases.models import RunLease
from qinglong.testing import make_run
from workers.tests.api_helpers import (
    API,
    PHASE_EXTRA,
    WorkerClient,
    error_code,
    operator_headers,
    post_json,
    state_snapshot,
)

pytestmark = pytest.mark.django_db

PHASES = ("starting", "running", "start_failed", "succeeded", "failed")


def _claimed(client: Client) -> tuple[WorkerClient, dict[str, Any], str]:
    worker = WorkerClient.open(client, slots=1)
    response, _, token = worker.pull()
    [offer] = response.json()["offers"]
    return worker, offer, token


@pytest.fixture
def two_workers(client: Client) -> tuple[Any, ...]:
    make_run()
    make_run()
    alice, alice_offer, alice_token = _claimed(client)
    bob, bob_offer, bob_token = _claimed(client)
    return alice, alice_offer, alice_token, bob, bob_offer, bob_token


@pytest.mark.parametrize("bob_stage", ["claimed", "starting", "running"])
@pytest.mark.parametrize("phase", PHASES)
def test_acks_with_another_workers_offer_or_token_are_refused_and_change_nothing(
    two_workers: tuple[Any, ...], phase: str, bob_stage: str
) -> None:
    alice, alice_offer, alice_token, bob, bob_offer, bob_token = two_workers
    if bob_stage in ("starting", "running"):
        assert bob.ack(bob_offer, "starting", bob_token).status_code == 200
    if bob_stage == "running":
        assert bob.ack(bob_offer, "running", bob_token, **PHASE_EXTRA["running"]).status_code == 200
    before = state_snapshot()
    attempts = (
        (bob_offer, bob_token, "lease_forbidden"),  # Bob's offer with Bob's token
        (bob_offer, alice_token, "lease_forbidden"),  # Bob's offer with Alice's token
        (alice_offer, bob_token, "lease_token_invalid"),  # Alice's offer, Bob's token
    )
    for offer, token, code in attempts:
        response = alice.ack(offer, phase, token, **PHASE_EXTRA[phase])
        assert response.status_code == 403, response.content
        assert error_code(response) == code
    assert state_snapshot() == before


def test_heartbeat_lists_and_renews_only_the_own_sessions_leases(
    client: Client, two_workers: tuple[Any, ...]
) -> None:
    alice, alice_offer, alice_token, bob, bob_offer, bob_token = two_workers
    for worker, offer, token in ((alice, alice_offer, alice_token), (bob, bob_offer, bob_token)):
        for phase in ("starting", "running"):
            assert worker.ack(offer, phase, token, **PHASE_EXTRA[phase]).status_code == 200
    bob_run = bob_offer["run_id"]
    assert (
        post_json(client, f"{API}/runs/{bob_run}/cancel", {}, operator_headers()).status_code == 200
    )
    bob_lease = RunLease.objects.get(offer_id=bob_offer["offer_id"])
    beat = alice.heartbeat()
    assert beat.json()["cancel"] == []
    bob_lease_after = RunLease.objects.get(pk=bob_lease.pk)
    assert (bob_lease_after.expires_at, bob_lease_after.version) == (
        bob_lease.expires_at,
        bob_lease.version,
    )
    assert bob.heartbeat().json()["cancel"] == [bob_offer["offer_id"]]


def test_ack_with_a_different_spec_digest_is_a_conflict_and_changes_nothing(
    two_workers: tuple[Any, ...],
) -> None:
    alice, alice_offer, alice_token, *_ = two_workers
    before = state_snapshot()
    tampered = {**alice_offer, "spec_sha256": "0" * 64}
    response = alice.ack(tampered, "starting", alice_token)
    assert response.status_code == 409
    assert error_code(response) == "spec_mismatch"
    assert state_snapshot() == before


def test_ack_of_an_expired_lease_is_a_conflict_and_changes_nothing(
    two_workers: tuple[Any, ...],
) -> None:
    alice, alice_offer, alice_token, *_ = two_workers
    lease = RunLease.objects.get(offer_id=alice_offer["offer_id"])
    RunLease.objects.filter(pk=lease.pk).update(expires_at=lease.claimed_at - timedelta(seconds=1))
    before = state_snapshot()
    response = alice.ack(alice_offer, "starting", alice_token)
    assert response.status_code == 409
    assert error_code(response) == "lease_expired"
    assert state_snapshot() == before


def test_ack_of_an_unknown_offer_is_not_found(two_workers: tuple[Any, ...]) -> None:
    alice, alice_offer, alice_token, *_ = two_workers
    before = state_snapshot()
    response = alice.ack({**alice_offer, "offer_id": "f" * 64}, "starting", alice_token)
    assert response.status_code == 404
    assert error_code(response) == "lease_not_found"
    assert state_snapshot() == before


def test_a_pull_never_offers_another_sessions_lease(two_workers: tuple[Any, ...]) -> None:
    alice, alice_offer, _, bob, bob_offer, _ = two_workers
    for worker, own in ((alice, alice_offer), (bob, bob_offer)):
        [offer] = worker.pull()[0].json()["offers"]
        assert offer["offer_id"] == own["offer_id"]
