"""Heartbeats are throttled per Session (issue 8 item 6).

Before the fix every heartbeat was a write transaction: one Worker made 6,109
writes in 25 s and slowed every other Worker's heartbeats tenfold. Now a
Session's heartbeat records (heartbeat_at, state, lease renewals) at most once
per QL_HEARTBEAT_MIN_INTERVAL_S; sooner ones are answered from the current
state with no write, and requests past QL_THROTTLE_WORKER_HEARTBEAT are 429.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext
from rest_framework.settings import api_settings

from leases.models import RunLease
from qinglong.testing import claim, make_run, open_session, pending_attempt
from runs.models import Attempt
from workers.models import SessionState, WorkerSession
from workers.services import session_heartbeat
from workers.tests.api_helpers import (
    API,
    PHASE_EXTRA,
    WorkerClient,
    error_code,
    operator_headers,
    post_json,
)

pytestmark = pytest.mark.django_db


def _writes(queries: CaptureQueriesContext) -> list[str]:
    return [
        q["sql"]
        for q in queries.captured_queries
        if q["sql"].lstrip().upper().startswith(("UPDATE", "INSERT", "DELETE"))
    ]


def _age(session: WorkerSession, seconds: int) -> None:
    """Make the Session's last recorded heartbeat `seconds` old."""
    WorkerSession.objects.filter(pk=session.pk).update(
        heartbeat_at=session.heartbeat_at - timedelta(seconds=seconds)
    )


def _fresh(session: WorkerSession) -> WorkerSession:
    # What authentication hands the view: the row as it is now.
    return WorkerSession.objects.select_related("worker").get(pk=session.pk)


@override_settings(QINGLONG_HEARTBEAT_MIN_INTERVAL_S=5)
def test_a_heartbeat_loop_writes_once_per_min_interval_over_http(client: Client) -> None:
    worker = WorkerClient.open(client)
    session = WorkerSession.objects.get(worker=worker.worker)
    _age(session, 6)
    with CaptureQueriesContext(connection) as queries:
        for _ in range(40):
            response = worker.heartbeat()
            assert response.status_code == 200
            assert response.json()["session_state"] == "online"
    # The first beat is due and recorded; the 39 after it inside the interval write nothing.
    writes = _writes(queries)
    assert len(writes) == 1, writes
    assert "workers_workersession" in writes[0]
    after = WorkerSession.objects.get(pk=session.pk)
    assert after.heartbeat_at > session.heartbeat_at - timedelta(seconds=6)


@override_settings(QINGLONG_HEARTBEAT_MIN_INTERVAL_S=5)
def test_a_beat_inside_the_interval_still_answers_the_cancel_verdicts(client: Client) -> None:
    run = make_run()
    worker = WorkerClient.open(client)
    response, _, token = worker.pull()
    [offer] = response.json()["offers"]
    for phase in ("starting", "running"):
        assert worker.ack(offer, phase, token, **PHASE_EXTRA[phase]).status_code == 200
    cancel = post_json(client, f"{API}/runs/{run.pk}/cancel", {}, operator_headers())
    assert cancel.status_code == 200
    before = WorkerSession.objects.get(worker=worker.worker).heartbeat_at
    beat = worker.heartbeat()
    assert beat.json()["cancel"] == [offer["offer_id"]]
    assert WorkerSession.objects.get(worker=worker.worker).heartbeat_at == before


@override_settings(QINGLONG_HEARTBEAT_MIN_INTERVAL_S=5)
def test_a_due_heartbeat_renews_started_leases_and_a_throttled_one_does_not() -> None:
    opened = open_session(slots=1)
    attempt = pending_attempt(make_run())
    _, offer_id, _ = claim(attempt, opened.session)
    Attempt.objects.filter(pk=attempt.pk).update(state="running")
    lease = RunLease.objects.get(offer_id=offer_id)

    throttled = session_heartbeat(session=_fresh(opened.session), draining=False)
    assert (throttled.recorded, throttled.renewed) == (False, 0)
    assert RunLease.objects.get(pk=lease.pk).version == lease.version

    _age(opened.session, 6)
    due = session_heartbeat(session=_fresh(opened.session), draining=False)
    assert (due.recorded, due.renewed) == (True, 1)
    assert RunLease.objects.get(pk=lease.pk).version == lease.version + 1


@override_settings(QINGLONG_HEARTBEAT_MIN_INTERVAL_S=5)
def test_draining_takes_effect_at_once_but_flapping_writes_at_most_twice_per_interval() -> None:
    session = open_session().session
    recorded = []
    with CaptureQueriesContext(connection) as queries:
        for i in range(20):
            beat = session_heartbeat(session=_fresh(session), draining=i % 2 == 0)
            recorded.append(beat.recorded)
    # Entering draining is immediate; leaving it waits for the interval.
    assert recorded[0] is True
    assert recorded.count(True) == 1
    assert len(_writes(queries)) == 1
    assert WorkerSession.objects.get(pk=session.pk).state == SessionState.DRAINING


@override_settings(QINGLONG_HEARTBEAT_MIN_INTERVAL_S=0)
def test_a_zero_interval_records_every_heartbeat() -> None:
    session = open_session().session
    assert all(
        session_heartbeat(session=_fresh(session), draining=False).recorded for _ in range(3)
    )


def _rates(**rates: str) -> dict[str, Any]:
    return {**api_settings.user_settings, "DEFAULT_THROTTLE_RATES": rates}


def test_heartbeat_requests_past_the_rate_are_429_with_retry_after(client: Client) -> None:
    with override_settings(REST_FRAMEWORK=_rates(worker_heartbeat="3/min")):
        worker = WorkerClient.open(client)
        for _ in range(3):
            assert worker.heartbeat().status_code == 200
        limited = worker.heartbeat()
        assert limited.status_code == 429
        assert error_code(limited) == "throttled"
        assert int(limited["Retry-After"]) >= 1
        # Keyed by Session: another Worker's heartbeats are not refused.
        assert WorkerClient.open(client).heartbeat().status_code == 200
