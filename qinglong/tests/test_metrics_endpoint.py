"""`/metrics`: who may scrape, what it reports (parsed by the Prometheus client), no leaks."""

from __future__ import annotations

import hashlib
import ipaddress
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import transaction
from django.test import Client, override_settings
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from dispatch.core.ports import DispatchScope
from dispatch.cycles import dispatch_cycle
from leases.models import RunLease
from qinglong.metrics import REGISTRY
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
from runs.services import run_enqueue, task_create

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "metrics-test-token-0123456789"
DIGEST = hashlib.sha256(TOKEN.encode()).hexdigest()
ALLOWED = [ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("::1/128")]


def scrape(client=None, **extra):
    return (client or Client()).get("/metrics", **extra)


def families(body: bytes) -> dict[str, list]:
    """Sample lists by family name, parsed by the Prometheus client's own parser."""
    return {family.name: family.samples for family in text_string_to_metric_families(body.decode())}


def value(parsed: dict[str, list], family: str, sample: str, **labels: str) -> float:
    for item in parsed[family]:
        if item.name == sample and all(item.labels.get(k) == v for k, v in labels.items()):
            return item.value
    return 0.0


def counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def token_scrape():
    with override_settings(QINGLONG_METRICS_TOKEN_DIGEST=DIGEST):
        yield lambda: scrape(HTTP_AUTHORIZATION=f"Bearer {TOKEN}")


# ------------------------------------------------------------------- access


def test_closed_to_everyone_without_a_token_or_an_allow_list():
    response = scrape(REMOTE_ADDR="127.0.0.1")
    assert response.status_code == 403
    assert b"qinglong_" not in response.content
    assert b"QL_METRICS_TOKEN" in response.content


