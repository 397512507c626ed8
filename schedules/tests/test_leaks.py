"""No secret leaves through any Schedule surface (issue 13; docs/adr/0003).

A Task whose command, env and cwd carry the canaries is scheduled; its fires
are enqueued (one claimed and started: a lease token, a Session token and a
Worker credential exist), skipped, blocked, missed, paused and run by hand,
with a missed-fire webhook. Then every surface is read: the operator API
(every operation, its error bodies, the ledger with each filter), the admin
(lists, pages, the time search, the actions and their LogEntry rows),
`manage.py schedules` (text and JSON), `run_dispatcher`'s schedule events, the
Celery task's result, the webhook delivery, the ledger rows themselves and the
logs at DEBUG. None carries a canary, a token, a digest or a credential.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.core.cache import cache
from django.core.management import call_command
from django.test import Client
from django.urls import reverse

from leases.models import RunLease
from notifications.models import WebhookDelivery, WebhookEvent
from notifications.services import subscription_create
from qinglong.testing import (
    CANARY_COMMAND,
    CANARY_CWD,
    CANARY_ENV,
    canary_definition,
    claim,
    make_project,
    make_worker,
    open_session,
    pending_attempt,
)
from runs.services import task_create
from schedules.models import Schedule, ScheduleFire
from schedules.services import schedule_pause, schedule_resume, schedule_run_now, schedules_evaluate
from schedules.tasks import evaluate_schedules_task
from schedules.tests.helpers import _spec_digest, at, make_schedule
from workers.models import Worker
from workers.tests.api_helpers import API, operator_headers

pytestmark = pytest.mark.django_db

CANARIES = (CANARY_COMMAND, CANARY_ENV, CANARY_CWD)
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
def debug_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    # The project loggers do not propagate to the root (settings.LOGGING).
    logger = logging.getLogger("qinglong")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="qinglong")
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)


def rendered_logs(caplog: pytest.LogCaptureFixture) -> str:
    formatter = logging.Formatter("%(message)s %(args)s")
    return "\n".join(
        formatter.format(r) + " " + json.dumps(vars(r), default=str) for r in caplog.records
    )


@pytest.fixture
def history() -> dict[str, Any]:
    """A canary Task's Schedule with every outcome, and every secret that exists."""
    from leases.ack import AckPhase, lease_ack

    project = make_project()
    subscription_create(
        project=project,
        name="ops",
        url="https://hooks.example.com/qinglong",
        events=[WebhookEvent.SCHEDULE_MISSED],
    )
    task = task_create(
        project=project,
        name="secret",
        definition=canary_definition(max_concurrent_runs=1),
    )
    schedule = make_schedule(task, cron="*/5 * * * *", timezone="Asia/Shanghai", catchup_window_s=0)
    schedules_evaluate(now=at(minutes=5))  # enqueued
    run = ScheduleFire.objects.get(schedule=schedule).run
    assert run is not None
    worker, credential = make_worker()
    opened = open_session(worker)
    _, offer_id, token = claim(pending_attempt(run), opened.session)
    lease_ack(
        session=opened.session,
        offer_id=offer_id,
        phase=AckPhase.STARTING,
        lease_token=token,
        spec_sha256=_spec_digest(run),
    )
    schedules_evaluate(now=at(minutes=10))  # skipped: the Run is running
    other = make_schedule(task, name="allow", overlap_policy="allow", catchup_window_s=0)
    schedules_evaluate(now=at(minutes=11))  # blocked: the Task's one slot is taken
    schedules_evaluate(now=at(hours=2))  # 12:15-13:55 missed (a webhook), 14:00 skipped
    schedule_pause(schedule_id=schedule.pk, actor="ops", reason="maint", now=at(hours=2, seconds=1))
    schedule_resume(schedule_id=schedule.pk, actor="ops", now=at(hours=2, minutes=30, seconds=1))
    schedule_run_now(schedule_id=schedule.pk, actor="ops", now=at(hours=2, minutes=31))
    outcomes = set(ScheduleFire.objects.values_list("outcome", flat=True))
    assert {"enqueued", "skipped_overlap", "blocked", "missed", "paused"} <= outcomes
    lease = RunLease.objects.get(offer_id=offer_id)
    return {
        "schedule": schedule,
        "other": other,
        "secrets": (
            *CANARIES,
            token,
            lease.token_digest,
            opened.token,
            credential,
            Worker.objects.get(pk=worker.pk).credential_digest,
        ),
    }


def assert_clean(text: str, secrets: tuple[str, ...], *more: str) -> None:
    for secret in (*secrets, *more):
        assert secret not in text


