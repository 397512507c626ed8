"""HTTP-level hardening of the APIs: bodies need a length, answers are never cached.

- A chunked body (no Content-Length) used to be read as `{}`: a heartbeat's
  `draining: true` or an operator's definition silently became "nothing".
  Now it is `411 length_required` and changes nothing.
- Worker answers carry specs, lease tokens and session tokens: every one of
  them, errors included, is `Cache-Control: no-store`.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client, override_settings
from django.utils.cache import get_max_age
from rest_framework.settings import api_settings

from qinglong.testing import make_project, make_run, make_task, make_worker
from runs.models import Project, TaskRevision
from workers.models import SessionState, WorkerSession
from workers.tests.api_helpers import (
    API,
    PHASE_EXTRA,
    WORKER_API,
    WorkerClient,
    bearer,
    error_code,
    operator_headers,
    post_json,
    state_snapshot,
)

pytestmark = pytest.mark.django_db

# What a WSGI server hands Django for a chunked request: the header, and no
# usable CONTENT_LENGTH (Django then reads zero bytes).
CHUNKED: dict[str, Any] = {"HTTP_TRANSFER_ENCODING": "chunked", "CONTENT_LENGTH": ""}


def _chunked(client: Client, method: str, path: str, body: Any, headers: dict[str, Any]) -> Any:
    send = client.post if method == "post" else client.put
    return send(path, data=json.dumps(body), content_type="application/json", **headers, **CHUNKED)


def _no_store(response: Any) -> bool:
    directives = {part.strip() for part in response.get("Cache-Control", "").split(",")}
    return "no-store" in directives


@pytest.fixture
def claimed(client: Client) -> tuple[WorkerClient, dict[str, Any], str, str]:
    make_run()
    worker, credential = make_worker(slots=2)
    wc = WorkerClient.open(client, worker=worker)
    response, _, token = wc.pull()
    [offer] = response.json()["offers"]
    return wc, offer, token, credential


# ------------------------------------------------------------------------ 411


def test_a_chunked_heartbeat_is_411_not_an_empty_body(client: Client, claimed: Any) -> None:
    wc = claimed[0]
    before = state_snapshot()
    response = _chunked(
        client, "post", f"{WORKER_API}/heartbeat", {"draining": True}, bearer(wc.token)
    )
    assert response.status_code == 411
    assert error_code(response) == "length_required"
    assert _no_store(response)
    # Not silently served as `{}` (draining: false): nothing was touched.
    assert state_snapshot() == before
    assert WorkerSession.objects.get().state == SessionState.ONLINE


def test_chunked_worker_calls_are_411_and_change_nothing(client: Client, claimed: Any) -> None:
    wc, offer, token, credential = claimed
    before = state_snapshot()
    calls = [
        (f"{WORKER_API}/sessions", {"executor_types": ["process"], "slots": 1}, credential),
        (f"{WORKER_API}/pull", {"pull_id": "x"}, wc.token),
        (
            f"{WORKER_API}/leases/{offer['offer_id']}/ack",
            {"phase": "starting", "lease_token": token, "spec_sha256": offer["spec_sha256"]},
            wc.token,
        ),
    ]
    for path, body, secret in calls:
        response = _chunked(client, "post", path, body, bearer(secret))
        assert response.status_code == 411, path
        assert error_code(response) == "length_required"
    assert state_snapshot() == before
    assert WorkerSession.objects.count() == 1


def test_chunked_operator_writes_are_411_and_change_nothing(client: Client) -> None:
    make_task(project=make_project("p"), name="t")
    op = operator_headers()
    revisions = TaskRevision.objects.count()
    created = _chunked(client, "post", f"{API}/projects", {"slug": "q", "name": "Q"}, op)
    assert created.status_code == 411
    assert error_code(created) == "length_required"
    definition = {"executor_type": "process", "command": ["true"], "timeout_s": 5}
    edited = _chunked(client, "put", f"{API}/projects/p/tasks/t", definition, op)
    assert edited.status_code == 411
    assert error_code(edited) == "length_required"
    assert list(Project.objects.values_list("slug", flat=True)) == ["p"]
    assert TaskRevision.objects.count() == revisions


def test_a_body_with_content_length_still_works(client: Client, claimed: Any) -> None:
    wc = claimed[0]
    response = wc.heartbeat(draining=True)
    assert response.status_code == 200
    assert response.json()["session_state"] == "draining"


def test_the_schema_documents_411(client: Client) -> None:
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    assert "411" in schema["paths"]["/api/v1/worker/heartbeat"]["post"]["responses"]
    assert "length_required" in json.dumps(schema)


# ------------------------------------------------------------------- no-store


def test_every_worker_success_response_is_no_store(client: Client) -> None:
    make_run()
    worker, credential = make_worker(slots=1)
    opened = post_json(
        client,
        f"{WORKER_API}/sessions",
        {"executor_types": ["process"], "slots": 1},
        bearer(credential),
    )
    assert opened.status_code == 201
    wc = WorkerClient(client, opened.json()["session_token"], worker)
    pulled, _, token = wc.pull()
    [offer] = pulled.json()["offers"]
    responses = {
        "sessions": opened,
        "pull": pulled,
        "heartbeat": wc.heartbeat(),
        **{
            f"ack-{phase}": wc.ack(offer, phase, token, **PHASE_EXTRA[phase])
            for phase in ("starting", "running", "succeeded")
        },
    }
    for name, response in responses.items():
        assert response.status_code in (200, 201), name
        assert _no_store(response), name
        # Not merely "revalidate": never stored at all, and no max-age to reuse.
        assert get_max_age(response) is None, name


def test_worker_error_responses_are_no_store(client: Client, claimed: Any) -> None:
    wc, offer, token, _ = claimed
    ack = f"{WORKER_API}/leases/{offer['offer_id']}/ack"
    errors = {
        400: post_json(client, f"{WORKER_API}/pull", [1], bearer(wc.token)),
        401: post_json(client, f"{WORKER_API}/heartbeat", {}, bearer("not-a-token")),
        404: client.get(f"{WORKER_API}/nope"),
        405: client.get(f"{WORKER_API}/pull", **bearer(wc.token)),
        409: post_json(
            client,
            ack,
            {"phase": "starting", "lease_token": token, "spec_sha256": "0" * 64},
            bearer(wc.token),
        ),
        413: client.post(
            f"{WORKER_API}/heartbeat",
            data=b"{}" + b" " * (81 * 1024),
            content_type="application/json",
            **bearer(wc.token),
        ),
        415: client.post(
            f"{WORKER_API}/heartbeat",
            data="draining=true",
            content_type="application/x-www-form-urlencoded",
            **bearer(wc.token),
        ),
    }
    for status, response in errors.items():
        assert response.status_code == status, (status, response.content)
        assert _no_store(response), status


def test_throttled_and_server_error_responses_are_no_store(
    client: Client, claimed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    wc = claimed[0]
    rates = {
        **api_settings.user_settings,
        "DEFAULT_THROTTLE_RATES": {"worker_pull": "1/min", "worker_session_open": "1/min"},
    }
    with override_settings(REST_FRAMEWORK=rates):
        responses = [wc.pull()[0] for _ in range(2)]
    throttled = responses[-1]
    assert throttled.status_code == 429
    assert _no_store(throttled)

    def broken(**kwargs: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr("workers.api.views.session_heartbeat", broken)
    quiet = Client(raise_request_exception=False)
    failed = post_json(quiet, f"{WORKER_API}/heartbeat", {}, bearer(wc.token))
    assert failed.status_code == 500
    assert error_code(failed) == "internal_error"
    assert _no_store(failed)


def test_operator_responses_are_no_store_too(client: Client) -> None:
    op = operator_headers()
    assert _no_store(client.get(f"{API}/runs", **op))
    assert _no_store(client.get(f"{API}/runs"))  # 401
