"""The operator's console: pages render redacted, actions call services and report counts."""

from __future__ import annotations

import pytest
from django.contrib import admin
from django.contrib.admin.models import CHANGE, LogEntry
from django.urls import reverse
from django.utils import timezone

from dispatch.core.ports import DispatchScope
from dispatch.cycles import dispatch_cycle, dispatch_paused
from dispatch.models import DispatchControl, DispatchCycle
from leases.models import LeaseState, RunLease
from qinglong.testing import (
    CANARY_COMMAND,
    CANARY_CWD,
    CANARY_ENV,
    canary_definition,
    claim,
    make_project,
    make_run,
    make_worker,
    open_session,
    pending_attempt,
)
from runs.models import Run
from runs.services import task_create
from workers.models import Worker

pytestmark = pytest.mark.django_db

CANARIES = (CANARY_COMMAND, CANARY_ENV, CANARY_CWD)


@pytest.fixture
def leased():
    """A canary-spec Run claimed by an open Session; returns (run, lease, token, credential)."""
    worker, credential = make_worker()
    opened = open_session(worker)
    task = task_create(project=make_project(), name="canary", definition=canary_definition())
    run = make_run(task)
    _, offer_id, token = claim(pending_attempt(run), opened.session)
    dispatch_cycle(scope=DispatchScope.global_())  # a DispatchCycle row to show
    return run, RunLease.objects.get(offer_id=offer_id), token, credential, opened.token


def assert_redacted(body: str, *secrets: str) -> None:
    for secret in (*CANARIES, *secrets):
        assert secret not in body


def act(client, model: str, action: str, ids: list[int], reason: str = "admin test"):
    url = reverse(f"admin:{model}_changelist")
    data = {"action": action, "_selected_action": ids, "reason": reason}
    return client.post(url, data, follow=True)


def messages_of(response) -> list[str]:
    return [str(m) for m in response.context["messages"]]


@pytest.mark.parametrize(
    "model",
    [
        "leases_runlease",
        "runs_run",
        "dispatch_dispatchcycle",
        "workers_worker",
        "workers_workersession",
        "runs_attempt",
        "runs_task",
        "dispatch_dispatchcontrol",
    ],
)
def test_changelists_render_without_canary_or_token(admin_client, leased, model):
    _, lease, token, credential, session_token = leased
    response = admin_client.get(reverse(f"admin:{model}_changelist"))
    assert response.status_code == 200
    assert_redacted(response.content.decode(), token, credential, session_token, lease.token_digest)


def test_change_views_render_without_canary_or_token(admin_client, leased):
    run, lease, token, credential, session_token = leased
    pages = [
        reverse("admin:leases_runlease_change", args=[lease.pk]),
        reverse("admin:runs_run_change", args=[run.pk]),
        reverse("admin:dispatch_dispatchcycle_change", args=[DispatchCycle.objects.first().pk]),
        reverse("admin:workers_worker_change", args=[lease.worker_id]),
        reverse("admin:workers_workersession_change", args=[lease.session_id]),
        reverse("admin:runs_attempt_change", args=[lease.attempt_id]),
        reverse("admin:overview"),
    ]
    for url in pages:
        response = admin_client.get(url)
        assert response.status_code == 200, url
        body = response.content.decode()
        assert_redacted(
            body,
            token,
            credential,
            session_token,
            lease.token_digest,
            Worker.objects.get().credential_digest,
        )
    lease_page = admin_client.get(pages[0]).content.decode()
    assert lease.token_digest[:8] in lease_page


def test_the_task_page_shows_the_current_command_and_env_names_but_no_env_value(
    admin_client, leased
):
    run, lease, token, credential, session_token = leased
    body = admin_client.get(reverse("admin:runs_task_change", args=[run.task_id])).content.decode()
    # Operators own the command: the current revision's, as a shell would read it.
    assert "sh -c &#x27;echo CANARY-CMD-7f3a9&#x27;" in body
    assert "SECRET_TOKEN (values hidden)" in body
    for secret in (CANARY_ENV, CANARY_CWD, token, credential, session_token, lease.token_digest):
        assert secret not in body
    # Never from a Run's page, where lease facts are listed.
    run_page = admin_client.get(reverse("admin:runs_run_change", args=[run.pk])).content.decode()
    assert CANARY_COMMAND not in run_page
    # A new revision: its command is the one shown, and still no env value.
    from runs.services import task_update

    task_update(
        task=run.task,
        definition={**canary_definition(), "command": ["sh", "-c", "echo revised-2"]},
    )
    body = admin_client.get(reverse("admin:runs_task_change", args=[run.task_id])).content.decode()
    assert "sh -c &#x27;echo revised-2&#x27;" in body
    assert CANARY_COMMAND not in body and CANARY_ENV not in body


