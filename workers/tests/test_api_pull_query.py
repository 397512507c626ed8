"""The pull's query string: only `wait_s`, once; anything else is a 400 that claims nothing.

README "Worker API": "unknown request fields are rejected with 400 (never silently
applied)" holds for the query string too (the schema fuzzer checks it).
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.test import Client

from qinglong.testing import make_run
from workers.tests.api_helpers import (
    WORKER_API,
    WorkerClient,
    bearer,
    error_code,
    new_lease_token,
    post_json,
    state_snapshot,
)

pytestmark = pytest.mark.django_db


def _pull(client: Client, worker: WorkerClient, query: str) -> Any:
    body = {"pull_id": str(uuid.uuid4()), "lease_token": new_lease_token(), "max_offers": 1}
    return post_json(client, f"{WORKER_API}/pull?{query}", body, bearer(worker.token))


@pytest.mark.parametrize(
    ("query", "code"),
    [
        ("max_offers=5", "unknown_field"),
        ("wait_s=0&session=x", "unknown_field"),
        ("wait_s=0&wait_s=1", "invalid_request"),
    ],
)
def test_unknown_or_repeated_query_parameters_are_a_400_and_claim_nothing(
    client: Client, query: str, code: str
) -> None:
    make_run()
    worker = WorkerClient.open(client)
    before = state_snapshot()
    response = _pull(client, worker, query)
    assert response.status_code == 400
    assert error_code(response) == code
    assert state_snapshot() == before


def test_wait_s_zero_alone_is_a_plain_pull(client: Client) -> None:
    make_run()
    worker = WorkerClient.open(client)
    response = _pull(client, worker, "wait_s=0")
    assert response.status_code == 200
    assert len(response.json()["offers"]) == 1
