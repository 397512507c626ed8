"""The retry policy of a Task's revision (README "Run policies"): which failures
retry, exponential backoff with a cap in `Attempt.not_before`, and the claim
waiting for it."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from django.test import override_settings

from dispatch.core.ports import DispatchScope
from dispatch.cycles import dispatch_cycle
from dispatch.sweeps import sweep_timed_out_attempts
from leases.ack import AckPhase, lease_ack
from leases.end import leases_end_for_session
from leases.models import RunLease
from leases.reasons import WaitReason
from qinglong.clock import db_now
from qinglong.testing import claim, make_run, open_session, pending_attempt
from runs.models import Attempt, AttemptState, Run, RunState

pytestmark = pytest.mark.django_db


def _start(run: Run):
    session = open_session().session
    outcome, offer_id, token = claim(pending_attempt(run), session)
    assert outcome.status == "won"
    lease = RunLease.objects.get(offer_id=offer_id)
    ack: dict[str, Any] = {"session": session, "offer_id": offer_id, "lease_token": token}
    lease_ack(**ack, phase=AckPhase.STARTING, spec_sha256=lease.spec_digest)
    lease_ack(**ack, phase=AckPhase.RUNNING, spec_sha256=lease.spec_digest, executor_handle="h")
    return session, ack, lease


def _fail(run: Run) -> Attempt:
    """One Attempt of the Run runs and exits non-zero; returns the next one, if any."""
    _session, ack, lease = _start(run)
    lease_ack(**ack, phase=AckPhase.FAILED, spec_sha256=lease.spec_digest, exit_code=3)
    run.refresh_from_db()
    latest = Attempt.objects.filter(run=run).order_by("-number").first()
    assert latest is not None
    return latest


def _lose(run: Run) -> None:
    """The Worker's Session is fenced while the Attempt runs: it is lost."""
    session, _ack, _lease = _start(run)
    leases_end_for_session(session.pk, reason="worker_lost")
    run.refresh_from_db()


def test_backoff_doubles_from_the_first_retry_up_to_the_cap() -> None:
    run = make_run(max_attempts=4, retry_backoff_s=10, retry_backoff_max_s=15)
    waits = []
    for _ in range(3):
        before = db_now()
        nxt = _fail(run)
        assert nxt.state == AttemptState.PENDING and nxt.not_before is not None
        assert nxt.not_before_reason == WaitReason.RETRY_BACKOFF
        waits.append(round((nxt.not_before - before).total_seconds()))
        # Let the test claim the retry now; its wait is what was asserted.
        Attempt.objects.filter(pk=nxt.pk).update(not_before=None, not_before_reason="")
    assert waits == [10, 15, 15]  # 10, 20 → capped at 15, 40 → 15
    _fail(run)
    assert run.state == RunState.FAILED  # four attempts, no fifth


def test_no_backoff_means_the_retry_is_claimable_at_once() -> None:
    run = make_run(max_attempts=2)
    nxt = _fail(run)
    assert (nxt.number, nxt.not_before, nxt.not_before_reason) == (2, None, "")


def test_the_dispatcher_does_not_claim_a_retry_before_its_backoff() -> None:
    run = make_run(max_attempts=2, retry_backoff_s=1, retry_backoff_max_s=1)
    nxt = _fail(run)
    open_session(slots=4)  # a free Worker for the global cycle
    dispatch_cycle(scope=DispatchScope.global_())
    assert Attempt.objects.get(pk=nxt.pk).state == AttemptState.PENDING
    time.sleep(1.05)
    dispatch_cycle(scope=DispatchScope.global_())
    assert Attempt.objects.get(pk=nxt.pk).state == AttemptState.CLAIMED


def test_retry_on_exit_code_retries_failures_but_not_lost_workers() -> None:
    failed = make_run(max_attempts=2, retry_on="exit_code")
    assert _fail(failed).number == 2 and failed.state == RunState.QUEUED
    lost = make_run(max_attempts=2, retry_on="exit_code")
    _lose(lost)
    assert lost.state == RunState.FAILED
    assert Attempt.objects.filter(run=lost).count() == 1


def test_retry_on_worker_lost_retries_lost_workers_but_not_failures() -> None:
    failed = make_run(max_attempts=2, retry_on="worker_lost")
    _fail(failed)
    assert failed.state == RunState.FAILED
    lost = make_run(max_attempts=2, retry_on="worker_lost")
    _lose(lost)
    assert lost.state == RunState.QUEUED
    nxt = Attempt.objects.get(run=lost, number=2)
    # The lost-execution grace of docs/adr/0005 still holds the retry back.
    assert nxt.not_before_reason == WaitReason.LOST_EXECUTION_GRACE


def test_retry_on_both_retries_failures_and_lost_workers_with_the_backoff() -> None:
    failed = make_run(max_attempts=2, retry_on="both", retry_backoff_s=30)
    nxt = _fail(failed)
    assert failed.state == RunState.QUEUED and nxt.number == 2
    assert nxt.not_before_reason == WaitReason.RETRY_BACKOFF
    lost = make_run(max_attempts=2, retry_on="both")
    _lose(lost)
    assert lost.state == RunState.QUEUED
    assert Attempt.objects.get(run=lost, number=2).state == AttemptState.PENDING


def test_the_later_of_grace_and_backoff_holds_a_lost_retry() -> None:
    run = make_run(max_attempts=2, retry_backoff_s=86_400, retry_backoff_max_s=86_400)
    before = db_now()
    _lose(run)
    nxt = Attempt.objects.get(run=run, number=2)
    assert nxt.not_before_reason == WaitReason.RETRY_BACKOFF
    assert nxt.not_before is not None
    assert nxt.not_before - before >= timedelta(days=1) - timedelta(seconds=5)


@override_settings(QINGLONG_TIMEOUT_MARGIN_S=0)
def test_a_timeout_is_retried_like_a_failed_exit_code() -> None:
    retried = make_run(timeout_s=1, max_attempts=2, retry_on="exit_code")
    not_retried = make_run(timeout_s=1, max_attempts=2, retry_on="worker_lost")
    _start(retried)
    _start(not_retried)
    time.sleep(1.05)
    assert sweep_timed_out_attempts().applied == 2
    retried.refresh_from_db()
    not_retried.refresh_from_db()
    assert (retried.state, not_retried.state) == (RunState.QUEUED, RunState.FAILED)
    # The timed-out process may still run somewhere: the retry waits the grace.
    nxt = Attempt.objects.get(run=retried, number=2)
    assert nxt.not_before_reason == WaitReason.LOST_EXECUTION_GRACE
    assert nxt.not_before is not None and nxt.not_before > db_now()