def test_read_only_pages_offer_no_save_button(admin_client):
    from runs.tests.test_admin_permissions import build_world

    build_world()
    checked = 0
    for model, model_admin in admin.site._registry.items():
        obj = model._default_manager.order_by("pk").first()
        url = reverse(
            f"admin:{model._meta.app_label}_{model._meta.model_name}_change", args=[obj.pk]
        )
        response = admin_client.get(url)
        assert response.status_code == 200, url
        body = response.content.decode()
        editable = model_admin.has_change_permission(response.wsgi_request, obj)
        assert ('name="_save"' in body) == editable, url
        if not editable:
            assert 'name="_continue"' not in body and 'name="_addanother"' not in body, url
            checked += 1
    assert checked >= 8  # Tasks, Runs, Attempts, Workers, Sessions, Leases, cycles, ...


def test_the_cycle_list_opens_on_cycles_that_did_something(admin_client):
    now = timezone.now()
    DispatchCycle.objects.bulk_create(
        [
            DispatchCycle(started_at=now, scope="global", status=status, reason=reason, cycles=n)
            for status, reason, n in [
                ("idle", "no_candidates", 120),
                ("offered", "claimed", 1),
                ("no_match", "no_eligible_worker", 3),
            ]
        ]
    )
    url = reverse("admin:dispatch_dispatchcycle_changelist")

    def listed(query: str = "") -> set[str]:
        response = admin_client.get(url + query)
        assert response.status_code == 200
        return {cycle.status for cycle in response.context["cl"].result_list}

    assert listed() == {"offered", "no_match"}
    assert "Not idle (default)" in admin_client.get(url).content.decode()
    assert listed("?outcome=all") == {"idle", "offered", "no_match"}
    assert listed("?outcome=idle") == {"idle"}
    # Picking a status in its own filter wins over the default.
    assert listed("?status__exact=idle") == {"idle"}


def test_leases_cannot_be_added_or_deleted_or_edited(admin_client, leased):
    _, lease, *_ = leased
    assert admin_client.get(reverse("admin:leases_runlease_add")).status_code == 403
    assert (
        admin_client.post(
            reverse("admin:leases_runlease_delete", args=[lease.pk]), {"post": "yes"}
        ).status_code
        == 403
    )
    assert RunLease.objects.filter(pk=lease.pk).exists()


def test_revoke_lease_action_revokes_and_reports_the_count(admin_client, leased):
    run, lease, *_ = leased
    response = act(admin_client, "leases_runlease", "revoke_leases", [lease.pk])
    assert "Revoked 1 lease(s)." in messages_of(response)
    lease.refresh_from_db()
    assert (lease.state, lease.end_reason) == (LeaseState.REVOKED, "operator_revoke")
    assert Run.objects.get(pk=run.pk).state == "queued"


def test_cancel_runs_action_cancels_and_reports_the_count(admin_client):
    runs = [make_run(), make_run()]
    response = act(admin_client, "runs_run", "cancel_runs", [r.pk for r in runs])
    assert "Cancelled 2 run(s)." in messages_of(response)
    assert set(Run.objects.values_list("state", flat=True)) == {"cancelled"}


def test_retry_failed_runs_enqueues_new_runs_of_the_current_revision(admin_client):
    failed, queued = make_run(), make_run()
    Run.objects.filter(pk=failed.pk).update(state="failed")
    response = act(admin_client, "runs_run", "retry_failed_runs", [failed.pk, queued.pk])
    assert "Enqueued 1 retry run(s)." in messages_of(response)
    retry = Run.objects.filter(task=failed.task).exclude(pk=failed.pk).get()
    assert (retry.state, retry.task_revision_id) == ("queued", failed.task.current_revision_id)


def test_enqueue_run_action_on_task(admin_client):
    run = make_run()
    response = act(admin_client, "runs_task", "enqueue_run", [run.task_id])
    assert "Enqueued 1 run(s)." in messages_of(response)
    assert Run.objects.filter(task_id=run.task_id).count() == 2


