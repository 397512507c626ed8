"""Two senders at once (duplicate beats, the embedded loop beside Celery) send each try once."""

from __future__ import annotations

import pytest
from django.db import transaction

from leases.tests.racing import race
from notifications.delivery import webhooks_deliver_due
from notifications.models import DeliveryState, WebhookDelivery, WebhookEvent
from notifications.services import event_emit, subscription_create
from notifications.tests.receiver import serve
from qinglong.testing import make_project

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def receiver(settings):
    settings.QINGLONG_WEBHOOK_ALLOW_PRIVATE = True
    yield from serve()


def test_racing_senders_deliver_each_due_delivery_exactly_once(receiver) -> None:
    project = make_project()
    _, receiver.secret = subscription_create(
        project=project, name="ops", url=receiver.url, events=["schedule.missed"]
    )
    with transaction.atomic():
        for key in range(6):
            event_emit(
                event=WebhookEvent.SCHEDULE_MISSED,
                project_id=project.pk,
                subject_key=f"schedule:1:{key}",
                data={},
            )
    results = race(webhooks_deliver_due, webhooks_deliver_due, webhooks_deliver_due)
    assert all(not isinstance(r, Exception) for r in results), results
    assert sum(r.succeeded for r in results) == 6
    assert sum(r.lost_race for r in results) == sum(r.examined for r in results) - 6
    assert len(receiver.received) == 6
    assert len({r.headers["X-Qinglong-Delivery"] for r in receiver.received}) == 6
    assert all(r.signature_ok for r in receiver.received)
    assert set(WebhookDelivery.objects.values_list("state", "attempts")) == {
        (DeliveryState.SUCCEEDED, 1)
    }
