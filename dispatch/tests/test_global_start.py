"""A global cycle's first reads in fewer round trips (issue 12).

The Worker snapshot's pages read in one statement (`OrmWorkerSnapshotSource`
with `pages`), the kill switch, the clock and the first recovery page in one
(`dispatch.cycles.global_start`, PostgreSQL): the same answers as one read each.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext, override_settings

from dispatch.adapters.orm import (
    OrmLeaseRecoverySource,
    OrmWorkerSnapshotSource,
    fair_rotation,
    recovery_parts,
)
from dispatch.adapters.queue import OrmQueueReader
from dispatch.core.budget import DispatchBudget
from dispatch.core.fairness import WALK_CAP
from dispatch.core.ports import DispatchScope, Page, WorkerRecord
from dispatch.core.result import CycleStatus
from dispatch.cycles import dispatch_budget, dispatch_cycle, dispatch_set_paused, global_start
from leases.models import RunLease
from qinglong import testing
from qinglong.clock import db_now
from runs.models import Attempt, Run

pytestmark = pytest.mark.django_db

GLOBAL = DispatchScope.global_()


def budget(**overrides: int) -> Any:
    return override_settings(QINGLONG_DISPATCH={**asdict(DispatchBudget()), **overrides})


def _sessions(count: int, slots: int = 2) -> None:
    for _ in range(count):
        worker, _ = testing.make_worker(slots=slots)
        testing.open_session(worker, slots=slots)


def _one_by_one(limit: int) -> list[Page[WorkerRecord]]:
    source, pages, cursor = OrmWorkerSnapshotSource(), [], None
    while True:
        page = source.worker_page(scope=GLOBAL, cursor=cursor, limit=limit)
        pages.append(page)
        if page.next_cursor is None:
            return pages
        cursor = page.next_cursor


@pytest.mark.parametrize(("sessions", "pages"), [(5, 3), (6, 3), (7, 3), (2, 2), (0, 2)])
def test_worker_pages_read_ahead_are_the_pages_read_one_by_one(sessions: int, pages: int) -> None:
    _sessions(sessions)
    expected = _one_by_one(limit=2)
    source = OrmWorkerSnapshotSource(pages=pages)
    read: list[Page[WorkerRecord]] = []
    cursor = None
    with CaptureQueriesContext(connection) as queries:
        for _ in range(pages):
            page = source.worker_page(scope=GLOBAL, cursor=cursor, limit=2)
            read.append(page)
            cursor = page.next_cursor
            if cursor is None:
                break
    assert read == expected[: len(read)]
    assert len(queries.captured_queries) == 1
    if cursor is not None:  # the fleet is larger than the pages read ahead: read on
        with CaptureQueriesContext(connection) as more:
            page = source.worker_page(scope=GLOBAL, cursor=cursor, limit=2)
        assert page == expected[len(read)]
        assert len(more.captured_queries) == 1


def test_a_global_cycle_reads_its_worker_pages_with_its_first_walk() -> None:
    task = testing.make_task()
    for _ in range(6):
        testing.make_run(task)
    _sessions(3)
    with (
        budget(worker_page_size=1, worker_max_pages=3, redelivery_backoff_s=3600),
        CaptureQueriesContext(connection) as queries,
    ):
        result = dispatch_cycle(scope=GLOBAL)
    assert result.counts.claims_won == 6
    assert result.counts.workers_seen == 3
    # Issue #12: on PostgreSQL the pages' rows come with the first walk, no
    # statement of their own; elsewhere one statement reads every page.
    pages = [q for q in queries.captured_queries if 'ORDER BY s."worker_id" LIMIT' in q["sql"]]
    walks = [q for q in queries.captured_queries if "sess AS MATERIALIZED" in q["sql"]]
    ahead = connection.vendor == "postgresql"
    assert (len(pages), len(walks)) == ((0, 1) if ahead else (1, 0))


# --------------------------------------------------------------- global start


def _claim(runs: int) -> None:
    task = testing.make_task()
    for _ in range(runs):
        testing.make_run(task)
    _sessions((runs + 7) // 8, slots=8)
    won = 0
    with budget(redelivery_backoff_s=3600):
        for _ in range(runs):
            won += dispatch_cycle(scope=GLOBAL).counts.claims_won
            if won == runs:
                return
    raise AssertionError(f"claimed {won} of {runs}")


postgres_only = pytest.mark.skipif(
    "connection.vendor != 'postgresql'", reason="the one-statement start is PostgreSQL's"
)


@postgres_only
@pytest.mark.parametrize("leases", [0, 3, 4, 5])
def test_global_start_reads_the_recovery_page_the_port_reads(leases: int) -> None:
    if leases:
        _claim(leases)
    with budget(redelivery_backoff_s=0, recovery_page_size=4):
        start = global_start(dispatch_budget())
    assert start is not None and not start.paused
    first = start.recovery
    assert (first.due_before, first.max_deliveries, first.limit) == (
        start.observed_at,
        DispatchBudget().max_deliveries,
        4,
    )
    page = OrmLeaseRecoverySource().recover_page(
        scope=GLOBAL,
        observed_at=start.observed_at,
        due_before=first.due_before,
        max_deliveries=first.max_deliveries,
        cursor=None,
        limit=4,
    )
    assert first.page == page
    assert len(page.items) == min(leases, 4)
    assert (page.next_cursor is not None) == (leases > 4)


@postgres_only
def test_global_start_serves_the_cycles_first_recovery_page() -> None:
    _claim(3)
    with budget(redelivery_backoff_s=0), CaptureQueriesContext(connection) as queries:
        result = dispatch_cycle(scope=GLOBAL)
    assert result.counts.recovered == 3
    assert result.status is CycleStatus.OFFERED
    statements = [q["sql"] for q in queries.captured_queries]
    assert statements[0].startswith("WITH RECURSIVE h AS")
    # No other read of the recovery page, nor of the clock.
    assert not [sql for sql in statements if sql.startswith("WITH l AS")]
    assert not [sql for sql in statements if "statement_timestamp()" in sql][1:]


@postgres_only
def test_global_start_is_not_served_for_other_arguments() -> None:
    _claim(2)
    with budget(redelivery_backoff_s=0):
        start = global_start(dispatch_budget())
    assert start is not None and len(start.recovery.page.items) == 2
    source = OrmLeaseRecoverySource(first_page=start.recovery)
    later = start.observed_at - timedelta(days=1)
    with CaptureQueriesContext(connection) as queries:
        page = source.recover_page(
            scope=GLOBAL,
            observed_at=start.observed_at,
            due_before=later,  # not what it was read for: read again
            max_deliveries=start.recovery.max_deliveries,
            cursor=None,
            limit=start.recovery.limit,
        )
    assert page.items == ()
    assert len(queries.captured_queries) == 1


def _most_rows_met(plan: dict[str, Any]) -> int:
    """The most rows one node of an EXPLAIN (ANALYZE, FORMAT JSON) plan produced
    or threw away, every loop counted."""
    loops = int(plan.get("Actual Loops", 1))
    met = sum(
        int(plan.get(key, 0))
        for key in ("Actual Rows", "Rows Removed by Filter", "Rows Removed by Join Filter")
    )
    return max([met * loops, *(_most_rows_met(child) for child in plan.get("Plans", ()))])


@postgres_only
@pytest.mark.parametrize("due", [False, True])
def test_the_recovery_read_meets_each_lease_a_bounded_number_of_times_under_old_statistics(
    due: bool,
) -> None:
    # Analysed while nothing was in flight (a quiet night, a fresh database),
    # the plain joins ran every dispatching Run first and the due leases once
    # per Run: leases x Runs rows (issue 12).
    # A backlog the statistics know of (index scans by key pay off), and
    # none of the leases.
    task = testing.make_task()
    assert task.current_revision_id is not None
    runs = Run.objects.bulk_create(
        Run(
            project_id=task.project_id,
            task_id=task.pk,
            task_revision_id=task.current_revision_id,
            priority=0,
            queued_at=db_now(),
        )
        for _ in range(3000)
    )
    Attempt.objects.bulk_create(
        Attempt(run=run, number=1, priority=run.priority, queued_at=run.queued_at) for run in runs
    )
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE runs_run, runs_attempt")
    _sessions(6, slots=10)  # 60 slots
    with budget(redelivery_backoff_s=3600):
        for _ in range(20):
            if not dispatch_cycle(scope=GLOBAL).counts.claims_won:
                break
    assert RunLease.objects.count() == 60
    leases, rows = recovery_parts(session=False, due=True, after=False, clock=False)
    now = db_now()
    due_before = now + timedelta(days=1) if due else now - timedelta(days=1)
    with connection.cursor() as cursor:
        cursor.execute(
            f"EXPLAIN (ANALYZE, FORMAT JSON) WITH {leases} {rows}",
            [now, 5, due_before, False, 9],
        )
        (explained,) = cursor.fetchone()
    plan = (json.loads(explained) if isinstance(explained, str) else explained)[0]["Plan"]
    # The statistics outlive the test's transaction: leave them as an empty
    # database's, as the other tests expect them.
    # Each node meets each lease once at most; never leases x Runs.
    assert _most_rows_met(plan) <= 60, json.dumps(plan)


@postgres_only
def test_global_start_walks_as_the_cycles_first_candidate_page_would() -> None:
    # Issue #12: the first walk (with the Worker rows ahead) is read with the
    # kill switch, the clock and the recovery page: the same groups, rooms and
    # Worker rows as the walk read alone at that clock, from this process's turn.
    for project in range(3):
        task = testing.make_task(testing.make_project(f"start-{project}"))
        for _ in range(4):
            testing.make_run(task)
    _sessions(2, slots=8)
    with budget(redelivery_backoff_s=3600):
        dispatch_cycle(scope=GLOBAL)  # a turn taken, leases in flight, none due
        start = global_start(dispatch_budget(), workers_ahead=9)
    assert start is not None and start.walk is not None
    assert start.walk.start == fair_rotation.start() is not None
    served = OrmQueueReader(
        observed_at=start.observed_at, scope=GLOBAL, workers_ahead=9, first_walk=start.walk
    )
    alone = OrmQueueReader(observed_at=start.observed_at, scope=GLOBAL, workers_ahead=9)
    with CaptureQueriesContext(connection) as queries:
        walked = served.walk(start=start.walk.start, cap=WALK_CAP)
    assert queries.captured_queries == []
    groups, more = walked
    assert len(groups) == 3 and not more
    assert walked == alone.walk(start=start.walk.start, cap=WALK_CAP)
    assert served.worker_rows == alone.worker_rows is not None
    # Asked for another start, it reads (once: the walk read ahead is spent).
    other = OrmQueueReader(observed_at=start.observed_at, scope=GLOBAL, first_walk=start.walk)
    with CaptureQueriesContext(connection) as queries:
        other.walk(start=None, cap=WALK_CAP)
    assert len(queries.captured_queries) == 1


@postgres_only
def test_global_start_walks_only_when_the_cycle_may_claim() -> None:
    _claim(2)
    with budget(redelivery_backoff_s=0):  # both leases are due: re-delivered, no claim
        start = global_start(dispatch_budget(), workers_ahead=9)
    assert start is not None and len(start.recovery.page.items) == 2
    assert start.walk is None
    dispatch_set_paused(paused=True)
    start = global_start(dispatch_budget(), workers_ahead=9)
    assert start is not None and start.paused and start.walk is None
    dispatch_set_paused(paused=False)


@postgres_only
def test_a_claiming_global_cycle_is_four_statements_and_its_transaction() -> None:
    task = testing.make_task()
    for _ in range(20):
        testing.make_run(task)
    _sessions(2, slots=16)
    with budget(redelivery_backoff_s=3600):
        # The first reads the revision and writes its outcome's row.
        assert dispatch_cycle(scope=GLOBAL).counts.claims_won == 8
        with CaptureQueriesContext(connection) as queries:
            result = dispatch_cycle(scope=GLOBAL)
    assert result.counts.claims_won == 8
    statements = [q["sql"] for q in queries.captured_queries]
    # The start (kill switch, clock, recovery, walk, Worker rows), the rows,
    # BEGIN, the page's locks, its writes, COMMIT.
    assert len(statements) == 6, statements
    assert statements[0].startswith("WITH RECURSIVE h AS")
    assert "FOR UPDATE OF r, a" in statements[3] and "guard AS (SELECT" in statements[4]
