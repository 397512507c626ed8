"""No free slot in view, no queue group walked (issue 12, bench/dispatch_bench.py).

A cycle whose Sessions are all full could serve no group, so its walk reads
none: the queued-Runs index is not descended at all, and a full cycle costs
the same at 100 and at 100,000 queued Runs. One free slot and the walk reads
every group again. The Session scope of a pull is gated the same way by the
pulling Session's own free slots.
"""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from dispatch.adapters.orm import fair_rotation
from dispatch.adapters.queue import OrmQueueReader
from dispatch.core.fairness import WALK_CAP
from dispatch.core.ports import DispatchScope, SessionRef
from dispatch.core.result import CycleStatus
from dispatch.cycles import dispatch_cycle
from qinglong import testing
from qinglong.clock import db_now
from workers.models import WorkerSession

pytestmark = pytest.mark.django_db

GLOBAL = DispatchScope.global_()


def _queue(projects: int = 3, runs: int = 2) -> None:
    for project in range(projects):
        task = testing.make_task(testing.make_project(f"gate-{project}"))
        for _ in range(runs):
            testing.make_run(task)


def _walk(scope: DispatchScope) -> list[str]:
    groups, _ = OrmQueueReader(observed_at=db_now(), scope=scope).walk(start=None, cap=WALK_CAP)
    return [group.project_id for group in groups]


def _session_scope(session: WorkerSession) -> DispatchScope:
    return DispatchScope.for_session(
        SessionRef(
            worker_id=str(session.worker_id),
            session_id=str(session.session_id),
            session_generation=session.generation,
        )
    )


def test_a_global_walk_reads_no_group_while_no_session_has_a_free_slot() -> None:
    _queue()
    worker, _ = testing.make_worker(slots=1)
    testing.open_session(worker, slots=1)
    assert len(_walk(GLOBAL)) == 3  # a free slot: every group
    result = dispatch_cycle(scope=GLOBAL)
    assert result.counts.claims_won == 1  # the one slot taken
    assert _walk(GLOBAL) == []  # nothing could be served: nothing walked
    other, _ = testing.make_worker(slots=1)
    testing.open_session(other, slots=1)
    assert len(_walk(GLOBAL)) == 3  # a slot again: walked again


def test_a_full_global_cycle_is_one_statement_and_keeps_the_projects_turn() -> None:
    _queue(runs=1)  # the turn's Project fully claimed: the walk would not wrap to it
    worker, _ = testing.make_worker(slots=1)
    testing.open_session(worker, slots=1)
    dispatch_cycle(scope=GLOBAL)
    turn = fair_rotation.start()
    with CaptureQueriesContext(connection) as queries:
        result = dispatch_cycle(scope=GLOBAL)
    assert result.status is CycleStatus.IDLE
    assert result.counts.claims_won == 0
    # Not a Project's fault: no Project forfeits its turn to a full fleet.
    assert fair_rotation.start() == turn
    if connection.vendor == "postgresql":
        # The kill switch, the clock, recovery and the (empty) walk: one
        # statement (and the outcome's DispatchCycle row, new in this minute).
        reads = [q for q in queries.captured_queries if "INSERT" not in q["sql"]]
        assert len(reads) == 1, reads


def test_a_pull_scope_walk_reads_no_group_while_its_session_is_full() -> None:
    _queue()
    worker, _ = testing.make_worker(slots=1)
    opened = testing.open_session(worker, slots=1)
    session = opened.session
    scope = _session_scope(session)
    assert len(_walk(scope)) == 3
    dispatch_cycle(scope=GLOBAL)  # its one slot taken
    assert _walk(scope) == []
    # Another Session's free slot does not open this Session's walk.
    other, _ = testing.make_worker(slots=1)
    testing.open_session(other, slots=1)
    assert _walk(scope) == []
    assert len(_walk(GLOBAL)) == 3
