"""Schema fuzzing: thousands of generated requests against the in-process app.

schemathesis generates valid (positive) and schema-violating (negative)
requests for every operation of the served OpenAPI schema, sent with valid
Worker and operator credentials. Every response must be documented, match its
schema, never be a 5xx, and schema-invalid requests must be rejected.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from django.test import override_settings
from hypothesis import HealthCheck, Phase, given, settings
from rest_framework.settings import api_settings
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from qinglong.testing import make_project, make_run, make_task, make_worker, open_session
from workers.tests.api_helpers import WorkerClient, operator_headers

pytestmark = pytest.mark.django_db

EXAMPLES = int(os.environ.get("QL_FUZZ_EXAMPLES", "110"))
MIN_TOTAL_CASES = 3000 if EXAMPLES >= 110 else 0
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


def negative_data_rejected(ctx: Any, response: Any, case: Any) -> bool | None:
    """negative_data_rejection, counting 413 (an oversize body) as a rejection too."""
    if response.status_code == 413:
        return True
    return negative_data_rejection(ctx, response, case)


@contextmanager
def _test_transaction_kept_open() -> Iterator[None]:
    """Requests go straight to the WSGI app, so do what Django's test client does:
    keep the request signals from closing the connection (and with it the test's
    transaction) at the end of each request."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


def _auth_for(path: str, *, operator: str, credential: str, session: str) -> str:
    if path == "/api/v1/worker/sessions":
        return f"Bearer {credential}"
    if path.startswith("/api/v1/worker/"):
        return f"Bearer {session}"
    return operator


def _fuzz(
    strategy: Any, *, auth: str, checks: list[Any], tally: tuple[str, Counter[str], Counter[int]]
) -> None:
    op_id, cases, statuses = tally

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def run(case: Any) -> None:
        headers = {"Authorization": auth}
        response = case.call(headers=headers)
        cases[op_id] += 1
        statuses[response.status_code] += 1
        case.validate_response(response, checks=checks, headers=headers)

    run()


def test_generated_requests_get_documented_conforming_non_5xx_responses(client: Any) -> None:
    task = make_task(project=make_project("p"), name="t")
    runs = [make_run(task) for _ in range(6)]
    _worker, credential = make_worker(slots=4)
    session_worker, _ = make_worker(slots=4)
    opened = open_session(session_worker)
    # A real lease for ACK cases that target an existing offer id.
    [offer] = WorkerClient(client, opened.token, session_worker).pull()[0].json()["offers"]
    operator = operator_headers()["HTTP_AUTHORIZATION"]
    fixed_paths: dict[str, dict[str, str]] = {
        "worker_lease_ack": {"offer_id": offer["offer_id"]},
        "runs_retrieve": {"run_id": str(runs[0].pk)},
        "runs_cancel": {"run_id": str(runs[1].pk)},
        "tasks_create": {"slug": "p"},
        "tasks_update": {"slug": "p", "name": "t"},
    }

    rates = {"worker_pull": "100000/min", "worker_session_open": "100000/min"}
    with (
        _test_transaction_kept_open(),
        override_settings(
            REST_FRAMEWORK={**api_settings.user_settings, "DEFAULT_THROTTLE_RATES": rates}
        ),
    ):
        app = get_wsgi_application()
        schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", app)
        operations = [
            result.ok() for result in schema.get_all_operations() if isinstance(result, Ok)
        ]
        assert len(operations) == 12
        cases: Counter[str] = Counter()
        statuses: Counter[int] = Counter()
        for operation in operations:
            op_id = operation.definition.raw.get("operationId", operation.label)
            variants: list[dict[str, str] | None] = [None]
            if op_id in fixed_paths:
                variants.append(fixed_paths[op_id])
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                for path_parameters in variants:
                    if mode.is_negative and path_parameters is not None:
                        continue  # fixed valid paths are for reaching success paths
                    strategy = operation.as_strategy(
                        generation_mode=mode, path_parameters=path_parameters
                    )
                    auth = _auth_for(
                        operation.path,
                        operator=operator,
                        credential=credential,
                        session=opened.token,
                    )
                    checks = CHECKS + ([negative_data_rejected] if mode.is_negative else [])

                    _fuzz(strategy, auth=auth, checks=checks, tally=(op_id, cases, statuses))

    total = sum(cases.values())
    print(f"schemathesis: {total} cases; by status {dict(sorted(statuses.items()))}")
    assert total >= MIN_TOTAL_CASES
    assert not any(status >= 500 for status in statuses)
    # The fuzzing reached the success paths, not only validation errors.
    assert statuses[200] and statuses[201]
