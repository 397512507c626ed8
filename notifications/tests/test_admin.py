"""Webhooks in the admin: the secret shown once, send test, the delivery log, what a viewer sees."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse

from notifications.models import DeliveryState, WebhookDelivery, WebhookSubscription
from notifications.signing import subscription_secret
from notifications.tests.receiver import serve
from qinglong.testing import make_project

pytestmark = pytest.mark.django_db

SECRET_RE = re.compile(r"whsec_[A-Za-z0-9_-]{43}")


@pytest.fixture
def receiver(settings):
    settings.QINGLONG_WEBHOOK_ALLOW_PRIVATE = True
    yield from serve()


def _add(admin_client: Client, url: str, project_pk: int):
    return admin_client.post(
        reverse("admin:notifications_webhooksubscription_add"),
        {
            "project": project_pk,
            "name": "ops",
            "url": url,
            "events": ["run.failed", "worker.offline"],
            "active": "on",
        },
        follow=True,
    )


def test_adding_a_subscription_shows_its_secret_once_and_never_again(admin_client, receiver):
    project = make_project()
    response = _add(admin_client, receiver.url, project.pk)
    assert response.status_code == 200
    subscription = WebhookSubscription.objects.get()
    assert subscription.events == ["run.failed", "worker.offline"]
    expected = subscription_secret(subscription_id=subscription.pk, nonce=subscription.secret_nonce)
    assert SECRET_RE.findall(response.content.decode()) == [expected]
    # Not stored, not on any later page.
    assert expected not in str(list(WebhookSubscription.objects.values()))
    for url in (
        reverse("admin:notifications_webhooksubscription_change", args=[subscription.pk]),
        reverse("admin:notifications_webhooksubscription_changelist"),
    ):
        page = admin_client.get(url).content.decode()
        assert not SECRET_RE.search(page), url


def test_the_form_refuses_what_the_service_refuses(admin_client, settings):
    settings.QINGLONG_WEBHOOK_ALLOW_PRIVATE = False
    project = make_project()
    response = _add(admin_client, "http://127.0.0.1:9/x", project.pk)
    assert "must be an https:// URL" in response.content.decode()
    assert not WebhookSubscription.objects.exists()


def test_send_test_delivers_at_once_and_shows_in_the_delivery_log(admin_client, receiver):
    project = make_project()
    _add(admin_client, receiver.url, project.pk)
    subscription = WebhookSubscription.objects.get()
    receiver.secret = subscription_secret(
        subscription_id=subscription.pk, nonce=subscription.secret_nonce
    )
    response = admin_client.post(
        reverse("admin:notifications_webhooksubscription_changelist"),
        {"action": "send_test", "_selected_action": [subscription.pk], "reason": "check"},
        follow=True,
    )
    assert "answered 200" in response.content.decode()
    assert receiver.events() == ["webhook.test"]
    assert receiver.received[0].signature_ok
    delivery = WebhookDelivery.objects.get()
    assert (delivery.state, delivery.last_status_code) == (DeliveryState.SUCCEEDED, 200)
    log = admin_client.get(reverse("admin:notifications_webhookdelivery_changelist"))
    assert str(delivery.pk) in log.content.decode()
    detail = admin_client.get(
        reverse("admin:notifications_webhookdelivery_change", args=[delivery.pk])
    ).content.decode()
    assert "webhook.test" in detail and str(delivery.delivery_id) in detail
    assert receiver.secret not in detail


def test_rotating_the_secret_shows_the_new_one_once(admin_client, receiver):
    project = make_project()
    _add(admin_client, receiver.url, project.pk)
    subscription = WebhookSubscription.objects.get()
    old = subscription_secret(subscription_id=subscription.pk, nonce=subscription.secret_nonce)
    response = admin_client.post(
        reverse("admin:notifications_webhooksubscription_changelist"),
        {"action": "rotate_secret", "_selected_action": [subscription.pk], "reason": "leaked"},
        follow=True,
    )
    subscription.refresh_from_db()
    new = subscription_secret(subscription_id=subscription.pk, nonce=subscription.secret_nonce)
    assert new != old
    assert SECRET_RE.findall(response.content.decode()) == [new]


def test_a_viewer_sees_the_destination_host_not_the_full_url(client, receiver):
    project = make_project()
    subscription = WebhookSubscription.objects.create(
        project=project,
        name="chat",
        url="https://chat.example.com/hooks/T0KEN-IN-THE-PATH",
        events=["run.failed"],
        secret_nonce="n" * 32,
    )
    viewer = User.objects.create_user("viewer", is_staff=True)
    viewer.user_permissions.set(Permission.objects.filter(codename__startswith="view_"))
    client.force_login(viewer)
    for url in (
        reverse("admin:notifications_webhooksubscription_changelist"),
        reverse("admin:notifications_webhooksubscription_change", args=[subscription.pk]),
    ):
        page = client.get(url).content.decode()
        assert "https://chat.example.com" in page
        assert "T0KEN-IN-THE-PATH" not in page
