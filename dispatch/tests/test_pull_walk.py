"""A pull's first walk and rows, read with its snapshot (issue #12): what the reader reads.

`dispatch.cycles.pull_snapshot` also walks the queue groups (session scope,
`dispatch.adapters.queue.walk_sql` at the statement's clock, from this
process's turn) when the cycle may claim, and reads the first servable
group's first rows; the cycle's first candidate page is served that walk and
those rows instead of reading them. These tests hold the walk and the rows
to the reader's own at the same clock in the states that change the answer,
show when they are not read or not served, and race the claim they lead to
against another connection that takes or cancels the Run between the
snapshot and the claim.
"""

from __future__ import annotations

import secrets
import threading
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext

from dispatch import cycles
from dispatch.adapters.orm import FirstRows, _FirstRowsReader, fair_rotation
from dispatch.adapters.queue import OrmQueueReader
from dispatch.core.fairness import WALK_CAP, RowsWanted
from dispatch.core.ports import DispatchScope, PullCredential, SessionRef
from dispatch.core.result import CycleStatus
from dispatch.cycles import (
    PullSnapshot,
    dispatch_budget,
    dispatch_cycle,
    dispatch_set_paused,
    pull_snapshot,
)
from leases.ack import AckPhase, lease_ack
from leases.end import run_cancel
from leases.models import LeaseState, RunLease
from qinglong import testing
from qinglong.clock import db_now
from runs.models import Attempt, Project, Run, RunState
from workers.models import Worker, WorkerSession

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _scope(session: WorkerSession) -> DispatchScope:
    return DispatchScope.for_session(
        SessionRef(str(session.worker_id), str(session.session_id), session.generation)
    )


def _pull() -> PullCredential:
    return PullCredential(pull_id=str(uuid.uuid4()), token=secrets.token_urlsafe(32))


def _snapshot(session: WorkerSession) -> PullSnapshot:
    snapshot = pull_snapshot(
        _scope(session), session_pk=session.pk, max_deliveries=dispatch_budget().max_deliveries
    )
    assert snapshot is not None
    return snapshot


def _start(session: WorkerSession, offer: Any, token: str) -> None:
    lease_ack(
        session=session,
        offer_id=offer.offer_id,
        phase=AckPhase.STARTING,
        lease_token=token,
        spec_sha256=offer.spec_sha256,
    )


def _pull_and_start(session: WorkerSession) -> int:
    pull = _pull()
    result = dispatch_cycle(scope=_scope(session), pull=pull, session_pk=session.pk, max_offers=1)
    for offer in result.offers:  # started: no longer re-delivered
        _start(session, offer, pull.token)
    return result.counts.claims_won


def _assert_walk_is_the_readers(session: WorkerSession) -> list[Any]:
    """The snapshot's walk, served, is what the reader reads alone at that clock."""
    snapshot = _snapshot(session)
    assert snapshot.walk is not None
    assert (snapshot.walk.start, snapshot.walk.cap) == (fair_rotation.start(), WALK_CAP)
    scope = _scope(session)
    served = OrmQueueReader(observed_at=snapshot.observed_at, scope=scope, first_walk=snapshot.walk)
    alone = OrmQueueReader(observed_at=snapshot.observed_at, scope=scope)
    with CaptureQueriesContext(connection) as queries:
        walked = served.walk(start=snapshot.walk.start, cap=WALK_CAP)
    assert queries.captured_queries == []
    assert walked == alone.walk(start=snapshot.walk.start, cap=WALK_CAP)
    # Read once: asked again, the reader walks.
    with CaptureQueriesContext(connection) as queries:
        assert served.walk(start=snapshot.walk.start, cap=WALK_CAP) == walked
    assert len(queries.captured_queries) == 1
    groups, _ = walked
    return groups


def test_the_pull_walk_is_the_walk_the_reader_reads_at_that_clock() -> None:
    worker, _ = testing.make_worker(slots=4, labels={"zone": "a"})
    session = testing.open_session(worker).session
    # The second Task has room for two Runs at once.
    tasks = [
        testing.make_task(testing.make_project(f"walk-{n}"), max_concurrent_runs=limit)
        for n, limit in enumerate((0, 2, 0))
    ]
    for task in tasks:
        for _ in range(3):
            testing.make_run(task)
    # A group no Session here can take: it is walked, never servable.
    testing.make_run(placement={"required_labels": {"gpu": "yes"}})
    groups = _assert_walk_is_the_readers(session)
    assert [g.servable for g in groups] == [True, True, True, False]

    # A turn taken and leases in flight: the walk starts after that Project.
    assert _pull_and_start(session) == 1
    assert fair_rotation.start() is not None
    _assert_walk_is_the_readers(session)

    # Quotas: a Project with no room left beside the Task's room.
    Project.objects.filter(pk=tasks[0].project_id).update(max_concurrent_runs=1)
    assert _pull_and_start(session) == 1
    groups = _assert_walk_is_the_readers(session)
    rooms = {g.project_id: (g.servable, g.project_room, g.task_room) for g in groups}
    assert rooms[str(tasks[0].project_id)] == (False, 0, None)
    assert rooms[str(tasks[1].project_id)][2] in (1, 2)

    # The Session full: nothing it could take, so no group is walked.
    WorkerSession.objects.filter(pk=session.pk).update(slots=2)
    groups = _assert_walk_is_the_readers(session)
    assert groups == []