def test_worker_state_actions_go_through_the_service(admin_client):
    worker, _ = make_worker()
    opened = open_session(worker)
    response = act(admin_client, "workers_worker", "drain_workers", [worker.pk])
    assert "1 worker(s) now draining." in messages_of(response)
    response = act(admin_client, "workers_worker", "disable_workers", [worker.pk])
    assert "1 worker(s) now disabled." in messages_of(response)
    opened.session.refresh_from_db()
    assert opened.session.state == "offline"  # disabling ends the Session
    response = act(admin_client, "workers_worker", "activate_workers", [worker.pk])
    assert Worker.objects.get(pk=worker.pk).admin_state == "active"


def test_rotate_credential_shows_the_new_one_once_and_never_the_digest(admin_client):
    worker, old = make_worker()
    response = act(admin_client, "workers_worker", "rotate_credentials", [worker.pk])
    shown = messages_of(response)
    assert "Rotated 1 credential(s)." in shown
    [note] = [m for m in shown if "shown once" in m]
    new = note.rsplit(" ", 1)[-1]
    worker.refresh_from_db()
    assert new.startswith("qlw_") and new != old
    assert worker.credential_prefix == new[:8]
    assert worker.credential_digest not in response.content.decode()
    # Not on the next page view.
    assert new not in admin_client.get(reverse("admin:workers_worker_changelist")).content.decode()


def test_kill_switch_pauses_cycles_and_shows_on_the_cycle_list(admin_client):
    admin_client.get(reverse("admin:dispatch_dispatchcontrol_changelist"))  # creates the row
    response = act(admin_client, "dispatch_dispatchcontrol", "pause_dispatch", [1])
    assert "Dispatch paused (1 switch)." in messages_of(response)
    assert dispatch_paused()
    assert DispatchControl.objects.get(pk=1).updated_by == "admin:admin"
    make_run()
    result = dispatch_cycle(scope=DispatchScope.global_())
    assert result.summary()["status"] == "paused"
    assert DispatchCycle.objects.latest("id").status == "paused"
    page = admin_client.get(reverse("admin:dispatch_dispatchcycle_changelist"))
    assert "Dispatch is PAUSED" in page.content.decode()
    act(admin_client, "dispatch_dispatchcontrol", "resume_dispatch", [1])
    assert not dispatch_paused()


def test_kill_switch_toggle_form_goes_through_the_service(admin_client):
    admin_client.get(reverse("admin:dispatch_dispatchcontrol_changelist"))
    response = admin_client.post(
        reverse("admin:dispatch_dispatchcontrol_change", args=[1]),
        {"paused": "on", "reason": "db upgrade"},
        follow=True,
    )
    assert response.status_code == 200
    control = DispatchControl.objects.get(pk=1)
    assert (control.paused, control.reason, control.updated_by) == (
        True,
        "db upgrade",
        "admin:admin",
    )


def test_state_fields_are_read_only_on_run_change(admin_client):
    run = make_run()
    admin_client.post(reverse("admin:runs_run_change", args=[run.pk]), {"state": "succeeded"})
    assert Run.objects.get(pk=run.pk).state == "queued"


@pytest.mark.parametrize(
    "url_name",
    [
        "admin:runs_run_changelist",
        "admin:runs_task_changelist",
        "admin:leases_runlease_changelist",
        "admin:runs_attempt_changelist",
    ],
)
def test_changelists_cost_the_same_queries_for_3_rows_as_for_12(admin_client, url_name):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    session = open_session(make_worker(slots=64)[0]).session

    def add_rows(n: int) -> None:
        for _ in range(n):
            claim(pending_attempt(make_run()), session)

    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            response = admin_client.get(reverse(url_name))
        assert response.status_code == 200
        return len(captured.captured_queries)

    add_rows(3)
    few = queries()
    add_rows(9)
    assert queries() == few  # no query per row (list_select_related covers __str__)


def test_run_changelist_names_tasks_and_revisions_readably(admin_client):
    project = make_project(slug="billing")
    task = task_create(project=project, name="nightly", definition=canary_definition())
    make_run(task)
    page = admin_client.get(reverse("admin:runs_run_changelist")).content.decode()
    assert "billing/nightly" in page
    assert "nightly r1" in page


# ------------------------------------------------------------- who and why


