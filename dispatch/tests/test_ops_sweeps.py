"""The bounded sweeps (dispatch/sweeps.py): what each ends, what it never touches."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import override_settings
from django.utils import timezone

from dispatch.models import DispatchCycle
from dispatch.sweeps import (
    prune_dispatch_cycles,
    run_all_sweeps,
    sweep_expired_leases,
    sweep_over_delivered_leases,
    sweep_stale_sessions,
)
from leases.ack import AckPhase, lease_ack
from leases.models import LeaseState, RunLease
from qinglong.testing import claim, make_run, make_worker, open_session, pending_attempt
from runs.models import Attempt, Run
from workers.models import WorkerSession

pytestmark = pytest.mark.django_db


def claimed_lease(**session_kwargs):
    opened = open_session(**session_kwargs)
    run = make_run()
    attempt = pending_attempt(run)
    _, offer_id, token = claim(attempt, opened.session)
    lease = RunLease.objects.get(offer_id=offer_id)
    return opened, run, lease, token


def push_expiry(lease: RunLease, seconds: int) -> None:
    RunLease.objects.filter(pk=lease.pk).update(
        expires_at=timezone.now() + timedelta(seconds=seconds)
    )


def test_expired_claimed_lease_is_expired_and_its_attempt_returns_to_pending():
    _, run, lease, _ = claimed_lease()
    push_expiry(lease, -5)
    counts = sweep_expired_leases()
    assert (counts.examined, counts.applied) == (1, 1)
    lease.refresh_from_db()
    assert (lease.state, lease.end_reason) == (LeaseState.EXPIRED, "lease_expired")
    assert Attempt.objects.get(pk=lease.attempt_id).state == "pending"
    assert Run.objects.get(pk=run.pk).state == "queued"


def test_unexpired_lease_is_not_touched():
    _, _, lease, _ = claimed_lease()
    counts = sweep_expired_leases()
    assert counts.examined == 0
    lease.refresh_from_db()
    assert lease.state == LeaseState.ACTIVE


def test_expiry_sweep_is_bounded_and_reports_truncation():
    opened = open_session(make_worker(slots=8)[0])
    leases = []
    for _ in range(5):
        attempt = pending_attempt(make_run())
        _, offer_id, _ = claim(attempt, opened.session)
        leases.append(RunLease.objects.get(offer_id=offer_id))
    RunLease.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    first = sweep_expired_leases(page_size=2, max_pages=1)
    assert (first.applied, first.truncated) == (2, True)
    rest = sweep_expired_leases(page_size=2, max_pages=4)
    assert (rest.applied, rest.truncated) == (3, False)
    assert not RunLease.objects.filter(state=LeaseState.ACTIVE).exists()


def test_sweeper_never_overwrites_a_released_lease_or_its_completion():
    opened, run, lease, token = claimed_lease()
    for phase in (AckPhase.STARTING, AckPhase.RUNNING, AckPhase.SUCCEEDED):
        lease_ack(
            session=opened.session,
            offer_id=lease.offer_id,
            phase=phase,
            lease_token=token,
            spec_sha256=lease.spec_digest,
            executor_handle="pid:1",
            exit_code=0,
        )
    push_expiry(lease, -60)
    counts = sweep_expired_leases()
    assert counts.examined == 0
    lease.refresh_from_db()
    assert lease.state == LeaseState.RELEASED
    assert Attempt.objects.get(pk=lease.attempt_id).state == "succeeded"
    assert Run.objects.get(pk=run.pk).state == "succeeded"


@override_settings(QINGLONG_SESSION_TIMEOUT_S=30)
def test_stale_session_goes_offline_and_its_leases_end():
    opened, run, lease, _ = claimed_lease()
    WorkerSession.objects.filter(pk=opened.session.pk).update(
        heartbeat_at=timezone.now() - timedelta(seconds=31)
    )
    counts = sweep_stale_sessions()
    assert counts.applied == 1
    assert WorkerSession.objects.get(pk=opened.session.pk).state == "offline"
    lease.refresh_from_db()
    assert (lease.state, lease.end_reason) == (LeaseState.REVOKED, "worker_lost")
    assert Run.objects.get(pk=run.pk).state == "queued"


def test_fresh_session_stays_online():
    opened = open_session()
    assert sweep_stale_sessions().examined == 0
    assert WorkerSession.objects.get(pk=opened.session.pk).state == "online"


def test_over_delivered_claimed_lease_is_revoked_for_another_worker():
    _, run, lease, _ = claimed_lease()
    RunLease.objects.filter(pk=lease.pk).update(delivery_count=5)
    counts = sweep_over_delivered_leases(max_deliveries=5)
    assert counts.applied == 1
    lease.refresh_from_db()
    assert (lease.state, lease.end_reason) == (LeaseState.REVOKED, "max_deliveries")
    assert Attempt.objects.get(pk=lease.attempt_id).state == "pending"
    assert Run.objects.get(pk=run.pk).state == "queued"


def test_over_delivered_sweep_leaves_a_started_attempt_alone():
    opened, _, lease, token = claimed_lease()
    lease_ack(
        session=opened.session,
        offer_id=lease.offer_id,
        phase=AckPhase.STARTING,
        lease_token=token,
        spec_sha256=lease.spec_digest,
    )
    RunLease.objects.filter(pk=lease.pk).update(delivery_count=9)
    assert sweep_over_delivered_leases(max_deliveries=5).examined == 0
    lease.refresh_from_db()
    assert lease.state == LeaseState.ACTIVE


def test_prune_deletes_only_cycles_past_retention_in_bounded_batches():
    now = timezone.now()
    old = [
        DispatchCycle(
            started_at=now - timedelta(days=10),
            scope="global",
            status="idle",
            reason="no_candidates",
        )
        for _ in range(7)
    ]
    DispatchCycle.objects.bulk_create(old)
    keep = DispatchCycle.objects.create(
        started_at=now, scope="global", status="idle", reason="no_candidates"
    )
    first = prune_dispatch_cycles(retention_s=86400, batch_size=3, max_batches=2)
    assert (first.applied, first.truncated) == (6, True)
    second = prune_dispatch_cycles(retention_s=86400, batch_size=3, max_batches=2)
    assert (second.applied, second.truncated) == (1, False)
    assert list(DispatchCycle.objects.values_list("pk", flat=True)) == [keep.pk]


def test_run_all_sweeps_returns_only_counts():
    result = run_all_sweeps()
    assert set(result) == {
        "stale_sessions",
        "expired_leases",
        "over_delivered_leases",
        "timed_out_attempts",
        "pruned_cycles",
        "pruned_sessions",
        "pruned_output",
    }
    for counts in result.values():
        assert set(counts) == {"examined", "applied", "unchanged", "lost_race", "truncated"}
