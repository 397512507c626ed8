"""Delivery accounting over the Worker API (issue 10, finding 2; docs/adr/0005).

A pull that re-delivers an offer inside the redelivery backoff is a re-poll,
not a delivery; an over-delivered offer goes back to the queue for any Worker,
the same one included, after one backoff; and after `max_delivery_rounds`
such rounds its Run fails `undeliverable` instead of staying queued.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from leases.models import LeaseState, RunLease
from leases.tests.timeshift import rewind
from qinglong.testing import make_run, make_task
from runs.models import Attempt, AttemptEvent, AttemptState, Run, RunState
from workers.tests.api_helpers import PHASE_EXTRA, WorkerClient

pytestmark = pytest.mark.django_db

BACKOFF_S = 5  # the default redelivery backoff (dispatch.core.budget)


def _pull_offers(worker: WorkerClient, tokens: dict[str, str], max_offers: int) -> list[Any]:
    response, _, token = worker.pull(max_offers=max_offers)
    assert response.status_code == 200, response.content
    offers = response.json()["offers"]
    for offer in offers:
        # A re-delivery to another pull carries no token: the agent keeps the
        # one it generated for the pull that claimed the offer.
        tokens.setdefault(offer["offer_id"], offer["lease"]["token"] or token)
    return list(offers)


def test_one_worker_re_polling_before_it_acks_strands_no_run(client: Client) -> None:
    # The finding: one agent of 8 slots pulls every 0.2 s and pulls again
    # before it has ACKed the offers in hand. Those re-polls used to count as
    # deliveries: the lease was revoked for max_deliveries and the Attempt was
    # never offered to that Session again, so with one Worker its Run stayed
    # queued for good.
    worker = WorkerClient.open(client, slots=8)
    task = make_task()
    runs = [make_run(task) for _ in range(20)]
    tokens: dict[str, str] = {}
    for _ in range(10):
        held: dict[str, Any] = {}
        for _ in range(6):  # six pulls within a second, nothing ACKed yet
            for offer in _pull_offers(worker, tokens, max_offers=8):
                held[offer["offer_id"]] = offer
        for offer_id, offer in held.items():
            for phase in ("starting", "running", "succeeded"):
                response = worker.ack(offer, phase, tokens[offer_id], **PHASE_EXTRA[phase])
                assert response.status_code == 200, response.content
        if not Run.objects.filter(state=RunState.QUEUED).exists():
            break
    assert sorted(Run.objects.values_list("state", flat=True)) == [RunState.SUCCEEDED] * len(runs)
    leases = RunLease.objects.all()
    assert leases.count() == len(runs)
    # Each lease was delivered once: the re-polls inside the backoff did not count.
    assert set(leases.values_list("delivery_count", flat=True)) == {1}
    assert not leases.filter(end_reason="max_deliveries").exists()


def test_an_over_delivered_offer_goes_back_to_the_same_session_after_one_backoff(
    client: Client,
) -> None:
    worker = WorkerClient.open(client, slots=1)
    run = make_run()
    tokens: dict[str, str] = {}
    # Five counted deliveries (max_deliveries), one backoff apart, never started.
    for _ in range(5):
        (offer,) = _pull_offers(worker, tokens, max_offers=1)
        rewind(BACKOFF_S)
    first = RunLease.objects.get()
    assert first.delivery_count == 5
    # The next pull revokes it; the Attempt waits one backoff, for everyone.
    assert _pull_offers(worker, tokens, max_offers=1) == []
    first.refresh_from_db()
    assert (first.state, first.end_reason) == (LeaseState.REVOKED, "max_deliveries")
    attempt = Attempt.objects.get(run=run)
    assert (attempt.state, attempt.not_before_reason) == (
        AttemptState.PENDING,
        "redelivery_backoff",
    )
    assert attempt.not_before is not None
    assert Run.objects.get(pk=run.pk).state == RunState.QUEUED
    rewind(BACKOFF_S - 1)
    assert _pull_offers(worker, tokens, max_offers=1) == []
    # After the backoff the same Session gets it again (a new lease generation).
    rewind(1)
    (again,) = _pull_offers(worker, tokens, max_offers=1)
    assert again["offer_id"] != offer["offer_id"]
    assert again["lease"]["generation"] == 2
    response = worker.ack(again, "starting", tokens[again["offer_id"]])
    assert response.status_code == 200, response.content


def test_an_offer_no_worker_starts_fails_its_run_undeliverable_after_the_rounds(
    client: Client,
) -> None:
    worker = WorkerClient.open(client, slots=1)
    run = make_run(max_attempts=3)
    tokens: dict[str, str] = {}
    for _ in range(40):
        _pull_offers(worker, tokens, max_offers=1)
        rewind(BACKOFF_S)
        run.refresh_from_db()
        if run.state != RunState.QUEUED and run.state != RunState.DISPATCHING:
            break
    # Never silently queued: after max_delivery_rounds (3) the Run fails, with
    # a reason an operator can read, and is not retried (nothing ever ran).
    assert run.state == RunState.FAILED
    (attempt,) = Attempt.objects.filter(run=run)
    assert (attempt.state, attempt.error_code) == (AttemptState.START_FAILED, "undeliverable")
    assert AttemptEvent.objects.filter(attempt=attempt, reason="undeliverable").count() == 1
    leases = RunLease.objects.filter(run=run)
    assert (
        list(leases.order_by("lease_generation").values_list("end_reason", flat=True))
        == ["max_deliveries"] * 3
    )
    assert not leases.filter(state=LeaseState.ACTIVE).exists()
    assert _pull_offers(worker, tokens, max_offers=1) == []
