"""Operator API of Schedules: create/update/pause/resume/run/delete, the ledger,
bad input as a clear 400 that changes nothing, permissions, schema, leaks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.cache import cache
from django.test import Client

from qinglong.testing import CANARY_COMMAND, CANARY_CWD, CANARY_ENV, canary_definition, make_task
from runs.models import Run, Task
from runs.services import task_create
from schedules.models import Schedule, ScheduleFire
from schedules.services import schedules_evaluate
from workers.tests.api_helpers import API, error_code, operator_headers, post_json

pytestmark = pytest.mark.django_db

ALL = (
    "schedules.view_schedule",
    "schedules.add_schedule",
    "schedules.change_schedule",
    "schedules.delete_schedule",
    "schedules.pause_schedule",
    "schedules.view_schedulefire",
    "runs.add_run",
)


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    cache.clear()
    yield
    cache.clear()


@pytest.fixture
def op() -> dict[str, Any]:
    return operator_headers(perms=ALL)


@pytest.fixture
def task() -> Task:
    return make_task()


def create(client: Client, task: Task, headers: dict[str, Any], **fields: Any) -> Any:
    body = {
        "project": task.project.slug,
        "task": task.name,
        "name": "nightly",
        "cron": "0 3 * * *",
        "timezone": "Europe/Berlin",
        **fields,
    }
    return post_json(client, f"{API}/schedules", body, headers)


def patch_json(client: Client, path: str, body: Any, headers: dict[str, Any]) -> Any:
    return client.patch(path, data=json.dumps(body), content_type="application/json", **headers)


def rows() -> tuple[Any, ...]:
    return (
        list(Schedule.objects.values()),
        list(ScheduleFire.objects.values()),
        Run.objects.count(),
    )


def test_create_shows_the_next_fire_in_the_zone_and_in_utc(client: Client, task: Task, op) -> None:
    response = create(client, task, op, overlap_policy="buffer_one", catchup_window_s=600)
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["name"] == "nightly" and body["overlap_policy"] == "buffer_one"
    assert body["next_fire_local"].endswith(("T03:00:00+01:00", "T03:00:00+02:00"))
    assert body["next_fire_at"].endswith(("T02:00:00Z", "T01:00:00Z"))
    assert body["created_by"].startswith("operator:")
    got = client.get(f"{API}/schedules/{body['id']}", **op)
    assert got.status_code == 200 and got.json() == body
    listed = client.get(f"{API}/schedules", **op).json()
    assert [s["id"] for s in listed["results"]] == [body["id"]]
    assert listed["next_cursor"] is None
    # The same name twice for one Task is a conflict.
    assert create(client, task, op).status_code == 409


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"cron": "61 * * * *"}, "cron"),
        ({"cron": "* * *"}, "cron"),
        ({"cron": 5}, "cron"),
        ({"timezone": "Mars/Olympus"}, "timezone"),
        ({"timezone": "../../etc/passwd"}, "timezone"),
        ({"catchup_window_s": 7 * 86_400 + 1}, "catchup_window_s"),
        ({"catchup_window_s": -1}, "catchup_window_s"),
        ({"jitter_s": 3601}, "jitter_s"),
        ({"overlap_policy": "sometimes"}, "overlap_policy"),
        ({"priority": 5000}, "priority"),
        ({"surprise": 1}, "surprise"),
        ({"name": "no spaces allowed"}, "name"),
    ],
)
def test_bad_input_is_a_clear_400_that_changes_nothing(
    client: Client, task: Task, op, fields: dict[str, Any], field: str
) -> None:
    existing = create(client, task, op, name="keep").json()
    before = rows()
    response = create(client, task, op, **fields)
    assert response.status_code == 400, response.content
    assert error_code(response) == "invalid_schedule"
    assert response.json()["error"]["message"].startswith(f"{field}:")
    assert rows() == before
    # The same values through PATCH: refused, the Schedule as it was.
    patch_fields = {k: v for k, v in fields.items() if k != "name"}
    if patch_fields:
        response = patch_json(client, f"{API}/schedules/{existing['id']}", patch_fields, op)
        assert response.status_code == 400
        assert error_code(response) == "invalid_schedule"
        assert rows() == before


def test_bad_operator_calls_are_a_400_or_404_that_change_nothing(
    client: Client, task: Task, op
) -> None:
    schedule = create(client, task, op, cron="* * * * *", timezone="UTC").json()
    path = f"{API}/schedules/{schedule['id']}"
    before = rows()
    calls = [
        ("post", f"{path}/pause", {"reason": "r", "resume_at": "2000-01-01T00:00:00Z"}, 400),
        ("post", f"{path}/pause", {"reason": "x" * 201}, 400),
        ("post", f"{path}/pause", {"reason": "r", "resume_at": "tomorrow"}, 400),
        ("post", f"{path}/pause", {"reason": "r", "surprise": 1}, 400),
        ("post", f"{path}/resume", {"surprise": 1}, 400),
        ("post", f"{path}/run", {"surprise": 1}, 400),
        ("patch", path, {"timezone": "Europe/Atlantis"}, 400),
        ("patch", path, {"catchup_window_s": 10**9}, 400),
        ("patch", path, [1], 400),
        ("patch", f"{API}/schedules/999999", {"priority": 1}, 404),
        ("post", f"{API}/schedules/999999/pause", {"reason": "r"}, 404),
        ("post", f"{API}/schedules/999999/run", {}, 404),
        ("delete", f"{API}/schedules/999999", None, 404),
    ]
    for method, url, body, expected in calls:
        if method == "delete":
            response = client.delete(url, **op)
        else:
            response = getattr(client, method)(
                url, data=json.dumps(body), content_type="application/json", **op
            )
        assert response.status_code == expected, (method, url, body, response.content)
        assert set(response.json()) == {"error"}, response.content  # the one envelope
        assert rows() == before, (method, url, body)
    for query in ("at=yesterday", "outcome=bogus", "limit=0", "cursor=x", "at=1&at=2"):
        response = client.get(f"{path}/fires?{query}", **op)
        assert response.status_code == 400, query
        assert set(response.json()) == {"error"}


def test_a_non_object_body_and_missing_task_fields(client: Client, task: Task, op) -> None:
    assert post_json(client, f"{API}/schedules", [1], op).status_code == 400
    response = post_json(client, f"{API}/schedules", {"cron": "* * * * *"}, op)
    assert response.status_code == 400 and error_code(response) == "invalid_schedule"
    body = {"project": task.project.slug, "task": "nope", "name": "n", "cron": "* * * * *"}
    response = post_json(client, f"{API}/schedules", body, op)
    assert response.status_code == 404
    assert not Schedule.objects.exists()


def test_update_pause_resume_run_now_and_the_ledger(client: Client, task: Task, op) -> None:
    schedule = create(client, task, op, cron="* * * * *", timezone="UTC").json()
    path = f"{API}/schedules/{schedule['id']}"
    updated = patch_json(client, path, {"overlap_policy": "allow", "priority": 5}, op)
    assert updated.status_code == 200
    assert (updated.json()["overlap_policy"], updated.json()["priority"]) == ("allow", 5)

    paused = post_json(
        client,
        f"{path}/pause",
        {"reason": "maintenance window", "resume_at": "2999-01-01T00:00:00Z"},
        op,
    )
    assert paused.status_code == 200, paused.content
    body = paused.json()
    assert (body["paused"], body["pause_reason"], body["next_fire_at"]) == (
        True,
        "maintenance window",
        None,
    )
    assert body["paused_by"].startswith("operator:") and body["resume_at"].startswith("2999")
    bad = post_json(client, f"{path}/pause", {"resume_at": "2000-01-01T00:00:00Z"}, op)
    assert bad.status_code == 400 and error_code(bad) == "invalid_schedule"
    resumed = post_json(client, f"{path}/resume", {}, op)
    assert resumed.status_code == 200 and resumed.json()["paused"] is False

    ran = post_json(client, f"{path}/run", {}, op)
    assert ran.status_code == 201
    assert (ran.json()["outcome"], ran.json()["manual"]) == ("enqueued", True)
    run = Run.objects.get(pk=int(ran.json()["run_id"]))
    assert run.schedule_id == int(schedule["id"]) and run.priority == 5

    fires = client.get(f"{path}/fires", **op).json()["results"]
    assert [(f["outcome"], f["manual"]) for f in fires if f["manual"]] == [("enqueued", True)]
    # The real clock may cross a minute while paused: that fire is then `paused`.
    assert {f["outcome"] for f in fires if not f["manual"]} <= {"paused"}
    assert client.get(f"{path}/fires?outcome=missed", **op).json()["results"] == []
    assert client.get(f"{path}/fires?outcome=bogus", **op).status_code == 400

    deleted = client.delete(path, **op)
    assert deleted.status_code == 204
    assert client.get(path, **op).status_code == 404
    assert client.delete(path, **op).status_code == 404
    run.refresh_from_db()
    assert run.schedule_id is None


def test_why_did_it_not_run_at_a_given_time(client: Client, task: Task, op) -> None:
    from schedules.tests.helpers import at, make_schedule

    schedule = make_schedule(task, cron="*/5 * * * *", catchup_window_s=0)
    schedules_evaluate(now=at(hours=1))  # down for an hour: 12:05 to 12:55 missed, 13:00 on time
    path = f"{API}/schedules/{schedule.pk}/fires"
    answer = client.get(f"{path}?at=2026-06-01T12:30:00Z", **op).json()["results"]
    assert [(f["outcome"], f["fire_at"], f["last_fire_at"], f["fire_count"]) for f in answer] == [
        ("missed", "2026-06-01T12:05:00Z", "2026-06-01T12:55:00Z", 11)
    ]
    answer = client.get(f"{path}?at=2026-06-01T13:00:00Z", **op).json()["results"]
    assert [f["outcome"] for f in answer] == ["enqueued"]
    assert client.get(f"{path}?at=2026-06-01T11:00:00Z", **op).json()["results"] == []


def test_the_ledger_pages_newest_first(client: Client, task: Task, op) -> None:
    from schedules.tests.helpers import at, make_schedule

    schedule = make_schedule(task, overlap_policy="skip")
    for minute in range(1, 6):
        schedules_evaluate(now=at(minutes=minute))
    path = f"{API}/schedules/{schedule.pk}/fires"
    first = client.get(f"{path}?limit=2", **op).json()
    second = client.get(f"{path}?limit=2&cursor={first['next_cursor']}", **op).json()
    third = client.get(f"{path}?limit=2&cursor={second['next_cursor']}", **op).json()
    times = [f["fire_at"][11:16] for page in (first, second, third) for f in page["results"]]
    assert times == ["12:05", "12:04", "12:03", "12:02", "12:01"]
    assert third["next_cursor"] is None
    assert client.get(f"{path}?cursor=12", **op).status_code == 400


# -------------------------------------------------------------- permissions


CALLS: dict[str, tuple[str, str, Any, tuple[str, ...], int]] = {
    "schedules_list": ("get", "/schedules", None, ("schedules.view_schedule",), 200),
    "schedules_create": (
        "post",
        "/schedules",
        {"project": "{project}", "task": "{task}", "name": "other", "cron": "* * * * *"},
        ("schedules.add_schedule", "runs.add_run"),
        201,
    ),
    "schedules_retrieve": ("get", "/schedules/{id}", None, ("schedules.view_schedule",), 200),
    "schedules_update": (
        "patch",
        "/schedules/{id}",
        {"priority": 3},
        ("schedules.change_schedule", "runs.add_run"),
        200,
    ),
    "schedules_delete": ("delete", "/schedules/{id}", None, ("schedules.delete_schedule",), 204),
    "schedules_pause": ("post", "/schedules/{id}/pause", {}, ("schedules.pause_schedule",), 200),
    "schedules_resume": ("post", "/schedules/{id}/resume", {}, ("schedules.pause_schedule",), 200),
    "schedules_run_now": ("post", "/schedules/{id}/run", {}, ("runs.add_run",), 201),
    "schedules_fires": (
        "get",
        "/schedules/{id}/fires",
        None,
        ("schedules.view_schedulefire",),
        200,
    ),
}


def _call(client: Client, name: str, schedule: Schedule, headers: dict[str, Any]) -> Any:
    method, path, body, _, _ = CALLS[name]
    path = path.format(id=schedule.pk)
    if isinstance(body, dict):
        body = {
            k: v.format(project=schedule.task.project.slug, task=schedule.task.name)
            if isinstance(v, str)
            else v
            for k, v in body.items()
        }
    if method in ("get", "delete"):
        return getattr(client, method)(f"{API}{path}", **headers)
    return getattr(client, method)(
        f"{API}{path}", data=json.dumps(body), content_type="application/json", **headers
    )


@pytest.fixture
def schedule(task: Task) -> Schedule:
    from schedules.tests.helpers import make_schedule

    return make_schedule(task)


@pytest.mark.parametrize("name", CALLS)
def test_each_listed_permission_is_needed_and_enough(
    client: Client, schedule: Schedule, name: str
) -> None:
    perms = CALLS[name][3]
    for missing in perms:
        before = rows()
        headers = operator_headers(perms=tuple(p for p in ALL if p != missing))
        response = _call(client, name, schedule, headers)
        assert response.status_code == 403, (name, missing)
        assert error_code(response) == "permission_denied"
        assert rows() == before
    assert (
        _call(client, name, schedule, operator_headers(perms=perms)).status_code == CALLS[name][4]
    )


def test_non_staff_is_forbidden(client: Client, schedule: Schedule) -> None:
    response = _call(client, "schedules_list", schedule, operator_headers(staff=False, perms=ALL))
    assert response.status_code == 403 and error_code(response) == "forbidden"
    assert client.get(f"{API}/schedules").status_code == 401


def test_the_schema_documents_every_operation_and_its_permissions(client: Client) -> None:
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    operations = {
        op["operationId"]: op for path in schema["paths"].values() for op in path.values()
    }
    for name, (_, _, _, perms, _) in CALLS.items():
        description = operations[name]["description"]
        for perm in perms:
            assert f"`{perm}`" in description, name
        assert "400" in operations[name]["responses"]
    create_body = operations["schedules_create"]["requestBody"]["content"]["application/json"]
    assert create_body["schema"]["$ref"].endswith("ScheduleCreateRequest")


# -------------------------------------------------------------------- leaks


def test_no_task_secret_appears_in_any_schedule_response(client: Client, op, caplog) -> None:
    caplog.set_level("DEBUG")
    from schedules.tests.helpers import at, make_schedule

    secret_task = task_create(
        project=make_task().project, name="secret", definition=canary_definition()
    )
    schedule = make_schedule(secret_task, overlap_policy="allow")
    schedules_evaluate(now=at(minutes=1))
    path = f"{API}/schedules/{schedule.pk}"
    bodies = [
        client.get(path, **op).content,
        client.get(f"{API}/schedules", **op).content,
        client.get(f"{path}/fires", **op).content,
        post_json(client, f"{path}/run", {}, op).content,
        post_json(client, f"{path}/pause", {"reason": "r"}, op).content,
        create(client, secret_task, op, cron="bad").content,
    ]
    for text in [body.decode() for body in bodies] + [caplog.text]:
        for canary in (CANARY_COMMAND, CANARY_ENV, CANARY_CWD):
            assert canary not in text
    assert "schedule_created" in caplog.text or "schedule created" in caplog.text
