"""Schema fuzzing: thousands of generated requests against the in-process app.

schemathesis generates valid (positive) and schema-violating (negative)
requests for every operation of the served OpenAPI schema, sent with valid
Worker and operator credentials. Every response must be documented, match its
schema, never be a 5xx, and schema-invalid requests must be rejected.

Two smaller runs fuzz the refusals (issue 8): a staff user holding only the
view_* permissions gets its reads and a 403 for every write, and a Worker
whose credential was rotated gets 401 for its old credential and for the
Session opened with it — and neither run changes a row.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import schemathesis
from django.contrib.auth.models import Permission
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
from runs.models import Project, Task, TaskRevision
from schedules.models import Schedule, ScheduleFire
from schedules.services import schedule_create
from workers.models import WorkerSession
from workers.services import worker_rotate_credential
from workers.tests.api_helpers import WorkerClient, operator_headers, state_snapshot

pytestmark = pytest.mark.django_db

# Cases per operation and mode; QL_FUZZ_EXAMPLES=110 (or more) for a deeper
# run. The suite's default keeps both database passes inside its time budget.
EXAMPLES = int(os.environ.get("QL_FUZZ_EXAMPLES", "50"))
# About 65 cases are generated per unit of EXAMPLES over all operations and
# modes (3,250 at 50, 7,150 at 110): far fewer means operations stopped
# generating.
MIN_TOTAL_CASES = 50 * EXAMPLES
# The refusal runs: every request stops at authentication or permissions, so
# a few cases per operation and mode cover them.
REFUSAL_EXAMPLES = max(5, EXAMPLES // 8)
THROTTLE_RATES = {
    "worker_pull": "100000/min",
    "worker_heartbeat": "100000/min",
    "worker_session_open": "100000/min",
}
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
    strategy: Any,
    *,
    auth: str,
    checks: list[Any],
    tally: tuple[str, Counter[str], Counter[int]],
    examples: int = EXAMPLES,
) -> None:
    op_id, cases, statuses = tally

    @settings(
        max_examples=examples,
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


@contextmanager
def _served_schema() -> Iterator[list[Any]]:
    """The app's operations as schemathesis loads them, with throttling out of the way."""
    with (
        _test_transaction_kept_open(),
        override_settings(
            REST_FRAMEWORK={**api_settings.user_settings, "DEFAULT_THROTTLE_RATES": THROTTLE_RATES}
        ),
    ):
        app = get_wsgi_application()
        schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", app)
        yield [result.ok() for result in schema.get_all_operations() if isinstance(result, Ok)]


def _naming(case: Any, offer_id: str) -> Any:
    """Every other ACK item of a generated `POST acks` body names `offer_id`."""
    if isinstance(case.body, dict) and isinstance(case.body.get("acks"), list):
        for index, item in enumerate(case.body["acks"]):
            if isinstance(item, dict) and index % 2 == 0:
                item["offer_id"] = offer_id
    return case


def _op_id(operation: Any) -> str:
    return str(operation.definition.raw.get("operationId", operation.label))


def _strategies(
    operation: Any, fixed_paths: dict[str, dict[str, str]]
) -> Iterator[tuple[GenerationMode, Any]]:
    """Positive and negative cases; positive ones also on a real object's path."""
    variants: list[dict[str, str] | None] = [None]
    if _op_id(operation) in fixed_paths:
        variants.append(fixed_paths[_op_id(operation)])
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        for path_parameters in variants:
            if mode.is_negative and path_parameters is not None:
                continue
            yield mode, operation.as_strategy(generation_mode=mode, path_parameters=path_parameters)


