"""Admin actions and pages enforce the permission each one declares (issue 8).

The permission model, one line per action (README "Admin permissions"):
`ACTIONS` below is its executable form. Every action registered on any
ModelAdmin is walked, and the walk fails for an action that is not listed here
or declares no permission: a new action must say who may run it.

For each action:
- a view-only staff user (every `view_*` permission, nothing else) is not
  offered it and POSTing it to the changelist changes nothing;
- a staff user with the view permissions plus exactly the declared one is
  offered it and it takes effect;
- a staff user with every permission except the declared one is refused too
  (the declared permission is the one that matters, not some other).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.contrib import admin
from django.contrib.admin.models import CHANGE, DELETION, LogEntry
from django.contrib.auth.models import Group, Permission, User
from django.contrib.messages import get_messages
from django.db.models import Model
from django.forms.models import model_to_dict
from django.test import Client, RequestFactory
from django.urls import reverse

from dispatch.core.ports import DispatchScope
from dispatch.cycles import dispatch_cycle, dispatch_set_paused
from dispatch.models import DispatchControl
from leases.models import RunLease
from notifications.models import WebhookDelivery, WebhookSubscription
from notifications.services import webhook_test_emit
from notifications.signing import new_secret_nonce
from qinglong.testing import (
    claim,
    make_project,
    make_run,
    make_worker,
    open_session,
    pending_attempt,
)
from runs.models import Project, Run, Task
from schedules.models import Schedule, ScheduleFire
from schedules.services import schedule_create, schedule_run_now
from workers.models import Worker, WorkerAdminState, WorkerSession
from workers.services import worker_set_admin_state

pytestmark = pytest.mark.django_db

REASON = "walk test"


# ------------------------------------------------------------------- world


@dataclass
class World:
    """One of everything an action can target."""

    task: Task
    queued_run: Run
    failed_run: Run
    worker: Worker
    session: WorkerSession
    lease: RunLease
    spare_project: Project
    spare_user: User
    spare_group: Group
    schedule: Schedule
    paused_schedule: Schedule
    webhook: WebhookSubscription


def build_world() -> World:
    worker, _ = make_worker()
    session = open_session(worker).session
    leased_run = make_run()
    _, offer_id, _ = claim(pending_attempt(leased_run), session)
    queued_run = make_run()
    failed_run = make_run()
    Run.objects.filter(pk=failed_run.pk).update(state="failed")
    dispatch_set_paused(paused=False, reason="", actor="test")
    dispatch_cycle(scope=DispatchScope.global_())  # a DispatchCycle row
    schedule = schedule_create(
        task=queued_run.task, name="hourly", definition={"cron": "0 * * * *"}
    )
    schedule_run_now(schedule_id=schedule.pk, actor="test")  # a ScheduleFire row
    paused_schedule = schedule_create(
        task=queued_run.task, name="paused", definition={"cron": "0 * * * *"}
    )
    Schedule.objects.filter(pk=paused_schedule.pk).update(paused=True, attention_at=None)
    return World(
        task=queued_run.task,
        queued_run=queued_run,
        failed_run=failed_run,
        worker=worker,
        session=session,
        lease=RunLease.objects.get(offer_id=offer_id),
        spare_project=make_project(),
        spare_user=User.objects.create_user("spare", is_staff=True),
        spare_group=Group.objects.create(name="spare"),
        schedule=schedule,
        paused_schedule=paused_schedule,
        webhook=_webhook(queued_run.project),
    )


def _webhook(project: Project) -> WebhookSubscription:
    # Made directly, not through the services: a loopback URL that the send
    # rules refuse (QL_WEBHOOK_ALLOW_PRIVATE is off), so "send test" records a
    # delivery without any network call.
    subscription = WebhookSubscription.objects.create(
        project=project,
        name="alerts",
        url="https://127.0.0.1:9/hook",
        events=["run.failed"],
        secret_nonce=new_secret_nonce(),
    )
    webhook_test_emit(subscription=subscription, actor="test")  # a delivery log row
    return subscription


def _worker_state(w: World) -> object:
    return (
        Worker.objects.filter(pk=w.worker.pk).values_list("admin_state", "credential_digest").get(),
        WorkerSession.objects.filter(pk=w.session.pk).values_list("state", "ended_at").get(),
    )


def _switch(w: World) -> object:
    return DispatchControl.objects.filter(pk=1).values_list("paused", "reason", "updated_by").get()


def _schedule_state(schedule: Callable[[World], Schedule]) -> Callable[[World], object]:
    def state(w: World) -> object:
        row = schedule(w)
        return (
            Schedule.objects.filter(pk=row.pk).values_list("paused", "pause_reason").get(),
            ScheduleFire.objects.filter(schedule=row).count(),
        )

    return state


@dataclass(frozen=True)
class ActionSpec:
    permission: str  # the one permission (besides viewing) that lets a staff user run it
    targets: Callable[[World], list[int]]
    state: Callable[[World], object]  # what the action changes; compared before/after
    prepare: Callable[[World], object] = field(default=lambda w: None)


# (model label, action name) → who may run it and what it changes.
ACTIONS: dict[tuple[str, str], ActionSpec] = {
    ("runs.task", "enqueue_run"): ActionSpec(
        "runs.add_run",
        lambda w: [w.task.pk],
        lambda w: Run.objects.filter(task=w.task).count(),
    ),
    ("runs.run", "cancel_runs"): ActionSpec(
        "runs.change_run",
        lambda w: [w.queued_run.pk],
        lambda w: (
            Run.objects.filter(pk=w.queued_run.pk)
            .values_list("state", "cancel_requested", "version")
            .get()
        ),
    ),
    ("runs.run", "retry_failed_runs"): ActionSpec(
        "runs.add_run",
        lambda w: [w.failed_run.pk],
        lambda w: Run.objects.filter(task=w.failed_run.task).count(),
    ),
    ("workers.worker", "drain_workers"): ActionSpec(
        "workers.change_worker", lambda w: [w.worker.pk], _worker_state
    ),
    ("workers.worker", "disable_workers"): ActionSpec(
        "workers.change_worker", lambda w: [w.worker.pk], _worker_state
    ),
    ("workers.worker", "activate_workers"): ActionSpec(
        "workers.change_worker",
        lambda w: [w.worker.pk],
        _worker_state,
        prepare=lambda w: worker_set_admin_state(
            worker=w.worker, admin_state=WorkerAdminState.DRAINING
        ),
    ),
    ("workers.worker", "rotate_credentials"): ActionSpec(
        "workers.rotate_credential", lambda w: [w.worker.pk], _worker_state
    ),
    ("leases.runlease", "revoke_leases"): ActionSpec(
        "leases.revoke_lease",
        lambda w: [w.lease.pk],
        lambda w: (
            RunLease.objects.filter(pk=w.lease.pk)
            .values_list("state", "end_reason", "ended_at")
            .get()
        ),
    ),
    ("notifications.webhooksubscription", "send_test"): ActionSpec(
        "notifications.send_test_webhook",
        lambda w: [w.webhook.pk],
        lambda w: WebhookDelivery.objects.filter(subscription=w.webhook).count(),
    ),
    ("notifications.webhooksubscription", "rotate_secret"): ActionSpec(
        "notifications.change_webhooksubscription",
        lambda w: [w.webhook.pk],
        lambda w: WebhookSubscription.objects.values_list("secret_nonce", flat=True).get(
            pk=w.webhook.pk
        ),
    ),
    ("notifications.webhooksubscription", "delete_selected"): ActionSpec(
        "notifications.delete_webhooksubscription",
        lambda w: [w.webhook.pk],
        lambda w: WebhookSubscription.objects.filter(pk=w.webhook.pk).exists(),
    ),
    ("dispatch.dispatchcontrol", "pause_dispatch"): ActionSpec(
        "dispatch.pause_dispatch", lambda w: [1], _switch
    ),
    ("dispatch.dispatchcontrol", "resume_dispatch"): ActionSpec(
        "dispatch.pause_dispatch",
        lambda w: [1],
        _switch,
        prepare=lambda w: dispatch_set_paused(paused=True, reason="maintenance", actor="test"),
    ),
    ("schedules.schedule", "pause_schedules"): ActionSpec(
        "schedules.pause_schedule",
        lambda w: [w.schedule.pk],
        _schedule_state(lambda w: w.schedule),
    ),
    ("schedules.schedule", "resume_schedules"): ActionSpec(
        "schedules.pause_schedule",
        lambda w: [w.paused_schedule.pk],
        _schedule_state(lambda w: w.paused_schedule),
    ),
    ("schedules.schedule", "run_now"): ActionSpec(
        "runs.add_run",
        lambda w: [w.schedule.pk],
        lambda w: Run.objects.filter(schedule=w.schedule).count(),
    ),
    # Django's own "delete selected", where deleting makes sense at all: it
    # asks for the model's delete permission.
    ("runs.project", "delete_selected"): ActionSpec(
        "runs.delete_project",
        lambda w: [w.spare_project.pk],
        lambda w: Project.objects.filter(pk=w.spare_project.pk).exists(),
    ),
    ("auth.user", "delete_selected"): ActionSpec(
        "auth.delete_user",
        lambda w: [w.spare_user.pk],
        lambda w: User.objects.filter(pk=w.spare_user.pk).exists(),
    ),
    ("auth.group", "delete_selected"): ActionSpec(
        "auth.delete_group",
        lambda w: [w.spare_group.pk],
        lambda w: Group.objects.filter(pk=w.spare_group.pk).exists(),
    ),
}


def _enumerating_request() -> Any:
    # An unsaved active superuser holds every permission without a query, so
    # the registry can be walked at collection time.
    request = RequestFactory().get("/admin/")
    request.user = User(username="enumerator", is_staff=True, is_superuser=True, is_active=True)
    return request


def registered_actions() -> list[tuple[str, str]]:
    """Every (model label, action name) the admin offers a superuser."""
    request = _enumerating_request()
    return sorted(
        (model._meta.label_lower, name)
        for model, model_admin in admin.site._registry.items()
        for name in model_admin.get_actions(request)
    )


# ------------------------------------------------------------------- users


def staff_user(username: str, permissions: Iterable[Permission]) -> User:
    user = User.objects.create_user(username, is_staff=True)
    user.user_permissions.set(list(permissions))
    return User.objects.get(pk=user.pk)  # fresh permission cache


def _permission(dotted: str) -> Permission:
    app_label, codename = dotted.split(".")
    return Permission.objects.get(content_type__app_label=app_label, codename=codename)


def view_permissions() -> list[Permission]:
    return list(Permission.objects.filter(codename__startswith="view_"))


def client_for(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def viewer() -> Client:
    return client_for(staff_user("viewer", view_permissions()))


def offered_actions(client: Client, label: str) -> list[str]:
    app_label, model_name = label.split(".")
    response = client.get(reverse(f"admin:{app_label}_{model_name}_changelist"))
    assert response.status_code == 200
    action_form = response.context["action_form"]
    if action_form is None:
        return []
    return [name for name, _ in action_form.fields["action"].choices if name]


def post_action(
    client: Client, label: str, action: str, ids: list[int], reason: str = REASON
) -> Any:
    app_label, model_name = label.split(".")
    return client.post(
        reverse(f"admin:{app_label}_{model_name}_changelist"),
        # `post=yes` is the confirmation "delete selected" asks for; `reason`
        # the why every action needs (qinglong.admin.ReasonedActions).
        {"action": action, "_selected_action": ids, "post": "yes", "reason": reason},
    )


def logged_by(username: str) -> Any:
    return LogEntry.objects.filter(user__username=username)


# ------------------------------------------------------------- the walk


def test_every_registered_action_declares_a_permission_and_is_in_the_model() -> None:
    request = _enumerating_request()
    for model, model_admin in admin.site._registry.items():
        for name, action in model_admin.get_actions(request).items():
            assert action is not None
            declared = getattr(action[0], "allowed_permissions", ())
            where = f"{model._meta.label_lower}.{name}"
            assert declared, f"admin action {where} declares no permission"
            # Django runs an action if ANY listed permission is held: one each
            # keeps the model readable.
            assert len(declared) == 1, f"admin action {where} declares {declared}"
            assert "view" not in declared, f"admin action {where} is allowed to mere viewers"
    missing = set(registered_actions()) - set(ACTIONS)
    assert not missing, f"actions not in the permission model (add them to ACTIONS): {missing}"
    assert set(ACTIONS) <= set(registered_actions()), "ACTIONS lists an action that is gone"


@pytest.mark.parametrize(("label", "action"), registered_actions())
def test_a_view_only_user_can_neither_see_nor_run_the_action(
    viewer: Client, label: str, action: str
) -> None:
    spec = ACTIONS[(label, action)]
    world = build_world()
    spec.prepare(world)
    before = spec.state(world)
    assert action not in offered_actions(viewer, label)
    response = post_action(viewer, label, action, spec.targets(world))
    assert response.status_code in (200, 302)
    assert spec.state(world) == before
    assert "shown once" not in response.content.decode()
    assert not logged_by("viewer").exists()


@pytest.mark.parametrize(("label", "action"), registered_actions())
def test_the_declared_permission_alone_lets_a_staff_user_run_the_action(
    label: str, action: str
) -> None:
    spec = ACTIONS[(label, action)]
    world = build_world()
    spec.prepare(world)
    before = spec.state(world)
    client = client_for(staff_user("operator", [*view_permissions(), _permission(spec.permission)]))
    assert action in offered_actions(client, label)
    post_action(client, label, action, spec.targets(world))
    assert spec.state(world) != before
    # Who and why: one admin LogEntry by this operator per selected object.
    targets = {str(pk) for pk in spec.targets(world)}
    # Deleting is logged as a DELETION, with the reason too.
    flag = DELETION if action == "delete_selected" else CHANGE
    entries = logged_by("operator").filter(
        action_flag=flag, change_message__endswith=f"(reason: {REASON})"
    )
    assert {entry.object_id for entry in entries} == targets


@pytest.mark.parametrize(("label", "action"), registered_actions())
def test_an_action_without_a_reason_changes_nothing_and_logs_nothing(
    label: str, action: str
) -> None:
    spec = ACTIONS[(label, action)]
    world = build_world()
    spec.prepare(world)
    before = spec.state(world)
    client = client_for(staff_user("operator", [*view_permissions(), _permission(spec.permission)]))
    response = post_action(client, label, action, spec.targets(world), reason="   ")
    assert spec.state(world) == before
    assert not logged_by("operator").exists()
    assert "shown once" not in response.content.decode()
    shown = [str(m) for m in get_messages(response.wsgi_request)]
    assert any("needs a reason" in m for m in shown), shown


@pytest.mark.parametrize(("label", "action"), registered_actions())
def test_every_permission_but_the_declared_one_is_not_enough(label: str, action: str) -> None:
    spec = ACTIONS[(label, action)]
    world = build_world()
    spec.prepare(world)
    before = spec.state(world)
    others = Permission.objects.exclude(pk=_permission(spec.permission).pk)
    client = client_for(staff_user("almost", others))
    assert action not in offered_actions(client, label)
    post_action(client, label, action, spec.targets(world))
    assert spec.state(world) == before
    assert not logged_by("almost").exists()


def test_a_view_only_user_is_offered_no_action_on_any_page(viewer: Client) -> None:
    build_world()
    for model in admin.site._registry:
        assert offered_actions(viewer, model._meta.label_lower) == [], model


# ------------------------------------------------------ the other pages

STANDARD_VIEWS = frozenset({"changelist", "add", "history", "delete", "change"})


def _row(obj: Model) -> dict[str, Any]:
    obj.refresh_from_db()
    return model_to_dict(obj)


def _password_change(client: Client, world: World) -> tuple[int, bool]:
    before = world.spare_user.password
    response = client.post(
        reverse("admin:auth_user_password_change", args=[world.spare_user.pk]),
        {"password1": "n3w-Passw0rd-x", "password2": "n3w-Passw0rd-x"},
    )
    return response.status_code, User.objects.get(pk=world.spare_user.pk).password != before


# URL name suffix → a POST to it as the given client: (status, whether it changed anything).
CUSTOM_VIEWS: dict[str, Callable[[Client, World], tuple[int, bool]]] = {
    "password_change": _password_change,
}


def test_every_admin_url_is_a_standard_view_or_a_reviewed_custom_one() -> None:
    for model, model_admin in admin.site._registry.items():
        prefix = f"{model._meta.app_label}_{model._meta.model_name}_"
        for pattern in model_admin.get_urls():
            name = getattr(pattern, "name", None)
            if name is None:  # Django's redirect from the pre-1.9 change URL
                continue
            suffix = name.removeprefix(prefix)
            assert suffix in STANDARD_VIEWS | CUSTOM_VIEWS.keys(), (
                f"admin URL {name} checks which permission? Add it to CUSTOM_VIEWS with a test"
            )


def test_a_view_only_user_gets_403_from_every_write_page_and_changes_nothing(
    viewer: Client,
) -> None:
    world = build_world()
    for model in admin.site._registry:
        app_label, model_name = model._meta.app_label, model._meta.model_name
        obj = model._default_manager.order_by("pk").first()
        assert obj is not None, f"build_world makes no {model._meta.label}"
        before_row, before_count = _row(obj), model._default_manager.count()
        for url in (
            reverse(f"admin:{app_label}_{model_name}_add"),
            reverse(f"admin:{app_label}_{model_name}_change", args=[obj.pk]),
            reverse(f"admin:{app_label}_{model_name}_delete", args=[obj.pk]),
        ):
            assert viewer.post(url, {"post": "yes"}).status_code == 403, url
        assert (_row(obj), model._default_manager.count()) == (before_row, before_count), model
    for name, post in CUSTOM_VIEWS.items():
        assert post(viewer, world) == (403, False), name


def test_a_superuser_can_use_the_reviewed_custom_views(admin_client: Client) -> None:
    # The CUSTOM_VIEWS probes do reach a working page: the 403 above is the permission.
    world = build_world()
    for name, post in CUSTOM_VIEWS.items():
        assert post(admin_client, world) == (302, True), name


# ---------------------------------------------------------- the kill switch


def _toggle(client: Client) -> int:
    return client.post(
        reverse("admin:dispatch_dispatchcontrol_change", args=[1]),
        {"paused": "on", "reason": "from the form"},
    ).status_code


def test_the_kill_switch_form_needs_pause_dispatch_not_change_dispatchcontrol() -> None:
    dispatch_set_paused(paused=False, reason="", actor="test")
    change_only = staff_user(
        "changer",
        [*view_permissions(), _permission("dispatch.change_dispatchcontrol")],
    )
    assert _toggle(client_for(change_only)) == 403
    assert not DispatchControl.objects.get(pk=1).paused
    switcher = staff_user("switcher", [*view_permissions(), _permission("dispatch.pause_dispatch")])
    assert _toggle(client_for(switcher)) == 302
    control = DispatchControl.objects.get(pk=1)
    assert (control.paused, control.reason, control.updated_by) == (
        True,
        "from the form",
        "admin:switcher",
    )


def test_a_view_only_user_looking_at_the_kill_switch_writes_nothing(viewer: Client) -> None:
    assert not DispatchControl.objects.exists()
    response = viewer.get(reverse("admin:dispatch_dispatchcontrol_changelist"))
    assert response.status_code == 200
    assert not DispatchControl.objects.exists()  # only an operator who may flip it creates it
