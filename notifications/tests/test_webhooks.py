"""Webhooks end to end (README "Webhooks"): a real receiver on loopback verifies every
signature and gets exactly one delivery per state change; retries back off; the
SSRF rules hold; payloads carry ids, states and admin URLs, never a secret.
"""

from __future__ import annotations

import json
import random
import socket
from datetime import timedelta
from typing import Any

import pytest
from django.db import transaction
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from dispatch.sweeps import sweep_stale_sessions, sweep_timed_out_attempts
from leases.end import run_cancel
from notifications import delivery as delivery_module
from notifications.delivery import (
    RETRY_BASE_S,
    RETRY_CAP_S,
    retry_delay_s,
    webhook_deliveries_prune,
    webhooks_deliver_due,
)
from notifications.models import DeliveryState, WebhookDelivery, WebhookEvent, WebhookSubscription
from notifications.services import (
    WebhookInputError,
    event_emit,
    subscription_create,
    subscription_rotate_secret,
    webhook_url_problem,
)
from notifications.signing import new_secret_nonce
from notifications.tests.receiver import Receiver, serve
from qinglong.testing import (
    CANARY_COMMAND,
    CANARY_CWD,
    CANARY_ENV,
    canary_definition,
    make_project,
    make_worker,
    open_session,
)
from runs.models import Attempt, Project
from runs.services import run_enqueue, task_create
from workers.models import WorkerSession
from workers.tests.api_helpers import WorkerClient

pytestmark = pytest.mark.django_db

ALL_RUN_EVENTS = ["run.failed", "run.succeeded", "run.timed_out"]


@pytest.fixture(autouse=True)
def _loopback_allowed(settings):
    settings.QINGLONG_WEBHOOK_ALLOW_PRIVATE = True


@pytest.fixture
def receiver():
    yield from serve()


def subscribe(receiver: Receiver, project: Project, events: list[str], name: str = "ops"):
    subscription, secret = subscription_create(
        project=project, name=name, url=receiver.url, events=events
    )
    receiver.secret = secret
    return subscription


def run_to_the_end(
    client: Client, project: Project, phase: str, *, max_attempts: int = 1, **extra: Any
) -> tuple[Any, list[str]]:
    """Enqueue a canary Run and take each of its Attempts through the real Worker API."""
    task = task_create(
        project=project,
        name=f"t{random.randrange(10**9)}",
        definition=canary_definition(max_attempts=max_attempts),
    )
    run = run_enqueue(task=task)
    worker, _ = make_worker(slots=1)
    wc = WorkerClient.open(client, worker=worker)
    tokens = []
    for _ in range(max_attempts):
        response, _, token = wc.pull()
        offers = response.json()["offers"]
        if not offers:
            break
        [offer] = offers
        tokens.append(token)
        assert wc.ack(offer, "starting", token).status_code == 200
        assert wc.ack(offer, "running", token, executor_handle="pid:7").status_code == 200
        assert wc.ack(offer, phase, token, **extra).status_code == 200
    run.refresh_from_db()
    return run, tokens


def deliver_all() -> None:
    while webhooks_deliver_due().examined:
        pass


def test_a_failed_run_is_delivered_once_signed_with_ids_states_and_admin_urls(client, receiver):
    project = make_project("web")
    subscription = subscribe(receiver, project, ["run.failed"])
    run, _ = run_to_the_end(client, project, "failed", exit_code=3, error_code="exit_nonzero")
    assert run.state == "failed"

    deliver_all()
    deliver_all()  # nothing is sent twice
    assert len(receiver.received) == 1
    [got] = receiver.received
    assert got.signature_ok
    assert got.path == "/hooks/qinglong"
    assert got.headers["X-Qinglong-Event"] == "run.failed"
    assert got.headers["Content-Type"] == "application/json"
    body = got.json
    delivery = WebhookDelivery.objects.get()
    assert got.headers["X-Qinglong-Delivery"] == str(delivery.delivery_id) == body["id"]
    assert body["event"] == "run.failed"
    assert body["project"] == {"id": str(project.pk), "slug": "web"}
    assert body["subscription"] == {"id": str(subscription.pk), "name": "ops"}
    assert body["run"]["id"] == str(run.pk)
    assert body["run"]["state"] == "failed"
    assert body["run"]["admin_url"] == f"/admin/runs/run/{run.pk}/change/"
    attempt = body["run"]["attempt"]
    assert (attempt["number"], attempt["state"], attempt["exit_code"]) == (1, "failed", 3)
    assert attempt["error_code"] == "exit_nonzero"
    assert (delivery.state, delivery.attempts, delivery.last_status_code) == (
        DeliveryState.SUCCEEDED,
        1,
        200,
    )


