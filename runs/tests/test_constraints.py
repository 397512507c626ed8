"""The database itself carries the invariants: inserts that bypass the services."""

from __future__ import annotations

import uuid

import pytest
from django.db import IntegrityError, transaction
from django.utils import timezone

from leases.models import LeaseState, RunLease
from qinglong.testing import claim, make_run, open_session, pending_attempt
from runs.models import Attempt
from workers.models import SessionState, WorkerSession

pytestmark = pytest.mark.django_db


def _lease_row(lease: RunLease, **overrides: object) -> RunLease:
    fields = {
        "attempt_id": lease.attempt_id,
        "run_id": lease.run_id,
        "worker_id": lease.worker_id,
        "session_id": lease.session_id,
        "session_generation": lease.session_generation,
        "lease_generation": lease.lease_generation + 1,
        "offer_id": uuid.uuid4().hex,
        "token_digest": "0" * 64,
        "spec_digest": lease.spec_digest,
        "source": lease.source,
        "claimed_at": timezone.now(),
        "expires_at": timezone.now(),
    }
    fields.update(overrides)
    return RunLease(**fields)


def test_database_rejects_second_active_lease_for_an_attempt():
    opened = open_session()
    attempt = pending_attempt(make_run())
    claim(attempt, opened.session)
    lease = RunLease.objects.get(attempt=attempt)
    with pytest.raises(IntegrityError), transaction.atomic():
        _lease_row(lease).save()
    assert RunLease.objects.filter(attempt=attempt, state=LeaseState.ACTIVE).count() == 1


def test_database_allows_a_new_lease_once_the_old_one_ended():
    opened = open_session()
    attempt = pending_attempt(make_run())
    claim(attempt, opened.session)
    lease = RunLease.objects.get(attempt=attempt)
    RunLease.objects.filter(pk=lease.pk).update(state=LeaseState.EXPIRED)
    _lease_row(lease).save()
    assert RunLease.objects.filter(attempt=attempt).count() == 2


def test_database_rejects_duplicate_lease_generation_for_an_attempt():
    opened = open_session()
    attempt = pending_attempt(make_run())
    claim(attempt, opened.session)
    lease = RunLease.objects.get(attempt=attempt)
    with pytest.raises(IntegrityError), transaction.atomic():
        _lease_row(lease, lease_generation=lease.lease_generation, state=LeaseState.REVOKED).save()


def test_database_rejects_second_non_terminal_attempt_for_a_run():
    run = make_run()
    with pytest.raises(IntegrityError), transaction.atomic():
        Attempt.objects.create(run=run, number=2, queued_at=run.queued_at)
    assert run.attempts.count() == 1


def test_database_rejects_duplicate_attempt_number():
    run = make_run()
    Attempt.objects.filter(run=run).update(state="failed")
    with pytest.raises(IntegrityError), transaction.atomic():
        Attempt.objects.create(run=run, number=1, queued_at=run.queued_at)


def test_database_rejects_duplicate_session_generation():
    opened = open_session()
    session = opened.session
    with pytest.raises(IntegrityError), transaction.atomic():
        WorkerSession.objects.create(
            worker=session.worker,
            session_id=uuid.uuid4(),
            generation=session.generation,
            state=SessionState.OFFLINE,
            token_digest="1" * 64,
            heartbeat_at=timezone.now(),
        )


def test_database_rejects_second_current_session_for_a_worker():
    opened = open_session()
    session = opened.session
    with pytest.raises(IntegrityError), transaction.atomic():
        WorkerSession.objects.create(
            worker=session.worker,
            session_id=uuid.uuid4(),
            generation=session.generation + 1,
            state=SessionState.ONLINE,
            token_digest="2" * 64,
            heartbeat_at=timezone.now(),
        )


@pytest.mark.parametrize(
    ("model", "field"),
    [("run", "state"), ("attempt", "state"), ("session", "state"), ("lease", "state")],
)
def test_database_rejects_states_outside_their_choices(model, field):
    opened = open_session()
    run = make_run()
    attempt = pending_attempt(run)
    claim(attempt, opened.session)
    target = {
        "run": type(run).objects.filter(pk=run.pk),
        "attempt": Attempt.objects.filter(pk=attempt.pk),
        "session": WorkerSession.objects.filter(pk=opened.session.pk),
        "lease": RunLease.objects.filter(attempt=attempt),
    }[model]
    with pytest.raises(IntegrityError), transaction.atomic():
        target.update(**{field: "bogus"})
