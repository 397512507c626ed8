"""A pull's lean start (issue #12): one statement instead of six, same answers.

`dispatch.cycles.pull_snapshot` reads the kill switch, the clock, whether the
Session has over-delivered or re-deliverable leases, the Session's record
and, when the cycle may claim, its first walk and its first servable group's
rows in one statement on PostgreSQL; the cycle then serves its recovery page
(when there is nothing to re-deliver), its Worker page, its first walk and
those rows from it (the walk and the rows: test_pull_walk.py). These tests hold
each part to the port it stands in for, in the states that change the
answer, and count what a pull costs.
"""

from __future__ import annotations

import secrets
import uuid

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from dispatch.adapters.orm import OrmLeaseRecoverySource, OrmWorkerSnapshotSource
from dispatch.core.ports import DispatchScope, PullCredential, SessionRef
from dispatch.core.result import CycleReason, CycleStatus
from dispatch.cycles import (
    cycle_recorder,
    dispatch_budget,
    dispatch_cycle,
    dispatch_set_paused,
    pull_snapshot,
)
from leases.ack import AckPhase, lease_ack
from leases.models import RunLease
from qinglong import testing
from qinglong.clock import db_now
from runs.models import Run
from workers.models import Worker, WorkerSession

pytestmark = pytest.mark.django_db(transaction=True)


def _scope(session: WorkerSession) -> DispatchScope:
    return DispatchScope.for_session(
        SessionRef(str(session.worker_id), str(session.session_id), session.generation)
    )


def _pull() -> PullCredential:
    return PullCredential(pull_id=str(uuid.uuid4()), token=secrets.token_urlsafe(32))


def _ports_say(session: WorkerSession) -> tuple[bool, tuple]:
    """What the recovery and Worker ports read for this Session right now."""
    scope = _scope(session)
    now = db_now()
    recovered = OrmLeaseRecoverySource().recover_page(
        scope=scope,
        observed_at=now,
        due_before=None,
        max_deliveries=dispatch_budget().max_deliveries,
        cursor=None,
        limit=8,
    )
    workers = OrmWorkerSnapshotSource().worker_page(scope=scope, cursor=None, limit=8)
    return bool(recovered.items), workers.items


def _snapshot_says(session: WorkerSession) -> tuple[bool, tuple]:
    snapshot = pull_snapshot(
        _scope(session), session_pk=session.pk, max_deliveries=dispatch_budget().max_deliveries
    )
    assert snapshot is not None
    return snapshot.recoverable, snapshot.session_page


@pytest.mark.postgres
def test_the_snapshot_answers_as_the_ports_it_stands_in_for() -> None:
    worker, _ = testing.make_worker(slots=3, labels={"zone": "a"})
    session = testing.open_session(worker).session
    assert _snapshot_says(session) == _ports_say(session) == (False, _ports_say(session)[1])
    (record,) = _snapshot_says(session)[1]
    assert (record.free_slots, dict(record.labels)) == (3, {"zone": "a"})

    # A claimed lease: re-deliverable, and it holds a slot.
    attempt = testing.pending_attempt(testing.make_run())
    _, offer_id, token = testing.claim(attempt, session)
    assert _snapshot_says(session) == _ports_say(session)
    assert _snapshot_says(session)[0] is True
    assert _snapshot_says(session)[1][0].free_slots == 2

    # Started: no longer re-delivered, still holding its slot.
    lease = RunLease.objects.get(offer_id=offer_id)
    lease_ack(
        session=session,
        offer_id=offer_id,
        phase=AckPhase.STARTING,
        lease_token=token,
        spec_sha256=lease.spec_digest,
    )
    assert _snapshot_says(session) == _ports_say(session)
    assert _snapshot_says(session)[0] is False

    # A draining Worker takes no claims: no record, as the Worker page says.
    Worker.objects.filter(pk=worker.pk).update(admin_state="draining")
    assert _snapshot_says(session) == _ports_say(session) == (False, ())
    Worker.objects.filter(pk=worker.pk).update(admin_state="active")
    WorkerSession.objects.filter(pk=session.pk).update(state="draining")
    assert _snapshot_says(session) == _ports_say(session) == (False, ())


