"""A pull response is bounded by construction (issue 8, item 7).

DRF wrote U+2028/U+2029 as 6-byte escapes, so 8 offers of a large task full of
them reached 3 MB, near the reference agent's 4 MiB read cap, and nothing
bounded a spec as a whole (128 env values of 32768 characters each passed).
Now a spec's command + cwd + env is at most MAX_SPEC_PAYLOAD_BYTES of
canonical JSON, a response renders strings exactly as canonical JSON does,
and `max_offers` is capped so that MAX_OFFERS_PER_RESPONSE of the largest
legal specs fit MAX_PULL_RESPONSE_BYTES.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from typing import Any

import pytest
from django.test import Client, override_settings

from dispatch.core.budget import DispatchBudget
from dispatch.core.errors import SpecError
from dispatch.core.spec import (
    MAX_ENV_VALUE_CHARS,
    MAX_SPEC_BYTES,
    MAX_SPEC_PAYLOAD_BYTES,
    canonical_json,
    validate_spec,
    validate_task_definition,
)
from qinglong.api_renderers import WireJSONRenderer
from qinglong.testing import definition, make_project, make_worker
from runs.models import Task
from runs.services import DefinitionError, run_enqueue, task_create
from workers.agent.transport import _MAX_RESPONSE_BYTES as AGENT_READ_CAP
from workers.api.serializers import (
    MAX_OFFER_ENVELOPE_BYTES,
    MAX_OFFERS_PER_PULL,
    MAX_OFFERS_PER_RESPONSE,
    MAX_PULL_RESPONSE_BYTES,
)
from workers.tests.api_helpers import (
    API,
    WorkerClient,
    error_code,
    new_lease_token,
    operator_headers,
    post_json,
)

pytestmark = pytest.mark.django_db


def _payload_bytes(defn: dict[str, Any]) -> int:
    return len(
        canonical_json({"command": defn["command"], "cwd": defn.get("cwd"), "env": defn["env"]})
    )


def largest_definition() -> dict[str, Any]:
    """A definition whose payload is exactly MAX_SPEC_PAYLOAD_BYTES, made of the
    characters that cost the most: U+2028/U+2029 (3 bytes, 6 when escaped) and
    control characters (6 bytes as canonical `\\u0001`)."""
    env = {
        "LS": "\u2028" * MAX_ENV_VALUE_CHARS,
        "PS": "\u2029" * MAX_ENV_VALUE_CHARS,
        "CTL": "\x01" * 4096,
    }
    defn = definition(command=["sh", "-c", "\u2028" * 4096], env=env)
    env["FILL"] = ""
    room = MAX_SPEC_PAYLOAD_BYTES - _payload_bytes(defn)
    assert room > 0
    env["FILL"] = "\x02" * (room // 6) + "x" * (room % 6)
    assert _payload_bytes(defn) == MAX_SPEC_PAYLOAD_BYTES
    return defn


def test_the_budget_fits_the_agent_read_cap() -> None:
    assert MAX_PULL_RESPONSE_BYTES <= AGENT_READ_CAP
    assert 1 <= MAX_OFFERS_PER_RESPONSE <= MAX_OFFERS_PER_PULL
    assert MAX_OFFERS_PER_RESPONSE * (MAX_SPEC_BYTES + MAX_OFFER_ENVELOPE_BYTES) + 256 <= (
        MAX_PULL_RESPONSE_BYTES
    )


def test_the_payload_limit_is_enforced_at_the_byte() -> None:
    defn = largest_definition()
    validate_task_definition(defn)
    over = {**defn, "env": {**defn["env"], "FILL": defn["env"]["FILL"] + "x"}}
    with pytest.raises(SpecError) as err:
        validate_task_definition(over)
    assert err.value.field == "definition"
    assert str(MAX_SPEC_PAYLOAD_BYTES) in err.value.message
    # The one validator holds at dispatch time too.
    spec = {
        "spec_version": 1,
        "run_id": "1",
        "attempt_id": "1",
        "project_id": "1",
        "task_id": "1",
        "task_revision": 1,
        "executor_type": "process",
        "command": over["command"],
        "cwd": None,
        "env": over["env"],
        "timeout_s": 60,
        "resources": {"cpu_millis": 1, "memory_mb": 1},
    }
    with pytest.raises(SpecError) as err:
        validate_spec(spec)
    assert err.value.field == "spec"
    validate_spec({**spec, "env": defn["env"]})


def test_the_operator_api_refuses_an_oversize_definition(client: Client) -> None:
    make_project("p")
    defn = largest_definition()
    body = {**defn, "name": "big", "env": {**defn["env"], "MORE": "x" * 64}}
    # Only a raised body cap lets such a definition reach the validator at all.
    with override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=2 * 1024 * 1024):
        response = post_json(client, f"{API}/projects/p/tasks", body, operator_headers())
    assert response.status_code == 400, response.content
    assert error_code(response) == "invalid_definition"
    assert response.json()["error"]["message"].startswith("definition: ")
    assert not Task.objects.exists()
    defn_only = {key: value for key, value in body.items() if key != "name"}
    with pytest.raises(DefinitionError) as err:
        task_create(project=make_project("q"), name="big", definition=defn_only)
    assert err.value.field == "definition"


# A budget that lets one pull claim past the response cap (the default claims
# 8 per cycle; the hard caps allow 64).
WIDE_BUDGET = {**asdict(DispatchBudget()), "candidate_page_size": 32, "max_claim_attempts": 32}


@override_settings(QINGLONG_DISPATCH=WIDE_BUDGET)
def test_the_largest_offers_fit_the_agent_read_cap(client: Client) -> None:
    task = task_create(project=make_project("p"), name="big", definition=largest_definition())
    for _ in range(MAX_OFFERS_PER_PULL):
        run_enqueue(task=task)
    worker, _ = make_worker(slots=MAX_OFFERS_PER_PULL)
    wc = WorkerClient.open(client, worker=worker)

    response, _, token = wc.pull(max_offers=MAX_OFFERS_PER_PULL)
    assert response.status_code == 200
    offers = response.json()["offers"]
    assert len(offers) == MAX_OFFERS_PER_RESPONSE
    assert len(response.content) <= MAX_PULL_RESPONSE_BYTES <= AGENT_READ_CAP
    # U+2028/U+2029 travel as themselves (3 bytes), not as 6-byte escapes.
    assert b"\\u2028" not in response.content and b"\\u2029" not in response.content
    assert "\u2028".encode() in response.content
    for offer in offers:
        spec_json = canonical_json(offer["spec"])
        assert len(spec_json) <= MAX_SPEC_BYTES
        assert hashlib.sha256(spec_json).hexdigest() == offer["spec_sha256"]
        assert offer["lease"]["token"] == token

    # The rest is a later pull's, not lost.
    for offer in offers:
        assert wc.ack(offer, "starting", token).status_code == 200
    rest, _, _ = wc.pull(max_offers=MAX_OFFERS_PER_PULL)
    assert len(rest.json()["offers"]) == MAX_OFFERS_PER_PULL - MAX_OFFERS_PER_RESPONSE


def test_an_offer_without_its_spec_fits_the_envelope_bound(client: Client) -> None:
    task = task_create(project=make_project("p"), name="t", definition=definition())
    run_enqueue(task=task)
    wc = WorkerClient.open(client, worker=make_worker(slots=1)[0])
    [offer] = wc.pull()[0].json()["offers"]
    # Every field at its widest: 20-digit ids, 64-bit integers, a 128-character
    # token, RFC 3339 times with microseconds, the longer source name.
    widest_id, widest_int, when = "9" * 20, -(2**63), "2026-12-31T23:59:59.999999Z"
    wide = {
        **offer,
        **{key: widest_id for key in ("run_id", "attempt_id", "project_id", "task_id")},
        "source": "lease_recovery",
        "task_revision": widest_int,
        "priority": -1000,
        "queued_at": when,
        "worker_id": widest_id,
        "session_generation": widest_int,
        "lease": {
            "lease_id": widest_id,
            "generation": widest_int,
            "token": new_lease_token() + "A" * 85,
            "expires_at": when,
        },
        "placement_score": widest_int,
        "spec": {},
    }
    assert set(wide) == set(offer)
    assert len(wide["lease"]["token"]) == 128
    envelope = len(json.dumps(wide, separators=(",", ":"), ensure_ascii=False).encode())
    assert envelope - len("{}") <= MAX_OFFER_ENVELOPE_BYTES


def test_the_renderer_writes_line_separators_as_themselves_and_never_indents() -> None:
    renderer = WireJSONRenderer()
    data = {"a": "\u2028\u2029é\x01", "b": [1, 2]}
    rendered = renderer.render(data, "application/json; indent=8", {})
    assert rendered == '{"a":"\u2028\u2029é\\u0001","b":[1,2]}'.encode()
    assert rendered == canonical_json(data)
