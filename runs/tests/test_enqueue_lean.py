"""The single enqueue's lean path (issue #12): fewer statements, the same answers.

`POST /api/v1/runs` with one object: the Token, its User and its permissions
in one statement (`qinglong.api_auth`), the Task by name in one
(`runs.api.selectors.task_by_name`), the Run and its Attempt in one
(`runs.services.run_enqueue_one`), and the answer built from the rows just
written — exactly what `GET /api/v1/runs/{id}` then answers.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.db import connection, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext
from rest_framework.authentication import TokenAuthentication
from rest_framework.authtoken.models import Token
from rest_framework.exceptions import AuthenticationFailed

from dispatch.cycles import dispatch_set_paused
from qinglong import testing
from qinglong.api_auth import OperatorTokenAuthentication
from qinglong.testing import make_project, make_task
from runs.models import Attempt, Project, Run
from runs.services import run_enqueue_one
from workers.tests.api_helpers import API, operator_headers, post_json

pytestmark = pytest.mark.django_db


def test_the_answer_is_what_the_run_page_then_says(client: Client) -> None:
    op = operator_headers()
    make_task(project=make_project("p"), name="t")
    created = post_json(client, f"{API}/runs", {"project": "p", "task": "t", "priority": 4}, op)
    assert created.status_code == 201, created.content
    body = created.json()
    shown = client.get(f"{API}/runs/{body['id']}", **op)
    assert shown.status_code == 200
    page = shown.json()
    assert {k: v for k, v in body.items() if k in page} == page
    assert set(body) - set(page) <= {"unplaceable_now", "unplaceable_reason"}
    (attempt,) = page["attempts"]
    assert (attempt["number"], attempt["state"], attempt["leases"]) == (1, "pending", [])


def test_the_run_and_its_attempt_are_written_as_the_orm_writes_them() -> None:
    task = make_task(project=make_project("p"), name="t")
    run, attempt = run_enqueue_one(task=task, priority=-7)
    stored_run = Run.objects.get(pk=run.pk)
    stored_attempt = Attempt.objects.get(run=stored_run)
    for field in Run._meta.concrete_fields:
        assert getattr(run, field.attname) == getattr(stored_run, field.attname), field.name
    for field in Attempt._meta.concrete_fields:
        assert getattr(attempt, field.attname) == getattr(stored_attempt, field.attname), field.name
    assert (stored_run.state, stored_run.version, stored_run.task_revision_id) == (
        "queued",
        0,
        task.current_revision_id,
    )
    assert (stored_attempt.number, stored_attempt.state, stored_attempt.priority) == (
        1,
        "pending",
        -7,
    )
    assert stored_attempt.queued_at == stored_run.queued_at
    assert stored_run.created_at is not None and stored_attempt.created_at is not None


def test_an_enqueue_inside_a_transaction_goes_with_it() -> None:
    task = make_task(project=make_project("p"), name="t")
    with pytest.raises(RuntimeError), transaction.atomic():
        run, _ = run_enqueue_one(task=task)
        assert Run.objects.filter(pk=run.pk).exists()
        raise RuntimeError("roll back")
    assert not Run.objects.exists() and not Attempt.objects.exists()


@pytest.mark.postgres
def test_a_single_enqueue_reads_and_writes_in_few_statements(client: Client) -> None:
    op = operator_headers()
    make_task(project=make_project("p"), name="t")
    post_json(client, f"{API}/runs", {"project": "p", "task": "t"}, op)  # warm-up
    with CaptureQueriesContext(connection) as queries:
        response = post_json(client, f"{API}/runs", {"project": "p", "task": "t"}, op)
    assert response.status_code == 201
    statements = [q["sql"] for q in queries.captured_queries]
    # No transaction of its own: the Run and its Attempt are one INSERT statement.
    assert "BEGIN" not in statements, statements
    inserts = [s for s in statements if "INSERT INTO" in s]
    assert len(inserts) == 1, statements
    # The Token with its User and permissions, the Task: one statement each.
    auth = [s for s in statements if '"authtoken_token"' in s or '"auth_permission"' in s]
    tasks = [s for s in statements if 'FROM "runs_task"' in s]
    assert (len(auth), len(tasks)) == (1, 1), statements
    # In all: those three; the kill switch with the clock and the enrolled
    # Workers (unplaceable_now) in one, the online Workers (why-waiting); the
    # savepoint around the insert is the test's own transaction's.
    own = [s for s in statements if "SAVEPOINT" not in s]
    assert len(own) == 5, "\n".join(own)
    dispatch_set_paused(paused=True, reason="test")
    with CaptureQueriesContext(connection) as queries:
        post_json(client, f"{API}/runs", {"project": "p", "task": "t"}, op)
    paused = [q["sql"] for q in queries.captured_queries if "SAVEPOINT" not in q["sql"]]
    assert len(paused) == 4, "\n".join(paused)  # paused: no online Worker is asked about


# ------------------------------------------------------------ authentication


def _user(**flags: Any) -> Any:
    return get_user_model().objects.create_user(
        username=f"u{get_user_model().objects.count()}", is_staff=True, **flags
    )


def _permission(codename: str) -> Permission:
    return Permission.objects.get(content_type__app_label="runs", codename=codename)


@pytest.mark.postgres
def test_a_token_reads_its_user_and_permissions_in_one_statement() -> None:
    own = _user()
    own.user_permissions.add(_permission("add_run"))
    by_group = _user()
    group = Group.objects.create(name="operators")
    group.permissions.add(_permission("add_run"), _permission("view_run"))
    by_group.groups.add(group)
    both = _user()
    both.user_permissions.add(_permission("view_run"))
    both.groups.add(group)
    none = _user()
    boss = _user(is_superuser=True)
    asked = (("runs.add_run",), ("runs.view_run",), ("runs.add_run", "runs.view_run"))
    for user in (own, by_group, both, none, boss):
        key = Token.objects.create(user=user).key
        with CaptureQueriesContext(connection) as queries:
            mine, token = OperatorTokenAuthentication().authenticate_credentials(key)
            answers = [mine.has_perms(perms) for perms in asked]
        assert len(queries.captured_queries) == 1, [q["sql"] for q in queries.captured_queries]
        drf, _ = TokenAuthentication().authenticate_credentials(key)
        assert answers == [drf.has_perms(perms) for perms in asked], user.username
        assert (mine.pk, token.key, token.user_id) == (user.pk, key, user.pk)
        if not user.is_superuser:
            assert mine.get_all_permissions() == drf.get_all_permissions()


def test_a_bad_or_inactive_token_is_refused_as_drf_refuses_it() -> None:
    with pytest.raises(AuthenticationFailed, match="Invalid token"):
        OperatorTokenAuthentication().authenticate_credentials("0" * 40)
    user = _user(is_active=False)
    key = Token.objects.create(user=user).key
    with pytest.raises(AuthenticationFailed, match="inactive"):
        OperatorTokenAuthentication().authenticate_credentials(key)


def test_a_user_without_the_permission_is_still_refused(client: Client) -> None:
    make_task(project=make_project("p"), name="t")
    headers = operator_headers(perms=("runs.view_run",))
    response = post_json(client, f"{API}/runs", {"project": "p", "task": "t"}, headers)
    assert response.status_code == 403
    assert not Run.objects.exists()


@pytest.mark.parametrize("state", ["eligible", "no_worker", "paused", "project_full"])
def test_the_answers_waiting_is_what_the_run_page_then_says(client: Client, state: str) -> None:
    op = operator_headers()
    project = make_project("p")
    make_task(project=project, name="t")
    if state != "no_worker":
        testing.open_session()
    if state == "paused":
        dispatch_set_paused(paused=True, reason="test")
    if state == "project_full":
        Project.objects.filter(pk=project.pk).update(max_concurrent_runs=1)
        testing.claim(
            testing.pending_attempt(testing.make_run(make_task(project=project))),
            testing.open_session().session,
        )
    created = post_json(client, f"{API}/runs", {"project": "p", "task": "t"}, op).json()
    shown = client.get(f"{API}/runs/{created['id']}", **op).json()
    assert created["waiting"] == shown["waiting"]
    expected = {
        "eligible": "eligible",
        "no_worker": "no_matching_worker",
        "paused": "dispatch_paused",
        "project_full": "project_limit",
    }[state]
    assert created["waiting"]["reason"] == expected


@pytest.mark.postgres
def test_the_enqueue_statements_are_prepared_once_per_connection(client: Client) -> None:
    op = operator_headers()
    make_task(project=make_project("p"), name="t")
    testing.open_session()
    for body in ({"project": "p", "task": "t"}, [{"project": "p", "task": "t"}] * 3) * 3:
        assert post_json(client, f"{API}/runs", body, op).status_code == 201
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement, generic_plans + custom_plans FROM pg_prepared_statements")
        prepared = list(cursor.fetchall())

    def runs_of(*needles: str) -> list[int]:
        return [n for text, n in prepared if all(needle in text for needle in needles)]

    # The operator Token with its User and permissions (every request), the
    # single's Task lookup, the single and the bulk insert (each text once,
    # whatever the list's length), and the why-waiting and placement questions.
    assert runs_of('FROM "authtoken_token" t') == [6]
    assert runs_of('FROM "runs_task" t') == [3]
    assert runs_of('INSERT INTO "runs_run"', "COALESCE") == [3]
    assert runs_of('INSERT INTO "runs_run"', "unnest") == [3]
    # Casts never carry a length: a cast would truncate what the column refuses.
    inserts = [text for text, _ in prepared if 'INSERT INTO "runs_run"' in text]
    assert inserts and all("::varchar(" not in text for text in inserts)
    assert runs_of('FROM "workers_workersession" s') == [3]
    # A single's kill switch, clock and enrolled Workers are one statement; a
    # list asks the enrolled Workers alone.
    assert runs_of('"dispatch_dispatchcontrol"', 'FROM "workers_worker" s WHERE') == [3]
    assert runs_of('"dispatch_dispatchcontrol"') == [3]
    assert sorted(runs_of('FROM "workers_worker" s WHERE')) == [3, 3]


@pytest.mark.postgres  # the PostgreSQL inserts' helper
def test_insert_values_are_what_model_save_writes() -> None:
    """`_insert_values` (no model instance) against a new instance's `pre_save`."""
    from datetime import timedelta

    from django.utils import timezone

    from runs.services import _insert_values

    task = make_task(project=make_project("p"), name="t")
    given = {"project_id": task.project_id, "task_id": task.pk, "priority": 7, "schedule_id": None}
    for model, values in ((Run, given), (Attempt, {"number": 1, "priority": 7})):
        fields = tuple(f for f in model._meta.concrete_fields if not f.primary_key)
        before = timezone.now()
        ours = _insert_values(fields, values, connection)
        instance = model(**values)
        for field, value in zip(fields, ours, strict=True):
            expected = field.get_db_prep_save(field.pre_save(instance, add=True), connection)
            if getattr(field, "auto_now_add", False):
                assert before <= value <= timezone.now() + timedelta(seconds=1), field.name
            else:
                assert value == expected, field.name