@override_settings(QINGLONG_METRICS_TOKEN_DIGEST=DIGEST)
def test_the_token_opens_it_and_anything_else_is_401():
    ok = scrape(HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert ok.status_code == 200
    assert ok["Content-Type"].startswith("text/plain; version=")
    assert "no-store" in ok["Cache-Control"]
    for header in (None, f"Bearer {TOKEN}x", f"Basic {TOKEN}", "Bearer", TOKEN):
        extra = {} if header is None else {"HTTP_AUTHORIZATION": header}
        refused = scrape(**extra)
        assert refused.status_code == 401, header
        assert refused["WWW-Authenticate"] == 'Bearer realm="metrics"'
        assert b"qinglong_" not in refused.content


@override_settings(QINGLONG_METRICS_ALLOW=ALLOWED)
def test_the_allow_list_matches_the_direct_peer_only():
    assert scrape(REMOTE_ADDR="10.1.2.3").status_code == 200
    assert scrape(REMOTE_ADDR="::1").status_code == 200
    assert scrape(REMOTE_ADDR="192.168.1.5").status_code == 403
    # A proxy header names no peer: only REMOTE_ADDR counts.
    assert scrape(REMOTE_ADDR="192.168.1.5", HTTP_X_FORWARDED_FOR="10.1.2.3").status_code == 403
    # A wrong token is refused even from an allowed address.
    assert scrape(REMOTE_ADDR="10.1.2.3", HTTP_AUTHORIZATION="Bearer nope").status_code == 401


def test_only_get(token_scrape):
    with override_settings(QINGLONG_METRICS_ALLOW=ALLOWED):
        assert Client().post("/metrics", REMOTE_ADDR="10.1.2.3").status_code == 405


# ----------------------------------------------------------------- contents


def test_the_scrape_parses_and_reports_runs_and_the_queue(token_scrape):
    session = open_session(make_worker(slots=4)[0]).session
    for _ in range(3):
        make_run()
    claim(pending_attempt(make_run()), session)
    Run.objects.filter(pk=make_run().pk).update(state="succeeded", finished_at=timezone.now())
    response = token_scrape()
    assert response.status_code == 200
    parsed = families(response.content)
    assert value(parsed, "qinglong_runs", "qinglong_runs", state="queued") == 3
    assert value(parsed, "qinglong_runs", "qinglong_runs", state="dispatching") == 1
    assert value(parsed, "qinglong_runs", "qinglong_runs", state="running") == 0
    # The succeeded Run still has its pending Attempt: 3 + 1 pending.
    assert value(parsed, "qinglong_queue_depth", "qinglong_queue_depth") == 4
    assert (
        value(parsed, "qinglong_queue_oldest_age_seconds", "qinglong_queue_oldest_age_seconds") >= 0
    )
    assert (
        value(
            parsed,
            "qinglong_runs_finished_recent",
            "qinglong_runs_finished_recent",
            state="succeeded",
        )
        == 1
    )
    for family in (
        "qinglong_claims",
        "qinglong_lost_races",
        "qinglong_lease_expiries",
        "qinglong_redeliveries",
        "qinglong_cycle_truncations",
        "qinglong_cycle_duration_seconds",
        "qinglong_webhook_failures",
    ):
        assert family in parsed, family


def test_claims_by_outcome_are_counted_where_the_cycle_claims(token_scrape):
    open_session(make_worker(slots=2)[0])
    for _ in range(3):
        make_run()
    won_before = counter("qinglong_claims_total", outcome="won")
    dispatch_cycle(scope=DispatchScope.global_())
    assert counter("qinglong_claims_total", outcome="won") == won_before + 2
    parsed = families(token_scrape().content)
    assert value(parsed, "qinglong_claims", "qinglong_claims_total", outcome="won") == (
        won_before + 2
    )


def _total(parsed: dict[str, list], family: str, sample: str, **labels: str) -> float:
    """The sum of a sample over every label set matching `labels`."""
    return sum(
        item.value
        for item in parsed.get(family, [])
        if item.name == sample and all(item.labels.get(k) == v for k, v in labels.items())
    )


def test_every_counter_moves_in_the_parsed_scrape(token_scrape, monkeypatch, settings):
    """Claims, lost races, expiries, re-deliveries, truncations by reason, the cycle
    duration histogram and webhook failures: each event is read back from /metrics."""
    from dispatch.tests.test_cycle_orm import budget, pull, session_scope
    from leases import end as lease_end_module
    from leases.end import lease_expire, lease_revoke
    from leases.errors import LostRace, Outcome
    from notifications.delivery import webhooks_deliver_due
    from notifications.models import WebhookEvent
    from notifications.services import event_emit, subscription_create
    from notifications.tests.receiver import serve

    wanted = [
        ("qinglong_claims", "qinglong_claims_total", {"outcome": "won"}, 1),
        (
            "qinglong_cycle_truncations",
            "qinglong_cycle_truncations_total",
            {"reason": "claim_budget_exhausted"},
            1,
        ),
        ("qinglong_redeliveries", "qinglong_redeliveries_total", {}, 1),
        ("qinglong_cycle_duration_seconds", "qinglong_cycle_duration_seconds_count", {}, 2),
        ("qinglong_lease_expiries", "qinglong_lease_expiries_total", {}, 1),
        ("qinglong_lost_races", "qinglong_lost_races_total", {"operation": "lease_end"}, 1),
        (
            "qinglong_webhook_failures",
            "qinglong_webhook_failures_total",
            {"event": "run.failed"},
            1,
        ),
    ]
    before = families(token_scrape().content)

    session = open_session(make_worker(slots=4)[0]).session
    for _ in range(3):
        make_run()
    with budget(max_claim_attempts=1):
        dispatch_cycle(scope=DispatchScope.global_())  # one claim, then the budget
    # The Session's pull re-delivers the lease the global cycle claimed for it.
    assert dispatch_cycle(scope=session_scope(session), pull=pull()).counts.recovered == 1
    claimed = RunLease.objects.get()
    RunLease.objects.filter(pk=claimed.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert lease_expire(claimed.pk) is Outcome.APPLIED
    _, offer_id, _ = claim(pending_attempt(make_run()), session)

    def lose(*args, **kwargs):
        raise LostRace("another writer")

    with monkeypatch.context() as patch:
        patch.setattr(lease_end_module, "lease_transition", lose)
        lease = RunLease.objects.get(offer_id=offer_id)
        assert lease_revoke(lease.pk, reason="operator_revoke") is Outcome.LOST_RACE
    settings.QINGLONG_WEBHOOK_ALLOW_PRIVATE = True
    receivers = serve()
    receiver = next(receivers)
    try:
        receiver.answers = [500]
        project = make_project()
        subscription_create(project=project, name="ops", url=receiver.url, events=["run.failed"])
        with transaction.atomic():
            event_emit(
                event=WebhookEvent.RUN_FAILED, project_id=project.pk, subject_key="k", data={}
            )
        assert webhooks_deliver_due().retrying == 1
    finally:
        next(receivers, None)

    after = families(token_scrape().content)
    moved = {
        sample: _total(after, family, sample, **labels) - _total(before, family, sample, **labels)
        for family, sample, labels, _ in wanted
    }
    assert moved == {sample: n for _, sample, _, n in wanted}
    # The histogram is whole: cumulative buckets up to +Inf, which equals the count.
    buckets = [s for s in after["qinglong_cycle_duration_seconds"] if s.name.endswith("_bucket")]
    assert any(s.labels["le"] == "+Inf" for s in buckets)
    assert _total(
        after,
        "qinglong_cycle_duration_seconds",
        "qinglong_cycle_duration_seconds_bucket",
        le="+Inf",
    ) == _total(after, "qinglong_cycle_duration_seconds", "qinglong_cycle_duration_seconds_count")


# --------------------------------------------------------------------- leaks


def test_the_scrape_carries_no_spec_token_or_digest(token_scrape):
    worker, credential = make_worker(slots=4)
    opened = open_session(worker)
    task = task_create(project=make_project(), name="canary", definition=canary_definition())
    for _ in range(2):
        run_enqueue(task=task)
    dispatch_cycle(scope=DispatchScope.global_())
    body = token_scrape().content.decode()
    assert "qinglong_claims_total" in body
    secrets = [CANARY_COMMAND, CANARY_ENV, CANARY_CWD, credential, opened.token, TOKEN, DIGEST]
    secrets += list(RunLease.objects.values_list("token_digest", flat=True))
    secrets.append(worker.credential_digest)
    for secret in secrets:
        assert secret not in body