def test_an_empty_queue_is_walked_as_empty() -> None:
    session = testing.open_session().session
    snapshot = _snapshot(session)
    assert snapshot.walk is not None and snapshot.walk.rows == ()
    assert _assert_walk_is_the_readers(session) == []


def test_the_walk_is_read_only_when_the_cycle_may_claim() -> None:
    worker, _ = testing.make_worker(slots=4)
    session = testing.open_session(worker).session
    testing.make_run()
    testing.make_run()
    assert _snapshot(session).walk is not None
    dispatch_set_paused(paused=True, reason="test")
    assert _snapshot(session).walk is None
    dispatch_set_paused(paused=False)

    # A lease to re-deliver: the cycle re-delivers it and claims nothing new.
    (offer,) = dispatch_cycle(
        scope=_scope(session), pull=_pull(), session_pk=session.pk, max_offers=1
    ).offers
    snapshot = _snapshot(session)
    assert (snapshot.recoverable, snapshot.walk) == (True, None)
    # Over-delivered: the pull revokes first and reads again.
    RunLease.objects.filter(offer_id=offer.offer_id).update(
        delivery_count=dispatch_budget().max_deliveries
    )
    snapshot = _snapshot(session)
    assert (snapshot.over_delivered, snapshot.walk) == (True, None)
    RunLease.objects.filter(offer_id=offer.offer_id).update(delivery_count=1)

    # A Session that takes no claims.
    Worker.objects.filter(pk=worker.pk).update(admin_state="draining")
    snapshot = _snapshot(session)
    assert (snapshot.recoverable, snapshot.session_page, snapshot.walk) == (True, (), None)


def test_a_pull_serves_its_first_walk_and_walks_again_for_a_new_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    session = testing.open_session(testing.make_worker(slots=4)[0]).session
    for n in range(2):
        task = testing.make_task(testing.make_project(f"turn-{n}"))
        testing.make_run(task)
        testing.make_run(task)
    assert _pull_and_start(session) == 1  # warm-up: revision read, outcome row
    with CaptureQueriesContext(connection) as queries:
        assert _pull_and_start(session) == 1
    walks = [q["sql"] for q in queries.captured_queries if "after_walk(" in q["sql"]]
    assert len(walks) == 1 and '"dispatch_dispatchcontrol"' in walks[0]

    # Another thread of the process moved the turn between the snapshot and
    # the candidate page: the walk read ahead is for another start, not served.
    real = cycles.pull_snapshot

    def then_turn(*args: Any, **kwargs: Any) -> PullSnapshot | None:
        found = real(*args, **kwargs)
        fair_rotation.served("0")
        return found

    monkeypatch.setattr(cycles, "pull_snapshot", then_turn)
    with CaptureQueriesContext(connection) as queries:
        assert _pull_and_start(session) == 1
    walks = [q["sql"] for q in queries.captured_queries if "after_walk(" in q["sql"]]
    assert len(walks) == 2 and walks[1].startswith("WITH RECURSIVE servable")


def _assert_rows_are_the_readers(session: WorkerSession) -> FirstRows | None:
    """With exactly one servable group, the snapshot's rows are that group's rows
    the reader reads alone at that clock, from its start, as many as the page
    and its rooms allow; otherwise none are read ahead."""
    snapshot = _snapshot(session)
    assert snapshot.walk is not None
    scope = _scope(session)
    alone = OrmQueueReader(observed_at=snapshot.observed_at, scope=scope)
    groups, _ = alone.walk(start=snapshot.walk.start, cap=WALK_CAP)
    servable = [group for group in groups if group.servable]
    if len(servable) != 1:
        assert snapshot.rows is None
        return None
    (first,) = servable
    rows = snapshot.rows
    assert rows is not None
    assert (rows.project_id, rows.revision_id) == (first.project_id, first.group_id)
    page = dispatch_budget().candidate_page_size
    assert rows.limit == min(
        r for r in (page, first.project_room, first.task_room) if r is not None
    )
    wanted = [RowsWanted(first, None, rows.limit)]
    read = alone.rows(wanted)
    served = _FirstRowsReader(OrmQueueReader(observed_at=snapshot.observed_at, scope=scope), rows)
    with CaptureQueriesContext(connection) as queries:
        got = served.rows(wanted)
    assert queries.captured_queries == []
    assert got == read
    for candidate in got.get(first.group_id, ()):
        assert served.revision_pk(candidate) == alone.revision_pk(candidate)
    return rows


