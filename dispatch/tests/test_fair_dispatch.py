"""The three starvations of issue 11, through real cycles (both databases).

Each is reproduced as an operator with several Projects met it, and each
served Project's first Run must be claimed within the bound docs/adr/0012
states: with a free slot that fits it in every cycle, a Project's first Run is
claimed by the (k + 1)-th cycle, k being the Projects with servable work
ahead of it in the rotation — whatever else is queued.

1. Runs that require a label no Worker has, queued first, used to fill every
   candidate page: every cycle and every pull ended `truncated` with no offer.
2. A Project at its `max_concurrent_runs` with queued Runs used to spend every
   cycle's claim attempts losing.
3. One Project's 10,000 Runs used to delay every other Project's Runs behind
   all of them.
"""

from __future__ import annotations

import secrets
import uuid
from typing import Any

import pytest

from dispatch.core.ports import DispatchScope, PullCredential, SessionRef
from dispatch.core.result import CycleReason, CycleStatus, DispatchCycleResult
from dispatch.cycles import dispatch_cycle
from leases.end import run_cancel
from qinglong import testing
from runs.models import Project, Run, RunState, Task
from runs.services import project_create, run_enqueue_bulk

pytestmark = pytest.mark.django_db(transaction=True)

GLOBAL = DispatchScope.global_()


def project(*, limit: int = 0) -> Project:
    return project_create(
        slug=f"fair-{uuid.uuid4().hex[:10]}", name="Fair", max_concurrent_runs=limit
    )


def task(*, limit: int = 0, **overrides: Any) -> Task:
    return testing.make_task(project(limit=limit), **overrides)


def enqueue(task: Task, count: int) -> list[Run]:
    runs: list[Run] = []
    for offset in range(0, count, 1000):
        runs += run_enqueue_bulk(items=[(task, 0)] * min(1000, count - offset))
    return runs


def claimed_projects(result: DispatchCycleResult) -> list[str]:
    return [offer.project_id for offer in result.offers]


def free_slots_again(result: DispatchCycleResult) -> None:
    """The claimed Runs go away (cancelled before they start): their slots free."""
    for offer in result.offers:
        run_cancel(run=Run.objects.get(pk=int(offer.run_id)), actor="test")


def pull(session_pk: int) -> DispatchCycleResult:
    from workers.models import WorkerSession

    session = WorkerSession.objects.get(pk=session_pk)
    ref = SessionRef(str(session.worker_id), str(session.session_id), session.generation)
    credential = PullCredential(str(uuid.uuid4()), secrets.token_urlsafe(32))
    return dispatch_cycle(
        scope=DispatchScope.for_session(ref), pull=credential, max_offers=4, session_pk=session_pk
    )


# ------------------------------------------------------ 1. unplaceable first


def test_runs_no_worker_can_take_do_not_block_other_projects() -> None:
    gpu = task(placement={"required_labels": {"gpu": "a100"}})
    enqueue(gpu, 16)  # queued first, and nobody has the label
    plain = task()
    (first,) = enqueue(plain, 1)
    testing.open_session(slots=4)

    result = dispatch_cycle(scope=GLOBAL)
    # The other Project's Run is claimed in the first cycle; nothing was cut short.
    assert (result.status, result.truncated) == (CycleStatus.OFFERED, False)
    assert [offer.run_id for offer in result.offers] == [str(first.pk)]
    assert result.counts.claims_attempted == result.counts.claims_won == 1

    # A pull is served the same way: the unplaceable Runs take no place.
    (second,) = enqueue(plain, 1)
    puller = testing.open_session(slots=4).session
    pulled = pull(puller.pk)
    assert [offer.run_id for offer in pulled.offers] == [str(second.pk)]
    assert pulled.truncated is False

    # With nothing else to do, cycles are idle, not truncated on the 16.
    result = dispatch_cycle(scope=GLOBAL)
    assert (result.status, result.reason, result.truncated) == (
        CycleStatus.IDLE,
        CycleReason.NO_CANDIDATES,
        False,
    )
    assert Run.objects.filter(task=gpu, state=RunState.QUEUED).count() == 16


# ------------------------------------------------------ 2. a full Project


def test_a_project_at_its_limit_spends_no_claim_attempts() -> None:
    limited = task(limit=1)
    enqueue(limited, 9)
    testing.open_session(slots=8)
    result = dispatch_cycle(scope=GLOBAL)
    assert result.counts.claims_won == 1  # its one slot
    assert result.counts.claims_lost == 0

    other = task()
    (theirs,) = enqueue(other, 1)
    result = dispatch_cycle(scope=GLOBAL)
    # The full Project's 8 queued Runs are not candidates: no claim is lost on
    # them and the other Project's Run is claimed at once.
    assert [offer.run_id for offer in result.offers] == [str(theirs.pk)]
    assert (result.counts.claims_attempted, result.counts.claims_lost) == (1, 0)
    assert result.truncated is False
    assert Run.objects.filter(task=limited, state=RunState.QUEUED).count() == 8


# ------------------------------------------------------ 3. a flood


def test_a_flood_of_one_project_delays_another_first_run_by_its_place_in_the_rotation() -> None:
    flood = task()
    enqueue(flood, 10_000)
    late = [task(), task(), task()]  # each enqueues one Run after the flood
    for each in late:
        enqueue(each, 1)
    testing.open_session(slots=1)  # one free slot per cycle: the slowest case

    first_claim: dict[str, int] = {}
    for cycle in range(1, 9):
        result = dispatch_cycle(scope=GLOBAL)
        (claimed,) = claimed_projects(result)
        first_claim.setdefault(claimed, cycle)
        free_slots_again(result)
    # Rotation order is by Project id: the flood's Project, then the three.
    # Each late Project's first Run: within (Projects ahead of it) + 1 cycles.
    for ahead, each in enumerate(late, start=1):
        assert first_claim[str(each.project_id)] <= ahead + 1
    # The flood is served too, once per round (not starved either).
    assert first_claim[str(flood.project_id)] == 1


def test_with_slots_to_spare_every_project_is_served_in_the_first_cycle() -> None:
    flood = task()
    enqueue(flood, 10_000)
    late = [task(), task(), task()]
    for each in late:
        enqueue(each, 1)
    worker, _ = testing.make_worker(slots=8)
    testing.open_session(worker)
    result = dispatch_cycle(scope=GLOBAL)
    projects = claimed_projects(result)
    assert len(projects) == 8
    assert {str(each.project_id) for each in late} <= set(projects)
    # The flood takes what the others leave: one per round, the rest after.
    assert projects.count(str(flood.project_id)) == 5
