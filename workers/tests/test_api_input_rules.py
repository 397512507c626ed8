"""Input rules of both APIs (issue 8, items 5 and 7): clear 400s, never 500s.

- Deeply nested JSON (40 KB of `[`) drove the JSON parser into RecursionError,
  a 500, on every endpoint with a body. Nesting deeper than MAX_JSON_DEPTH is
  now refused before parsing: `400 nesting_too_deep`, nothing changed.
- Numbers in query strings are ASCII digits only: `?wait_s=²` passed
  `str.isdigit()` and then `int()` refused it (a 500); DRF's IntegerField took
  " 5", "5.0" and "٣".
- Validation patterns match the whole value: `$` alone also matched before a
  trailing newline, so a lease token, a spec digest, a slug or a runs cursor
  followed by "\\n" was accepted.
"""

from __future__ import annotations

import json
import uuid
from typing import Any
from urllib.parse import urlencode

import pytest
from django.core.management import CommandError, call_command
from django.test import Client, override_settings

from qinglong.api_common import MAX_JSON_DEPTH, json_nesting_exceeds
from qinglong.testing import make_project, make_run, make_task, make_worker
from runs.models import Project, Run, Task, TaskRevision
from workers.models import Worker, WorkerSession
from workers.services import WorkerInputError
from workers.tests.api_helpers import (
    API,
    WORKER_API,
    WorkerClient,
    bearer,
    error_code,
    new_lease_token,
    operator_headers,
    post_json,
    state_snapshot,
)

pytestmark = pytest.mark.django_db

DEEP = "[" * 40_000  # 40 KB of nesting: under every body cap


@pytest.fixture
def claimed(client: Client) -> tuple[WorkerClient, dict[str, Any], str, str]:
    make_run(task=make_task(project=make_project("p"), name="t"))
    worker, credential = make_worker(slots=2)
    wc = WorkerClient.open(client, worker=worker)
    response, _, token = wc.pull()
    [offer] = response.json()["offers"]
    return wc, offer, token, credential


def _raw(client: Client, method: str, path: str, body: str, headers: dict[str, Any]) -> Any:
    send = {"post": client.post, "put": client.put}[method]
    return send(path, data=body.encode(), content_type="application/json", **headers)


def _operator_rows() -> tuple[Any, ...]:
    return (
        list(Project.objects.values_list("slug", flat=True)),
        list(Task.objects.values_list("id", flat=True)),
        TaskRevision.objects.count(),
        list(Run.objects.values_list("id", "state", "cancel_requested")),
    )


# -------------------------------------------------------------------- nesting


def test_deep_nesting_is_a_400_on_every_worker_endpoint(client: Client, claimed: Any) -> None:
    wc, offer, _, credential = claimed
    before = state_snapshot()
    calls = {
        "sessions": (f"{WORKER_API}/sessions", credential),
        "heartbeat": (f"{WORKER_API}/heartbeat", wc.token),
        "pull": (f"{WORKER_API}/pull", wc.token),
        "ack": (f"{WORKER_API}/leases/{offer['offer_id']}/ack", wc.token),
    }
    for name, (path, secret) in calls.items():
        for body in (DEEP, '{"draining": ' + DEEP, '{"a": [' + "[" * 5000 + "]" * 5000 + "]}"):
            response = _raw(client, "post", path, body, bearer(secret))
            assert response.status_code == 400, (name, response.content[:200])
            assert error_code(response) == "nesting_too_deep", name
            assert str(MAX_JSON_DEPTH) in response.json()["error"]["message"]
    assert state_snapshot() == before
    assert WorkerSession.objects.count() == 1


def test_deep_nesting_is_a_400_on_every_operator_write(client: Client) -> None:
    task = make_task(project=make_project("p"), name="t")
    run = make_run(task=task)
    op = operator_headers()
    before = _operator_rows()
    calls = [
        ("post", f"{API}/projects"),
        ("post", f"{API}/projects/p/tasks"),
        ("put", f"{API}/projects/p/tasks/t"),
        ("post", f"{API}/runs"),
        ("post", f"{API}/runs/{run.pk}/cancel"),
    ]
    for method, path in calls:
        response = _raw(client, method, path, DEEP, op)
        assert response.status_code == 400, (path, response.content[:200])
        assert error_code(response) == "nesting_too_deep", path
    # A task definition nested too deep inside a valid-looking object, too.
    definition = '{"name": "u", "executor_type": "process", "command": ["x"], "env": ' + DEEP
    response = _raw(client, "post", f"{API}/projects/p/tasks", definition, op)
    assert error_code(response) == "nesting_too_deep"
    assert _operator_rows() == before


