"""The pull's `wait_s` query parameter (long poll) is validated and capped."""

from __future__ import annotations

import time
import uuid

import pytest
from django.test import override_settings

from workers.tests.api_helpers import (
    WORKER_API,
    WorkerClient,
    bearer,
    error_code,
    new_lease_token,
    post_json,
)

pytestmark = pytest.mark.django_db


def _pull(client, worker: WorkerClient, query: str):
    body = {"pull_id": str(uuid.uuid4()), "lease_token": new_lease_token(), "max_offers": 1}
    return post_json(client, f"{WORKER_API}/pull{query}", body, bearer(worker.token))


@pytest.mark.parametrize("value", ["-1", "61", "abc", "1.5", ""])
def test_bad_wait_s_is_a_400_naming_it(client, value):
    worker = WorkerClient.open(client)
    response = _pull(client, worker, f"?wait_s={value}")
    assert response.status_code == 400
    assert error_code(response) == "invalid_request"
    assert "wait_s" in response.json()["error"]["message"]


@override_settings(QINGLONG_PULL_WAIT_MAX_S=0)
def test_wait_s_is_ignored_when_the_server_does_not_long_poll(client):
    worker = WorkerClient.open(client)
    started = time.monotonic()
    response = _pull(client, worker, "?wait_s=30")
    assert response.status_code == 200
    assert response.json()["offers"] == []
    assert time.monotonic() - started < 5
