"""The cycle's reads are prepared once per connection with their states as literals (issue 12).

PostgreSQL soon runs a prepared statement with a generic plan; a state passed
as a parameter would keep that plan off the partial indexes over queued Runs
and active leases (`qinglong.prepared.state_literal`).
"""

from __future__ import annotations

import json
import uuid

import pytest
from django.db import connection, transaction

from dispatch.adapters import orm as orm_module
from dispatch.adapters.orm import OrmLeaseRecoverySource, OrmWorkerSnapshotSource
from dispatch.adapters.queue import OrmQueueReader, servable_sessions_cte
from dispatch.core.fairness import QueueGroup, RowsWanted
from dispatch.core.ports import DispatchScope, SessionRef
from dispatch.cycles import dispatch_cycle
from leases.locks import BatchKey, lock_claim_batch
from leases.models import LeaseState, RunLease
from qinglong import testing
from qinglong.clock import db_now
from workers.models import SessionState, Worker, WorkerAdminState, WorkerSession

pytestmark = [pytest.mark.postgres, pytest.mark.django_db]


def test_the_walk_is_prepared_once_per_scope_kind_with_literal_states() -> None:
    task = testing.make_task()
    for _ in range(3):
        testing.make_run(task)
    session = testing.open_session(slots=2).session
    scopes = [
        None,
        DispatchScope.for_session(
            SessionRef(str(session.worker_id), str(session.session_id), session.generation)
        ),
    ]
    for _ in range(6):  # past PostgreSQL's five custom plans
        for scope in scopes:
            groups, _more = OrmQueueReader(observed_at=db_now(), scope=scope).walk(
                start=None, cap=8
            )
            assert [g.group_id for g in groups] == [str(task.current_revision_id)]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT statement, generic_plans + custom_plans FROM pg_prepared_statements "
            "WHERE statement LIKE %s",
            ["%after_walk%"],
        )
        prepared = cursor.fetchall()
    assert sorted(runs for _, runs in prepared) == [6, 6]
    for text, _ in prepared:
        assert "r.state = 'queued'" in text, text
        # What is left as parameters: keys, the cursor, caps and clocks; no state.
        assert "state = $" not in text and "state IN ($" not in text, text


def _prepared(like: str) -> list[tuple[str, int, int]]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements "
            "WHERE statement LIKE %s",
            [like],
        )
        return list(cursor.fetchall())


def _no_state_parameter(text: str) -> None:
    assert "state = $" not in text and "state IN ($" not in text, text


def test_the_rows_of_any_number_of_groups_are_one_prepared_statement() -> None:
    # Its text used to grow a UNION ALL branch per group: planned anew each
    # cycle. Two texts now: one group's (a pull's common case) and any
    # number's (a LATERAL over a JSON array of the groups), each planned once
    # for good — over arrays PostgreSQL kept planning the second anew for the
    # arrays at hand, which it judged cheaper (issue #12).
    tasks = [testing.make_task() for _ in range(3)]
    runs = {task.pk: [testing.make_run(task, priority=p) for p in (0, 5)] for task in tasks}
    testing.open_session(slots=8)
    reader = OrmQueueReader(observed_at=db_now(), scope=None)
    groups, _more = reader.walk(start=None, cap=8)
    assert len(groups) == 3
    for _ in range(6):  # past PostgreSQL's five custom plans
        for chosen in (groups[:1], groups):
            found = reader.rows([RowsWanted(group, None, 8) for group in chosen])
            assert sorted(found) == sorted(group.group_id for group in chosen)
            for group in chosen:
                high, low = runs[int(group.task_id)][1], runs[int(group.task_id)][0]
                assert [c.run_id for c in found[group.group_id]] == [str(high.pk), str(low.pk)]
    ((many, generic, custom),) = _prepared("%CROSS JOIN LATERAL%")
    assert (generic, custom) == (1, 5)
    ((one, generic, custom),) = _prepared("SELECT a.id, a.version, a.lease_generation%")
    assert (generic, custom) == (1, 5)
    for text in (many, one):
        assert "r.state = 'queued'" in text
        _no_state_parameter(text)


def test_a_global_cycle_prepares_its_recovery_and_worker_reads() -> None:
    task = testing.make_task()
    for _ in range(30):
        testing.make_run(task)
    for _ in range(2):
        worker, _ = testing.make_worker(slots=16)
        testing.open_session(worker, slots=16)
    for _ in range(3):  # each claims its budget of 8, reading both Worker pages
        assert dispatch_cycle(scope=DispatchScope.global_()).counts.claims_won == 8
    # The first recovery page is read with the clock (dispatch.cycles.global_start),
    # the Worker pages by the first walk (no statement of their own).
    recovery = _prepared("WITH RECURSIVE h AS %l AS MATERIALIZED%")
    walks = _prepared("%sess AS MATERIALIZED%after_walk%")
    assert [runs for _, g, c in recovery for runs in (g + c,)] == [3]
    assert [g + c for _, g, c in walks] == [3]
    assert _prepared('%FROM "workers_workersession" s JOIN%ORDER BY s."worker_id" LIMIT%') == []
    for text, _, _ in (*recovery, *walks):
        _no_state_parameter(text)
    # Each still answers as its port says (the contract suite checks the rest).
    assert (
        OrmLeaseRecoverySource()
        .recover_page(
            scope=DispatchScope.global_(),
            observed_at=db_now(),
            due_before=None,
            max_deliveries=5,
            cursor=None,
            limit=8,
        )
        .items
    )
    assert (
        len(
            OrmWorkerSnapshotSource()
            .worker_page(scope=DispatchScope.global_(), cursor=None, limit=8)
            .items
        )
        == 2
    )