def test_generated_requests_get_documented_conforming_non_5xx_responses(client: Any) -> None:
    task = make_task(project=make_project("p"), name="t")
    runs = [make_run(task) for _ in range(6)]
    _worker, credential = make_worker(slots=4)
    session_worker, _ = make_worker(slots=4)
    opened = open_session(session_worker)
    # A real lease for ACK cases that target an existing offer id.
    [offer] = WorkerClient(client, opened.token, session_worker).pull()[0].json()["offers"]
    schedule = schedule_create(task=task, name="fuzz", definition={"cron": "* * * * *"})
    operator = operator_headers()["HTTP_AUTHORIZATION"]
    fixed_paths: dict[str, dict[str, str]] = {
        "schedules_retrieve": {"schedule_id": str(schedule.pk)},
        "schedules_update": {"schedule_id": str(schedule.pk)},
        "schedules_delete": {"schedule_id": str(schedule.pk)},
        "schedules_pause": {"schedule_id": str(schedule.pk)},
        "schedules_resume": {"schedule_id": str(schedule.pk)},
        "schedules_run_now": {"schedule_id": str(schedule.pk)},
        "schedules_fires": {"schedule_id": str(schedule.pk)},
        "worker_lease_ack": {"offer_id": offer["offer_id"]},
        "worker_lease_output": {"offer_id": offer["offer_id"]},
        "runs_output": {"run_id": str(runs[2].pk)},
        "runs_retrieve": {"run_id": str(runs[0].pk)},
        "runs_cancel": {"run_id": str(runs[1].pk)},
        "tasks_create": {"slug": "p"},
        "tasks_update": {"slug": "p", "name": "t"},
    }

    with _served_schema() as operations:
        # 9 of schedules (issue 13), reconcile (issue 10), 2 of live output (issue 14),
        # several ACKs in one request (issue 12).
        assert len(operations) == 25
        cases: Counter[str] = Counter()
        statuses: Counter[int] = Counter()
        for operation in operations:
            op_id = _op_id(operation)
            auth = _auth_for(
                operation.path, operator=operator, credential=credential, session=opened.token
            )
            for mode, strategy in _strategies(operation, fixed_paths):
                checks = CHECKS + ([negative_data_rejected] if mode.is_negative else [])
                _fuzz(strategy, auth=auth, checks=checks, tally=(op_id, cases, statuses))
            if op_id == "worker_lease_acks":
                # Items naming the real lease too: its rows are locked and the
                # token decides (the body has no path to fix).
                real = operation.as_strategy(generation_mode=GenerationMode.POSITIVE).map(
                    lambda case: _naming(case, offer["offer_id"])
                )
                _fuzz(real, auth=auth, checks=CHECKS, tally=(op_id, cases, statuses))

    total = sum(cases.values())
    print(f"schemathesis: {total} cases; by status {dict(sorted(statuses.items()))}")
    assert total >= MIN_TOTAL_CASES
    assert not any(status >= 500 for status in statuses)
    # The fuzzing reached the success paths, not only validation errors.
    assert statuses[200] and statuses[201]


def _operator_rows() -> dict[str, Any]:
    return {
        **state_snapshot(),
        "projects": list(Project.objects.order_by("id").values_list("id", "slug", "name")),
        "tasks": list(Task.objects.order_by("id").values_list("id", "current_revision_id")),
        "revisions": TaskRevision.objects.count(),
        "schedules": list(Schedule.objects.order_by("id").values()),
        "fires": ScheduleFire.objects.count(),
    }


def _refused_writes(ctx: Any, response: Any, case: Any) -> bool | None:
    """A view-only user: reads may succeed, writes never do."""
    if case.method.upper() != "GET" and response.status_code < 300:
        raise AssertionError(f"{case.method} {case.path} → {response.status_code} for view-only")
    return None


# Answers a request may get before its credentials are even looked at: the
# path does not exist (404), or the body is refused on its length (411/413).
_BEFORE_AUTHENTICATION = {404, 411, 413}
# The old credential is unknown; a Session opened with it was fenced.
_ROTATION_CODES = {"invalid_credential", "credential_rotated"}


def _refused_credentials(codes: Counter[str]) -> Any:
    """Every answer a 401 (or refused before authentication); counts the codes."""

    def check(ctx: Any, response: Any, case: Any) -> bool | None:
        if response.status_code in _BEFORE_AUTHENTICATION:
            return None
        if response.status_code != 401:
            raise AssertionError(f"{case.method} {case.path} → {response.status_code}, not 401")
        code = response.json()["error"]["code"]
        # A generated case may replace the Authorization header: not_authenticated.
        if code not in _ROTATION_CODES | {"not_authenticated", "authentication_failed"}:
            raise AssertionError(f"{case.method} {case.path} → 401 {code}")
        codes[code] += 1
        return None

    return check


