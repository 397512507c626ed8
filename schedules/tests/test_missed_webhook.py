"""A missed stretch of fires is reported to the Project's webhooks once (schedule.missed)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import time_machine
from django.utils import timezone

from notifications.delivery import webhooks_deliver_due
from notifications.models import DeliveryState, WebhookDelivery, WebhookEvent
from notifications.services import subscription_create
from notifications.tests.receiver import serve
from qinglong.testing import CANARY_COMMAND, CANARY_ENV, canary_definition, make_project
from runs.services import task_create
from schedules.models import FireOutcome, ScheduleFire
from schedules.services import schedule_pause, schedule_resume, schedules_evaluate
from schedules.tests.helpers import T0, at, make_schedule

pytestmark = pytest.mark.django_db


def test_a_missed_stretch_is_one_signed_delivery_with_ids_and_no_secrets() -> None:
    project = make_project()
    other = make_project()
    task = task_create(project=project, name="nightly", definition=canary_definition())
    subscription, _ = subscription_create(
        project=project,
        name="ops",
        url="https://hooks.example.com/qinglong",
        events=[WebhookEvent.SCHEDULE_MISSED],
    )
    # Another Project's subscriber and a subscriber to other events hear nothing.
    subscription_create(
        project=other,
        name="ops",
        url="https://hooks.example.com/other",
        events=[WebhookEvent.SCHEDULE_MISSED],
    )
    subscription_create(
        project=project,
        name="runs",
        url="https://hooks.example.com/runs",
        events=[WebhookEvent.RUN_FAILED],
    )
    with time_machine.travel(T0, tick=False) as clock:
        schedule = make_schedule(
            task, cron="*/5 * * * *", catchup_window_s=900, overlap_policy="allow", now=T0
        )
        # The control plane is down for two hours.
        clock.shift(timedelta(hours=2))
        schedules_evaluate(now=timezone.now())
        # Evaluating again records and reports nothing more.
        schedules_evaluate(now=timezone.now())

    missed = ScheduleFire.objects.get(schedule=schedule, outcome=FireOutcome.MISSED)
    deliveries = list(WebhookDelivery.objects.all())
    assert [(d.subscription_id, d.event) for d in deliveries] == [
        (subscription.pk, WebhookEvent.SCHEDULE_MISSED)
    ]
    body = json.loads(deliveries[0].body)
    assert body["event"] == "schedule.missed"
    assert body["schedule"]["id"] == str(schedule.pk)
    assert body["schedule"]["ledger_id"] == str(missed.pk)
    assert body["schedule"]["missed"] == missed.fire_count == 20
    assert body["schedule"]["first_missed_at"] == at(minutes=5).isoformat()
    assert body["schedule"]["admin_url"].endswith(
        f"/admin/schedules/schedule/{schedule.pk}/change/"
    )
    assert CANARY_COMMAND not in deliveries[0].body
    assert CANARY_ENV not in deliveries[0].body


def test_a_paused_stretch_is_not_reported_as_missed() -> None:
    project = make_project()
    task = task_create(project=project, name="t", definition=canary_definition())
    subscription_create(
        project=project,
        name="ops",
        url="https://hooks.example.com/qinglong",
        events=[WebhookEvent.SCHEDULE_MISSED],
    )
    with time_machine.travel(T0, tick=False) as clock:
        schedule = make_schedule(task, cron="* * * * *", overlap_policy="allow", now=T0)
        schedule_pause(schedule_id=schedule.pk, actor="ops", reason="maintenance", now=T0)
        clock.shift(timedelta(minutes=10))
        schedule_resume(schedule_id=schedule.pk, actor="ops", now=timezone.now())
        schedules_evaluate(now=timezone.now())
    assert ScheduleFire.objects.filter(schedule=schedule, outcome=FireOutcome.PAUSED).exists()
    assert not WebhookDelivery.objects.exists()


def test_a_receiver_verifies_the_signature_of_exactly_one_delivery_per_missed_stretch(
    settings,
) -> None:
    settings.QINGLONG_WEBHOOK_ALLOW_PRIVATE = True
    receivers = serve()
    receiver = next(receivers)
    try:
        project = make_project()
        task = task_create(project=project, name="nightly", definition=canary_definition())
        _, receiver.secret = subscription_create(
            project=project, name="ops", url=receiver.url, events=[WebhookEvent.SCHEDULE_MISSED]
        )
        with time_machine.travel(T0, tick=False) as clock:
            schedule = make_schedule(
                task, cron="*/5 * * * *", catchup_window_s=900, overlap_policy="allow", now=T0
            )
            clock.shift(timedelta(hours=2))  # down for two hours: one missed stretch
            schedules_evaluate(now=timezone.now())
            clock.shift(timedelta(minutes=1))
            schedules_evaluate(now=timezone.now())  # nothing new is missed
        # Sent at the real time (the signature's timestamp is checked against it).
        while webhooks_deliver_due().examined:
            pass
        assert webhooks_deliver_due().examined == 0
    finally:
        next(receivers, None)
    assert receiver.events() == ["schedule.missed"]
    [got] = receiver.received
    assert got.signature_ok
    assert got.headers["X-Qinglong-Event"] == "schedule.missed"
    assert got.json["schedule"]["id"] == str(schedule.pk)
    assert WebhookDelivery.objects.get().state == DeliveryState.SUCCEEDED
    assert CANARY_COMMAND.encode() not in got.body and CANARY_ENV.encode() not in got.body
