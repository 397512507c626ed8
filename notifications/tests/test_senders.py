"""Who sends: the embedded default's run_dispatcher (a thread of its own) and Celery beat."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.db import transaction

from notifications.delivery import WebhookSender
from notifications.models import DeliveryState, WebhookDelivery, WebhookEvent
from notifications.services import event_emit, subscription_create
from notifications.tasks import deliver_webhooks_task, prune_webhook_deliveries_task
from notifications.tests.receiver import serve
from qinglong.celery import app
from qinglong.testing import make_project

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def receiver(settings):
    settings.QINGLONG_WEBHOOK_ALLOW_PRIVATE = True
    yield from serve()


def _pending(receiver) -> None:
    project = make_project()
    _, receiver.secret = subscription_create(
        project=project, name="ops", url=receiver.url, events=["schedule.missed"]
    )
    with transaction.atomic():
        event_emit(
            event=WebhookEvent.SCHEDULE_MISSED, project_id=project.pk, subject_key="k", data={}
        )


def test_the_sender_starts_a_thread_only_when_something_is_due(receiver):
    sender = WebhookSender()
    assert sender.kick() is False  # nothing due: no thread at all
    _pending(receiver)
    assert sender.kick() is True
    assert sender.kick() is False  # one thread at a time
    sender.stop(timeout_s=10)
    assert receiver.events() == ["schedule.missed"]
    assert receiver.received[0].signature_ok
    assert WebhookDelivery.objects.get().state == DeliveryState.SUCCEEDED


def test_run_dispatcher_delivers_beside_its_cycles(receiver):
    _pending(receiver)
    call_command("run_dispatcher", "--max-cycles", "30", "--interval", "0.05", "--json")
    assert receiver.events() == ["schedule.missed"]
    assert WebhookDelivery.objects.get().state == DeliveryState.SUCCEEDED


def test_the_celery_tasks_return_counts_only_and_beat_runs_them(receiver):
    _pending(receiver)
    result = deliver_webhooks_task()
    assert result["succeeded"] == 1
    assert set(result) == {"examined", "succeeded", "retrying", "failed", "lost_race", "truncated"}
    assert prune_webhook_deliveries_task() == {"deleted": 0}
    scheduled = {entry["task"] for entry in app.conf.beat_schedule.values()}
    assert {
        "notifications.tasks.deliver_webhooks_task",
        "notifications.tasks.prune_webhook_deliveries_task",
    } <= scheduled
