"""Operator API: Projects, Tasks (revisions), Runs (redacted), cancel, pagination."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.cache import cache
from django.db import OperationalError
from django.test import Client

from qinglong.testing import CANARY_ENV, make_project, make_run, make_task
from runs.models import Project, Run, Task, TaskRevision
from workers.tests.api_helpers import (
    API,
    WorkerClient,
    error_code,
    grant,
    operator_headers,
    post_json,
    put_json,
)

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    cache.clear()
    yield
    cache.clear()


@pytest.fixture
def op() -> dict[str, Any]:
    return operator_headers()


TASK = {
    "name": "echo",
    "executor_type": "process",
    "command": ["echo", "hello"],
    "env": {"A": "1"},
    "timeout_s": 60,
    "max_attempts": 2,
    "placement": {"executor_type": "process", "required_labels": {"zone": "a"}, "preferred": []},
}


def test_operator_endpoints_need_a_staff_token(client: Client) -> None:
    assert client.get(f"{API}/projects").status_code == 401
    non_staff = operator_headers(staff=False)
    response = client.get(f"{API}/projects", **non_staff)
    assert response.status_code == 403
    assert error_code(response) == "forbidden"
    staff = get_user_model().objects.create_user(username="admin-session", is_staff=True)
    client.force_login(staff)
    # The admin's session works too, under the same model permissions.
    assert client.get(f"{API}/projects").status_code == 403
    grant(staff, "runs.view_project")
    assert client.get(f"{API}/projects").status_code == 200


def test_projects_create_list_and_reject_duplicates(client: Client, op: dict[str, Any]) -> None:
    for slug in ("b", "a", "c"):
        created = post_json(client, f"{API}/projects", {"slug": slug, "name": slug.upper()}, op)
        assert created.status_code == 201
        assert created.json()["slug"] == slug
    dup = post_json(client, f"{API}/projects", {"slug": "a", "name": "again"}, op)
    assert dup.status_code == 409
    assert error_code(dup) == "already_exists"
    page = client.get(f"{API}/projects?limit=2", **op).json()
    assert [p["slug"] for p in page["results"]] == ["a", "b"]
    rest = client.get(f"{API}/projects?limit=2&cursor={page['next_cursor']}", **op).json()
    assert [p["slug"] for p in rest["results"]] == ["c"]
    assert rest["next_cursor"] is None
    bad = post_json(client, f"{API}/projects", {"slug": "not a slug", "name": "x"}, op)
    assert bad.status_code == 400
    assert Project.objects.count() == 3


def test_task_create_and_edit_make_revisions_and_never_echo_the_definition(
    client: Client, op: dict[str, Any]
) -> None:
    make_project("p")
    created = post_json(client, f"{API}/projects/p/tasks", TASK, op)
    assert created.status_code == 201, created.content
    assert created.json()["revision"] == 1
    assert "command" not in created.json() and "env" not in created.json()
    run = Run.objects.get(
        pk=post_json(client, f"{API}/runs", {"project": "p", "task": "echo"}, op).json()["id"]
    )
    edit = {k: v for k, v in TASK.items() if k != "name"} | {"command": ["echo", "bye"]}
    edited = put_json(client, f"{API}/projects/p/tasks/echo", edit, op)
    assert edited.status_code == 200
    assert edited.json()["revision"] == 2
    task = Task.objects.get(name="echo")
    assert task.current_revision is not None and task.current_revision.command == ["echo", "bye"]
    run.refresh_from_db()
    assert run.task_revision.revision == 1
    missing = put_json(client, f"{API}/projects/p/tasks/nope", edit, op)
    assert missing.status_code == 404
    assert error_code(missing) == "not_found"


@pytest.mark.parametrize("field", ["state", "worker_id", "generation", "expires_at", "spec"])
def test_extra_fields_in_operator_bodies_are_rejected_and_change_nothing(
    client: Client, op: dict[str, Any], field: str
) -> None:
    task = make_task(project=make_project("p"), name="t")
    run = make_run(task)
    before = (
        Project.objects.count(),
        Task.objects.count(),
        TaskRevision.objects.count(),
        list(Run.objects.values_list("id", "state", "version", "cancel_requested")),
    )
    definition = {k: v for k, v in TASK.items() if k != "name"}
    calls: list[tuple[str, str, dict[str, Any]]] = [
        ("post", f"{API}/projects", {"slug": "q", "name": "Q"}),
        ("post", f"{API}/projects/p/tasks", {**TASK, "name": "other"}),
        ("put", f"{API}/projects/p/tasks/t", definition),
        ("post", f"{API}/runs", {"project": "p", "task": "t", "priority": 0}),
        ("post", f"{API}/runs/{run.pk}/cancel", {}),
    ]
    for method, path, body in calls:
        send = post_json if method == "post" else put_json
        response = send(client, path, {**body, field: "x"}, op)
        assert response.status_code == 400, (path, response.content)
        assert error_code(response) in ("unknown_field", "invalid_definition")
        assert field in response.json()["error"]["message"]
    after = (
        Project.objects.count(),
        Task.objects.count(),
        TaskRevision.objects.count(),
        list(Run.objects.values_list("id", "state", "version", "cancel_requested")),
    )
    assert after == before


def test_invalid_definition_names_the_field_never_the_value(
    client: Client, op: dict[str, Any]
) -> None:
    make_project("p")
    bad = {**TASK, "env": {"bad key": CANARY_ENV}}
    response = post_json(client, f"{API}/projects/p/tasks", bad, op)
    assert response.status_code == 400
    assert error_code(response) == "invalid_definition"
    assert response.json()["error"]["message"].startswith("env")
    assert CANARY_ENV not in response.content.decode()
    response = post_json(client, f"{API}/projects/p/tasks", {**TASK, "timeout_s": "60"}, op)
    assert response.json()["error"]["message"].startswith("timeout_s")
    assert not Task.objects.exists()


def test_runs_enqueue_detail_and_redacted_lease_facts(client: Client, op: dict[str, Any]) -> None:
    task = make_task(project=make_project("p"), name="t")
    created = post_json(client, f"{API}/runs", {"project": "p", "task": "t", "priority": 5}, op)
    assert created.status_code == 201
    run_id = created.json()["id"]
    assert created.json()["state"] == "queued"
    assert created.json()["priority"] == 5
    assert created.json()["task_revision"] == task.current_revision.revision  # type: ignore[union-attr]

    worker = WorkerClient.open(client)
    [offer] = worker.pull()[0].json()["offers"]
    detail = client.get(f"{API}/runs/{run_id}", **op).json()
    assert detail["state"] == "dispatching"
    [attempt] = detail["attempts"]
    [lease] = attempt["leases"]
    assert lease["lease_id"] == offer["lease"]["lease_id"]
    assert lease["state"] == "active"
    assert lease["generation"] == 1
    assert lease["worker_id"] == str(worker.worker.pk)
    assert len(lease["token_digest_prefix"]) <= 8
    text = str(detail)
    for secret in ("command", "env", "cwd", "spec", 'token"', offer["lease"]["token"], "hello"):
        assert secret not in text
    assert offer["spec_sha256"] not in text


def test_run_create_errors(client: Client, op: dict[str, Any]) -> None:
    make_task(project=make_project("p"), name="t")
    missing = post_json(client, f"{API}/runs", {"project": "p", "task": "nope"}, op)
    assert missing.status_code == 404
    for priority in (1001, "1", True):
        response = post_json(
            client, f"{API}/runs", {"project": "p", "task": "t", "priority": priority}, op
        )
        assert response.status_code == 400
    assert not Run.objects.exists()


def test_runs_list_is_keyset_paginated_and_filtered(client: Client, op: dict[str, Any]) -> None:
    task = make_task()
    runs = [make_run(task) for _ in range(5)]
    post_json(client, f"{API}/runs/{runs[0].pk}/cancel", {}, op)
    seen: list[str] = []
    url = f"{API}/runs?limit=2"
    while True:
        page = client.get(url, **op).json()
        seen += [r["id"] for r in page["results"]]
        if page["next_cursor"] is None:
            break
        url = f"{API}/runs?limit=2&cursor={page['next_cursor']}"
    assert seen == [str(r.pk) for r in reversed(runs)]
    cancelled = client.get(f"{API}/runs?state=cancelled", **op).json()["results"]
    assert [r["id"] for r in cancelled] == [str(runs[0].pk)]
    for query in ("state=bogus", "limit=101", "limit=0", "cursor=abc", "page=2", "limit=1&limit=2"):
        response = client.get(f"{API}/runs?{query}", **op)
        assert response.status_code == 400, query
    assert "bogus" not in client.get(f"{API}/runs?state=bogus", **op).content.decode()


def test_cancel_is_idempotent_and_unknown_runs_are_404(client: Client, op: dict[str, Any]) -> None:
    run = make_run()
    first = post_json(client, f"{API}/runs/{run.pk}/cancel", {}, op)
    assert first.json()["state"] == "cancelled"
    # No body at all is fine too.
    again = client.post(
        f"{API}/runs/{run.pk}/cancel", data=b"", content_type="application/json", **op
    )
    assert again.status_code == 200
    assert again.json()["state"] == "cancelled"
    assert post_json(client, f"{API}/runs/999999/cancel", {}, op).status_code == 404
    assert client.get(f"{API}/runs/999999999999999999", **op).status_code == 404


def test_operator_database_unavailable_is_503(
    client: Client, op: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    make_task(project=make_project("p"), name="t")

    def down(**kwargs: Any) -> None:
        raise OperationalError("could not connect to server")

    monkeypatch.setattr("runs.api.views.run_enqueue_one", down)
    response = post_json(client, f"{API}/runs", {"project": "p", "task": "t"}, op)
    assert response.status_code == 503
    assert error_code(response) == "database_unavailable"
    assert response["Retry-After"]


def test_schema_and_docs_are_public(client: Client) -> None:
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    assert "/api/v1/worker/pull" in paths and "/api/v1/runs/{run_id}" in paths
    schemes = schema.json()["components"]["securitySchemes"]
    assert schemes["sessionToken"] == {
        **schemes["sessionToken"],
        "type": "http",
        "scheme": "bearer",
    }
    assert client.get("/api/docs/").status_code == 200