def test_an_action_needs_a_reason_and_leaves_one_log_entry_per_object(admin_client):
    runs = [make_run(), make_run()]
    ids = [r.pk for r in runs]
    refused = act(admin_client, "runs_run", "cancel_runs", ids, reason="")
    assert any("needs a reason" in m for m in messages_of(refused))
    assert set(Run.objects.values_list("state", flat=True)) == {"queued"}
    assert not LogEntry.objects.exists()

    act(admin_client, "runs_run", "cancel_runs", ids, reason="wrong input file")
    entries = LogEntry.objects.order_by("object_id")
    assert [(e.user.username, e.object_id, e.action_flag) for e in entries] == [
        ("admin", str(pk), CHANGE) for pk in sorted(ids)
    ]
    assert {e.change_message for e in entries} == {
        "Action: Cancel selected runs (reason: wrong input file)"
    }
    # The Run's History page shows who did what and why.
    history = admin_client.get(reverse("admin:runs_run_history", args=[ids[0]])).content.decode()
    assert "wrong input file" in history
    assert "Cancel selected runs" in history


def test_the_reason_box_sits_in_the_action_bar(admin_client):
    make_run()
    page = admin_client.get(reverse("admin:runs_run_changelist")).content.decode()
    assert 'name="reason"' in page
    assert 'placeholder="why (logged)"' in page


def test_deleting_selected_needs_a_reason_which_the_confirmation_carries_to_the_log(
    admin_client,
):
    from django.contrib.admin.models import DELETION

    from runs.models import Project

    spare = make_project("spare")
    url = reverse("admin:runs_project_changelist")
    refused = admin_client.post(
        url, {"action": "delete_selected", "_selected_action": [spare.pk]}, follow=True
    )
    assert any("needs a reason" in m for m in messages_of(refused))
    assert "Are you sure" not in refused.content.decode()
    # With a reason: the confirmation page shows it and posts it back with the yes.
    confirm = admin_client.post(
        url,
        {"action": "delete_selected", "_selected_action": [spare.pk], "reason": "typo in slug"},
    ).content.decode()
    assert "Are you sure" in confirm
    assert '<input type="hidden" name="reason" value="typo in slug">' in confirm
    assert Project.objects.filter(pk=spare.pk).exists()
    admin_client.post(
        url,
        {
            "action": "delete_selected",
            "_selected_action": [spare.pk],
            "reason": "typo in slug",
            "post": "yes",
        },
    )
    assert not Project.objects.filter(pk=spare.pk).exists()
    [entry] = LogEntry.objects.filter(object_id=str(spare.pk))
    assert (entry.user.username, entry.action_flag, entry.change_message) == (
        "admin",
        DELETION,
        "Deleted (reason: typo in slug)",
    )


def test_an_objects_delete_page_asks_for_a_reason_and_logs_it(admin_client):
    from django.contrib.admin.models import DELETION

    from runs.models import Project

    spare = make_project("spare")
    url = reverse("admin:runs_project_delete", args=[spare.pk])
    page = admin_client.get(url).content.decode()
    assert 'name="reason"' in page and "required" in page
    refused = admin_client.post(url, {"post": "yes", "reason": " "}, follow=True)
    assert any("needs a reason" in m for m in messages_of(refused))
    assert Project.objects.filter(pk=spare.pk).exists()
    assert not LogEntry.objects.exists()
    admin_client.post(url, {"post": "yes", "reason": "made by mistake"})
    assert not Project.objects.filter(pk=spare.pk).exists()
    [entry] = LogEntry.objects.all()
    assert (entry.object_id, entry.action_flag, entry.change_message) == (
        str(spare.pk),
        DELETION,
        "Deleted (reason: made by mistake)",
    )


def test_users_and_groups_are_deleted_with_a_reason_too(admin_client):
    from django.contrib.auth.models import Group, User

    from qinglong.admin import ReasonedActions

    for model in (User, Group):
        assert isinstance(admin.site.get_model_admin(model), ReasonedActions), model
    spare = User.objects.create_user("leaver")
    url = reverse("admin:auth_user_changelist")
    admin_client.post(
        url, {"action": "delete_selected", "_selected_action": [spare.pk], "post": "yes"}
    )
    assert User.objects.filter(pk=spare.pk).exists()
    admin_client.post(
        url,
        {
            "action": "delete_selected",
            "_selected_action": [spare.pk],
            "post": "yes",
            "reason": "left the team",
        },
    )
    assert not User.objects.filter(pk=spare.pk).exists()
    assert LogEntry.objects.get().change_message == "Deleted (reason: left the team)"