def test_each_subscription_gets_only_its_events_and_its_projects(client, receiver, settings):
    settings.QINGLONG_PUBLIC_URL = "https://ql.example.com"
    project = make_project("web")
    subscribe(receiver, project, ["run.succeeded"], name="good-news")
    WebhookSubscription.objects.create(
        project=project,
        name="failures",
        url=receiver.url,
        events=["run.failed"],
        secret_nonce=new_secret_nonce(),
    )
    WebhookSubscription.objects.create(
        project=make_project("elsewhere"),
        name="other",
        url=receiver.url,
        events=ALL_RUN_EVENTS,
        secret_nonce=new_secret_nonce(),
    )
    WebhookSubscription.objects.create(
        project=project,
        name="paused",
        url=receiver.url,
        events=ALL_RUN_EVENTS,
        active=False,
        secret_nonce=new_secret_nonce(),
    )
    run, _ = run_to_the_end(client, project, "succeeded", exit_code=0)
    deliver_all()
    deliver_all()  # nothing is sent twice
    assert receiver.events() == ["run.succeeded"]
    assert receiver.received[0].signature_ok
    body = receiver.received[0].json
    assert (body["run"]["id"], body["run"]["state"]) == (str(run.pk), "succeeded")
    assert body["subscription"]["name"] == "good-news"
    assert body["run"]["admin_url"] == f"https://ql.example.com/admin/runs/run/{run.pk}/change/"


def test_a_run_whose_last_attempt_timed_out_is_run_timed_out(client, receiver):
    project = make_project()
    subscribe(receiver, project, ALL_RUN_EVENTS)
    run_to_the_end(client, project, "failed", exit_code=-15, error_code="timeout")
    deliver_all()
    deliver_all()
    assert receiver.events() == ["run.timed_out"]
    assert receiver.received[0].signature_ok
    assert receiver.received[0].json["run"]["attempt"]["error_code"] == "timeout"


def test_a_retried_attempt_is_no_state_change_of_the_run(client, receiver):
    project = make_project()
    subscribe(receiver, project, ALL_RUN_EVENTS)
    run, tokens = run_to_the_end(client, project, "failed", max_attempts=2, exit_code=1)
    assert (len(tokens), run.state) == (2, "failed")
    deliver_all()
    assert receiver.events() == ["run.failed"]
    assert receiver.received[0].json["run"]["attempt"]["number"] == 2


def test_a_cancelled_run_sends_nothing(client, receiver):
    project = make_project()
    subscribe(receiver, project, ALL_RUN_EVENTS)
    task = task_create(project=project, name="t", definition=canary_definition())
    run = run_enqueue(task=task)
    run_cancel(run=run, actor="test")
    deliver_all()
    assert receiver.received == []
    assert not WebhookDelivery.objects.exists()


def test_a_stale_worker_going_offline_is_reported_once_to_every_project(receiver):
    subscribe(receiver, make_project("a"), ["worker.offline"])
    worker, _ = make_worker("edge-7")
    session = open_session(worker).session
    WorkerSession.objects.filter(pk=session.pk).update(
        heartbeat_at=timezone.now() - timedelta(hours=1)
    )
    assert sweep_stale_sessions().applied == 1
    assert sweep_stale_sessions().applied == 0
    deliver_all()
    deliver_all()
    assert receiver.events() == ["worker.offline"]
    assert receiver.received[0].signature_ok
    body = receiver.received[0].json
    assert body["worker"] == {
        "id": str(worker.pk),
        "name": "edge-7",
        "admin_url": f"/admin/workers/worker/{worker.pk}/change/",
    }
    assert body["session"] == {"id": str(session.session_id), "generation": 1, "state": "offline"}


def _silent(session: WorkerSession) -> None:
    WorkerSession.objects.filter(pk=session.pk).update(
        heartbeat_at=timezone.now() - timedelta(hours=1)
    )


