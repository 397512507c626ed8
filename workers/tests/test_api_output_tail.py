"""An output tail can never make a terminal ACK fail.

Process output is arbitrary bytes: a NUL (which PostgreSQL text refuses) or a
lone surrogate used to turn the terminal ACK into a 400 and leave the Attempt
`running` until its lease expired. The server now stores U+FFFD for them, on
SQLite and PostgreSQL alike. The short machine strings (`error_code`,
`executor_handle`) keep refusing them with a clear 400.

The limit is on the tail as sent (its JSON escaping in UTF-8), so a tail
within it always fits the 80 KiB body cap, and a terminal ACK without a tail
is complete.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client

from qinglong.testing import make_run, make_worker
from runs.models import Attempt, AttemptState
from workers.api.serializers import (
    MAX_OUTPUT_TAIL_BYTES,
    clean_output_tail,
    output_tail_wire_bytes,
)
from workers.api.views import WORKER_MAX_BODY_BYTES
from workers.tests.api_helpers import (
    PHASE_EXTRA,
    WORKER_API,
    WorkerClient,
    bearer,
    error_code,
    state_snapshot,
)

pytestmark = pytest.mark.django_db

DIRTY = "before\x00middle\ud800after\udfffend\x00"
CLEAN = "before\ufffdmiddle\ufffdafter\ufffdend\ufffd"


@pytest.fixture
def started(client: Client) -> tuple[WorkerClient, dict[str, Any], str]:
    make_run()
    worker, _ = make_worker(slots=1)
    wc = WorkerClient.open(client, worker=worker)
    response, _, token = wc.pull()
    [offer] = response.json()["offers"]
    assert wc.ack(offer, "starting", token).status_code == 200
    return wc, offer, token


def _stored_tail() -> str:
    return Attempt.objects.get().output_tail


@pytest.mark.parametrize(
    ("phase", "state"),
    [
        ("succeeded", AttemptState.SUCCEEDED),
        ("failed", AttemptState.FAILED),
        ("start_failed", AttemptState.START_FAILED),
    ],
)
def test_nul_and_lone_surrogates_in_a_terminal_tail_are_stored_as_replacement_characters(
    started: Any, phase: str, state: str
) -> None:
    wc, offer, token = started
    if phase != "start_failed":
        assert wc.ack(offer, "running", token, **PHASE_EXTRA["running"]).status_code == 200
    # json.dumps writes them as \u0000 / \ud800 escapes: valid JSON.
    response = wc.ack(offer, phase, token, **PHASE_EXTRA[phase], output_tail=DIRTY)
    assert response.status_code == 200, response.content
    assert response.json()["attempt_state"] == state
    stored = _stored_tail()
    assert stored == CLEAN
    assert "\x00" not in stored
    stored.encode("utf-8")  # strict: no surrogate survived


def _post_raw(wc: WorkerClient, offer: dict[str, Any], body: dict[str, Any]) -> Any:
    # As the reference agent sends it: UTF-8 JSON, no \\u escapes for non-ASCII.
    raw = json.dumps(body, ensure_ascii=False).encode("utf-8")
    path = f"{WORKER_API}/leases/{offer['offer_id']}/ack"
    return wc.client.post(path, data=raw, content_type="application/json", **bearer(wc.token))


def test_an_accepted_tail_with_nul_is_stored_whole(started: Any) -> None:
    # The limit counts a NUL as its 6-byte escape and U+FFFD as 3 bytes, so
    # cleaning never pushes an accepted tail over it: nothing is cut.
    wc, offer, token = started
    assert wc.ack(offer, "running", token, **PHASE_EXTRA["running"]).status_code == 200
    tail = "é" * 30000 + "\x00" * 900  # 60,000 + 5,400 bytes as sent
    assert output_tail_wire_bytes(tail) <= MAX_OUTPUT_TAIL_BYTES
    body = {
        "phase": "failed",
        "lease_token": token,
        "spec_sha256": offer["spec_sha256"],
        "exit_code": 1,
        "output_tail": tail,
    }
    response = _post_raw(wc, offer, body)
    assert response.status_code == 200, response.content
    assert _stored_tail() == "é" * 30000 + "\ufffd" * 900


@pytest.mark.parametrize("char", ['"', "\\", "\x01", "\n", "\x00", "😀", "雪", "a"])
def test_a_tail_at_the_limit_fits_the_body_cap_and_is_accepted_whole(
    started: Any, char: str
) -> None:
    """Whatever the output holds, a tail within the limit makes an ACK body the
    server takes (the 80 KiB cap used to turn escape-heavy tails into 413s)."""
    wc, offer, token = started
    tail = clean_output_tail(char * MAX_OUTPUT_TAIL_BYTES)
    assert MAX_OUTPUT_TAIL_BYTES - 6 < output_tail_wire_bytes(tail) <= MAX_OUTPUT_TAIL_BYTES
    body = {
        "phase": "start_failed",
        "lease_token": token,
        "spec_sha256": offer["spec_sha256"],
        "exit_code": -(2**31),
        "error_code": "e" * 64,
        "output_tail": tail,
    }
    assert len(json.dumps(body, ensure_ascii=False).encode("utf-8")) < WORKER_MAX_BODY_BYTES
    response = _post_raw(wc, offer, body)
    assert response.status_code == 200, response.content
    assert _stored_tail() == tail


@pytest.mark.parametrize(
    ("phase", "state"),
    [
        ("succeeded", AttemptState.SUCCEEDED),
        ("failed", AttemptState.FAILED),
        ("start_failed", AttemptState.START_FAILED),
    ],
)
def test_a_terminal_ack_without_a_tail_is_complete(started: Any, phase: str, state: str) -> None:
    # The agent's last resort (phase, token, digest, exit code) must always do.
    wc, offer, token = started
    if phase != "start_failed":
        assert wc.ack(offer, "running", token, **PHASE_EXTRA["running"]).status_code == 200
    extra = {"exit_code": 0 if phase == "succeeded" else 1} if phase != "start_failed" else {}
    response = wc.ack(offer, phase, token, **extra)
    assert response.status_code == 200, response.content
    assert response.json()["attempt_state"] == state
    attempt = Attempt.objects.get()
    assert (attempt.state, attempt.output_tail) == (state, "")


@pytest.mark.parametrize(
    ("field", "phase", "value"),
    [
        ("error_code", "failed", "exit\x00nonzero"),
        ("error_code", "failed", "exit\ud800"),
        ("executor_handle", "running", "pid:\x001"),
    ],
)
def test_short_machine_strings_still_refuse_nul_and_surrogates_clearly(
    started: Any, field: str, phase: str, value: str
) -> None:
    wc, offer, token = started
    before = state_snapshot()
    extra = {**PHASE_EXTRA[phase], field: value}
    response = wc.ack(offer, phase, token, **extra)
    assert response.status_code == 400
    assert error_code(response) == "invalid_request"
    message = response.json()["error"]["message"]
    assert field in message and "characters_not_allowed" in message
    assert state_snapshot() == before


def test_a_tail_over_64_kib_as_sent_is_still_a_400(started: Any) -> None:
    wc, offer, token = started
    before = state_snapshot()
    response = wc.ack(offer, "failed", token, exit_code=1, output_tail="x" * 65537)
    assert response.status_code == 400
    assert response.json()["error"]["message"].endswith("output_tail: max_length")
    assert state_snapshot() == before


def test_the_limit_counts_escapes_so_a_quote_heavy_tail_over_it_is_a_400(started: Any) -> None:
    # 33,000 characters, but 66,000 bytes once escaped: over the limit as sent
    # (it used to pass as "33,000 bytes of UTF-8").
    wc, offer, token = started
    before = state_snapshot()
    response = wc.ack(offer, "failed", token, exit_code=1, output_tail='"' * 33000)
    assert response.status_code == 400
    assert "output_tail" in response.json()["error"]["message"]
    assert state_snapshot() == before


def test_clean_output_tail_keeps_valid_text_and_cuts_at_character_boundaries() -> None:
    text = "ok 😀 雪\n\tü"
    assert clean_output_tail(text) == text
    assert clean_output_tail("\ud83d\ude00") == "\ufffd\ufffd"  # a pair split into lone halves
    assert clean_output_tail("a雪雪", limit=4) == "雪"  # 7 bytes → last 4 → one whole 雪
    assert clean_output_tail("\x00" * 10, limit=9) == "\ufffd" * 3


def test_a_repeated_terminal_ack_without_the_tail_keeps_the_stored_tail(started: Any) -> None:
    # The agent's retry after a lost response may go without the tail (its
    # fallback); the outcome is already recorded, so nothing is overwritten.
    wc, offer, token = started
    assert wc.ack(offer, "running", token, **PHASE_EXTRA["running"]).status_code == 200
    first = wc.ack(offer, "succeeded", token, exit_code=0, output_tail="all done\n")
    assert first.status_code == 200
    again = wc.ack(offer, "succeeded", token, exit_code=0)
    assert again.status_code == 200
    assert again.json()["attempt_state"] == AttemptState.SUCCEEDED
    assert _stored_tail() == "all done\n"
