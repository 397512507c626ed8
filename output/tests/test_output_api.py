"""Live output: the Worker's endpoint and the operator's read (README "Live output").

A started Attempt's output is appended in numbered chunks (a repeat stores
nothing), only by the Session holding the lease with its token, redacted of
the Task's env values, bounded per Attempt with an explicit marker, and read
back page by page through `GET /api/v1/runs/{id}/output`.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client, override_settings

from output.models import AttemptOutput, OutputChunk
from output.redaction import REDACTED
from qinglong.testing import CANARY_ENV, canary_definition, make_project, make_worker
from runs.models import Attempt
from runs.services import run_enqueue, task_create
from workers.agent.output import MAX_OUTPUT_CHUNK_BYTES
from workers.tests.api_helpers import (
    API,
    WORKER_API,
    WorkerClient,
    bearer,
    error_code,
    operator_headers,
    post_json,
    state_snapshot,
)

pytestmark = pytest.mark.django_db


def _run(definition: dict[str, object] | None = None):
    task = task_create(
        project=make_project(), name="t", definition=definition or canary_definition()
    )
    return run_enqueue(task=task)


def _claimed(client: Client) -> tuple[WorkerClient, dict[str, Any], str]:
    worker, _ = make_worker(slots=1)
    wc = WorkerClient.open(client, worker=worker)
    response, _, token = wc.pull()
    [offer] = response.json()["offers"]
    return wc, offer, token


class Started(tuple):
    """(WorkerClient, offer, lease token) of a running Attempt, and its Run."""

    run: Any


@pytest.fixture
def started(client: Client) -> Started:
    run = _run()
    wc, offer, token = _claimed(client)
    assert wc.ack(offer, "starting", token).status_code == 200
    assert wc.ack(offer, "running", token, executor_handle="pid:1").status_code == 200
    result = Started((wc, offer, token))
    result.run = run
    return result


def send(wc: WorkerClient, offer: dict[str, Any], token: str, seq: int, chunk: str, **extra):
    return post_json(
        wc.client,
        f"{WORKER_API}/leases/{offer['offer_id']}/output",
        {"lease_token": token, "seq": seq, "chunk": chunk, **extra},
        bearer(wc.token),
    )


def stored() -> list[tuple[int, str]]:
    return list(OutputChunk.objects.order_by("seq").values_list("seq", "text"))


def test_chunks_are_stored_in_order_and_a_repeated_sequence_number_stores_nothing(started):
    wc, offer, token = started
    first = send(wc, offer, token, 1, "hello\n")
    assert first.status_code == 200
    assert first.json() == {"seq": 1, "stored": True, "cancel_requested": False}
    assert send(wc, offer, token, 2, "world\n").json()["stored"] is True
    # The response to seq 2 was "lost": the Worker sends it again.
    again = send(wc, offer, token, 2, "world\n")
    assert again.status_code == 200
    assert again.json()["stored"] is False
    assert send(wc, offer, token, 1, "late duplicate\n").json()["stored"] is False
    assert stored() == [(1, "hello\n"), (2, "world\n")]
    book = AttemptOutput.objects.get()
    assert (book.last_seq, book.stored_bytes) == (2, 12)


def test_output_is_stored_redacted_of_the_env_values_even_when_split(started):
    wc, offer, token = started
    send(wc, offer, token, 1, f"token is {CANARY_ENV}\nhalf: {CANARY_ENV[:7]}")
    send(wc, offer, token, 2, f"{CANARY_ENV[7:]} done\n")
    texts = "".join(text for _, text in stored())
    assert CANARY_ENV not in texts
    assert CANARY_ENV[:7] not in texts
    assert texts == f"token is {REDACTED}\nhalf: {REDACTED} done\n"


def test_the_terminal_acks_output_tail_is_stored_redacted_too(started):
    wc, offer, token = started
    response = wc.ack(offer, "succeeded", token, exit_code=0, output_tail=f"x {CANARY_ENV} y")
    assert response.status_code == 200
    assert Attempt.objects.get().output_tail == f"x {REDACTED} y"


def test_nul_and_lone_surrogates_are_stored_as_replacement_characters(started):
    wc, offer, token = started
    assert send(wc, offer, token, 1, "a\x00b\ud800c").status_code == 200
    assert stored() == [(1, "a\ufffdb\ufffdc")]


def test_the_answer_carries_a_cancel_so_the_worker_stops_early(started):
    from leases.end import run_cancel

    wc, offer, token = started
    run_cancel(run=started.run, actor="test")
    assert send(wc, offer, token, 1, "x").json()["cancel_requested"] is True


def test_another_sessions_wrong_tokens_and_unknown_leases_change_nothing(client, started):
    wc, offer, token = started
    other = WorkerClient.open(client)
    before = state_snapshot()
    response = post_json(
        client,
        f"{WORKER_API}/leases/{offer['offer_id']}/output",
        {"lease_token": token, "seq": 1, "chunk": "x"},
        bearer(other.token),
    )
    assert (response.status_code, error_code(response)) == (403, "lease_forbidden")
    wrong = send(wc, offer, "A" * 43, 1, "x")
    assert (wrong.status_code, error_code(wrong)) == (403, "lease_token_invalid")
    unknown = post_json(
        client,
        f"{WORKER_API}/leases/{'0' * 64}/output",
        {"lease_token": token, "seq": 1, "chunk": "x"},
        bearer(wc.token),
    )
    assert (unknown.status_code, error_code(unknown)) == (404, "lease_not_found")
    no_auth = post_json(
        client,
        f"{WORKER_API}/leases/{offer['offer_id']}/output",
        {"lease_token": token, "seq": 1, "chunk": "x"},
        {},
    )
    assert no_auth.status_code == 401
    assert state_snapshot() == before
    assert stored() == []


def test_output_before_starting_or_after_the_end_is_a_conflict(client):
    _run()
    wc, offer, token = _claimed(client)
    early = send(wc, offer, token, 1, "too early")
    assert (early.status_code, error_code(early)) == (409, "not_started")
    assert wc.ack(offer, "starting", token).status_code == 200
    assert send(wc, offer, token, 1, "now\n").status_code == 200
    assert wc.ack(offer, "running", token, executor_handle="pid:1").status_code == 200
    assert wc.ack(offer, "failed", token, exit_code=3).status_code == 200
    late = send(wc, offer, token, 2, "after the end")
    assert (late.status_code, error_code(late)) == (409, "lease_released")
    assert stored() == [(1, "now\n")]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"seq": 0, "chunk": "x"}, "seq"),
        ({"seq": "1", "chunk": "x"}, "seq"),
        ({"seq": 1, "chunk": ""}, "chunk"),
        ({"seq": 1, "chunk": "x" * (MAX_OUTPUT_CHUNK_BYTES + 1)}, "chunk"),
        # Counted as sent: a quote is two bytes.
        ({"seq": 1, "chunk": '"' * (MAX_OUTPUT_CHUNK_BYTES // 2 + 1)}, "chunk"),
        ({"seq": 1, "chunk": "x", "skipped_bytes": -1}, "skipped_bytes"),
        ({"seq": 1, "chunk": "x", "extra": 1}, "extra"),
    ],
)
def test_bad_bodies_are_400_and_change_nothing(started, body, field):
    wc, offer, token = started
    response = post_json(
        wc.client,
        f"{WORKER_API}/leases/{offer['offer_id']}/output",
        {"lease_token": token, **body},
        bearer(wc.token),
    )
    assert response.status_code == 400
    assert field in response.json()["error"]["message"]
    assert stored() == []


def test_a_chunk_at_the_limit_is_accepted(started):
    wc, offer, token = started
    assert send(wc, offer, token, 1, "x" * MAX_OUTPUT_CHUNK_BYTES).status_code == 200


@override_settings(QINGLONG_OUTPUT_MAX_BYTES=64 * 1024)
def test_the_total_is_bounded_keeping_the_newest_with_a_truncation_marker(client, started):
    wc, offer, token = started
    piece = "y" * 10_000 + "\n"
    for seq in range(1, 21):
        assert send(wc, offer, token, seq, f"{seq:03d}" + piece).status_code == 200
    book = AttemptOutput.objects.get()
    chunks = stored()
    assert book.stored_bytes <= 64 * 1024
    assert book.stored_bytes == sum(len(t.encode()) for _, t in chunks)
    assert chunks[-1][0] == 20  # the newest is always kept
    assert [s for s, _ in chunks] == list(range(book.dropped_through_seq + 1, 21))
    assert book.dropped_bytes == (20 - len(chunks)) * len("001" + piece)
    page = client.get(
        f"{API}/runs/{started.run.pk}/output", **operator_headers(perms=("runs.view_run",))
    ).json()
    assert page["truncated"] == {
        "dropped_through_seq": book.dropped_through_seq,
        "dropped_bytes": book.dropped_bytes,
    }
    assert page["chunks"][0]["seq"] == book.dropped_through_seq + 1


def test_skipped_output_is_counted_and_shown_per_chunk(client, started):
    wc, offer, token = started
    send(wc, offer, token, 1, "start\n")
    send(wc, offer, token, 2, "newest\n", skipped_bytes=5000)
    assert AttemptOutput.objects.get().skipped_bytes == 5000
    page = client.get(
        f"{API}/runs/{started.run.pk}/output", **operator_headers(perms=("runs.view_run",))
    ).json()
    assert [c["skipped_bytes"] for c in page["chunks"]] == [0, 5000]
    assert page["skipped_bytes"] == 5000


@override_settings(
    REST_FRAMEWORK={
        **__import__("django.conf").conf.settings.REST_FRAMEWORK,
        "DEFAULT_THROTTLE_RATES": {
            **__import__("django.conf").conf.settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"],
            "worker_output": "3/min",
        },
    }
)
def test_the_rate_is_capped_per_attempt(started):
    wc, offer, token = started
    codes = [send(wc, offer, token, seq, "x").status_code for seq in range(1, 6)]
    assert codes == [200, 200, 200, 429, 429]
    assert [s for s, _ in stored()] == [1, 2, 3]


# ------------------------------------------------------------- operator read


def test_the_operator_reads_pages_by_sequence_number(client, started):
    wc, offer, token = started
    for seq in range(1, 6):
        send(wc, offer, token, seq, f"line {seq}\n")
    headers = operator_headers(perms=("runs.view_run",))
    url = f"{API}/runs/{started.run.pk}/output"
    first = client.get(f"{url}?limit=2", **headers).json()
    assert [c["text"] for c in first["chunks"]] == ["line 1\n", "line 2\n"]
    assert (first["next_after"], first["more"], first["live"]) == (2, True, True)
    assert first["attempt"]["number"] == 1 and first["attempt"]["state"] == "running"
    assert first["latest_attempt"] == 1
    rest = client.get(f"{url}?after=2&limit=10", **headers).json()
    assert [c["seq"] for c in rest["chunks"]] == [3, 4, 5]
    assert (rest["next_after"], rest["more"]) == (5, False)
    idle = client.get(f"{url}?after=5", **headers).json()
    assert (idle["chunks"], idle["next_after"]) == ([], 5)
    wc.ack(offer, "succeeded", token, exit_code=0)
    done = client.get(f"{url}?after=5&attempt=1", **headers).json()
    assert done["live"] is False
    assert done["attempt"]["state"] == "succeeded"


@pytest.mark.parametrize(
    "query", ["?after=-1", "?after=x", "?limit=0", "?limit=65", "?attempt=0", "?foo=1", "?after=²"]
)
def test_bad_queries_are_400(client, started, query):
    response = client.get(
        f"{API}/runs/{started.run.pk}/output{query}", **operator_headers(perms=("runs.view_run",))
    )
    assert response.status_code == 400


def test_reading_needs_view_run_and_an_existing_run(client, started):
    url = f"{API}/runs/{started.run.pk}/output"
    assert client.get(url, **operator_headers(perms=())).status_code == 403
    assert client.get(url, **operator_headers(staff=False)).status_code == 403
    assert client.get(url).status_code in (401, 403)
    missing = client.get(f"{API}/runs/999999/output", **operator_headers(perms=("runs.view_run",)))
    assert (missing.status_code, error_code(missing)) == (404, "not_found")
    no_attempt = client.get(f"{url}?attempt=7", **operator_headers(perms=("runs.view_run",))).json()
    assert (no_attempt["attempt"], no_attempt["chunks"]) == (None, [])