def _lease_rows_read(plan: dict[str, object]) -> int:
    """Lease rows a plan's scans of `dispatch_runlease` looked at, every loop counted."""
    seen = 0
    if plan.get("Relation Name") == "dispatch_runlease":
        loops = int(plan.get("Actual Loops", 1))  # type: ignore[call-overload]
        rows = int(plan.get("Actual Rows", 0)) + int(plan.get("Rows Removed by Filter", 0))  # type: ignore[call-overload]
        seen += rows * loops
    for child in plan.get("Plans", ()):  # type: ignore[attr-defined]
        seen += _lease_rows_read(child)
    return seen


def test_slot_counts_read_each_active_lease_once_under_statistics_older_than_the_leases() -> None:
    # Issue #12: analysed while no lease existed (a fresh database, a quiet
    # night), the plan counted each Session's slots by reading every active
    # lease: Sessions x leases in flight per Worker page and walk.
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE dispatch_runlease")
    task = testing.make_task()
    for _ in range(40):
        testing.make_run(task)
    for _ in range(6):
        worker, _ = testing.make_worker(slots=8)
        testing.open_session(worker, slots=8)
    for _ in range(4):
        dispatch_cycle(scope=DispatchScope.global_())
    active = RunLease.objects.filter(state=LeaseState.ACTIVE).count()
    assert active == 32
    assert (
        OrmWorkerSnapshotSource()
        .worker_page(scope=DispatchScope.global_(), cursor=None, limit=8)
        .items
    )  # writes its text once
    statements = [
        (next(iter(orm_module._WORKER_PAGE_SQL.values())), [9]),
        (*servable_sessions_cte(DispatchScope.global_()),),
    ]
    for sql, params in statements:
        with connection.cursor() as cursor:
            cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
            (document,) = cursor.fetchone()
        plan = (json.loads(document) if isinstance(document, str) else document)[0]["Plan"]
        assert _lease_rows_read(plan) <= active, sql


def test_ids_of_every_width_share_one_prepared_statement_per_text() -> None:
    # psycopg types an int by its value (smallint, integer, bigint; a list by
    # its largest element) and keys a prepared statement by text and types:
    # ids crossing 32,767 or 2**31, or a page mixing them, made the same text
    # new prepared statements, each planned anew (issue 12). As bigint: one.
    task = testing.make_task()
    testing.make_run(task)
    testing.open_session(slots=2)
    reader = OrmQueueReader(observed_at=db_now(), scope=None)
    (group,), _ = reader.walk(start=None, cap=8)
    other = QueueGroup(
        project_id=str(2**31 + 5), group_id="40000", task_id=group.task_id, servable=True
    )
    moment = db_now()
    widths = [5, 40_000, 2**31 + 7]
    for run_id in widths:  # a single group, then a mix of widths in one page
        reader.rows([RowsWanted(group, (run_id % 10, moment, str(run_id)), 8)])
        reader.rows([RowsWanted(group, (0, moment, str(run_id)), 8), RowsWanted(other, None, 8)])
        orm_module._global_worker_records(run_id, 9)
        keys = [
            BatchKey(0, run_id, 3, None, None, "x" * 64),
            BatchKey(1, 2**31 + 9, run_id, uuid.uuid4(), None, "y" * 64),
        ]
        with transaction.atomic():
            lock_claim_batch(keys, skip_locked=True)
    for like in (
        '%FROM "workers_workersession" s JOIN%worker_id" > $1%',
        "%unnest($1::integer[], $2::bigint[], $3::bigint[]%FOR UPDATE OF r, a SKIP LOCKED%",
    ):
        prepared = _prepared(like)
        assert len(prepared) <= 1, prepared
    for like in (
        "SELECT g.* FROM %",
        "SELECT a.id, a.version, a.lease_generation, r.id AS run_id%",
    ):
        prepared = _prepared(like)  # the rows of several groups, of one group
        assert [g + c for _, g, c in prepared] == [3], prepared


def test_the_walk_reads_ahead_exactly_the_rows_of_the_global_worker_page() -> None:
    # Issue #12: a global cycle's first walk also reads its Worker snapshot
    # (one statement fewer per claiming cycle); the rows must be the Worker
    # page's own: online Sessions of active Workers, in worker id order, with
    # their active leases.
    task = testing.make_task()
    for _ in range(12):
        testing.make_run(task)
    opened = [testing.open_session(testing.make_worker(slots=s)[0], slots=4) for s in (3, 4, 2)]
    draining, paused = (testing.open_session(testing.make_worker()[0]) for _ in range(2))
    WorkerSession.objects.filter(pk=draining.session.pk).update(state=SessionState.DRAINING)
    Worker.objects.filter(pk=paused.session.worker_id).update(admin_state=WorkerAdminState.DRAINING)
    assert dispatch_cycle(scope=DispatchScope.global_()).counts.claims_won == 8
    assert RunLease.objects.filter(state=LeaseState.ACTIVE).count() == 8
    for ahead in (2, 3, 9):
        reader = OrmQueueReader(
            observed_at=db_now(), scope=DispatchScope.global_(), workers_ahead=ahead
        )
        reader.walk(start=None, cap=8)
        assert reader.worker_rows is not None
        read = orm_module._worker_records(reader.worker_rows, canonical_ids=True)
        assert read == orm_module._global_worker_records(None, ahead)
        assert len(read) == min(ahead, len(opened))
    # Every slot taken: no Session could be served, nothing is read ahead.
    for _ in range(3):
        dispatch_cycle(scope=DispatchScope.global_())
    reader = OrmQueueReader(observed_at=db_now(), scope=DispatchScope.global_(), workers_ahead=9)
    reader.walk(start=None, cap=8)
    assert reader.worker_rows is None
