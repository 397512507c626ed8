"""`leases.writes`: the writes of one use case applied together, on both databases.

Each compare-and-set keeps its own guard; one that touches no row raises
`LostRace` and nothing of the use case is written. On PostgreSQL they are
one statement.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from leases.errors import IllegalTransition, LostRace
from leases.models import LeaseState, RunLease
from leases.writes import Guard, Writes
from qinglong import testing
from qinglong.clock import db_now
from runs.models import Attempt, AttemptEvent, AttemptState, Run, RunState

pytestmark = pytest.mark.django_db(transaction=True)


def _claimed() -> tuple[Run, Attempt, RunLease]:
    session = testing.open_session().session
    attempt = testing.pending_attempt(testing.make_run())
    _, offer_id, _ = testing.claim(attempt, session)
    lease = RunLease.objects.get(offer_id=offer_id)
    return Run.objects.get(pk=attempt.run_id), Attempt.objects.get(pk=attempt.pk), lease


def test_attempt_event_run_and_lease_change_together() -> None:
    run, attempt, lease = _claimed()
    now = db_now()
    writes = Writes()
    writes.attempt(
        attempt,
        AttemptState.STARTING,
        reason="ack_starting",
        actor="worker:1",
        started_at=now,
    )
    writes.run(run, RunState.RUNNING)
    writes.lease_extend(lease, expires_at=now + timedelta(seconds=90))
    with transaction.atomic(), CaptureQueriesContext(connection) as queries:
        assert writes.apply() is None
    if connection.vendor == "postgresql":
        assert len(queries.captured_queries) == 1  # one statement, four rows
    # The instances follow the rows, as the one-at-a-time transitions do.
    assert (attempt.state, attempt.version, attempt.started_at) == ("starting", 2, now)
    assert (run.state, run.version) == ("running", 2)
    assert (lease.expires_at, lease.version) == (now + timedelta(seconds=90), 1)
    stored = Attempt.objects.get(pk=attempt.pk)
    assert (stored.state, stored.version, stored.started_at) == ("starting", 2, now)
    assert Run.objects.get(pk=run.pk).state == "running"
    assert RunLease.objects.get(pk=lease.pk).expires_at == now + timedelta(seconds=90)
    event = AttemptEvent.objects.filter(attempt=attempt).latest("id")
    assert (event.from_state, event.to_state, event.reason, event.actor) == (
        "claimed",
        "starting",
        "ack_starting",
        "worker:1",
    )
    assert event.at is not None


def test_an_illegal_change_is_refused_before_anything_is_written() -> None:
    run, attempt, _ = _claimed()
    writes = Writes()
    with pytest.raises(IllegalTransition):
        writes.attempt(attempt, AttemptState.SUCCEEDED, reason="x", actor="")
    with pytest.raises(IllegalTransition):
        writes.run(run, RunState.SUCCEEDED)
    assert Attempt.objects.get(pk=attempt.pk).state == "claimed"


def test_one_stale_version_loses_the_race_and_writes_nothing() -> None:
    run, attempt, lease = _claimed()
    Run.objects.filter(pk=run.pk).update(version=run.version + 5)  # someone else moved it
    now = db_now()
    writes = Writes()
    writes.attempt(attempt, AttemptState.STARTING, reason="r", actor="", started_at=now)
    writes.run(run, RunState.RUNNING)
    writes.lease_extend(lease, expires_at=now + timedelta(seconds=90))
    events = AttemptEvent.objects.count()
    with pytest.raises(LostRace), transaction.atomic():
        writes.apply()
    assert Attempt.objects.get(pk=attempt.pk).state == "claimed"
    assert RunLease.objects.get(pk=lease.pk).version == 0
    assert AttemptEvent.objects.count() == events
    assert attempt.state == "claimed"  # the instance did not move either


def test_a_failed_guard_writes_nothing_and_returns_its_row() -> None:
    _, _, lease = _claimed()
    now = db_now()
    table = connection.ops.quote_name(RunLease._meta.db_table)
    guard = Guard(
        columns={"active": f"(SELECT count(*) FROM {table} WHERE state = %s)"},
        params=[LeaseState.ACTIVE],
        ok="g.active < %s",
        ok_params=[1],
    )
    writes = Writes()
    writes.lease_end(lease, LeaseState.REVOKED, reason="test", now=now)
    with transaction.atomic():
        row = writes.apply(guard=guard)
    assert row is not None
    assert (bool(row["ok"]), row["active"]) == (False, 1)
    assert RunLease.objects.get(pk=lease.pk).state == "active"
    assert lease.state == "active"

    passing = Guard(columns=guard.columns, params=guard.params, ok="g.active < %s", ok_params=[2])
    writes = Writes()
    writes.lease_end(lease, LeaseState.REVOKED, reason="test", now=now)
    with transaction.atomic():
        row = writes.apply(guard=passing)
    assert row is not None and bool(row["ok"])
    stored = RunLease.objects.get(pk=lease.pk)
    assert (stored.state, stored.end_reason, stored.ended_at) == ("revoked", "test", now)


def test_a_created_lease_gets_its_id_and_every_column_the_orm_would_write() -> None:
    run, attempt, lease = _claimed()
    with transaction.atomic():
        RunLease.objects.filter(pk=lease.pk).update(state=LeaseState.REVOKED)
        copy = RunLease(
            attempt_id=attempt.pk,
            run_id=run.pk,
            worker_id=lease.worker_id,
            session_id=lease.session_id,
            session_generation=lease.session_generation,
            lease_generation=lease.lease_generation + 1,
            offer_id="f" * 64,
            token_digest="a" * 64,
            spec_digest="b" * 64,
            placement_score=None,
            source="pull_claim",
            pull_id="6f1c2c5e-6f1c-4c5e-8f1c-6f1c2c5e6f1c",
            claimed_at=lease.claimed_at,
            expires_at=lease.expires_at,
        )
        writes = Writes()
        writes.lease_create(copy)
        writes.apply()
    assert copy.pk is not None
    stored = RunLease.objects.get(pk=copy.pk)
    assert (stored.state, stored.version, stored.delivery_count, stored.end_reason) == (
        "active",
        0,
        0,
        "",
    )
    assert str(stored.pull_id) == "6f1c2c5e-6f1c-4c5e-8f1c-6f1c2c5e6f1c"
    assert stored.placement_score is None


@pytest.mark.postgres
def test_a_batch_refuses_a_write_that_must_hand_back_a_new_id() -> None:
    # `AckWrites` applies a wave and reports counts only: a step that returns
    # an id (a created lease) would never get it, so it is refused when added.
    from leases.writes import AckWrites

    created = Writes()
    created.lease_create(RunLease(offer_id="x" * 64))
    # A history row's insert (set-based) asked for its id.
    asking = Writes()
    asking.attempt(
        Attempt(pk=1, state=AttemptState.CLAIMED), AttemptState.STARTING, reason="r", actor="a"
    )
    asking._steps[-1].returns_id = True
    for writes in (created, asking):
        with pytest.raises(ValueError, match="returns an id"):
            AckWrites().add(writes)


def test_plain_values_are_prepared_as_the_field_itself_prepares_them() -> None:
    """`leases.writes._prepared` (its shortcut for plain values) against
    `Field.get_db_prep_save`, every concrete field of the rows `Writes` writes,
    on this database: the same value of the same type, or the same error."""
    from leases.writes import _prepared

    now = db_now()
    values: list[object] = [
        "",
        "running",
        "x" * 300,
        0,
        -1,
        7,
        2**31,
        2**40,
        True,
        now,
        now.replace(microsecond=0),
        None,
        LeaseState.ACTIVE,
        1.5,
    ]
    db = connection
    checked = 0
    for model in (Attempt, Run, RunLease, AttemptEvent):
        for field in model._meta.concrete_fields:
            for value in values:
                try:
                    expected = field.get_db_prep_save(value, db)
                except Exception as err:
                    with pytest.raises(type(err)):
                        _prepared(field, value, db)
                    continue
                got = _prepared(field, value, db)
                assert (type(got), got) == (type(expected), expected), (field, value)
                checked += 1
    assert checked > 200, checked
