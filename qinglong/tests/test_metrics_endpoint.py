"""`/metrics`: who may scrape, what it reports (parsed by the Prometheus client), no leaks."""

from __future__ import annotations

import hashlib
import ipaddress
from pathlib import Path

import pytest
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
