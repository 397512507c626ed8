"""A pull's first walk, read with its snapshot (issue #12): the walk the reader reads.

`dispatch.cycles.pull_snapshot` also walks the queue groups (session scope,
`dispatch.adapters.queue.walk_sql` at the statement's clock, from this
process's turn) when the cycle may claim, and the cycle's first candidate
page is served that walk instead of reading it. These tests hold the walk to
the reader's own at the same clock in the states that change its answer,
show when it is not read, and race the claim it leads to against another
connection that takes or cancels the Run between the snapshot and the claim.
"""

from __future__ import annotations

import secrets
import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext

from dispatch import cycles
from dispatch.adapters.orm import fair_rotation
from dispatch.adapters.queue import OrmQueueReader
from dispatch.core.fairness import WALK_CAP
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
from runs.models import Project, Run, RunState
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

    # The Session full: still walked (it takes claims), nothing servable.
    WorkerSession.objects.filter(pk=session.pk).update(slots=2)
    groups = _assert_walk_is_the_readers(session)
    assert not any(g.servable for g in groups)


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