def test_each_time_a_worker_goes_offline_is_one_delivery_and_a_restart_is_none(receiver):
    subscribe(receiver, make_project("a"), ["worker.offline"])
    worker, _ = make_worker("edge-8")
    open_session(worker)
    # The agent restarts: its first Session is replaced, which is no offline.
    second = open_session(worker).session
    _silent(second)
    assert sweep_stale_sessions().applied == 1
    # It comes back and goes silent again: a second change, a second delivery.
    third = open_session(worker).session
    _silent(third)
    assert sweep_stale_sessions().applied == 1
    assert sweep_stale_sessions().applied == 0
    deliver_all()
    deliver_all()
    assert receiver.events() == ["worker.offline", "worker.offline"]
    assert all(r.signature_ok for r in receiver.received)
    assert sorted(r.json["session"]["generation"] for r in receiver.received) == [2, 3]
    assert len({r.headers["X-Qinglong-Delivery"] for r in receiver.received}) == 2


def test_a_run_the_control_plane_timed_out_is_one_run_timed_out(client, receiver):
    """The timeout sweep (issue 13) ends the Run with no Worker ACK: one signed delivery."""
    project = make_project()
    subscribe(receiver, project, ALL_RUN_EVENTS)
    task = task_create(
        project=project, name="slow", definition=canary_definition(max_attempts=1, timeout_s=5)
    )
    run = run_enqueue(task=task)
    worker, _ = make_worker(slots=1)
    wc = WorkerClient.open(client, worker=worker)
    response, _, token = wc.pull()
    [offer] = response.json()["offers"]
    assert wc.ack(offer, "starting", token).status_code == 200
    assert wc.ack(offer, "running", token, executor_handle="pid:7").status_code == 200
    # Past its deadline and the margin: the sweep ends it, agent or no agent.
    Attempt.objects.filter(run=run).update(deadline_at=timezone.now() - timedelta(hours=1))
    assert sweep_timed_out_attempts().applied == 1
    assert sweep_timed_out_attempts().applied == 0
    # The Worker's late terminal ACK changes nothing more (a repeat of the
    # phase the Attempt is in is a no-op): still one state change.
    wc.ack(offer, "failed", token, exit_code=-15)
    run.refresh_from_db()
    assert run.state == "failed"
    assert Attempt.objects.get(run=run).error_code == "timed_out"
    deliver_all()
    deliver_all()
    assert receiver.events() == ["run.timed_out"]
    [got] = receiver.received
    assert got.signature_ok
    assert got.json["run"]["id"] == str(run.pk)
    assert got.json["run"]["attempt"]["error_code"] == "timed_out"


def test_deliveries_are_written_in_the_transaction_of_the_change(receiver):
    project = make_project()
    subscribe(receiver, project, ["schedule.missed"])
    with pytest.raises(RuntimeError), transaction.atomic():
        event_emit(
            event=WebhookEvent.SCHEDULE_MISSED,
            project_id=project.pk,
            subject_key="schedule:1:2026-11-30T10:00:00Z",
            data={"schedule": {"id": "1"}},
        )
        raise RuntimeError("the state change rolled back")
    assert not WebhookDelivery.objects.exists()


def test_the_same_change_reported_twice_is_delivered_once(receiver):
    project = make_project()
    subscribe(receiver, project, ["schedule.missed"])
    for _ in range(2):
        with transaction.atomic():
            event_emit(
                event=WebhookEvent.SCHEDULE_MISSED,
                project_id=project.pk,
                subject_key="schedule:1:2026-11-30T10:00:00Z",
                data={"schedule": {"id": "1", "missed_at": "2026-11-30T10:00:00Z"}},
            )
    deliver_all()
    assert receiver.events() == ["schedule.missed"]
    assert receiver.received[0].json["schedule"]["missed_at"] == "2026-11-30T10:00:00Z"


# ----------------------------------------------------------------- retries


def _make_due() -> None:
    WebhookDelivery.objects.update(next_attempt_at=timezone.now() - timedelta(seconds=1))