def test_the_pull_rows_are_the_rows_the_reader_reads_at_that_clock() -> None:
    worker, _ = testing.make_worker(slots=4)
    session = testing.open_session(worker).session
    assert _assert_rows_are_the_readers(session) is None  # nothing queued
    # The first group (by Project) nobody here can take: the next one's rows.
    testing.make_run(placement={"required_labels": {"gpu": "yes"}})
    task = testing.make_task(max_concurrent_runs=3)
    runs = [testing.make_run(task, priority=p) for p in (0, 5, 0, 5, 1, 0, 0, 0, 0, 0, 0)]
    rows = _assert_rows_are_the_readers(session)
    assert rows is not None and rows.limit == 3  # the Task's room
    assert [row[3] for row in rows.rows] == [runs[1].pk, runs[3].pk, runs[4].pk]
    # Not eligible now (a retry's backoff), cancel requested: not candidates.
    Attempt.objects.filter(run=runs[1]).update(not_before=db_now() + timedelta(hours=1))
    Run.objects.filter(pk=runs[3].pk).update(cancel_requested=True)
    rows = _assert_rows_are_the_readers(session)
    assert rows is not None and [row[3] for row in rows.rows] == [
        runs[4].pk,
        runs[0].pk,
        runs[2].pk,
    ]
    # A lease in flight: the Task's room is 2; the Project's (1) is less.
    assert _pull_and_start(session) == 1
    rows = _assert_rows_are_the_readers(session)
    assert rows is not None and rows.limit == 2
    Project.objects.filter(pk=task.project_id).update(max_concurrent_runs=2)
    rows = _assert_rows_are_the_readers(session)
    assert rows is not None and rows.limit == 1
    # Two servable groups: the page reads both, so none is read ahead.
    task_free = testing.make_task(task.project)
    testing.make_run(task_free)
    assert _assert_rows_are_the_readers(session) is None
    # Nothing servable: the Session full.
    WorkerSession.objects.filter(pk=session.pk).update(slots=1)
    assert _assert_rows_are_the_readers(session) is None


def test_rows_read_ahead_are_served_once_and_only_for_what_they_answer() -> None:
    session = testing.open_session(testing.make_worker(slots=4)[0]).session
    task = testing.make_task()
    for _ in range(5):
        testing.make_run(task)
    # Another group, which no Session here can take (so one group is servable).
    testing.make_run(placement={"required_labels": {"gpu": "yes"}})
    snapshot = _snapshot(session)
    rows = snapshot.rows
    assert rows is not None and len(rows.rows) == 5 and rows.limit == 8
    scope = _scope(session)
    groups, _ = OrmQueueReader(observed_at=snapshot.observed_at, scope=scope).walk(
        start=snapshot.walk.start if snapshot.walk else None, cap=WALK_CAP
    )
    first, second = groups
    assert first.group_id == rows.revision_id

    def walked(reader: Any) -> Any:
        reader.walk(start=None, cap=WALK_CAP)  # as fair_page does, first
        return reader

    def reader() -> _FirstRowsReader:
        inner = OrmQueueReader(observed_at=snapshot.observed_at, scope=scope)
        return walked(_FirstRowsReader(inner, rows))

    def reads(served: _FirstRowsReader, wanted: list[RowsWanted]) -> int:
        with CaptureQueriesContext(connection) as queries:
            got = served.rows(wanted)
        alone = walked(OrmQueueReader(observed_at=snapshot.observed_at, scope=scope))
        assert got == alone.rows(wanted)
        return len(queries.captured_queries)

    # A shorter ask is a prefix; a longer one than the group has is all of it.
    assert reads(reader(), [RowsWanted(first, None, 2)]) == 0
    assert reads(reader(), [RowsWanted(first, None, 20)]) == 0
    # With another group: that one is read, this one served.
    assert reads(reader(), [RowsWanted(first, None, 8), RowsWanted(second, None, 8)]) == 1
    # Another group alone, or this one after a key: read.
    assert reads(reader(), [RowsWanted(second, None, 8)]) == 1
    key = (0, db_now() - timedelta(days=1), "0")
    assert reads(reader(), [RowsWanted(first, key, 8)]) == 1
    # Once: asked again, it reads.
    served = reader()
    assert reads(served, [RowsWanted(first, None, 8)]) == 0
    assert reads(served, [RowsWanted(first, None, 8)]) == 1