def test_the_operator_api_shows_no_secret(
    client: Client, history: dict[str, Any], debug_logs: pytest.LogCaptureFixture
) -> None:
    op = operator_headers(perms=ALL)
    api_token = op["HTTP_AUTHORIZATION"].split()[1]
    schedule: Schedule = history["schedule"]
    path = f"{API}/schedules/{schedule.pk}"
    task = schedule.task

    def post(url: str, body: Any, headers: dict[str, Any] = op) -> bytes:
        return bytes(
            client.post(
                url, data=json.dumps(body), content_type="application/json", **headers
            ).content
        )

    def patch(url: str, body: Any) -> bytes:
        return bytes(
            client.patch(url, data=json.dumps(body), content_type="application/json", **op).content
        )

    bodies = [
        client.get(f"{API}/schedules", **op).content,
        client.get(path, **op).content,
        client.get(f"{path}/fires", **op).content,
        client.get(f"{path}/fires?at=2026-06-01T12:30:00Z", **op).content,
        *(
            client.get(f"{path}/fires?outcome={outcome}", **op).content
            for outcome in ("enqueued", "skipped_overlap", "blocked", "missed", "paused")
        ),
        post(
            f"{API}/schedules",
            {"project": task.project.slug, "task": task.name, "name": "n2", "cron": "0 3 * * *"},
        ),
        post(
            f"{API}/schedules",
            {"project": task.project.slug, "task": task.name, "name": "n3", "cron": "bad"},
        ),
        patch(path, {"priority": 3}),
        patch(path, {"timezone": "Nowhere/Else"}),
        post(f"{path}/pause", {"reason": "check", "resume_at": "2999-01-01T00:00:00Z"}),
        post(f"{path}/resume", {}),
        post(f"{path}/run", {}),
        client.get(f"{API}/schedules/999999/fires", **op).content,
        # A user without the permission: 403, in the same envelope.
        client.get(path, **operator_headers(perms=("runs.add_run",))).content,
        post(f"{path}/run", {}, operator_headers(perms=("schedules.view_schedule",))),
    ]
    text = "\n".join(body.decode() for body in bodies)
    assert "paused" in text and "missed" in text  # the surfaces were really read
    assert_clean(text, history["secrets"], api_token)
    assert_clean(rendered_logs(debug_logs), history["secrets"], api_token)


def test_the_admin_shows_no_secret(admin_client: Client, history: dict[str, Any]) -> None:
    schedule: Schedule = history["schedule"]
    fires = reverse("admin:schedules_schedulefire_changelist")
    schedules = reverse("admin:schedules_schedule_changelist")
    pages = [
        schedules,
        reverse("admin:schedules_schedule_change", args=[schedule.pk]),
        fires,
        f"{fires}?schedule__id__exact={schedule.pk}&q=2026-06-01+20:30",
        f"{fires}?q={schedule.name}",
        f"{fires}?outcome__exact=missed",
        *(
            reverse("admin:schedules_schedulefire_change", args=[pk])
            for pk in ScheduleFire.objects.values_list("pk", flat=True)
        ),
    ]
    texts = []
    for url in pages:
        response = admin_client.get(url)
        assert response.status_code == 200, url
        texts.append(response.content.decode())
    for action in ("pause_schedules", "resume_schedules", "run_now"):
        response = admin_client.post(
            schedules,
            {"action": action, "_selected_action": [schedule.pk], "reason": "leak check"},
            follow=True,
        )
        assert response.status_code == 200
        texts.append(response.content.decode())
    texts.append(json.dumps(list(LogEntry.objects.values()), default=str))
    text = "\n".join(texts)
    assert "missed" in text and "leak check" in text
    assert_clean(text, history["secrets"])


def test_commands_tasks_webhooks_and_rows_show_no_secret(
    history: dict[str, Any], debug_logs: pytest.LogCaptureFixture
) -> None:
    outputs = []
    for args in (("schedules",), ("schedules", "--json", "--recent", "50")):
        out = io.StringIO()
        call_command(*args, stdout=out)
        outputs.append(out.getvalue())
    assert "missed" in outputs[0] and json.loads(outputs[1])["schedules"]
    out = io.StringIO()
    call_command("run_dispatcher", "--max-cycles", "1", "--json", stdout=out)
    outputs.append(out.getvalue())
    outputs.append(json.dumps(evaluate_schedules_task.apply().get()))
    deliveries = list(WebhookDelivery.objects.values_list("body", flat=True))
    assert deliveries  # the missed stretch was reported
    outputs.extend(deliveries)
    outputs.append(json.dumps(list(ScheduleFire.objects.values()), default=str))
    outputs.append(json.dumps(list(Schedule.objects.values()), default=str))
    assert_clean("\n".join(outputs), history["secrets"])
    assert_clean(rendered_logs(debug_logs), history["secrets"])