def test_nesting_at_the_limit_is_parsed_and_brackets_in_strings_do_not_count(
    client: Client,
) -> None:
    make_project("p")
    op = operator_headers()
    at_limit = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    response = _raw(client, "post", f"{API}/projects", at_limit, op)
    # Parsed: refused as what it is (not an object), not as too deep.
    assert response.status_code == 400
    assert error_code(response) == "invalid_request"
    over = "[" + at_limit + "]"
    assert error_code(_raw(client, "post", f"{API}/projects", over, op)) == "nesting_too_deep"

    # 35 KB of brackets inside a string (with escaped quotes) is just text.
    text = '"[' * 5_000 + "{" * 20_000
    body = {"name": "brackets", "executor_type": "process", "command": ["echo"], "env": {"X": text}}
    response = post_json(client, f"{API}/projects/p/tasks", body, op)
    assert response.status_code == 201, response.content[:300]
    revision = Task.objects.get(name="brackets").current_revision
    assert revision is not None and revision.env == {"X": text}


@pytest.mark.parametrize(
    ("text", "exceeds"),
    [
        ("{}", False),
        ("[" * 33 + "]" * 33, True),
        ("[" * 32 + "]" * 32, False),
        ("[]" * 10_000, False),
        ('["' + "[" * 100 + '"]', False),
        ('["\\"' + "[" * 100 + '"]', False),
        ('["\\\\"' + ", [" * 40 + "]" * 40 + "]", True),  # the escape ends before the quote
        ('"' + "[" * 100, False),  # an unterminated string runs to the end
        ("[" * 40_000, True),
        ('{"a":' * 33 + "1" + "}" * 33, True),
    ],
)
def test_json_nesting_exceeds(text: str, exceeds: bool) -> None:
    assert json_nesting_exceeds(text) is exceeds


# -------------------------------------------------------------- query numbers

NOT_ASCII_NUMBERS = [
    "\u00b2",
    "\u0663",
    "\uff15",
    " 5",
    "5 ",
    "+5",
    "-1",
    "5.0",
    "1_0",
    "5\n",
    "",
    "x",
]


@pytest.mark.parametrize("raw", NOT_ASCII_NUMBERS)
def test_wait_s_takes_ascii_digits_only(client: Client, claimed: Any, raw: str) -> None:
    wc = claimed[0]
    before = state_snapshot()
    body = {"pull_id": str(uuid.uuid4()), "lease_token": new_lease_token()}
    response = post_json(
        client, f"{WORKER_API}/pull?{urlencode({'wait_s': raw})}", body, bearer(wc.token)
    )
    assert response.status_code == 400, response.content
    assert error_code(response) == "invalid_request"
    assert "wait_s" in response.json()["error"]["message"]
    assert state_snapshot() == before


@override_settings(QINGLONG_PULL_WAIT_MAX_S=0)  # never actually wait here
def test_wait_s_in_range_is_accepted(client: Client, claimed: Any) -> None:
    wc = claimed[0]
    for raw, status in (("0", 200), ("05", 200), ("60", 200), ("61", 400)):
        body = {"pull_id": str(uuid.uuid4()), "lease_token": new_lease_token()}
        response = post_json(client, f"{WORKER_API}/pull?wait_s={raw}", body, bearer(wc.token))
        assert response.status_code == status, (raw, response.content)


@pytest.mark.parametrize("raw", NOT_ASCII_NUMBERS)
@pytest.mark.parametrize("path", ["runs", "projects"])
def test_operator_limit_takes_ascii_digits_only(client: Client, path: str, raw: str) -> None:
    op = operator_headers()
    response = client.get(f"{API}/{path}", {"limit": raw}, **op)
    assert response.status_code == 400, response.content
    assert error_code(response) == "invalid_request"
    assert client.get(f"{API}/{path}", {"limit": "7"}, **op).status_code == 200


# ----------------------------------------------------------- trailing newline


def test_a_lease_token_with_a_trailing_newline_is_refused(client: Client, claimed: Any) -> None:
    wc, offer, token, _ = claimed
    before = state_snapshot()
    pulled = post_json(
        client,
        f"{WORKER_API}/pull",
        {"pull_id": str(uuid.uuid4()), "lease_token": new_lease_token() + "\n"},
        bearer(wc.token),
    )
    assert pulled.status_code == 400
    assert "lease_token" in pulled.json()["error"]["message"]
    acked = wc.ack(offer, "running", token + "\n", executor_handle="pid:1")
    assert acked.status_code == 400
    assert "lease_token" in acked.json()["error"]["message"]
    assert state_snapshot() == before


def test_a_spec_digest_or_pull_id_with_a_trailing_newline_is_refused(
    client: Client, claimed: Any
) -> None:
    wc, offer, token, _ = claimed
    before = state_snapshot()
    acked = wc.ack({**offer, "spec_sha256": offer["spec_sha256"] + "\n"}, "running", token)
    assert acked.status_code == 400
    assert "spec_sha256" in acked.json()["error"]["message"]
    pulled = post_json(
        client,
        f"{WORKER_API}/pull",
        {"pull_id": str(uuid.uuid4()) + "\n", "lease_token": new_lease_token()},
        bearer(wc.token),
    )
    assert pulled.status_code == 400
    assert "pull_id" in pulled.json()["error"]["message"]
    assert state_snapshot() == before