def test_a_pull_reads_ahead_only_the_rows_of_a_lone_servable_group() -> None:
    session = testing.open_session(testing.make_worker(slots=4)[0]).session
    first = testing.make_task()
    for _ in range(4):
        testing.make_run(first)
    assert _pull_and_start(session) == 1  # warm-up: revision read, outcome row
    with CaptureQueriesContext(connection) as queries:
        assert _pull_and_start(session) == 1
    rows_reads = [q for q in queries.captured_queries if q["sql"].startswith("SELECT a.id")]
    assert rows_reads == []
    # A second Project to serve: the page asks for both groups' rows, read
    # by the candidate source as before, and none is read ahead for nothing.
    second = testing.make_task()
    for _ in range(4):
        testing.make_run(second)
    assert _snapshot(session).rows is None
    with CaptureQueriesContext(connection) as queries:
        assert _pull_and_start(session) == 1
    rows_reads = [q for q in queries.captured_queries if "CROSS JOIN LATERAL" in q["sql"]]
    assert len(rows_reads) == 1


def test_a_full_read_ahead_does_not_answer_a_longer_ask() -> None:
    session = testing.open_session(testing.make_worker(slots=4)[0]).session
    task = testing.make_task()
    for _ in range(10):
        testing.make_run(task)
    snapshot = _snapshot(session)
    rows = snapshot.rows
    assert rows is not None and len(rows.rows) == rows.limit == 8
    scope = _scope(session)
    (group,), _ = OrmQueueReader(observed_at=snapshot.observed_at, scope=scope).walk(
        start=None, cap=WALK_CAP
    )
    served = _FirstRowsReader(OrmQueueReader(observed_at=snapshot.observed_at, scope=scope), rows)
    served.walk(start=None, cap=WALK_CAP)
    with CaptureQueriesContext(connection) as queries:
        got = served.rows([RowsWanted(group, None, 9)])
    assert len(queries.captured_queries) == 1 and len(got[group.group_id]) == 9


# ------------------------------------------------- races on real connections


def _on_another_connection(work: Callable[[], Any]) -> Any:
    """Run `work` in a thread: its own connection, committed before this returns."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = work()
        except Exception as err:  # handed back to the test
            out["result"] = err
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, name="other")
    thread.start()
    thread.join(20)
    assert not thread.is_alive()
    result = out["result"]
    if isinstance(result, Exception):
        raise result
    return result


def _between_snapshot_and_claim(monkeypatch: pytest.MonkeyPatch, work: Callable[[], Any]) -> None:
    """After the pull's snapshot (and walk) is read, `work` commits on another connection."""
    real = cycles.pull_snapshot

    def then_work(*args: Any, **kwargs: Any) -> PullSnapshot | None:
        found = real(*args, **kwargs)
        assert found is not None and found.walk is not None and found.walk.rows
        _on_another_connection(work)
        return found

    monkeypatch.setattr(cycles, "pull_snapshot", then_work)


@pytest.mark.parametrize("other", ["claims", "cancels"])
def test_a_run_taken_or_cancelled_after_the_walk_is_not_claimed_by_the_pull(
    other: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = testing.open_session(testing.make_worker(slots=4)[0]).session
    rival = testing.open_session(testing.make_worker(slots=4)[0]).session
    run = testing.make_run()

    def take() -> Any:
        if other == "claims":
            outcome, _, _ = testing.claim(testing.pending_attempt(run), rival)
            return outcome.status
        return run_cancel(run=run)

    _between_snapshot_and_claim(monkeypatch, take)
    result = dispatch_cycle(scope=_scope(session), pull=_pull(), session_pk=session.pk)
    # The walk said the group had a Run; the rows and the claim see it gone.
    assert result.status is not CycleStatus.REJECTED
    assert (result.offers, result.counts.claims_won) == ((), 0)
    leases = list(RunLease.objects.values_list("session_id", "state"))
    if other == "claims":
        assert leases == [(rival.pk, LeaseState.ACTIVE)]
        assert Run.objects.get(pk=run.pk).state == RunState.DISPATCHING
    else:
        assert leases == []
        assert Run.objects.get(pk=run.pk).state == RunState.CANCELLED


def test_a_run_taken_after_the_walk_leaves_the_pull_the_next_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    session = testing.open_session(testing.make_worker(slots=4)[0]).session
    rival = testing.open_session(testing.make_worker(slots=4)[0]).session
    task = testing.make_task()
    first, second = testing.make_run(task), testing.make_run(task)

    def take() -> Any:
        outcome, _, _ = testing.claim(testing.pending_attempt(first), rival)
        return outcome.status

    _between_snapshot_and_claim(monkeypatch, take)
    result = dispatch_cycle(
        scope=_scope(session), pull=_pull(), session_pk=session.pk, max_offers=1
    )
    assert result.counts.claims_won == 1
    (offer,) = result.offers
    assert offer.run_id == str(second.pk)
    assert sorted(RunLease.objects.values_list("run_id", "session_id")) == [
        (first.pk, rival.pk),
        (second.pk, session.pk),
    ]