def test_a_view_only_staff_user_reads_and_is_refused_every_write(client: Any) -> None:
    task = make_task(project=make_project("p"), name="t")
    runs = [make_run(task) for _ in range(2)]
    view_perms = tuple(
        f"{perm.content_type.app_label}.{perm.codename}"
        for perm in Permission.objects.filter(codename__startswith="view_").select_related(
            "content_type"
        )
    )
    schedule = schedule_create(task=task, name="fuzz", definition={"cron": "* * * * *"})
    operator = operator_headers(perms=view_perms)["HTTP_AUTHORIZATION"]
    fixed_paths = {
        "schedules_retrieve": {"schedule_id": str(schedule.pk)},
        "schedules_update": {"schedule_id": str(schedule.pk)},
        "schedules_delete": {"schedule_id": str(schedule.pk)},
        "schedules_pause": {"schedule_id": str(schedule.pk)},
        "schedules_resume": {"schedule_id": str(schedule.pk)},
        "schedules_run_now": {"schedule_id": str(schedule.pk)},
        "schedules_fires": {"schedule_id": str(schedule.pk)},
        "runs_retrieve": {"run_id": str(runs[0].pk)},
        "runs_cancel": {"run_id": str(runs[1].pk)},
        "tasks_create": {"slug": "p"},
        "tasks_update": {"slug": "p", "name": "t"},
    }
    before = _operator_rows()
    cases: Counter[str] = Counter()
    statuses: Counter[int] = Counter()
    by_method: Counter[tuple[str, int]] = Counter()
    with _served_schema() as operations:
        operator_ops = [op for op in operations if not op.path.startswith("/api/v1/worker/")]
        assert len(operator_ops) == 18  # 9 of schedules (issue 13), a Run's output (issue 14)
        for operation in operator_ops:
            for _mode, strategy in _strategies(operation, fixed_paths):
                seen = Counter(statuses)
                _fuzz(
                    strategy,
                    auth=operator,
                    checks=[*CHECKS, _refused_writes],
                    tally=(_op_id(operation), cases, statuses),
                    examples=REFUSAL_EXAMPLES,
                )
                for status, count in (statuses - seen).items():
                    by_method[(operation.method.upper(), status)] += count
    print(f"view-only: {sum(cases.values())} cases; {dict(sorted(by_method.items()))}")
    assert not any(status >= 500 for status in statuses)
    # Reads were served; writes got the permission refusal, not just validation errors.
    assert by_method[("GET", 200)]
    assert by_method[("POST", 403)] and by_method[("PUT", 403)]
    assert not any(method != "GET" and status < 300 for method, status in by_method)
    assert _operator_rows() == before


def test_a_rotated_credential_and_its_sessions_get_401_everywhere(client: Any) -> None:
    make_run(make_task(project=make_project("p"), name="t"))
    worker, old_credential = make_worker(slots=2)
    opened = open_session(worker)
    [offer] = WorkerClient(client, opened.token, worker).pull()[0].json()["offers"]
    new_credential = worker_rotate_credential(worker=worker)
    before = state_snapshot()
    cases: Counter[str] = Counter()
    statuses: Counter[int] = Counter()
    with _served_schema() as operations:
        worker_ops = [op for op in operations if op.path.startswith("/api/v1/worker/")]
        assert len(worker_ops) == 7
        for operation in worker_ops:
            auth = _auth_for(
                operation.path, operator="", credential=old_credential, session=opened.token
            )
            fixed = {"worker_lease_ack": {"offer_id": offer["offer_id"]}}
            codes: Counter[str] = Counter()
            for _mode, strategy in _strategies(operation, fixed):
                _fuzz(
                    strategy,
                    auth=auth,
                    checks=[*CHECKS, _refused_credentials(codes)],
                    tally=(_op_id(operation), cases, statuses),
                    examples=REFUSAL_EXAMPLES,
                )
            # Refused as rotated, not merely for a missing header.
            expected = "credential_rotated"
            if operation.path.endswith("/sessions"):
                expected = "invalid_credential"
            assert codes[expected], (_op_id(operation), codes)
    print(f"rotated: {sum(cases.values())} cases; by status {dict(sorted(statuses.items()))}")
    assert state_snapshot() == before
    assert WorkerSession.objects.filter(worker=worker).count() == 1
    # The new credential is the one that works.
    reopened = client.post(
        "/api/v1/worker/sessions",
        data={"executor_types": ["process"], "slots": 1},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {new_credential}",
    )
    assert reopened.status_code == 201