def test_a_failed_try_is_retried_after_a_backoff_with_the_same_body(receiver):
    project = make_project()
    subscribe(receiver, project, ["schedule.missed"])
    receiver.answers = [500, 503]
    with transaction.atomic():
        event_emit(
            event=WebhookEvent.SCHEDULE_MISSED, project_id=project.pk, subject_key="k", data={}
        )
    before = timezone.now()
    assert webhooks_deliver_due().retrying == 1
    delivery = WebhookDelivery.objects.get()
    assert (delivery.state, delivery.attempts, delivery.last_status_code) == ("pending", 1, 500)
    assert delivery.last_error == "http_500"
    wait = (delivery.next_attempt_at - before).total_seconds()
    assert RETRY_BASE_S / 2 - 1 <= wait <= RETRY_BASE_S + 1
    assert webhooks_deliver_due().examined == 0  # not due yet
    _make_due()
    webhooks_deliver_due()
    _make_due()
    counts = webhooks_deliver_due()
    assert counts.succeeded == 1
    delivery.refresh_from_db()
    assert (delivery.state, delivery.attempts, delivery.last_status_code) == ("succeeded", 3, 200)
    assert len({r.body for r in receiver.received}) == 1
    assert len({r.headers["X-Qinglong-Delivery"] for r in receiver.received}) == 1
    assert all(r.signature_ok for r in receiver.received)


def test_out_of_attempts_is_failed_for_good(receiver, settings):
    settings.QINGLONG_WEBHOOK_MAX_ATTEMPTS = 2
    project = make_project()
    subscribe(receiver, project, ["schedule.missed"])
    receiver.answers = [500, 500, 500]
    with transaction.atomic():
        event_emit(
            event=WebhookEvent.SCHEDULE_MISSED, project_id=project.pk, subject_key="k", data={}
        )
    webhooks_deliver_due()
    _make_due()
    assert webhooks_deliver_due().failed == 1
    _make_due()
    assert webhooks_deliver_due().examined == 0
    assert len(receiver.received) == 2
    assert WebhookDelivery.objects.get().state == DeliveryState.FAILED


def test_a_dead_receiver_is_retried(settings):
    project = make_project()
    # A port nothing listens on (bound, then closed).
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    subscription_create(
        project=project, name="down", url=f"http://127.0.0.1:{port}/x", events=["run.failed"]
    )
    with transaction.atomic():
        event_emit(event=WebhookEvent.RUN_FAILED, project_id=project.pk, subject_key="k", data={})
    assert webhooks_deliver_due().retrying == 1
    delivery = WebhookDelivery.objects.get()
    assert (delivery.last_status_code, delivery.last_error) == (None, "connection_refused")


def test_the_backoff_doubles_up_to_its_cap_with_jitter():
    rng = random.Random(7)
    for attempt in range(1, 12):
        ceiling = min(RETRY_CAP_S, RETRY_BASE_S * 2 ** (attempt - 1))
        for _ in range(20):
            assert ceiling / 2 <= retry_delay_s(attempt, rng=rng) <= ceiling
    assert len({round(retry_delay_s(3, rng=rng), 3) for _ in range(10)}) > 1


def test_old_finished_deliveries_are_pruned_pending_ones_kept(receiver):
    project = make_project()
    subscribe(receiver, project, ["schedule.missed"])
    for key in ("a", "b"):
        with transaction.atomic():
            event_emit(
                event=WebhookEvent.SCHEDULE_MISSED, project_id=project.pk, subject_key=key, data={}
            )
    WebhookDelivery.objects.filter(subject_key="a").update(state=DeliveryState.SUCCEEDED)
    WebhookDelivery.objects.update(created_at=timezone.now() - timedelta(days=30))
    assert webhook_deliveries_prune() == 1
    assert list(WebhookDelivery.objects.values_list("subject_key", flat=True)) == ["b"]


# -------------------------------------------------------------- SSRF rules


@pytest.mark.parametrize(
    ("url", "allow_private", "refused"),
    [
        ("https://hooks.example.com/qinglong", False, False),
        ("https://hooks.example.com:8443/q?x=1", False, False),
        ("http://hooks.example.com/qinglong", False, True),
        ("http://127.0.0.1:8080/x", False, True),
        ("http://127.0.0.1:8080/x", True, False),
        ("http://localhost/x", True, False),
        ("https://localhost/x", False, True),
        ("http://10.0.0.5/x", True, True),  # http:// only to loopback
        ("https://10.0.0.5/x", False, True),
        ("https://10.0.0.5/x", True, False),
        ("https://169.254.169.254/latest/meta-data", False, True),
        ("https://[::1]/x", False, True),
        ("https://[::ffff:10.0.0.1]/x", False, True),
        ("https://0.0.0.0/x", True, True),
        ("https://user:pw@hooks.example.com/x", False, True),
        ("ftp://hooks.example.com/x", False, True),
        ("https:///x", False, True),
        ("https://hooks.example.com/x#frag", False, True),
        ("https://hooks.example.com:0/x", False, True),
    ],
)
def test_destination_rules(settings, url, allow_private, refused):
    settings.QINGLONG_WEBHOOK_ALLOW_PRIVATE = allow_private
    assert (webhook_url_problem(url) is not None) is refused