@pytest.mark.postgres
def test_a_replaced_session_gets_no_record() -> None:
    worker, _ = testing.make_worker()
    old = testing.open_session(worker).session
    testing.open_session(worker)
    assert _snapshot_says(old) == _ports_say(old) == (False, ())


@pytest.mark.postgres
def test_a_snapshot_sees_the_kill_switch_and_over_delivered_leases() -> None:
    session = testing.open_session().session
    attempt = testing.pending_attempt(testing.make_run())
    testing.claim(attempt, session)
    scope = _scope(session)
    max_deliveries = dispatch_budget().max_deliveries
    snapshot = pull_snapshot(scope, session_pk=session.pk, max_deliveries=max_deliveries)
    assert snapshot is not None and (snapshot.paused, snapshot.over_delivered) == (False, False)
    RunLease.objects.filter(session=session).update(delivery_count=max_deliveries)
    dispatch_set_paused(paused=True, reason="test")
    snapshot = pull_snapshot(scope, session_pk=session.pk, max_deliveries=max_deliveries)
    assert snapshot is not None and (snapshot.paused, snapshot.over_delivered) == (True, True)
    assert dispatch_cycle(scope=scope, pull=_pull(), session_pk=session.pk).status is (
        CycleStatus.PAUSED
    )
    dispatch_set_paused(paused=False)
    # The pull revokes the over-delivered lease before its cycle; the Attempt
    # then waits its redelivery backoff, so nothing is offered.
    result = dispatch_cycle(scope=scope, pull=_pull(), session_pk=session.pk)
    assert RunLease.objects.get(session=session).end_reason == "max_deliveries"
    assert result.offers == ()


def test_the_snapshot_is_postgresqls_and_sqlite_reads_the_long_way() -> None:
    session = testing.open_session().session
    snapshot = pull_snapshot(
        _scope(session), session_pk=session.pk, max_deliveries=dispatch_budget().max_deliveries
    )
    assert (snapshot is not None) is (connection.vendor == "postgresql")
    testing.make_run()
    result = dispatch_cycle(scope=_scope(session), pull=_pull(), session_pk=session.pk)
    assert result.counts.claims_won == 1


@pytest.mark.postgres
def test_a_pull_repeated_after_a_lost_response_still_gets_its_offer_back() -> None:
    session = testing.open_session().session
    testing.make_run()
    scope = _scope(session)
    pull = _pull()
    (first,) = dispatch_cycle(scope=scope, pull=pull, session_pk=session.pk).offers
    again = dispatch_cycle(scope=scope, pull=pull, session_pk=session.pk)
    assert (again.reason, [o.offer_id for o in again.offers]) == (
        CycleReason.RECOVERED,
        [first.offer_id],
    )
    assert again.offers[0].lease.token == pull.token
    lease = RunLease.objects.get(offer_id=first.offer_id)
    # Delivered twice within one backoff: counted once (docs/adr/0005).
    assert lease.delivery_count == 1


