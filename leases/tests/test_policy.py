"""The shared rules of `leases.policy`: each predicate agrees with its filter form."""

from __future__ import annotations

from datetime import timedelta

import pytest

from dispatch.core.budget import HARD_CAPS
from leases import policy
from leases.models import RunLease
from qinglong import testing
from workers.models import SessionState, Worker, WorkerAdminState, WorkerSession
from workers.services import worker_set_admin_state

pytestmark = pytest.mark.django_db


def _lease() -> RunLease:
    session = testing.open_session().session
    _, offer_id, _ = testing.claim(testing.pending_attempt(testing.make_run()), session)
    return RunLease.objects.select_related("session__worker").get(offer_id=offer_id)


def test_live_and_expired_split_at_expires_at_in_python_and_in_sql():
    lease = _lease()
    at = lease.expires_at
    for now, live in (
        (at - timedelta(microseconds=1), True),
        (at, False),
        (at + timedelta(microseconds=1), False),
    ):
        assert policy.lease_is_live(lease, now=now) is live
        assert RunLease.objects.filter(policy.lease_live_q(now), pk=lease.pk).exists() is live
        assert (
            RunLease.objects.filter(policy.lease_expired_q(now), pk=lease.pk).exists() is not live
        )


def test_session_capacity_is_the_smaller_of_session_and_worker_slots():
    worker, _ = testing.make_worker(slots=3)
    assert policy.session_capacity(testing.open_session(worker, slots=2).session) == 2
    session = testing.open_session(worker, slots=3).session
    assert policy.session_capacity(session) == 3
    # An operator lowers the Worker's slots under a Session that has more.
    Worker.objects.filter(pk=worker.pk).update(slots=1)
    session = WorkerSession.objects.select_related("worker").get(pk=session.pk)
    assert (session.slots, policy.session_capacity(session)) == (3, 1)


def test_only_the_current_session_at_the_granted_generation_may_act():
    lease = _lease()
    session = lease.session
    assert policy.session_may_act(session, generation=lease.session_generation)
    assert not policy.session_may_act(session, generation=lease.session_generation + 1)
    assert RunLease.objects.filter(policy.lease_session_current_q(), pk=lease.pk).exists()
    newer = testing.open_session(session.worker).session  # fences the first
    session.refresh_from_db()
    assert session.state == SessionState.REPLACED
    assert not policy.session_is_current(session)
    assert not policy.session_may_act(session, generation=lease.session_generation)
    assert not RunLease.objects.filter(policy.lease_session_current_q(), pk=lease.pk).exists()
    assert policy.session_may_act(newer, generation=newer.generation)


def test_new_claims_go_only_to_online_sessions_of_active_workers():
    session = testing.open_session().session
    worker_id, generation = str(session.worker_id), session.generation

    def takes() -> bool:
        fresh = WorkerSession.objects.select_related("worker").get(pk=session.pk)
        in_sql = WorkerSession.objects.filter(policy.claimable_sessions_q(), pk=session.pk)
        ok = policy.session_takes_claims(fresh, worker_id=worker_id, generation=generation)
        assert ok is in_sql.exists()
        return ok

    assert takes()
    assert not policy.session_takes_claims(session, worker_id=worker_id, generation=generation + 1)
    assert not policy.session_takes_claims(session, worker_id="0", generation=generation)
    WorkerSession.objects.filter(pk=session.pk).update(state=SessionState.DRAINING)
    assert not takes()  # draining keeps its leases, takes nothing new
    WorkerSession.objects.filter(pk=session.pk).update(state=SessionState.ONLINE)
    worker_set_admin_state(worker=session.worker, admin_state=WorkerAdminState.DRAINING)
    assert not takes()


def test_lease_ttl_and_sweep_batch_come_from_the_budget_and_its_hard_cap(settings):
    settings.QINGLONG_DISPATCH = {**settings.QINGLONG_DISPATCH, "lease_ttl_s": 45}
    assert policy.lease_ttl() == timedelta(seconds=45)
    assert HARD_CAPS["page_size"] == policy.SWEEP_BATCH