def test_subscriptions_refuse_bad_urls_and_events(settings):
    settings.QINGLONG_WEBHOOK_ALLOW_PRIVATE = False
    project = make_project()
    for url, events in [
        ("http://127.0.0.1/x", ["run.failed"]),
        ("https://hooks.example.com/x", []),
        ("https://hooks.example.com/x", ["run.exploded"]),
        ("https://hooks.example.com/x", ["webhook.test"]),
        ("https://hooks.example.com/x", ["run.failed", "run.failed"]),
    ]:
        with pytest.raises(WebhookInputError):
            subscription_create(project=project, name="x", url=url, events=events)
    assert not WebhookSubscription.objects.exists()


def test_a_name_resolving_to_a_private_address_is_refused_at_send_time(
    receiver, settings, monkeypatch
):
    project = make_project()
    subscription_create(
        project=project, name="x", url="https://hooks.example.com/x", events=["run.failed"]
    )
    settings.QINGLONG_WEBHOOK_ALLOW_PRIVATE = False

    def rebound(host, port, *args, **kwargs):
        # DNS now points the public name inward (one public, one private record).
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", port)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.5", port)),
        ]

    monkeypatch.setattr(delivery_module.socket, "getaddrinfo", rebound)
    with transaction.atomic():
        event_emit(event=WebhookEvent.RUN_FAILED, project_id=project.pk, subject_key="k", data={})
    assert webhooks_deliver_due().failed == 1
    delivery = WebhookDelivery.objects.get()
    assert (delivery.state, delivery.last_error) == ("failed", "destination_refused")


def test_a_refused_loopback_destination_fails_without_a_request(receiver, settings):
    project = make_project()
    subscribe(receiver, project, ["run.failed"])
    settings.QINGLONG_WEBHOOK_ALLOW_PRIVATE = False
    with transaction.atomic():
        event_emit(event=WebhookEvent.RUN_FAILED, project_id=project.pk, subject_key="k", data={})
    assert webhooks_deliver_due().failed == 1
    assert receiver.received == []


def test_a_rotated_secret_signs_from_then_on(receiver):
    project = make_project()
    subscription = subscribe(receiver, project, ["schedule.missed"])
    old = receiver.secret
    receiver.secret = subscription_rotate_secret(subscription=subscription)
    assert receiver.secret != old
    with transaction.atomic():
        event_emit(
            event=WebhookEvent.SCHEDULE_MISSED, project_id=project.pk, subject_key="k", data={}
        )
    deliver_all()
    assert [r.signature_ok for r in receiver.received] == [True]


# ------------------------------------------------------------------- leaks


def test_payloads_logs_rows_and_admin_pages_carry_no_command_env_cwd_token_or_secret(
    client, admin_client, receiver, caplog
):
    caplog.set_level("DEBUG")
    project = make_project()
    subscription = subscribe(receiver, project, ALL_RUN_EVENTS)
    _, tokens = run_to_the_end(
        client, project, "failed", exit_code=1, output_tail=f"oops {CANARY_ENV}"
    )
    deliver_all()
    stored = json.dumps(list(WebhookDelivery.objects.values()), default=str)
    sent = b"".join(r.body + json.dumps(r.headers).encode() for r in receiver.received).decode()
    logs = "\n".join(json.dumps(r.__dict__, default=repr) for r in caplog.records)
    # The delivery log and the subscription in the admin (list and detail pages).
    delivery = WebhookDelivery.objects.get()
    pages = ""
    for url in (
        reverse("admin:notifications_webhookdelivery_changelist"),
        reverse("admin:notifications_webhookdelivery_change", args=[delivery.pk]),
        reverse("admin:notifications_webhooksubscription_changelist"),
        reverse("admin:notifications_webhooksubscription_change", args=[subscription.pk]),
    ):
        response = admin_client.get(url)
        assert response.status_code == 200, url
        pages += response.content.decode()
    assert str(delivery.delivery_id) in pages  # the log really was rendered
    secrets = [CANARY_COMMAND, CANARY_ENV, CANARY_CWD.rsplit("/", 1)[-1], receiver.secret, *tokens]
    for haystack in (stored, sent, logs, pages):
        for secret in secrets:
            assert secret not in haystack
    assert receiver.events() == ["run.failed"]