@pytest.mark.postgres
def test_a_pull_with_nothing_to_re_deliver_reads_one_snapshot() -> None:
    session = testing.open_session(testing.make_worker(slots=4)[0]).session
    task = testing.make_task()
    for _ in range(5):
        testing.make_run(task)
    scope = _scope(session)

    def pull_and_start() -> object:
        pull = _pull()
        result = dispatch_cycle(scope=scope, pull=pull, session_pk=session.pk, max_offers=1)
        for offer in result.offers:  # started: no longer re-delivered
            lease_ack(
                session=session,
                offer_id=offer.offer_id,
                phase=AckPhase.STARTING,
                lease_token=pull.token,
                spec_sha256=offer.spec_sha256,
            )
        return result

    pull_and_start()  # warm-up: the revision is read once per process
    cycle_recorder.reset()
    pull_and_start()  # the first cycle of its outcome writes its row
    with CaptureQueriesContext(connection) as queries:
        result = dispatch_cycle(scope=scope, pull=_pull(), session_pk=session.pk, max_offers=1)
    assert result.counts.claims_won == 1
    statements = [q["sql"] for q in queries.captured_queries]
    # The snapshot (with the walk and the first group's rows), the claim
    # (BEGIN, two, COMMIT); no recovery read, no Worker page, no walk or rows
    # read of its own, no telemetry write, no cycle row.
    lease_reads = [s for s in statements if s.startswith('SELECT "dispatch_runlease"')]
    worker_pages = [s for s in statements if s.startswith('SELECT "workers_workersession"')]
    snapshots = [s for s in statements if '"dispatch_dispatchcontrol"' in s]
    assert (lease_reads, worker_pages, len(snapshots)) == ([], [], 1), statements
    assert not any(s.startswith("UPDATE") for s in statements), statements
    walks = [s for s in statements if "after_walk(" in s]
    assert walks == snapshots, statements
    print(f"\npull claiming 1: {len(statements)} statements")
    assert len(statements) == 5, statements


@pytest.mark.postgres
@pytest.mark.parametrize(
    "change",
    [
        "expired",
        "cancel_requested",
        "delivered_max",
        "generation_moved_on",
        "session_draining",
        "started",
    ],
)
def test_what_is_re_deliverable_is_what_recovery_reads(change: str) -> None:
    session = testing.open_session(testing.make_worker(slots=4)[0]).session
    attempt = testing.pending_attempt(testing.make_run())
    _, offer_id, token = testing.claim(attempt, session)
    assert _snapshot_says(session)[0] is True
    lease = RunLease.objects.get(offer_id=offer_id)
    if change == "expired":
        RunLease.objects.filter(pk=lease.pk).update(expires_at=db_now())
    elif change == "cancel_requested":
        Run.objects.filter(pk=attempt.run_id).update(cancel_requested=True)
    elif change == "delivered_max":
        RunLease.objects.filter(pk=lease.pk).update(delivery_count=dispatch_budget().max_deliveries)
    elif change == "generation_moved_on":
        RunLease.objects.filter(pk=lease.pk).update(lease_generation=7)
    elif change == "session_draining":
        WorkerSession.objects.filter(pk=session.pk).update(state="draining")
    else:
        lease_ack(
            session=session,
            offer_id=offer_id,
            phase=AckPhase.STARTING,
            lease_token=token,
            spec_sha256=lease.spec_digest,
        )
    recovered, _ = _ports_say(session)
    assert _snapshot_says(session)[0] is recovered
    # A draining Session still gets its lease back; the rest no longer.
    assert recovered is (change == "session_draining")


@pytest.mark.postgres
def test_the_prepared_snapshot_names_its_states_as_literals() -> None:
    """The snapshot is prepared once per connection (qinglong.prepared) and soon
    runs a generic plan: only literal states let that plan use the partial
    indexes over active leases (`runlease_active_session`, …) instead of every
    lease a long-lived Session ever held."""
    from dispatch.cycles import _snapshot_sql

    session = testing.open_session().session
    for by_pk in (False, True):
        sql = _snapshot_sql(_scope(session), by_pk=by_pk)
        snapshot, walk = sql.split("after_walk(", 1)
        assert snapshot.count("l.state = 'active'") == 4, sql  # 3, and the servable Session's
        assert "state = %s" not in sql and "state IN (%s" not in sql, sql
        # What is left as parameters in its own part: the kill switch's key,
        # max_deliveries twice, the Session's public id (and its key), and the
        # servable Session's three; the walk's own nine (its start, its caps)
        # and the first group's four (the page size thrice, the walk's cap).
        assert snapshot.count("%s") == (8 if by_pk else 7), sql
        assert walk.count("%s") == 13, sql
        # Computed once: inlined, its leases' EXISTS ran for its columns and
        # again for each CASE that decides whether to walk and read rows.
        assert "WITH RECURSIVE snap AS MATERIALIZED (" in sql, sql