@pytest.mark.parametrize("setup", ["no_worker", "missing_label", "placed", "paused", "offline"])
def test_the_combined_answers_are_each_question_asked_alone(setup: str) -> None:
    """`enqueued_answers` (the kill switch and the enrolled Workers in one
    statement) answers what `enqueued_waiting` and `placement_unmatched` do."""
    from dispatch.adapters.waiting import enqueued_answers, enqueued_waiting, placement_unmatched
    from runs.api.selectors import task_by_name

    gpu = {"required_labels": {"gpu": "a100", "zone": "eu"}}
    make_task(project=make_project("p"), name="t", placement=gpu)
    if setup in ("missing_label", "paused"):
        testing.open_session(labels={"gpu": "t4"})
    if setup in ("placed", "paused"):
        testing.open_session(labels={"gpu": "a100", "zone": "eu"})
    if setup == "offline":
        testing.make_worker(labels={"gpu": "a100", "zone": "eu"})
    if setup == "paused":
        dispatch_set_paused(paused=True, reason="test")
    found = task_by_name("p", "t")
    assert found is not None
    run, _ = run_enqueue_one(task=found)
    run.project = found.project
    assert found.current_revision is not None
    run.task_revision = found.current_revision
    alone = (enqueued_waiting(run), placement_unmatched(run.task_revision))
    assert enqueued_answers(run) == alone
    expected = {
        "no_worker": ("no_matching_worker", "no_enrolled_worker"),
        "missing_label": ("no_matching_worker", "no_enrolled_worker"),
        "placed": ("eligible", None),
        "paused": ("dispatch_paused", None),
        "offline": ("no_matching_worker", None),
    }[setup]
    assert (alone[0]["reason"], alone[1] and alone[1]["reason"]) == expected
