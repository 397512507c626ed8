"""Ended Sessions are deleted after QL_SESSION_RETENTION_DAYS (issue 8 item 6).

Before the fix WorkerSession rows were never deleted: a Worker reconnecting in
a loop grew the table without bound. The retention sweep deletes ended
Sessions older than the retention in bounded batches, never a current one nor
one a lease points at (lease history keeps its Session).
"""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.test import override_settings

from dispatch import tasks
from dispatch.sweeps import prune_ended_sessions
from leases.models import RunLease
from qinglong.clock import db_now
from qinglong.testing import claim, make_run, make_worker, open_session, pending_attempt
from workers.models import SESSION_CURRENT_STATES, SessionState, WorkerSession

pytestmark = pytest.mark.django_db


def _end_days_ago(pks: list[int], days: float) -> None:
    WorkerSession.objects.filter(pk__in=pks).update(ended_at=db_now() - timedelta(days=days))


def _churn(count: int) -> list[int]:
    """A Worker reconnecting `count` times: every Session but the last ends replaced."""
    worker, _ = make_worker()
    for _ in range(count):
        open_session(worker)
    return list(
        WorkerSession.objects.filter(worker=worker)
        .exclude(state__in=SESSION_CURRENT_STATES)
        .order_by("id")
        .values_list("pk", flat=True)
    )


def test_old_ended_sessions_go_recent_current_and_leased_ones_stay() -> None:
    old = _churn(4)  # three ended + one current
    _end_days_ago(old, 8)
    recent = _churn(2)
    _end_days_ago(recent, 6)
    leased = open_session().session
    _, offer_id, _ = claim(pending_attempt(make_run()), leased)
    open_session(leased.worker)  # fences it: the lease ends, its row stays
    _end_days_ago([leased.pk], 30)
    current_old = WorkerSession.objects.filter(state=SessionState.ONLINE).first()
    assert current_old is not None
    WorkerSession.objects.filter(pk=current_old.pk).update(
        heartbeat_at=db_now() - timedelta(days=30)
    )

    counts = prune_ended_sessions(retention_days=7)

    assert (counts.examined, counts.applied, counts.truncated) == (4, 3, False)
    remaining = set(WorkerSession.objects.values_list("pk", flat=True))
    assert remaining.isdisjoint(old)
    assert set(recent) <= remaining
    assert leased.pk in remaining
    assert WorkerSession.objects.get(pk=leased.pk).kept_for_leases is True
    assert RunLease.objects.get(offer_id=offer_id).session_id == leased.pk
    assert WorkerSession.objects.filter(state__in=SESSION_CURRENT_STATES).count() == 3


def test_a_session_kept_for_its_leases_is_never_read_again() -> None:
    leased = open_session().session
    claim(pending_attempt(make_run()), leased)
    open_session(leased.worker)
    _end_days_ago([leased.pk], 30)
    assert prune_ended_sessions(retention_days=7).examined == 1
    assert prune_ended_sessions(retention_days=7).examined == 0
    assert WorkerSession.objects.filter(pk=leased.pk).exists()


def test_each_sweep_is_bounded_and_reports_truncation() -> None:
    ended = _churn(8)  # seven ended
    _end_days_ago(ended, 10)
    first = prune_ended_sessions(retention_days=7, batch_size=2, max_batches=2)
    assert (first.applied, first.truncated) == (4, True)
    second = prune_ended_sessions(retention_days=7, batch_size=2, max_batches=2)
    assert (second.applied, second.truncated) == (3, False)
    assert not WorkerSession.objects.exclude(state__in=SESSION_CURRENT_STATES).exists()


def test_the_retention_comes_from_the_setting() -> None:
    ended = _churn(3)
    _end_days_ago(ended, 3)
    with override_settings(QINGLONG_SESSION_RETENTION_DAYS=7):
        assert prune_ended_sessions().applied == 0
    with override_settings(QINGLONG_SESSION_RETENTION_DAYS=2):
        assert prune_ended_sessions().applied == 2


@pytest.mark.django_db(transaction=True)
def test_celery_task_and_run_dispatcher_both_prune() -> None:
    ended = _churn(3)
    _end_days_ago(ended, 10)
    result = tasks.prune_ended_sessions_task.apply().get()
    assert (result["applied"], result["truncated"]) == (2, False)

    more = _churn(2)
    _end_days_ago(more, 10)
    out = StringIO()
    call_command("run_dispatcher", "--max-cycles", "1", "--json", stdout=out)
    [sweep] = [e for e in map(json.loads, out.getvalue().splitlines()) if e["event"] == "sweep"]
    assert sweep["pruned_sessions"]["applied"] == 1
    assert not WorkerSession.objects.filter(pk__in=more).exists()
