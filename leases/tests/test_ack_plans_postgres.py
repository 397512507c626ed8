"""The plans of an ACK batch's statements on PostgreSQL (issue 12).

A batch (`lease_ack_each`) is one lock statement (`leases.locks.lock_leases_for_acks`)
and one statement per wave of writes (`leases.writes.AckWrites`), each prepared
once per connection. What PostgreSQL plans for them is what these tests pin:
the lock statement reads the leases by offer id whatever the statistics, and
the waves run one generic plan instead of being planned on every batch.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from django.db import connection, transaction

from leases.ack import AckPhase, AckResult, lease_ack_each
from leases.locks import _acks_sql, lock_leases_for_acks
from leases.models import RunLease
from leases.tests.acking import items, leased
from qinglong import testing
from workers.models import WorkerSession

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _lease_rows_read(plan: dict[str, Any]) -> int:
    """Lease rows a plan's scans of `dispatch_runlease` looked at, every loop counted."""
    seen = 0
    if plan.get("Relation Name") == "dispatch_runlease":
        rows = int(plan.get("Actual Rows", 0)) + int(plan.get("Rows Removed by Filter", 0))
        rows += int(plan.get("Rows Removed by Index Recheck", 0))
        seen += rows * int(plan.get("Actual Loops", 1))
    for child in plan.get("Plans", ()):
        seen += _lease_rows_read(child)
    return seen


def _with_history(session: WorkerSession, count: int) -> list[tuple[RunLease, str]]:
    """`count` live leases of `session`, the lease table analysed, then the
    Session's history: 3,000 ended leases (of one Attempt, lease generations
    past the live one's) the statistics do not know of."""
    pairs = leased(session, count)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE dispatch_runlease")
        columns = [f.column for f in RunLease._meta.concrete_fields if not f.primary_key]
        made = {"offer_id": "'past-' || g", "lease_generation": "100 + g", "state": "'released'"}
        cursor.execute(
            f"INSERT INTO dispatch_runlease ({', '.join(columns)}) "
            f"SELECT {', '.join(made.get(c, c) for c in columns)} "
            "FROM dispatch_runlease, generate_series(1, 3000) AS g WHERE id = %s",
            [pairs[0][0].pk],
        )
    return pairs


def test_the_batch_lock_reads_the_leases_by_offer_id_under_statistics_older_than_the_leases() -> (
    None
):
    # Analysed while the Session had no lease (a fresh database; the e2e
    # bench's ANALYZE before its drain), a generic plan found a batch's leases
    # through `runlease_pull` by Session: every lease the Session ever had,
    # read again on every batch, more with every Run it ran.
    session = testing.open_session(testing.make_worker(slots=4)[0]).session
    pairs = _with_history(session, 2)
    offer_ids = sorted(lease.offer_id for lease, _ in pairs)
    placeholders = iter(range(1, 100))
    text = re.sub("%s", lambda _: f"${next(placeholders)}", _acks_sql())
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"PREPARE ack_batch_lock AS {text}")
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        cursor.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE ack_batch_lock(%s::varchar[], %s, %s)",
            [offer_ids, session.pk, session.pk],
        )
        (document,) = cursor.fetchone()
        cursor.execute("DEALLOCATE ack_batch_lock")
    plan = (json.loads(document) if isinstance(document, str) else document)[0]["Plan"]
    # Two leases found by offer id, the same two locked by id.
    assert _lease_rows_read(plan) <= 4, json.dumps(plan)


def test_the_waves_of_a_batch_run_one_generic_plan_per_connection() -> None:
    # The waves' arrays hold a few items each: costed for the arrays at hand,
    # a custom plan looked cheaper than the generic one (10 rows per unnest),
    # so PostgreSQL planned every wave anew, 0.5 ms each (issue 12). The lock
    # statement makes the batch's transaction use generic plans, as a claim's
    # does; the setting ends with the transaction.
    session = testing.open_session(testing.make_worker(slots=64)[0]).session
    sizes = (2, 3, 2, 4, 2, 3, 2)  # past PostgreSQL's five custom plans
    for size in sizes:
        pairs = leased(session, size)
        for phases in ((AckPhase.STARTING,), (AckPhase.RUNNING, AckPhase.SUCCEEDED)):
            answers = list(
                lease_ack_each(
                    session=WorkerSession.objects.get(pk=session.pk), items=items(pairs, *phases)
                )
            )
            assert all(isinstance(a, AckResult) for a in answers), answers
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
            "WHERE statement LIKE %s",
            ["WITH w0 AS (%unnest(%"],
        )
        plans = sorted(cursor.fetchall())
    # starting, running and succeeded: three texts, each planned once and run
    # once per batch.
    assert plans == [(len(sizes), 0)] * 3, plans
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('plan_cache_mode')")
        assert cursor.fetchone() == ("auto",)


def test_the_batch_lock_turns_only_its_transaction_to_generic_plans() -> None:
    session = testing.open_session(testing.make_worker(slots=4)[0]).session
    pairs = leased(session, 2)
    with transaction.atomic():
        chains = lock_leases_for_acks(
            offer_ids=[lease.offer_id for lease, _ in pairs], session_pk=session.pk
        )
        assert len(chains) == 2
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('plan_cache_mode')")
            assert cursor.fetchone() == ("force_generic_plan",)
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('plan_cache_mode')")
        assert cursor.fetchone() == ("auto",)
