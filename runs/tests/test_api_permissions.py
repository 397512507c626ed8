"""Operator API authorization: staff AND the model permission of each call.

A staff flag alone must not let a user define or enqueue what Workers run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.core.cache import cache
from django.test import Client

from qinglong.testing import make_project, make_run, make_task
from runs.models import Project, Run, Task, TaskRevision
from workers.tests.api_helpers import (
    API,
    OPERATOR_PERMISSIONS,
    error_code,
    operator_headers,
    post_json,
    put_json,
)

pytestmark = pytest.mark.django_db

DEFINITION = {
    "executor_type": "process",
    "command": ["echo", "hello"],
    "env": {},
    "timeout_s": 60,
    "max_attempts": 1,
    "placement": {"executor_type": "process", "required_labels": {}, "preferred": []},
}

# operation → (method, path, body, permissions it needs, success status)
CALLS: dict[str, tuple[str, str, Any, tuple[str, ...], int]] = {
    "projects_list": ("get", "/projects", None, ("runs.view_project",), 200),
    "projects_create": (
        "post",
        "/projects",
        {"slug": "new", "name": "New"},
        ("runs.add_project",),
        201,
    ),
    "tasks_create": (
        "post",
        "/projects/p/tasks",
        {**DEFINITION, "name": "other"},
        ("runs.add_task", "runs.add_taskrevision"),
        201,
    ),
    "tasks_update": (
        "put",
        "/projects/p/tasks/t",
        DEFINITION,
        ("runs.change_task", "runs.add_taskrevision"),
        200,
    ),
    "runs_list": ("get", "/runs", None, ("runs.view_run",), 200),
    "runs_retrieve": ("get", "/runs/{run}", None, ("runs.view_run",), 200),
    "runs_create": ("post", "/runs", {"project": "p", "task": "t"}, ("runs.add_run",), 201),
    "runs_cancel": ("post", "/runs/{run}/cancel", {}, ("runs.change_run",), 200),
}
WRITES = [name for name, call in CALLS.items() if call[0] != "get"]


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    cache.clear()
    yield
    cache.clear()


@pytest.fixture
def run() -> Run:
    return make_run(make_task(project=make_project("p"), name="t"))


def _call(client: Client, name: str, run: Run, headers: dict[str, Any]) -> Any:
    method, path, body, _, _ = CALLS[name]
    url = API + path.format(run=run.pk)
    if method == "get":
        return client.get(url, **headers)
    return (post_json if method == "post" else put_json)(client, url, body, headers)


def _rows() -> tuple[Any, ...]:
    return (
        list(Project.objects.values_list("id", "slug")),
        list(Task.objects.values_list("id", "current_revision")),
        TaskRevision.objects.count(),
        list(Run.objects.values_list("id", "state", "version", "cancel_requested")),
    )


@pytest.mark.parametrize("name", list(CALLS))
def test_staff_without_the_permission_is_403_permission_denied_and_nothing_changes(
    client: Client, run: Run, name: str
) -> None:
    before = _rows()
    response = _call(client, name, run, operator_headers(perms=()))
    assert response.status_code == 403
    assert error_code(response) == "permission_denied"
    assert _rows() == before


@pytest.mark.parametrize(
    ("name", "missing"),
    [(name, perm) for name in WRITES for perm in CALLS[name][3]],
)
def test_every_listed_permission_is_needed(
    client: Client, run: Run, name: str, missing: str
) -> None:
    # All operator permissions but one: that one still refuses the call.
    headers = operator_headers(perms=tuple(p for p in OPERATOR_PERMISSIONS if p != missing))
    before = _rows()
    response = _call(client, name, run, headers)
    assert response.status_code == 403, response.content
    assert error_code(response) == "permission_denied"
    assert _rows() == before


@pytest.mark.parametrize("name", list(CALLS))
def test_staff_with_exactly_the_listed_permissions_is_allowed(
    client: Client, run: Run, name: str
) -> None:
    response = _call(client, name, run, operator_headers(perms=CALLS[name][3]))
    assert response.status_code == CALLS[name][4], response.content


@pytest.mark.parametrize("name", list(CALLS))
def test_a_superuser_needs_no_explicit_permission(client: Client, run: Run, name: str) -> None:
    response = _call(client, name, run, operator_headers(perms=(), superuser=True))
    assert response.status_code == CALLS[name][4], response.content


@pytest.mark.parametrize("name", WRITES)
def test_permissions_without_staff_are_still_forbidden(client: Client, run: Run, name: str) -> None:
    before = _rows()
    response = _call(client, name, run, operator_headers(staff=False))
    assert response.status_code == 403
    assert error_code(response) == "forbidden"
    assert _rows() == before


def test_the_schema_documents_each_operations_permissions(client: Client) -> None:
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    operations = {
        op["operationId"]: op for path in schema["paths"].values() for op in path.values()
    }
    for name, (_, _, _, perms, _) in CALLS.items():
        description = operations[name]["description"]
        for perm in perms:
            assert f"`{perm}`" in description, name
        assert "permission_denied" in description
