"""Failure paths of the Worker API: one envelope, the right status, nothing changed."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from django.db import InterfaceError, OperationalError
from django.test import Client, override_settings
from rest_framework.settings import api_settings

from qinglong.testing import make_run, make_worker
from workers.models import Worker, WorkerAdminState, WorkerSession
from workers.services import worker_set_admin_state
from workers.tests.api_helpers import (
    API,
    PHASE_EXTRA,
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

FORBIDDEN_FIELDS = ("state", "worker_id", "generation", "expires_at", "spec", "session_id")


@pytest.fixture
def claimed(client: Client) -> tuple[WorkerClient, dict[str, Any], str, str]:
    make_run()
    worker, credential = make_worker(slots=2)
    wc = WorkerClient.open(client, worker=worker)
    response, _, token = wc.pull()
    [offer] = response.json()["offers"]
    return wc, offer, token, credential


def _worker_bodies(offer: dict[str, Any], token: str) -> dict[str, tuple[str, dict[str, Any]]]:
    return {
        "sessions": (f"{WORKER_API}/sessions", {"executor_types": ["process"], "slots": 1}),
        "heartbeat": (f"{WORKER_API}/heartbeat", {"draining": False}),
        "pull": (
            f"{WORKER_API}/pull",
            {"pull_id": str(uuid.uuid4()), "lease_token": new_lease_token(), "max_offers": 1},
        ),
        **{
            f"ack-{phase}": (
                f"{WORKER_API}/leases/{offer['offer_id']}/ack",
                {
                    "phase": phase,
                    "lease_token": token,
                    "spec_sha256": offer["spec_sha256"],
                    **PHASE_EXTRA[phase],
                },
            )
            for phase in PHASE_EXTRA
        },
    }


@pytest.mark.parametrize("field", FORBIDDEN_FIELDS)
def test_extra_fields_in_any_worker_body_are_rejected_and_change_nothing(
    client: Client, claimed: tuple[WorkerClient, dict[str, Any], str, str], field: str
) -> None:
    wc, offer, token, credential = claimed
    before = state_snapshot()
    for name, (path, body) in _worker_bodies(offer, token).items():
        auth = bearer(credential) if name == "sessions" else bearer(wc.token)
        response = post_json(client, path, {**body, field: "x"}, auth)
        assert response.status_code == 400, (name, response.content)
        assert error_code(response) == "unknown_field"
        assert field in response.json()["error"]["message"]
    assert state_snapshot() == before
    assert WorkerSession.objects.count() == 1


def test_malformed_json_is_a_400_in_the_envelope(client: Client, claimed: Any) -> None:
    wc = claimed[0]
    for raw in (b"{not json", b'{"a": NaN}', b'{"draining": true, "draining": false}', b"\xff"):
        response = client.post(
            f"{WORKER_API}/heartbeat", data=raw, content_type="application/json", **bearer(wc.token)
        )
        assert response.status_code == 400
        assert error_code(response) == "malformed_json"


def test_a_body_that_is_not_an_object_is_a_400(client: Client, claimed: Any) -> None:
    wc = claimed[0]
    response = post_json(client, f"{WORKER_API}/pull", [1, 2], bearer(wc.token))
    assert response.status_code == 400
    assert error_code(response) == "invalid_request"


def test_wrong_content_type_is_a_415(client: Client, claimed: Any) -> None:
    wc = claimed[0]
    response = client.post(
        f"{WORKER_API}/heartbeat",
        data="draining=true",
        content_type="application/x-www-form-urlencoded",
        **bearer(wc.token),
    )
    assert response.status_code == 415
    assert error_code(response) == "unsupported_media_type"


def test_oversize_worker_bodies_are_a_413_and_change_nothing(client: Client, claimed: Any) -> None:
    wc, offer, token, _ = claimed
    before = state_snapshot()
    big = json.dumps(
        {
            "phase": "failed",
            "lease_token": token,
            "spec_sha256": offer["spec_sha256"],
            "exit_code": 1,
            "output_tail": "x" * (81 * 1024),
        }
    )
    path = f"{WORKER_API}/leases/{offer['offer_id']}/ack"
    response = client.post(path, data=big, content_type="application/json", **bearer(wc.token))
    assert response.status_code == 413
    assert error_code(response) == "payload_too_large"
    assert state_snapshot() == before


def test_parser_stops_reading_at_the_cap_whatever_the_header_says() -> None:
    import io

    from qinglong.api_common import CappedJSONParser
    from qinglong.api_errors import PayloadTooLarge

    class View:
        max_body_bytes = 10

    with pytest.raises(PayloadTooLarge):
        CappedJSONParser().parse(io.BytesIO(b'{"a": "' + b"x" * 20 + b'"}'), None, {"view": View()})


def test_output_tail_over_64_kib_is_rejected(client: Client, claimed: Any) -> None:
    wc, offer, token, _ = claimed
    # 33,000 two-byte characters: under the character limit, over 64 KiB of UTF-8.
    body = {
        "phase": "failed",
        "lease_token": token,
        "spec_sha256": offer["spec_sha256"],
        "exit_code": 1,
        "output_tail": "é" * 33000,
    }
    response = client.post(
        f"{WORKER_API}/leases/{offer['offer_id']}/ack",
        data=json.dumps(body, ensure_ascii=False).encode(),
        content_type="application/json",
        **bearer(wc.token),
    )
    assert response.status_code == 400
    assert "output_tail" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("phase", "extra", "field"),
    [
        ("running", {}, "executor_handle"),
        ("succeeded", {}, "exit_code"),
        ("failed", {}, "exit_code"),
        ("starting", {"exit_code": 0}, "exit_code"),
        ("starting", {"executor_handle": "pid:1"}, "executor_handle"),
    ],
)
def test_ack_fields_required_or_refused_per_phase(
    claimed: Any, phase: str, extra: dict[str, Any], field: str
) -> None:
    wc, offer, token, _ = claimed
    before = state_snapshot()
    response = wc.ack(offer, phase, token, **extra)
    assert response.status_code == 400
    assert field in response.json()["error"]["message"]
    assert state_snapshot() == before


@pytest.mark.parametrize(
    "body",
    [
        {"lease_token": "short", "max_offers": 1},
        {"lease_token": "a" * 129},
        {"lease_token": "+" * 43},
        {"max_offers": 0},
        {"max_offers": 17},
        {"max_offers": "1"},
        {"pull_id": "not-a-uuid"},
        {"pull_id": 12345},
    ],
)
def test_pull_validates_its_fields(client: Client, claimed: Any, body: dict[str, Any]) -> None:
    wc = claimed[0]
    full = {"pull_id": str(uuid.uuid4()), "lease_token": new_lease_token(), **body}
    before = state_snapshot()
    response = post_json(client, f"{WORKER_API}/pull", full, bearer(wc.token))
    assert response.status_code == 400
    assert error_code(response) == "invalid_request"
    assert state_snapshot() == before


def test_invalid_credential_and_token_are_401_with_their_codes(client: Client) -> None:
    body = {"executor_types": ["process"], "slots": 1}
    response = post_json(client, f"{WORKER_API}/sessions", body, bearer("qlw_" + "x" * 40))
    assert response.status_code == 401
    assert error_code(response) == "invalid_credential"
    assert response["WWW-Authenticate"].startswith("Bearer")
    response = post_json(client, f"{WORKER_API}/heartbeat", {}, bearer("qls_" + "x" * 40))
    assert response.status_code == 401
    assert error_code(response) == "invalid_session_token"
    response = post_json(client, f"{WORKER_API}/heartbeat", {}, {})
    assert response.status_code == 401
    assert error_code(response) == "not_authenticated"


def test_offline_session_token_is_401_session_offline(client: Client) -> None:
    wc = WorkerClient.open(client)
    WorkerSession.objects.filter(worker=wc.worker).update(state="offline")
    response = wc.heartbeat()
    assert response.status_code == 401
    assert error_code(response) == "session_offline"


def test_disabled_worker_is_403(client: Client) -> None:
    worker, credential = make_worker()
    wc = WorkerClient.open(client, worker=worker)
    worker_set_admin_state(worker=worker, admin_state=WorkerAdminState.DISABLED)
    body = {"executor_types": ["process"], "slots": 1}
    response = post_json(client, f"{WORKER_API}/sessions", body, bearer(credential))
    assert response.status_code == 403
    assert error_code(response) == "worker_disabled"
    assert WorkerSession.objects.filter(worker=worker).count() == 1
    # Its Session went offline with the disable.
    assert wc.heartbeat().status_code == 401


def test_session_open_with_unenrolled_executor_is_400_naming_the_field(client: Client) -> None:
    worker, credential = make_worker()
    body = {"executor_types": ["docker"], "slots": 1}
    response = post_json(client, f"{WORKER_API}/sessions", body, bearer(credential))
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("executor_types")
    assert not WorkerSession.objects.filter(worker=worker).exists()


def test_operator_tokens_and_worker_secrets_do_not_cross(client: Client) -> None:
    worker, credential = make_worker()
    wc = WorkerClient.open(client, worker=worker)
    op = operator_headers()
    for path in ("heartbeat", "pull", "sessions"):
        response = post_json(client, f"{WORKER_API}/{path}", {}, op)
        assert response.status_code == 401
        assert error_code(response) == "not_authenticated"
    for secret in (credential, wc.token):
        response = client.get(f"{API}/runs", **bearer(secret))
        assert response.status_code == 401
        # A Worker credential cannot open a "session" on the heartbeat either.
    response = post_json(client, f"{WORKER_API}/heartbeat", {}, bearer(credential))
    assert response.status_code == 401
    response = post_json(
        client,
        f"{WORKER_API}/sessions",
        {"executor_types": ["process"], "slots": 1},
        bearer(wc.token),
    )
    assert response.status_code == 401
    assert Worker.objects.get(pk=worker.pk).last_generation == 1


def _rates(**rates: str) -> dict[str, Any]:
    return {**api_settings.user_settings, "DEFAULT_THROTTLE_RATES": rates}


def test_pull_and_session_open_are_throttled_with_retry_after(client: Client) -> None:
    worker, credential = make_worker()
    body = {"executor_types": ["process"], "slots": 1}
    with override_settings(REST_FRAMEWORK=_rates(worker_pull="2/min", worker_session_open="1/min")):
        assert (
            post_json(client, f"{WORKER_API}/sessions", body, bearer(credential)).status_code == 201
        )
        limited = post_json(client, f"{WORKER_API}/sessions", body, bearer(credential))
        assert limited.status_code == 429
        assert error_code(limited) == "throttled"
        assert int(limited["Retry-After"]) >= 1
        wc = WorkerClient.open(client, worker=worker)
        assert wc.pull()[0].status_code == 200
        assert wc.pull()[0].status_code == 200
        throttled = wc.pull()[0]
        assert throttled.status_code == 429
        assert int(throttled["Retry-After"]) >= 1
        # Keyed by Session: another Worker is not slowed down.
        assert WorkerClient.open(client).pull()[0].status_code == 200


@pytest.mark.parametrize("error", [OperationalError, InterfaceError])
def test_database_unavailable_is_503_with_retry_after(
    client: Client, claimed: Any, monkeypatch: pytest.MonkeyPatch, error: type[Exception]
) -> None:
    wc = claimed[0]

    def down(**kwargs: Any) -> None:
        raise error("connection refused")

    monkeypatch.setattr("workers.api.views.session_heartbeat", down)
    monkeypatch.setattr("workers.api.views.worker_pull", down)
    for response in (wc.heartbeat(), wc.pull()[0]):
        assert response.status_code == 503
        assert error_code(response) == "database_unavailable"
        assert response["Retry-After"] == "5"
        assert "connection refused" not in response.content.decode()


def test_database_unavailable_during_authentication_is_503(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    def down(token: str) -> None:
        raise OperationalError("server closed the connection")

    monkeypatch.setattr("workers.api.authentication.session_authenticate", down)
    response = post_json(client, f"{WORKER_API}/heartbeat", {}, bearer("qls_" + "x" * 40))
    assert response.status_code == 503
    assert error_code(response) == "database_unavailable"


def test_unknown_api_paths_and_methods_use_the_envelope(client: Client, claimed: Any) -> None:
    wc = claimed[0]
    for path in ("/api/v1/nope", "/api/v1/worker/leases/xyz/ack", "/api/", "/api/v1/runs/"):
        response = client.get(path)
        assert response.status_code == 404, path
        assert error_code(response) == "not_found"
    response = client.get(f"{WORKER_API}/pull", **bearer(wc.token))
    assert response.status_code == 405
    assert error_code(response) == "method_not_allowed"
    response = client.delete(f"{API}/runs", **operator_headers())
    assert response.status_code == 405
    assert error_code(response) == "method_not_allowed"


def test_an_unexpected_error_is_a_500_envelope_without_details(
    claimed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    wc = claimed[0]

    def broken(**kwargs: Any) -> None:
        raise RuntimeError("internal detail CANARY-500")

    monkeypatch.setattr("workers.api.views.session_heartbeat", broken)
    quiet = Client(raise_request_exception=False)
    response = post_json(quiet, f"{WORKER_API}/heartbeat", {}, bearer(wc.token))
    assert response.status_code == 500
    assert error_code(response) == "internal_error"
    assert "CANARY-500" not in response.content.decode()


def test_operator_bodies_are_capped_too(client: Client) -> None:
    response = post_json(
        client, f"{API}/projects", {"slug": "x", "name": "y" * (300 * 1024)}, operator_headers()
    )
    assert response.status_code == 413
    assert error_code(response) == "payload_too_large"
