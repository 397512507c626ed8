"""Heartbeats that list what the agent holds (issue 10, findings 3 and 4; docs/adr/0005).

`held` renews only the listed started leases and ends this Session's started
Attempts it does not list (`not_held`), freeing their slots; `stop` names the
listed ids the agent must stop. Without `held` a heartbeat renews every
started lease, as before.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from django.test.utils import override_settings

from leases.models import LeaseState, RunLease
from leases.tests.timeshift import rewind
from qinglong.clock import db_now
from qinglong.testing import make_run, make_task
from runs.models import Attempt, AttemptEvent, AttemptState, Run, RunState
from workers.tests.api_helpers import PHASE_EXTRA, WorkerClient, error_code, state_snapshot

pytestmark = pytest.mark.django_db

# Every heartbeat is recorded (the minimum interval is tested elsewhere).
every_beat = override_settings(QINGLONG_HEARTBEAT_MIN_INTERVAL_S=0)
OLD_ENOUGH_S = 11  # past not_held_min_age (the heartbeat interval, 10 s)


def _take(worker: WorkerClient, n: int, phase: str = "running") -> list[tuple[dict[str, Any], str]]:
    """Pull `n` offers and ACK each up to `phase`; returns (offer, token) pairs."""
    response, _, token = worker.pull(max_offers=n)
    assert response.status_code == 200, response.content
    offers = response.json()["offers"]
    assert len(offers) == n
    phases = ("starting", "running") if phase == "running" else (phase,)
    for offer in offers:
        for step in phases:
            ack = worker.ack(offer, step, token, **PHASE_EXTRA[step])
            assert ack.status_code == 200, ack.content
    return [(offer, token) for offer in offers]


@every_beat
def test_phantom_leases_end_not_held_and_free_their_slots(client: Client) -> None:
    # The finding: four Attempts ran to completion but their terminal ACKs met
    # a web-server restart; the agent forgot them while its heartbeats kept
    # renewing every lease of its Session, so four phantom leases filled all
    # four slots and the Worker starved with Runs queued.
    worker = WorkerClient.open(client, slots=4)
    task = make_task(max_attempts=2)
    for _ in range(4):
        make_run(task)
    phantoms = _take(worker, 4)
    waiting = [make_run(task) for _ in range(3)]
    response, _, _ = worker.pull(max_offers=4)
    assert response.json()["offers"] == []  # every slot taken by a lease nobody runs
    rewind(OLD_ENOUGH_S)
    beat = worker.heartbeat(held=[])
    assert beat.status_code == 200, beat.content
    assert beat.json()["stop"] == []
    for offer, _ in phantoms:
        lease = RunLease.objects.get(offer_id=offer["offer_id"])
        assert (lease.state, lease.end_reason) == (LeaseState.REVOKED, "not_held")
        attempt = lease.attempt
        assert (attempt.state, attempt.error_code) == (AttemptState.LOST, "not_held")
        assert AttemptEvent.objects.filter(attempt=attempt, reason="not_held").exists()
        # The agent said it holds no process for it: the retry waits no grace.
        retry = Attempt.objects.get(run_id=attempt.run_id, number=2)
        assert (retry.state, retry.not_before) == (AttemptState.PENDING, None)
    # The slots are free: the Worker gets work again (retries keep their place).
    response, _, _ = worker.pull(max_offers=4)
    assert len(response.json()["offers"]) == 4
    assert all(Run.objects.get(pk=r.pk).state == RunState.QUEUED for r in waiting)


@every_beat
def test_held_renews_only_the_listed_started_leases(client: Client) -> None:
    worker = WorkerClient.open(client, slots=3)
    task = make_task()
    for _ in range(3):
        make_run(task)
    (kept, _), (dropped, _), (starting, starting_token) = _take(worker, 3, phase="starting")
    rewind(OLD_ENOUGH_S)
    before = {lease.offer_id: lease.expires_at for lease in RunLease.objects.all()}
    beat = worker.heartbeat(held=[kept["offer_id"], starting["offer_id"]])
    assert beat.status_code == 200, beat.content
    assert beat.json()["stop"] == []
    after = {lease.offer_id: lease for lease in RunLease.objects.all()}
    for offer in (kept, starting):
        lease = after[offer["offer_id"]]
        assert lease.state == LeaseState.ACTIVE
        assert lease.expires_at > before[offer["offer_id"]]
    assert (after[dropped["offer_id"]].state, after[dropped["offer_id"]].end_reason) == (
        LeaseState.REVOKED,
        "not_held",
    )
    # The ended one's later ACK is a 409: stop it (the agent said it holds none).
    assert worker.ack(dropped, "running", starting_token, **PHASE_EXTRA["running"]).status_code == (
        409
    )


@every_beat
def test_an_attempt_started_within_the_heartbeat_interval_is_left_for_the_next_beat(
    client: Client,
) -> None:
    # A heartbeat put together while a starting ACK was on the wire does not
    # list that offer yet: ending it would race the agent's spawn.
    worker = WorkerClient.open(client, slots=1)
    make_run()
    ((offer, _),) = _take(worker, 1, phase="starting")
    assert worker.heartbeat(held=[]).status_code == 200
    lease = RunLease.objects.get(offer_id=offer["offer_id"])
    assert (lease.state, lease.attempt.state) == (LeaseState.ACTIVE, AttemptState.STARTING)
    rewind(OLD_ENOUGH_S)
    assert worker.heartbeat(held=[]).status_code == 200
    lease.refresh_from_db()
    assert (lease.state, lease.end_reason) == (LeaseState.REVOKED, "not_held")


@every_beat
def test_claimed_offers_in_hand_are_not_affected_by_held(client: Client) -> None:
    worker = WorkerClient.open(client, slots=2)
    make_run()
    response, _, _ = worker.pull(max_offers=1)
    (offer,) = response.json()["offers"]
    lease = RunLease.objects.get(offer_id=offer["offer_id"])
    rewind(OLD_ENOUGH_S)
    before = RunLease.objects.get(pk=lease.pk).expires_at
    beat = worker.heartbeat(held=[])
    assert beat.status_code == 200 and beat.json()["stop"] == []
    lease.refresh_from_db()
    # Neither ended nor renewed: an offer keeps its claim TTL until it starts.
    assert (lease.state, lease.attempt.state, lease.expires_at) == (
        LeaseState.ACTIVE,
        AttemptState.CLAIMED,
        before,
    )
    # Listed while claimed: still not a stop.
    assert worker.heartbeat(held=[offer["offer_id"]]).json()["stop"] == []


@every_beat
def test_stop_names_listed_ids_that_are_not_live_leases_of_this_session(client: Client) -> None:
    worker = WorkerClient.open(client, slots=3)
    other = WorkerClient.open(client, slots=1)
    task = make_task()
    for _ in range(2):
        make_run(task)
    (running, _), (finished, token) = _take(worker, 2)
    done = worker.ack(finished, "succeeded", token, **PHASE_EXTRA["succeeded"])
    assert done.status_code == 200
    make_run(task)
    ((foreign, _),) = _take(other, 1)
    unknown = "ab" * 32
    held = [running["offer_id"], finished["offer_id"], foreign["offer_id"], unknown, unknown]
    beat = worker.heartbeat(held=held)
    assert beat.status_code == 200, beat.content
    body = beat.json()
    assert set(body) == {"session_state", "cancel", "stop", "server_time"}
    # A released lease, another Worker's live lease and an id that never existed
    # get the same answer: stop (a heartbeat is no oracle), in order, once each.
    assert body["stop"] == [finished["offer_id"], foreign["offer_id"], unknown]
    # The other Worker's lease is untouched by it.
    lease = RunLease.objects.get(offer_id=foreign["offer_id"])
    assert (lease.state, lease.attempt.state) == (LeaseState.ACTIVE, AttemptState.RUNNING)


@every_beat
def test_a_listed_lease_past_its_expiry_is_a_stop(client: Client) -> None:
    # Not renewed in time (the agent was cut off): its ACKs are refused and the
    # expiry sweep ends it, so the agent must not keep it running.
    worker = WorkerClient.open(client, slots=1)
    make_run()
    ((offer, _),) = _take(worker, 1)
    RunLease.objects.filter(offer_id=offer["offer_id"]).update(expires_at=db_now())
    beat = worker.heartbeat(held=[offer["offer_id"]])
    assert beat.status_code == 200, beat.content
    assert beat.json()["stop"] == [offer["offer_id"]]


@every_beat
def test_without_held_every_started_lease_is_renewed_as_before(client: Client) -> None:
    worker = WorkerClient.open(client, slots=2)
    task = make_task()
    for _ in range(2):
        make_run(task)
    _take(worker, 2)
    rewind(OLD_ENOUGH_S)
    before = dict(RunLease.objects.values_list("id", "expires_at"))
    beat = worker.heartbeat()
    assert beat.status_code == 200
    assert beat.json()["stop"] == []
    for lease in RunLease.objects.all():
        assert lease.state == LeaseState.ACTIVE
        assert lease.expires_at > before[lease.pk]


def test_a_heartbeat_inside_the_minimum_interval_answers_stop_and_writes_nothing(
    client: Client,
) -> None:
    worker = WorkerClient.open(client, slots=1)
    make_run()
    ((offer, _),) = _take(worker, 1)
    rewind(OLD_ENOUGH_S)
    with override_settings(QINGLONG_HEARTBEAT_MIN_INTERVAL_S=5):
        assert worker.heartbeat(held=[offer["offer_id"]]).status_code == 200
        snapshot = state_snapshot()
        beat = worker.heartbeat(held=["cd" * 32])
    assert beat.status_code == 200
    assert beat.json()["stop"] == ["cd" * 32]
    assert state_snapshot() == snapshot


@pytest.mark.parametrize(
    "held",
    [
        "not-a-list",
        ["ABCDEF" * 10 + "abcd"],  # upper case
        ["ab" * 32 + "\n"],
        ["ab" * 31],
        [12],
        ["ab" * 32] * 257,
    ],
)
def test_a_bad_held_list_is_a_400_that_changes_nothing(client: Client, held: Any) -> None:
    worker = WorkerClient.open(client, slots=1)
    make_run()
    _take(worker, 1)
    rewind(OLD_ENOUGH_S)
    snapshot = state_snapshot()
    response = worker.heartbeat(held=held)
    assert response.status_code == 400, response.content
    assert error_code(response) in {"invalid_request", "unknown_field"}
    assert state_snapshot() == snapshot
