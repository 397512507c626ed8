"""`POST /api/v1/worker/acks`: several leases' ACKs in one request (docs/adr/0013).

Each item is applied exactly as the single ACK would be (its own token, its
own checks, a compare-and-set with its history row, a repeat a no-op) and
answered on its own; a malformed item refuses the whole request. On
PostgreSQL the items share one transaction with one locking statement.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import OperationalError, connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from rest_framework.exceptions import ValidationError

import leases.ack as ack_use_case
from leases.end import run_cancel
from leases.errors import LostRace
from leases.models import LeaseState, RunLease
from qinglong.testing import make_run, make_task
from runs.models import Attempt, AttemptEvent, Run
from workers.api import views
from workers.api.serializers import MAX_ACKS_PER_REQUEST
from workers.tests.api_helpers import (
    PHASE_EXTRA,
    WORKER_API,
    WorkerClient,
    bearer,
    error_code,
    new_lease_token,
    post_json,
    state_snapshot,
)

pytestmark = pytest.mark.django_db

ACKS = f"{WORKER_API}/acks"


def item(offer: dict[str, Any], phase: str, token: str, **extra: Any) -> dict[str, Any]:
    return {
        "offer_id": offer["offer_id"],
        "phase": phase,
        "lease_token": token,
        "spec_sha256": offer["spec_sha256"],
        **PHASE_EXTRA[phase],
        **extra,
    }


def post_acks(worker: WorkerClient, items: list[dict[str, Any]]) -> Any:
    return post_json(worker.client, ACKS, {"acks": items}, bearer(worker.token))


def pulled(worker: WorkerClient, runs: int) -> tuple[list[dict[str, Any]], str]:
    task = make_task()
    for _ in range(runs):
        make_run(task)
    response, _, token = worker.pull(max_offers=runs)
    offers = response.json()["offers"]
    assert len(offers) == runs, response.content
    return offers, token


def history(offer: dict[str, Any]) -> list[tuple[str, str, str]]:
    return list(
        AttemptEvent.objects.filter(attempt_id=int(offer["attempt_id"]))
        .order_by("id")
        .values_list("from_state", "to_state", "reason")
    )


def test_a_run_goes_from_claim_to_success_in_two_requests_with_every_phase_recorded(
    client: Client,
) -> None:
    worker = WorkerClient.open(client, slots=4)
    offers, token = pulled(worker, 3)
    started = post_acks(worker, [item(offer, "starting", token) for offer in offers])
    assert started.status_code == 200, started.content
    assert [r["status"] for r in started.json()["results"]] == [200, 200, 200]
    assert [r["offer_id"] for r in started.json()["results"]] == [o["offer_id"] for o in offers]
    assert {r["attempt_state"] for r in started.json()["results"]} == {"starting"}
    # A process that ended before its `running` ACK: both phases, in order.
    finished = post_acks(
        worker,
        [i for o in offers for i in (item(o, "running", token), item(o, "succeeded", token))],
    )
    results = finished.json()["results"]
    assert [r["status"] for r in results] == [200] * 6
    assert [r["attempt_state"] for r in results] == ["running", "succeeded"] * 3
    assert set(results[1]) == {
        "offer_id",
        "status",
        "attempt_state",
        "run_state",
        "cancel_requested",
    }
    for offer in offers:
        assert history(offer) == [
            ("pending", "claimed", "claim"),
            ("claimed", "starting", "ack_starting"),
            ("starting", "running", "ack_running"),
            ("running", "succeeded", "ack_succeeded"),
        ]
        run = Run.objects.get(pk=int(offer["run_id"]))
        assert run.state == "succeeded"
        lease = RunLease.objects.get(offer_id=offer["offer_id"])
        assert (lease.state, lease.end_reason) == (LeaseState.RELEASED, "ack_succeeded")
    # The same request again: every item a no-op repeat, nothing changes.
    before = state_snapshot()
    assert post_acks(worker, [item(o, "succeeded", token) for o in offers]).json()["results"][0][
        "status"
    ] == (200)
    assert state_snapshot() == before


def test_each_item_is_authorized_and_answered_on_its_own(client: Client) -> None:
    worker = WorkerClient.open(client, slots=4)
    other = WorkerClient.open(client, slots=2)
    offers, token = pulled(worker, 2)
    [theirs], their_token = pulled(other, 1)
    before = state_snapshot()
    response = post_acks(
        worker,
        [
            item(offers[0], "starting", new_lease_token()),  # a wrong token
            item(theirs, "starting", their_token),  # another Session's lease
            {**item(offers[1], "starting", token), "offer_id": "f" * 64},  # no such lease
            item(offers[1], "starting", token, spec_sha256="0" * 64),  # not its spec
            item(offers[1], "running", token),  # not after `starting`
        ],
    )
    assert response.status_code == 200, response.content
    results = response.json()["results"]
    assert [(r["status"], r["error"]["code"]) for r in results] == [
        (403, "lease_token_invalid"),
        (403, "lease_forbidden"),
        (404, "lease_not_found"),
        (409, "spec_mismatch"),
        (409, "illegal_phase"),
    ]
    for result in results:
        assert set(result) == {"offer_id", "status", "error"}
        assert set(result["error"]) == {"code", "message"}
    assert state_snapshot() == before
    # One refused never stops another: the good one beside them applies.
    mixed = post_acks(
        worker, [item(offers[0], "starting", "x" * 43), item(offers[1], "starting", token)]
    ).json()["results"]
    assert [r["status"] for r in mixed] == [403, 200]
    assert Attempt.objects.get(pk=int(offers[1]["attempt_id"])).state == "starting"
    assert Attempt.objects.get(pk=int(offers[0]["attempt_id"])).state == "claimed"


def test_a_cancelled_run_is_a_409_for_its_item_only(client: Client) -> None:
    worker = WorkerClient.open(client, slots=4)
    offers, token = pulled(worker, 2)
    post_acks(worker, [item(o, "starting", token) for o in offers])
    run_cancel(run=Run.objects.get(pk=int(offers[0]["run_id"])))
    response = post_acks(worker, [item(o, "running", token) for o in offers]).json()["results"]
    # `running` is still accepted, with the verdict: stop it and ACK its end.
    assert [(r["status"], r["cancel_requested"]) for r in response] == [(200, True), (200, False)]
    ended = post_acks(
        worker,
        [
            item(offers[0], "failed", token, error_code="cancelled"),
            item(offers[1], "succeeded", token),
        ],
    ).json()["results"]
    assert [(r["status"], r["run_state"]) for r in ended] == [
        (200, "cancelled"),
        (200, "succeeded"),
    ]
    # A second cancelled Run before it started: its `starting` is a 409, the other's not.
    more, token2 = pulled(worker, 2)
    run_cancel(run=Run.objects.get(pk=int(more[1]["run_id"])))
    started = post_acks(worker, [item(o, "starting", token2) for o in more]).json()["results"]
    assert started[0]["status"] == 200
    assert (started[1]["status"], started[1]["error"]["code"]) == (409, "lease_revoked")
    assert Attempt.objects.get(pk=int(more[1]["attempt_id"])).state == "cancelled"


def test_a_failure_is_decided_by_the_retry_policy_inside_the_batch(client: Client) -> None:
    worker = WorkerClient.open(client, slots=4)
    offers, token = pulled(worker, 2)
    post_acks(worker, [item(o, "starting", token) for o in offers])
    results = post_acks(
        worker,
        [
            item(offers[0], "start_failed", token),
            item(offers[1], "running", token),
            item(offers[1], "failed", token, output_tail="boom"),
        ],
    ).json()["results"]
    assert [r["status"] for r in results] == [200, 200, 200]
    assert [r["attempt_state"] for r in results] == ["start_failed", "running", "failed"]
    attempt = Attempt.objects.get(pk=int(offers[1]["attempt_id"]))
    assert (attempt.state, attempt.output_tail, attempt.exit_code) == ("failed", "boom", 1)


def test_items_naming_one_offer_apply_in_order(client: Client) -> None:
    worker = WorkerClient.open(client, slots=2)
    [offer], token = pulled(worker, 1)
    results = post_acks(
        worker,
        [
            item(offer, "starting", token),
            item(offer, "starting", token),  # a repeat: a no-op
            item(offer, "succeeded", token),  # not yet: `running` comes first
            item(offer, "running", token),
            item(offer, "succeeded", token),
            item(offer, "running", token),  # the lease is released
        ],
    ).json()["results"]
    assert [(r["status"], r.get("attempt_state") or r["error"]["code"]) for r in results] == [
        (200, "starting"),
        (200, "starting"),
        (409, "illegal_phase"),
        (200, "running"),
        (200, "succeeded"),
        (409, "lease_released"),
    ]
    assert [h[1] for h in history(offer)] == ["claimed", "starting", "running", "succeeded"]


@pytest.mark.parametrize(
    ("body", "code", "text"),
    [
        ([], "invalid_request", "body"),
        ({}, "invalid_request", "acks: a list of 1 to"),
        ({"acks": []}, "invalid_request", "acks: a list of 1 to"),
        ({"acks": {}}, "invalid_request", "acks: a list of 1 to"),
        ({"acks": [], "extra": 1}, "unknown_field", "extra"),
        ({"acks": [1]}, "invalid_request", "acks[0]: not_object"),
    ],
)
def test_a_malformed_envelope_is_a_400(client: Client, body: Any, code: str, text: str) -> None:
    worker = WorkerClient.open(client)
    response = post_json(client, ACKS, body, bearer(worker.token))
    assert response.status_code == 400
    assert error_code(response) == code
    assert text in response.json()["error"]["message"]


def test_a_malformed_item_refuses_the_whole_request_by_index_and_field(client: Client) -> None:
    worker = WorkerClient.open(client, slots=4)
    offers, token = pulled(worker, 2)
    before = state_snapshot()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"phase": "running", "executor_handle": None}, "acks[1].executor_handle: null"),
        ({"phase": "running", "executor_handle": None, "exit_code": 1}, "acks[1]"),
        ({"offer_id": "F" * 64}, "acks[1].offer_id: invalid"),
        ({"exit_code": 0}, "acks[1].exit_code: not_allowed_for_phase"),
        ({"lease_token": token + "\n"}, "acks[1].lease_token: invalid"),
    ]
    for bad, expected in cases:
        body = [item(offers[0], "starting", token), {**item(offers[1], "starting", token), **bad}]
        response = post_acks(worker, body)
        assert response.status_code == 400, (bad, response.content)
        assert expected in response.json()["error"]["message"], response.content
        # Never a value in the answer.
        assert token not in response.content.decode()
    unknown = post_acks(worker, [{**item(offers[0], "starting", token), "nope": 1}])
    assert error_code(unknown) == "unknown_field"
    too_many = post_acks(worker, [item(offers[0], "starting", token)] * (MAX_ACKS_PER_REQUEST + 1))
    assert too_many.status_code == 400
    assert state_snapshot() == before


def test_a_replaced_session_gets_401_for_the_whole_request(client: Client) -> None:
    worker = WorkerClient.open(client, slots=2)
    [offer], token = pulled(worker, 1)
    WorkerClient.open(client, worker=worker.worker)  # fences the first Session
    before = state_snapshot()
    response = post_acks(worker, [item(offer, "starting", token)] * 2)
    assert response.status_code == 401
    assert error_code(response) == "session_replaced"
    assert state_snapshot() == before


def test_a_database_failure_answers_503_for_the_items_not_applied(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = WorkerClient.open(client, slots=4)
    offers, token = pulled(worker, 3)
    real = ack_use_case.lease_ack_each

    def failing(**kwargs: Any) -> Any:
        answers = real(**kwargs)
        yield next(answers)
        raise OperationalError("connection lost")

    monkeypatch.setattr("workers.api.views.lease_ack_each", failing)
    response = post_acks(worker, [item(o, "starting", token) for o in offers])
    assert response.status_code == 200
    results = response.json()["results"]
    assert [r["status"] for r in results] == [200, 503, 503]
    assert results[1]["error"]["code"] == "database_unavailable"
    assert [r["offer_id"] for r in results] == [o["offer_id"] for o in offers]


@pytest.mark.postgres
def test_on_postgresql_the_items_share_one_transaction_and_one_lock_statement(
    client: Client,
) -> None:
    worker = WorkerClient.open(client, slots=8)
    offers, token = pulled(worker, 8)
    session = worker_session(worker)
    items = [ack_use_case.AckItem(
        offer_id=o["offer_id"], phase=ack_use_case.AckPhase.STARTING, lease_token=token,
        spec_sha256=o["spec_sha256"],
    ) for o in offers]  # fmt: skip
    with CaptureQueriesContext(connection) as queries:
        answers = list(ack_use_case.lease_ack_each(session=session, items=items))
    assert all(isinstance(a, ack_use_case.AckResult) for a in answers)
    # BEGIN, one locking statement, one write for all the ACKs, COMMIT.
    assert len(queries) == 4, [q["sql"][:60] for q in queries]
    running = [
        ack_use_case.AckItem(
            offer_id=o["offer_id"],
            phase=phase,
            lease_token=token,
            spec_sha256=o["spec_sha256"],
            executor_handle="pid:1",
            exit_code=0,
        )
        for o in offers
        for phase in (ack_use_case.AckPhase.RUNNING, ack_use_case.AckPhase.SUCCEEDED)
    ]
    with CaptureQueriesContext(connection) as queries:
        answers = list(ack_use_case.lease_ack_each(session=session, items=running))
    assert all(isinstance(a, ack_use_case.AckResult) for a in answers)
    # One write per wave: every `running`, then every `succeeded` (one row is
    # written once per statement); no subscription, so no webhook read.
    assert len(queries) == 5, [q["sql"][:60] for q in queries]
    leases = RunLease.objects.filter(offer_id__in=[o["offer_id"] for o in offers])
    runs = Run.objects.filter(pk__in=leases.values("run_id"))
    assert sorted(runs.values_list("state", flat=True)) == ["succeeded"] * 8
    assert AttemptEvent.objects.filter(run__in=runs).count() == 8 * 4  # claimed..succeeded


@pytest.mark.postgres
def test_a_write_failing_midway_rolls_the_batch_back_and_applies_each_alone(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = WorkerClient.open(client, slots=4)
    offers, token = pulled(worker, 3)
    real = ack_use_case._apply
    calls = {"n": 0}

    def lose_once(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 2:
            raise LostRace("a row changed under us")  # after its writes

    monkeypatch.setattr(ack_use_case, "_apply", lose_once)
    results = post_acks(worker, [item(o, "starting", token) for o in offers]).json()["results"]
    # The 2nd item lost its race after writing: the batch rolled back, then
    # each item went again alone (one transaction each): all three land once.
    assert [r["status"] for r in results] == [200, 200, 200]
    for offer in offers:
        assert [h[1] for h in history(offer)] == ["claimed", "starting"]


def worker_session(worker: WorkerClient) -> Any:
    from workers.models import WorkerSession

    return WorkerSession.objects.select_related("worker").get(worker=worker.worker, state="online")


# --------------------------------------------------- the plain-item fast path

_ID = "ab" * 32
_TOKEN = "T" * 43
_BASE: dict[str, dict[str, Any]] = {
    "starting": {},
    "running": {"executor_handle": "pid:42"},
    "succeeded": {"exit_code": 0, "output_tail": "", "error_code": ""},
    "failed": {"exit_code": 1, "output_tail": "boom\x00\ud800 tail", "error_code": "exit_nonzero"},
    "start_failed": {"error_code": "spawn_failed", "output_tail": "OSError"},
}
_BAD_VALUES: dict[str, list[Any]] = {
    "offer_id": [None, 1, "", _ID.upper(), _ID + "\n", _ID[:-1], _ID + "0", [_ID]],
    "spec_sha256": [None, 0, "", "AB" * 32, "ab" * 32 + "\n", "ab" * 31, {"x": 1}],
    "lease_token": [None, 7, "T" * 42, "T" * 128, "T" * 129, "T" * 42 + "=", "T" * 43 + "\n"],
    "phase": [None, 1, "", "STARTING", "started", ["starting"]],
    "executor_handle": [None, 42, "", "x" * 200, "x" * 201, "pid:\x001", "pid\ud800", " "],
    "exit_code": [None, True, 1.0, "0", 2**31 - 1, 2**31, -(2**31), -(2**31) - 1],
    "error_code": [None, 1, "", "x" * 64, "x" * 65, "a\x00", "a\udfff", "  "],
    "output_tail": [None, 5, "x" * 65536, "x" * 65537, '"' * 33000, "ok 😀 雪\n"],
    "unknown": ["x"],
}


def _verdict(item: dict[str, Any]) -> Any:
    try:
        return views._serialized_ack_item(item)
    except ValidationError:
        return None


def _variants() -> list[dict[str, Any]]:
    found = []
    for phase, extra in _BASE.items():
        base = {
            "offer_id": _ID,
            "phase": phase,
            "lease_token": _TOKEN,
            "spec_sha256": "cd" * 32,
            **extra,
        }
        found.append(base)
        for key in base:
            found.append({k: v for k, v in base.items() if k != key})
        for key, values in _BAD_VALUES.items():
            found.extend({**base, key: value} for value in values)
    return found


def test_the_plain_item_reading_never_disagrees_with_the_serializer() -> None:
    """Every item the fast path reads, the serializer reads the same; it never
    reads one the serializer refuses (those go to the serializer for their 400)."""
    variants = _variants()
    read = 0
    for variant in variants:
        fast = views._plain_ack_item(variant)
        if fast is not None:
            read += 1
            assert fast == _verdict(variant), variant
    # It is the path the agent's items take: each phase's plain item is read.
    for phase, extra in _BASE.items():
        item = {"offer_id": _ID, "phase": phase, "lease_token": _TOKEN, "spec_sha256": "cd" * 32}
        assert views._plain_ack_item({**item, **extra}) is not None, phase
    assert read >= len(_BASE) + 10, read


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_on_postgresql_each_wave_text_is_prepared_once_per_connection(client: Client) -> None:
    # Issue #12, docs/adr/0013: a wave's text depends only on the kinds of
    # write it holds, and its integers go as bigint (`int8_params`), so each
    # text is one prepared statement per connection whatever the number of
    # items or the ids' widths (psycopg types an int list by its largest
    # element: ids crossing 32,767 made the same text a second statement).
    # Each batch is its own transaction, as in the server: the claim's
    # `force_generic_plan` (local to its transaction) does not reach it.
    worker = WorkerClient.open(client, slots=16)
    session = worker_session(worker)
    sizes = (2, 3, 2, 4, 2, 3, 2)  # past PostgreSQL's five custom plans
    for round_, size in enumerate(sizes):
        if round_ == 3:  # new rows' ids past 32,767 from here on
            with connection.cursor() as cursor:
                for table in ("runs_run", "runs_attempt", "runs_attemptevent", "dispatch_runlease"):
                    cursor.execute(
                        "SELECT setval(pg_get_serial_sequence(%s, 'id'), 40000)", [table]
                    )
        offers, token = pulled(worker, size)
        items = [ack_use_case.AckItem(
            offer_id=o["offer_id"], phase=ack_use_case.AckPhase(phase), lease_token=token,
            spec_sha256=o["spec_sha256"], executor_handle="pid:1", exit_code=0,
        ) for phase in ("starting", "running", "succeeded") for o in offers]  # fmt: skip
        answers = list(ack_use_case.lease_ack_each(session=session, items=items))
        assert all(isinstance(a, ack_use_case.AckResult) for a in answers), answers
    assert int(RunLease.objects.latest("pk").pk) > 40000
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT statement, generic_plans + custom_plans FROM pg_prepared_statements "
            "WHERE statement LIKE %s",
            ["WITH w0 AS (%unnest(%"],
        )
        runs = sorted(executions for _, executions in cursor)
    # starting, running and succeeded: three texts, each run once per batch.
    assert runs == [len(sizes)] * 3, runs


def test_a_batch_records_the_webhook_of_each_subscribed_success(client: Client) -> None:
    # On PostgreSQL the batch's writes are one statement per wave; the webhook
    # of a Run that ended is recorded after them, with its Attempt as written.
    import json

    from notifications.models import WebhookDelivery
    from qinglong.testing import subscribe_to_success

    worker = WorkerClient.open(client, slots=4)
    subscribed, plain = make_run(make_task()), make_run(make_task())
    subscribe_to_success(subscribed)
    response, _, token = worker.pull(max_offers=4)
    offers = response.json()["offers"]
    assert len(offers) == 2
    items = [
        item(o, phase, token) for phase in ("starting", "running", "succeeded") for o in offers
    ]
    response = post_acks(worker, items)
    assert [r["status"] for r in response.json()["results"]] == [200] * 6
    (delivery,) = WebhookDelivery.objects.all()
    assert delivery.subject_key == f"run:{subscribed.pk}:succeeded"
    body = json.loads(delivery.body)
    attempt = body["run"]["attempt"]
    assert attempt["state"] == "succeeded", body
    assert attempt["exit_code"] == 0
    assert Run.objects.get(pk=plain.pk).state == "succeeded"


@pytest.mark.postgres
def test_on_postgresql_a_wave_of_one_ack_is_its_own_write(client: Client) -> None:
    # `running` then `succeeded` of one offer: two waves of one ACK each, each
    # written by the single ACK's statement (no arrays to dump and unnest).
    worker = WorkerClient.open(client, slots=2)
    offers, token = pulled(worker, 1)
    assert post_acks(worker, [item(offers[0], "starting", token)]).status_code == 200
    with CaptureQueriesContext(connection) as queries:
        response = post_acks(
            worker, [item(offers[0], "running", token), item(offers[0], "succeeded", token)]
        )
    assert [r["status"] for r in response.json()["results"]] == [200, 200]
    writes = [q["sql"] for q in queries if q["sql"].lstrip().startswith("WITH w0")]
    assert len(writes) == 2 and not any("unnest" in sql for sql in writes), writes
    assert [h[1] for h in history(offers[0])] == ["claimed", "starting", "running", "succeeded"]