def test_ids_in_paths_with_a_trailing_newline_are_not_found(client: Client, claimed: Any) -> None:
    wc, offer, token, _ = claimed
    run = Run.objects.get()
    before = state_snapshot()
    body = {"phase": "running", "lease_token": token, "spec_sha256": offer["spec_sha256"]}
    acked = post_json(
        client,
        f"{WORKER_API}/leases/{offer['offer_id']}%0A/ack",
        {**body, "executor_handle": "pid:1"},
        bearer(wc.token),
    )
    assert acked.status_code == 404
    op = operator_headers()
    assert client.get(f"{API}/runs/{run.pk}%0A", **op).status_code == 404
    assert post_json(client, f"{API}/runs/{run.pk}%0A/cancel", {}, op).status_code == 404
    assert state_snapshot() == before


def test_runs_and_projects_cursors_with_a_trailing_newline_are_refused(client: Client) -> None:
    run = make_run(task=make_task(project=make_project("p"), name="t"))
    op = operator_headers()
    for path, cursor in (("runs", str(run.pk + 1)), ("projects", "a")):
        assert client.get(f"{API}/{path}", {"cursor": cursor}, **op).status_code == 200
        response = client.get(f"{API}/{path}", {"cursor": cursor + "\n"}, **op)
        assert response.status_code == 400, (path, response.content)
        assert "cursor" in response.json()["error"]["message"]


def test_a_project_slug_with_a_trailing_newline_is_refused(client: Client) -> None:
    response = post_json(
        client, f"{API}/projects", {"slug": "p\n", "name": "P"}, operator_headers()
    )
    assert response.status_code == 400
    assert "slug" in response.json()["error"]["message"]
    assert not Project.objects.exists()


# ------------------------------------------------------------ Content-Length


@pytest.mark.parametrize("length", ["١٢", " 2", "2 ", "+2", "0x2", "-1"])
def test_a_content_length_that_is_not_ascii_digits_is_a_400(
    client: Client, claimed: Any, length: str
) -> None:
    wc = claimed[0]
    before = state_snapshot()
    response = client.post(
        f"{WORKER_API}/heartbeat",
        data=b"{}",
        content_type="application/json",
        CONTENT_LENGTH=length,
        **bearer(wc.token),
    )
    assert response.status_code == 400
    assert error_code(response) == "invalid_content_length"
    assert state_snapshot() == before


# --------------------------------------------------------------------- labels

CYRILLIC_A = "\u0430"  # indistinguishable from the Latin "a" on screen


def test_task_creation_refuses_a_confusable_label(client: Client) -> None:
    make_project("p")
    op = operator_headers()
    placements = [
        {"required_labels": {"zone": CYRILLIC_A}},
        {"preferred": [{"labels": {"zone": CYRILLIC_A}, "weight": 5}]},
        {"required_labels": {f"zon{CYRILLIC_A}": "a"}},
    ]
    for placement in placements:
        body = {"name": "t", "executor_type": "process", "command": ["x"], "placement": placement}
        response = post_json(client, f"{API}/projects/p/tasks", body, op)
        assert response.status_code == 400, response.content
        assert error_code(response) == "invalid_definition"
        assert "placement." in response.json()["error"]["message"]
        assert CYRILLIC_A not in response.content.decode()
    assert not Task.objects.exists()


def test_task_update_refuses_a_confusable_label(client: Client) -> None:
    task = make_task(project=make_project("p"), name="t")
    body = {
        "executor_type": "process",
        "command": ["x"],
        "placement": {"required_labels": {"zone": CYRILLIC_A}},
    }
    response = client.put(
        f"{API}/projects/p/tasks/t",
        data=json.dumps(body),
        content_type="application/json",
        **operator_headers(),
    )
    assert response.status_code == 400
    assert error_code(response) == "invalid_definition"
    assert task.revisions.count() == 1


def test_session_open_refuses_a_confusable_label(client: Client) -> None:
    worker, credential = make_worker(labels={"zone": "a"})
    response = post_json(
        client,
        f"{WORKER_API}/sessions",
        {"executor_types": ["process"], "slots": 1, "labels": {"zone": CYRILLIC_A}},
        bearer(credential),
    )
    assert response.status_code == 400
    assert error_code(response) == "invalid_request"
    assert response.json()["error"]["message"].startswith("labels:")
    assert not WorkerSession.objects.filter(worker=worker).exists()


def test_enrollment_refuses_a_confusable_label() -> None:
    with pytest.raises(CommandError) as err:
        call_command(
            "enroll_worker", "edge", "--executor", "process", "--label", f"zone={CYRILLIC_A}"
        )
    assert str(err.value).startswith("labels: label values must match")
    assert not Worker.objects.exists()
    with pytest.raises(WorkerInputError):
        make_worker(labels={"zone": f"eu-{CYRILLIC_A}"})
