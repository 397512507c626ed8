"""The overview page: who may see it, what it shows, bounded queries, the switch, no leaks."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.db.models import Max
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from dispatch.cycles import dispatch_paused, dispatch_set_paused
from dispatch.models import DispatchControl, DispatchCycle
from dispatch.tests.test_ops_commands import seed_every_category
from leases.audit import PROBLEMS, audit
from leases.models import RunLease
from qinglong.console.views import OVERVIEW_PERMISSIONS
from qinglong.testing import (
    CANARY_COMMAND,
    CANARY_CWD,
    CANARY_ENV,
    canary_definition,
    claim,
    make_project,
    make_task,
    make_worker,
    open_session,
    pending_attempt,
)
from runs.models import Attempt, Run, RunState
from runs.services import run_enqueue, task_create
from workers.models import WorkerAdminState
from workers.services import worker_set_admin_state

pytestmark = pytest.mark.django_db

URL = "/admin/overview/"


def staff(username: str, permissions: list[str]) -> Client:
    user = User.objects.create_user(username, is_staff=True)
    for dotted in permissions:
        app_label, codename = dotted.split(".")
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label=app_label, codename=codename)
        )
    client = Client()
    client.force_login(user)
    return client


def viewer() -> Client:
    return staff("viewer", [f"{p.content_type.app_label}.{p.codename}" for p in _views()])


def _views() -> list[Permission]:
    return list(Permission.objects.filter(codename__startswith="view_").select_related())


# --------------------------------------------------------------------- access


def test_anonymous_users_are_sent_to_the_login(client):
    response = client.get(URL)
    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/")


def test_staff_need_the_view_permission_of_everything_it_summarizes():
    for missing in OVERVIEW_PERMISSIONS:
        partial = staff(f"u-{missing}", [p for p in OVERVIEW_PERMISSIONS if p != missing])
        assert partial.get(URL).status_code == 403, missing
        # The index offers the link only to those who may follow it.
        assert "ql-overview-link" not in partial.get("/admin/").content.decode()
    allowed = staff("allowed", list(OVERVIEW_PERMISSIONS))
    assert allowed.get(URL).status_code == 200
    index = allowed.get("/admin/").content.decode()
    assert 'id="ql-overview-link"' in index
    assert reverse("admin:overview") in index


def test_non_staff_users_never_see_it():
    user = User.objects.create_user("plain")
    for permission in Permission.objects.filter(codename__startswith="view_"):
        user.user_permissions.add(permission)
    client = Client()
    client.force_login(user)
    assert client.get(URL).status_code == 302  # to the admin login


# ------------------------------------------------------------------- content


def _finish(run: Run, state: RunState, ago: timedelta) -> None:
    Run.objects.filter(pk=run.pk).update(state=state, finished_at=timezone.now() - ago)


def test_it_shows_runs_queue_workers_charts_and_the_switch(admin_client):
    task = make_task()
    worker, _ = make_worker("alpha", slots=3)
    session = open_session(worker).session
    make_worker("bravo")  # enrolled, never connected
    charlie, _ = make_worker("charlie", slots=2)
    open_session(charlie)
    worker_set_admin_state(worker=charlie, admin_state=WorkerAdminState.DRAINING)
    queued = [run_enqueue(task=task) for _ in range(3)]
    claim(pending_attempt(queued[0]), session)
    for minutes in (1, 2, 2):
        _finish(run_enqueue(task=task), RunState.SUCCEEDED, timedelta(minutes=minutes))
    _finish(run_enqueue(task=task), RunState.FAILED, timedelta(minutes=3))
    _finish(run_enqueue(task=task), RunState.FAILED, timedelta(hours=5))
    _finish(run_enqueue(task=task), RunState.SUCCEEDED, timedelta(days=2))  # outside both charts
    Attempt.objects.filter(run__state__in=["succeeded", "failed"]).update(state="succeeded")
    dispatch_set_paused(paused=True, reason="db upgrade", actor="admin:ops")

    response = admin_client.get(URL)
    assert response.status_code == 200
    context = response.context
    assert [(s, n) for _, s, n in context["runs_by_state"]] == [
        ("queued", 2),
        ("dispatching", 1),
        ("running", 0),
    ]
    assert (context["queue"].depth, context["queue"].waiting) == (2, 0)
    assert [(s, n) for _, s, n in context["finished_day"]] == [
        ("succeeded", 3),
        ("failed", 2),
        ("cancelled", 0),
    ]
    hour, day = context["hour_chart"], context["day_chart"]
    assert dict(hour.legend) == {"succeeded": 3, "failed": 1, "cancelled": 0}
    assert dict(day.legend) == {"succeeded": 3, "failed": 2, "cancelled": 0}
    rows = {w.name: w for w in context["workers"]}
    assert (rows["alpha"].used, rows["alpha"].capacity, rows["alpha"].free) == (1, 3, 2)
    assert rows["alpha"].heartbeat_at is not None
    assert (rows["bravo"].session_state, rows["bravo"].free) == (None, 0)
    # Draining keeps its Session and leases but takes no claim: no free slot.
    assert (rows["charlie"].current, rows["charlie"].capacity, rows["charlie"].free) == (
        True,
        2,
        0,
    )
    assert context["slots_free"] == 2
    assert context["control"].paused

    body = response.content.decode()
    # The charts are SVG in the page: one <rect> per non-empty bucket and series,
    # each carrying its count; no script and nothing from another host.
    hour_svg = body[body.index('id="chart-hour"') : body.index('id="chart-day"')]
    counts = [
        int(n) for n in re.findall(r'<rect class="bar [a-z]+"[^>]*data-count="(\d+)"', hour_svg)
    ]
    assert sum(counts) == 4
    assert "<svg" in hour_svg
    assert "<script" not in body.split('<div id="content-main">', 1)[1].split("</main>", 1)[0]
    assert "PAUSED: db upgrade" in body
    assert 'data-worker="alpha"' in body
    # Each Worker's row: its slots used / capacity, free, and last heartbeat.
    rows_html = {
        name: body[body.index(f'data-worker="{name}"') :].split("</tr>", 1)[0]
        for name in ("alpha", "bravo", "charlie")
    }
    assert "<td>1 / 3</td><td>2</td>" in rows_html["alpha"]
    assert " ago</td>" in rows_html["alpha"]
    assert "<td>none</td>" in rows_html["bravo"] and "<td>never</td>" in rows_html["bravo"]
    assert "<td>0 / 2</td><td>0</td>" in rows_html["charlie"]


def test_problems_are_named_as_the_audit_command_names_them(admin_client):
    seeded = seed_every_category()
    now = timezone.now()
    expected = {f.lease_id: f.category for f in audit(now=now) if f.category in PROBLEMS}
    response = admin_client.get(URL)
    shown = {f.lease_id: f.category for f in response.context["problems"]}
    assert shown == expected
    seeded_problems = {c for c in seeded if c in PROBLEMS}
    assert len(seeded_problems) >= 6
    assert set(shown.values()) == seeded_problems
    assert {seeded[c] for c in seeded_problems} == set(shown)
    assert response.context["problem_total"] == len(shown)
    body = response.content.decode()
    for category in seeded_problems:
        assert f'data-category="{category}"' in body


def test_recent_truncations_are_listed_with_counts_by_reason(admin_client):
    now = timezone.now()
    DispatchCycle.objects.bulk_create(
        [
            DispatchCycle(
                started_at=now - timedelta(minutes=i),
                scope="global",
                status="offered",
                reason=reason,
                truncated=truncated,
                cycles=cycles,
            )
            for i, (reason, truncated, cycles) in enumerate(
                [
                    ("claim_budget_exhausted", True, 1),
                    # One row summing four truncated cycles of one outcome.
                    ("claim_budget_exhausted", True, 4),
                    ("worker_budget_exhausted", True, 1),
                    ("claimed", False, 1),
                ]
            )
        ]
    )
    response = admin_client.get(URL)
    assert [c.reason for c in response.context["truncations"]] == [
        "worker_budget_exhausted",
        "claim_budget_exhausted",
        "claim_budget_exhausted",
    ]
    assert response.context["truncations_by_reason"] == {
        "claim_budget_exhausted": 5,
        "worker_budget_exhausted": 1,
    }


# ------------------------------------------------------------ bounded reads


SEED = 1000


def _bulk_runs(task, count: int) -> None:
    """`count` more Runs of `task` in every state (finished ones spread over the
    last day) and a pending Attempt for each queued one.

    A seed of at most SEED Runs is bulk-created; copies of it are made in SQL
    (INSERT ... SELECT over a recursive counter, valid on both databases):
    building 100,000 model instances would cost more than the whole page test.
    """
    now = timezone.now()
    states = [RunState.QUEUED, RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED]
    seed = min(count, SEED)
    before = Run.objects.filter(task=task).aggregate(m=Max("id"))["m"] or 0
    Run.objects.bulk_create(
        Run(
            project_id=task.project_id,
            task_id=task.pk,
            task_revision_id=task.current_revision_id,
            state=states[i % 4],
            queued_at=now - timedelta(seconds=i),
            finished_at=None if i % 4 == 0 else now - timedelta(seconds=(i * 86) % 86400),
        )
        for i in range(seed)
    )
    copies = count // seed - 1
    run_table = Run._meta.db_table
    columns = ", ".join(
        connection.ops.quote_name(f.column) for f in Run._meta.concrete_fields if not f.primary_key
    )
    with connection.cursor() as cursor:
        if copies:
            cursor.execute(
                f"INSERT INTO {run_table} ({columns}) "
                f"WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < %s) "
                f"SELECT {columns} FROM {run_table} CROSS JOIN n WHERE id > %s",
                [copies, before],
            )
        # One pending Attempt per new queued Run; every other column its default.
        values, params = [], []
        for field in Attempt._meta.concrete_fields:
            if field.primary_key:
                continue
            source = {"run_id": "id", "queued_at": "queued_at", "priority": "priority"}
            if field.column in source:
                values.append(connection.ops.quote_name(source[field.column]))
            elif field.name == "number":
                values.append("1")
            else:
                values.append("%s")
                default = timezone.now() if field.name == "created_at" else field.get_default()
                params.append(field.get_db_prep_save(default, connection))
        attempt_columns = ", ".join(
            connection.ops.quote_name(f.column)
            for f in Attempt._meta.concrete_fields
            if not f.primary_key
        )
        cursor.execute(
            f"INSERT INTO {Attempt._meta.db_table} ({attempt_columns}) "
            f"SELECT {', '.join(values)} FROM {run_table} WHERE id > %s AND state = %s",
            [*params, before, RunState.QUEUED.value],
        )


def _overview_queries(client: Client) -> tuple[int, list[str]]:
    with CaptureQueriesContext(connection) as captured:
        response = client.get(URL)
    assert response.status_code == 200
    return len(captured.captured_queries), [q["sql"] for q in captured.captured_queries]


def test_the_same_queries_for_100_runs_as_for_100000(admin_client):
    task = make_task()
    session = open_session(make_worker(slots=4)[0]).session
    claim(pending_attempt(run_enqueue(task=task)), session)
    dispatch_set_paused(paused=False, reason="", actor="test")
    _bulk_runs(task, 100)
    few, few_sql = _overview_queries(admin_client)
    _bulk_runs(task, 100_000)
    assert Run.objects.count() > 100_000
    assert Attempt.objects.filter(state="pending").count() > 25_000
    many, many_sql = _overview_queries(admin_client)
    assert many == few, "\n".join(sorted(set(many_sql) - set(few_sql)))
    # Session, user, the overview's reads and the paused-switch row: a handful.
    assert few <= 15


# --------------------------------------------------------------- the switch


def test_a_viewer_cannot_flip_the_switch_from_the_overview():
    client = viewer()
    response = client.post(URL, {"paused": "1", "reason": "because"})
    assert response.status_code == 403
    assert not dispatch_paused()
    assert not LogEntry.objects.exists()
    assert "Pause dispatch" not in client.get(URL).content.decode()


def test_pausing_needs_a_reason_and_logs_who_and_why():
    client = staff("pauser", [*OVERVIEW_PERMISSIONS, "dispatch.pause_dispatch"])
    assert "Pause dispatch" in client.get(URL).content.decode()
    response = client.post(URL, {"paused": "1", "reason": "  "}, follow=True)
    assert not dispatch_paused()
    assert any("needs a reason" in str(m) for m in response.context["messages"])

    client.post(URL, {"paused": "1", "reason": "db upgrade"})
    control = DispatchControl.objects.get(pk=1)
    assert (control.paused, control.reason, control.updated_by) == (
        True,
        "db upgrade",
        "admin:pauser",
    )
    entry = LogEntry.objects.get()
    assert (entry.user.username, entry.object_id) == ("pauser", "1")
    assert entry.change_message == "Paused dispatch (reason: db upgrade)"

    client.post(URL, {"paused": "0", "reason": "upgrade done"})
    assert not dispatch_paused()
    assert LogEntry.objects.count() == 2
    assert "Resumed dispatch (reason: upgrade done)" in LogEntry.objects.latest("pk").change_message


def test_a_bad_switch_value_changes_nothing():
    client = staff("pauser", [*OVERVIEW_PERMISSIONS, "dispatch.pause_dispatch"])
    client.post(URL, {"paused": "yes", "reason": "x"})
    assert not DispatchControl.objects.exists()
    assert not LogEntry.objects.exists()


# ---------------------------------------------------------------------- leaks


def test_the_overview_carries_no_spec_token_or_digest(admin_client):
    worker, credential = make_worker(slots=4)
    opened = open_session(worker)
    task = task_create(project=make_project(), name="canary", definition=canary_definition())
    tokens = []
    for _ in range(3):
        _, _, token = claim(pending_attempt(run_enqueue(task=task)), opened.session)
        tokens.append(token)
    RunLease.objects.filter(pk=RunLease.objects.order_by("pk").first().pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )  # one problem row
    body = admin_client.get(URL).content.decode()
    assert 'data-category="expired"' in body
    secrets = [CANARY_COMMAND, CANARY_ENV, CANARY_CWD, credential, opened.token, *tokens]
    secrets += list(RunLease.objects.values_list("token_digest", flat=True))
    secrets += list(RunLease.objects.values_list("spec_digest", flat=True))
    secrets.append(worker.credential_digest)
    for secret in secrets:
        assert secret not in body
