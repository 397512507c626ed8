"""One contract suite for the dispatcher ports, run against the fakes and the ORM.

The port docstrings in `dispatch.core.ports` are the contract; the ORM case runs
on whichever database this pytest pass uses (SQLite, then PostgreSQL), so the
in-memory fakes the core is tested with are proven to behave like production.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import TypeVar

import pytest

from dispatch.core.ports import (
    ClaimStatus,
    DispatchPorts,
    DispatchScope,
    Page,
    PlanUnavailable,
    PullCredential,
    RecoverableLease,
    SessionRef,
    WorkerRecord,
    id_sort_key,
)
from dispatch.core.spec import validate_spec
from dispatch.tests.stores import (
    LEASE_TTL_S,
    Claimed,
    FakeStoreBuilder,
    OrmStoreBuilder,
    StoreBuilder,
    candidate_of,
    claim,
    claim_request,
    seconds,
    try_claim,
    unknown_session,
)

# The fakes need no database, but one module-wide mark keeps the ORM case simple.
pytestmark = pytest.mark.django_db

T = TypeVar("T")
GLOBAL = DispatchScope.global_()


@pytest.fixture(params=["fakes", "orm"])
def store(request: pytest.FixtureRequest) -> StoreBuilder:
    if request.param == "fakes":
        return FakeStoreBuilder()
    return OrmStoreBuilder()


def walk(fetch: Callable[[str | None, int], Page[T]], limit: int) -> Iterator[Page[T]]:
    """Every page in order, checking the generic paging contract on the way."""
    cursor: str | None = None
    seen: set[str] = set()
    for _ in range(200):
        page = fetch(cursor, limit)
        assert len(page.items) <= limit
        yield page
        if page.next_cursor is None:
            return
        assert page.items, "a page promising more rows must not be empty"
        assert page.next_cursor != cursor and page.next_cursor not in seen
        seen.add(page.next_cursor)
        cursor = page.next_cursor
    raise AssertionError("paging did not end")


def all_candidates(
    ports: DispatchPorts, limit: int = 64, *, observed_at: datetime | None = None
) -> list[str]:
    if observed_at is None:
        observed_at = ports.clock.now()
    pages = walk(
        lambda c, n: ports.candidates.candidate_page(observed_at=observed_at, cursor=c, limit=n),
        limit,
    )
    return [item.attempt_id for page in pages for item in page.items]


def all_workers(
    ports: DispatchPorts, scope: DispatchScope = GLOBAL, limit: int = 64
) -> list[WorkerRecord]:
    pages = walk(lambda c, n: ports.workers.worker_page(scope=scope, cursor=c, limit=n), limit)
    return [item for page in pages for item in page.items]


def all_recoverable(
    ports: DispatchPorts,
    observed_at: datetime,
    *,
    scope: DispatchScope = GLOBAL,
    due_before: datetime | None = None,
    max_deliveries: int = 5,
    limit: int = 64,
) -> list[RecoverableLease]:
    def fetch(cursor: str | None, n: int) -> Page[RecoverableLease]:
        return ports.recovery.recover_page(
            scope=scope,
            observed_at=observed_at,
            due_before=due_before,
            max_deliveries=max_deliveries,
            cursor=cursor,
            limit=n,
        )

    return [item for page in walk(fetch, limit) for item in page.items]


# ------------------------------------------------------------------ candidates


def test_candidates_come_in_priority_then_age_then_id_order_across_pages(
    store: StoreBuilder,
) -> None:
    task = store.add_task()
    t0 = store.now() - seconds(100)
    ids = {
        "old_low": store.add_run(task, priority=0, queued_at=t0)[1],
        "new_high": store.add_run(task, priority=5, queued_at=t0 + seconds(10))[1],
        "old_high": store.add_run(task, priority=5, queued_at=t0)[1],
        "new_low": store.add_run(task, priority=0, queued_at=t0 + seconds(20))[1],
        "neg": store.add_run(task, priority=-3, queued_at=t0 - seconds(50))[1],
        # Same priority and queued_at as old_high: the attempt id breaks the tie.
        "old_high_tie": store.add_run(task, priority=5, queued_at=t0)[1],
    }
    expected = [
        ids["old_high"],
        ids["old_high_tie"],
        ids["new_high"],
        ids["old_low"],
        ids["new_low"],
        ids["neg"],
    ]
    ports = store.ports()
    for limit in (1, 2, 4, 64):
        assert all_candidates(ports, limit=limit) == expected


def test_candidate_page_is_at_most_limit_and_cursor_resumes_after_it(store: StoreBuilder) -> None:
    task = store.add_task()
    t0 = store.now()
    attempts = [store.add_run(task, queued_at=t0 + seconds(i))[1] for i in range(5)]
    ports = store.ports()
    first = ports.candidates.candidate_page(observed_at=store.now(), cursor=None, limit=2)
    assert [c.attempt_id for c in first.items] == attempts[:2]
    assert first.next_cursor is not None
    second = ports.candidates.candidate_page(
        observed_at=store.now(), cursor=first.next_cursor, limit=2
    )
    assert [c.attempt_id for c in second.items] == attempts[2:4]
    last = ports.candidates.candidate_page(
        observed_at=store.now(), cursor=second.next_cursor, limit=2
    )
    assert [c.attempt_id for c in last.items] == attempts[4:]
    assert last.next_cursor is None


def test_candidates_exclude_cancelled_and_claimed_attempts(store: StoreBuilder) -> None:
    task = store.add_task()
    t0 = store.now()
    kept = store.add_run(task, queued_at=t0)[1]
    cancelled_run, cancelled = store.add_run(task, queued_at=t0 + seconds(1))
    claimed = store.add_run(task, queued_at=t0 + seconds(2))[1]
    ref = store.add_worker()
    claim(store, claimed, ref)
    store.cancel_run(cancelled_run)
    assert all_candidates(store.ports()) == [kept]
    assert cancelled not in all_candidates(store.ports())


def test_candidates_skip_attempts_held_back_past_observed_at(store: StoreBuilder) -> None:
    task = store.add_task()
    t0 = store.now()
    attempts = [store.add_run(task, queued_at=t0 + seconds(i))[1] for i in range(5)]
    now = store.now()
    # not_before: the past, exactly now, the future, the future, none.
    store.hold_back(attempts[0], now - seconds(1))
    store.hold_back(attempts[1], now)
    store.hold_back(attempts[2], now + seconds(1))
    store.hold_back(attempts[3], now + seconds(3600))
    eligible = [attempts[0], attempts[1], attempts[4]]
    for limit in (1, 2, 64):
        # The keyset steps over held-back rows without breaking the paging.
        assert all_candidates(store.ports(), limit, observed_at=now) == eligible
    later = now + seconds(1)
    assert all_candidates(store.ports(), observed_at=later) == [*attempts[:3], attempts[4]]
    # Lifting the wait makes it eligible at once.
    store.hold_back(attempts[3], None)
    assert all_candidates(store.ports(), observed_at=now) == [*eligible[:2], *attempts[3:]]


def test_candidate_carries_the_persisted_identity(store: StoreBuilder) -> None:
    task = store.add_task(executor_type="shell")
    run_id, attempt_id = store.add_run(task, priority=7, queued_at=store.now())
    (candidate,) = (
        store.ports().candidates.candidate_page(observed_at=store.now(), cursor=None, limit=8).items
    )
    assert (candidate.run_id, candidate.attempt_id) == (run_id, attempt_id)
    assert candidate.task_id == task
    assert candidate.task_revision == 1
    assert candidate.executor_type == "shell"
    assert candidate.priority == 7
    assert candidate.lease_generation == 0


def test_empty_backlog_is_one_empty_last_page(store: StoreBuilder) -> None:
    page = store.ports().candidates.candidate_page(observed_at=store.now(), cursor=None, limit=8)
    assert page.items == ()
    assert page.next_cursor is None


# --------------------------------------------------------------------- workers


def test_workers_come_in_ascending_worker_id_order_across_pages(store: StoreBuilder) -> None:
    refs = [store.add_worker() for _ in range(5)]
    expected = sorted((r.worker_id for r in refs), key=id_sort_key)
    for limit in (1, 2, 3, 64):
        assert [w.worker_id for w in all_workers(store.ports(), limit=limit)] == expected


def test_worker_snapshot_has_only_online_sessions_of_active_workers(store: StoreBuilder) -> None:
    online = store.add_worker()
    draining = store.add_worker()
    offline = store.add_worker()
    drained_worker = store.add_worker()
    replaced = store.add_worker()
    store.set_session_state(draining.worker_id, "draining")
    store.set_session_state(offline.worker_id, "offline")
    store.set_worker_admin_state(drained_worker.worker_id, "draining")
    new_ref = store.replace_session(replaced.worker_id)

    records = {w.worker_id: w for w in all_workers(store.ports())}
    assert set(records) == {online.worker_id, replaced.worker_id}
    # The replacement, never the fenced Session, is what a claim may target.
    assert records[replaced.worker_id].session == new_ref
    assert records[online.worker_id].session == online


def test_free_slots_are_slots_minus_active_leases(store: StoreBuilder) -> None:
    task = store.add_task()
    busy = store.add_worker(slots=3, labels={"zone": "a"})
    idle = store.add_worker(slots=2)
    t0 = store.now()
    for i in range(2):
        claim(store, store.add_run(task, queued_at=t0 + seconds(i))[1], busy)
    records = {w.worker_id: w for w in all_workers(store.ports())}
    assert records[busy.worker_id].free_slots == 1
    assert records[idle.worker_id].free_slots == 2
    assert dict(records[busy.worker_id].labels) == {"zone": "a"}
    assert "process" in records[busy.worker_id].executor_types


def test_full_worker_reports_zero_free_slots(store: StoreBuilder) -> None:
    task = store.add_task()
    ref = store.add_worker(slots=1)
    claim(store, store.add_run(task, queued_at=store.now())[1], ref)
    (record,) = all_workers(store.ports())
    assert record.free_slots == 0


def test_session_scope_snapshot_is_exactly_that_session(store: StoreBuilder) -> None:
    store.add_worker()
    mine = store.add_worker()
    store.add_worker()
    scope = DispatchScope.for_session(mine)
    assert [w.session for w in all_workers(store.ports(), scope)] == [mine]


def test_session_scope_snapshot_is_empty_once_the_session_is_replaced(
    store: StoreBuilder,
) -> None:
    old = store.add_worker()
    store.replace_session(old.worker_id)
    assert all_workers(store.ports(), DispatchScope.for_session(old)) == []
    assert all_workers(store.ports(), DispatchScope.for_session(unknown_session(old))) == []


# -------------------------------------------------------------------- recovery


@dataclasses.dataclass(frozen=True)
class Leased:
    a: SessionRef
    b: SessionRef
    runs: list[tuple[str, str]]
    claims: list[Claimed]


@pytest.fixture
def leased(store: StoreBuilder) -> Leased:
    """Three claimed leases on two Workers (a, b, a), claimed in order."""
    task = store.add_task()
    a, b = store.add_worker(slots=4), store.add_worker(slots=4)
    t0 = store.now()
    runs = [store.add_run(task, queued_at=t0 + seconds(i)) for i in range(3)]
    claims = [claim(store, attempt, ref) for (_, attempt), ref in zip(runs, (a, b, a), strict=True)]
    return Leased(a, b, runs, claims)


def lease_ids(rows: list[RecoverableLease]) -> list[str]:
    return [r.lease_id for r in rows]


def test_recovery_pages_active_claimed_leases_in_lease_order(
    store: StoreBuilder, leased: Leased
) -> None:
    expected = sorted((c.lease_id for c in leased.claims), key=id_sort_key)
    now = store.now()
    for limit in (1, 2, 64):
        assert lease_ids(all_recoverable(store.ports(), now, limit=limit)) == expected


def test_recovered_lease_carries_the_granted_identity(store: StoreBuilder) -> None:
    task = store.add_task()
    ref = store.add_worker()
    run_id, attempt_id = store.add_run(task, priority=3, queued_at=store.now())
    claimed = claim(store, attempt_id, ref)
    (row,) = all_recoverable(store.ports(), store.now())
    assert (row.lease_id, row.run_id, row.attempt_id) == (claimed.lease_id, run_id, attempt_id)
    assert row.session == ref
    assert row.lease_generation == 1
    assert (row.task_id, row.task_revision, row.priority) == (task, 1, 3)
    assert row.source == "new_claim"
    assert row.delivery_count == 0 and row.last_delivered_at is None
    # The plan re-materialized from the pinned revision has the claimed digest.
    plan = store.ports().plans.prepare(row.as_candidate())
    assert validate_spec(plan.spec)["attempt_id"] == attempt_id


def test_recovery_excludes_expired_leases(store: StoreBuilder, leased: Leased) -> None:
    later = store.now() + timedelta(hours=2)
    assert all_recoverable(store.ports(), later) == []


def test_recovery_excludes_cancelled_runs(store: StoreBuilder, leased: Leased) -> None:
    store.cancel_run(leased.runs[0][0])
    assert leased.claims[0].lease_id not in lease_ids(all_recoverable(store.ports(), store.now()))


def test_recovery_excludes_started_attempts(store: StoreBuilder, leased: Leased) -> None:
    store.start(leased.runs[1][1], leased.claims[1])
    assert leased.claims[1].lease_id not in lease_ids(all_recoverable(store.ports(), store.now()))


def test_recovery_excludes_replaced_and_offline_sessions_but_keeps_draining(
    store: StoreBuilder, leased: Leased
) -> None:
    store.set_session_state(leased.b.worker_id, "draining")
    rows = lease_ids(all_recoverable(store.ports(), store.now()))
    assert leased.claims[1].lease_id in rows, "a draining Session keeps its leases"
    store.replace_session(leased.a.worker_id)
    store.set_session_state(leased.b.worker_id, "offline")
    assert all_recoverable(store.ports(), store.now()) == []


def test_recovery_due_before_skips_recently_delivered_leases(
    store: StoreBuilder, leased: Leased
) -> None:
    now = store.now()
    store.record_delivery(leased.claims[0].lease_id, now - seconds(30))
    store.record_delivery(leased.claims[1].lease_id, now - seconds(1))
    rows = all_recoverable(store.ports(), now, due_before=now - seconds(5))
    # Never delivered, or delivered at/before the cutoff: due again.
    assert lease_ids(rows) == sorted(
        (leased.claims[0].lease_id, leased.claims[2].lease_id), key=id_sort_key
    )
    assert len(all_recoverable(store.ports(), now, due_before=None)) == 3


def test_recovery_skips_leases_delivered_max_deliveries_times(
    store: StoreBuilder, leased: Leased
) -> None:
    now = store.now()
    for i in range(3):  # three counted pulls, one redelivery backoff apart
        store.record_delivery(leased.claims[2].lease_id, now - seconds(60 - 5 * i))
    rows = lease_ids(all_recoverable(store.ports(), now, max_deliveries=3))
    assert leased.claims[2].lease_id not in rows
    assert leased.claims[2].lease_id in lease_ids(
        all_recoverable(store.ports(), now, max_deliveries=4)
    )


def test_session_scope_recovery_is_that_session_only(store: StoreBuilder, leased: Leased) -> None:
    rows = all_recoverable(store.ports(), store.now(), scope=DispatchScope.for_session(leased.a))
    assert lease_ids(rows) == sorted(
        (leased.claims[0].lease_id, leased.claims[2].lease_id), key=id_sort_key
    )
    assert all(r.session == leased.a for r in rows)


# ----------------------------------------------------------------------- plans


def test_plan_matches_the_candidate_and_its_pinned_revision(store: StoreBuilder) -> None:
    task = store.add_task()
    store.add_run(task, queued_at=store.now())
    ports = store.ports()
    (candidate,) = ports.candidates.candidate_page(
        observed_at=store.now(), cursor=None, limit=8
    ).items
    plan = ports.plans.prepare(candidate)
    spec = validate_spec(plan.spec)
    assert (plan.run_id, plan.attempt_id, plan.task_revision) == (
        candidate.run_id,
        candidate.attempt_id,
        candidate.task_revision,
    )
    assert spec["executor_type"] == candidate.executor_type


def test_plan_for_a_missing_attempt_or_other_revision_is_unavailable(
    store: StoreBuilder,
) -> None:
    task = store.add_task()
    store.add_run(task, queued_at=store.now())
    ports = store.ports()
    (candidate,) = ports.candidates.candidate_page(
        observed_at=store.now(), cursor=None, limit=8
    ).items
    with pytest.raises(PlanUnavailable):
        ports.plans.prepare(dataclasses.replace(candidate, attempt_id="999999"))
    # Another revision than the pinned one is never materialized, even once it
    # exists: nothing of revision 2 is built for a Run pinned to revision 1.
    with pytest.raises(PlanUnavailable):
        ports.plans.prepare(dataclasses.replace(candidate, task_revision=2))
    store.edit_task(task)
    with pytest.raises(PlanUnavailable):
        ports.plans.prepare(dataclasses.replace(candidate, task_revision=2))
    assert validate_spec(ports.plans.prepare(candidate).spec)["task_revision"] == 1


def test_free_slots_are_the_smaller_of_session_and_worker_slots(store: StoreBuilder) -> None:
    task = store.add_task()
    narrow_session = store.add_worker(slots=3, session_slots=1)
    narrowed_worker = store.add_worker(slots=3)
    store.set_worker_slots(narrowed_worker.worker_id, 2)
    claim(store, store.add_run(task, queued_at=store.now())[1], narrowed_worker)
    records = {w.worker_id: w.free_slots for w in all_workers(store.ports())}
    assert records == {narrow_session.worker_id: 1, narrowed_worker.worker_id: 1}


# ---------------------------------------------------------------------- claims
#
# The claim port's contract (`dispatch.core.ports.ClaimPort.claim`): the same
# request gets the same answer from the fake and from the database, including
# which answer wins when a request breaks several rules at once.

WON, ATTEMPT_LOST, UNAVAILABLE = (
    ClaimStatus.WON,
    ClaimStatus.ATTEMPT_LOST,
    ClaimStatus.WORKER_UNAVAILABLE,
)


def queued(store: StoreBuilder, task: str, n: int = 1) -> list[str]:
    """`n` queued Runs of `task`, oldest first; returns their Attempt ids."""
    t0 = store.now() - seconds(60)
    return [store.add_run(task, queued_at=t0 + seconds(i))[1] for i in range(n)]


def pull(n: int, token: str = "T") -> PullCredential:
    return PullCredential(pull_id=f"6f1f7a36-0000-4000-8000-{n:012d}", token=token * 43)


def test_a_won_claim_is_an_active_lease_and_the_attempt_leaves_the_candidates(
    store: StoreBuilder,
) -> None:
    task = store.add_task()
    ref = store.add_worker()
    (attempt,) = queued(store, task)
    candidate = candidate_of(store, attempt)
    before = store.now()
    outcome = try_claim(store, candidate, ref)
    assert outcome.status is WON and outcome.lease_id is not None
    assert outcome.expires_at is not None
    assert before + seconds(LEASE_TTL_S) <= outcome.expires_at <= store.now() + seconds(LEASE_TTL_S)
    assert all_candidates(store.ports()) == []
    (row,) = all_recoverable(store.ports(), store.now())
    assert (row.lease_id, row.attempt_id, row.lease_generation) == (outcome.lease_id, attempt, 1)
    assert row.session == ref


def test_a_stale_candidate_loses_the_attempt_once_another_claim_won(store: StoreBuilder) -> None:
    task = store.add_task()
    a, b = store.add_worker(), store.add_worker()
    (attempt,) = queued(store, task)
    candidate = candidate_of(store, attempt)
    assert try_claim(store, candidate, a).status is WON
    # The same read, claimed again (a rival dispatcher): Run no longer queued.
    assert try_claim(store, candidate, b).status is ATTEMPT_LOST
    (row,) = all_recoverable(store.ports(), store.now())
    assert row.session == a


def test_a_version_or_generation_mismatch_loses_the_attempt(store: StoreBuilder) -> None:
    task = store.add_task()
    ref = store.add_worker()
    (attempt,) = queued(store, task)
    candidate = candidate_of(store, attempt)
    older = dataclasses.replace(candidate, attempt_version=candidate.attempt_version - 1)
    assert try_claim(store, older, ref).status is ATTEMPT_LOST
    assert try_claim(store, candidate, ref, lease_generation=2).status is ATTEMPT_LOST
    assert try_claim(store, candidate, ref, lease_generation=0).status is ATTEMPT_LOST
    # Nothing changed: the exact candidate still wins.
    assert all_candidates(store.ports()) == [attempt]
    assert try_claim(store, candidate, ref).status is WON


def test_a_run_cancelled_after_the_read_loses_the_attempt(store: StoreBuilder) -> None:
    task = store.add_task()
    ref = store.add_worker()
    (attempt,) = queued(store, task)
    candidate = candidate_of(store, attempt)
    store.cancel_run(candidate.run_id)
    assert try_claim(store, candidate, ref).status is ATTEMPT_LOST
    assert all_recoverable(store.ports(), store.now()) == []


@pytest.mark.parametrize(
    "fence",
    [
        "replaced",
        "offline",
        "draining",
        "worker_draining",
        "worker_disabled",
        "other_generation",
        "unknown_session",
        "other_worker",
    ],
)
def test_a_session_that_may_not_take_claims_is_unavailable(store: StoreBuilder, fence: str) -> None:
    task = store.add_task()
    ref = store.add_worker()
    other = store.add_worker()
    (attempt,) = queued(store, task)
    candidate = candidate_of(store, attempt)
    target = ref
    if fence == "replaced":
        store.replace_session(ref.worker_id)
    elif fence in ("offline", "draining"):
        store.set_session_state(ref.worker_id, fence)
    elif fence.startswith("worker_"):
        store.set_worker_admin_state(ref.worker_id, fence.removeprefix("worker_"))
    elif fence == "other_generation":
        target = SessionRef(ref.worker_id, ref.session_id, ref.session_generation + 1)
    elif fence == "unknown_session":
        target = unknown_session(ref)
    else:
        target = SessionRef(other.worker_id, ref.session_id, ref.session_generation)
    assert try_claim(store, candidate, target).status is UNAVAILABLE
    # The Attempt is untouched: still the same candidate, claimable elsewhere.
    assert candidate_of(store, attempt) == candidate
    assert try_claim(store, candidate, other).status is WON


@pytest.mark.parametrize(("worker_slots", "session_slots", "narrow_to"), [(3, 1, None), (3, 3, 1)])
def test_capacity_is_the_smaller_of_session_and_worker_slots(
    store: StoreBuilder, worker_slots: int, session_slots: int, narrow_to: int | None
) -> None:
    task = store.add_task()
    ref = store.add_worker(slots=worker_slots, session_slots=session_slots)
    if narrow_to is not None:
        store.set_worker_slots(ref.worker_id, narrow_to)
    first, second = queued(store, task, 2)
    first_claim = claim(store, first, ref)
    assert try_claim(store, candidate_of(store, second), ref).status is UNAVAILABLE
    # Only active leases hold a slot: once the first one ends, the slot is free.
    store.revoke(first_claim.lease_id)
    assert try_claim(store, candidate_of(store, second), ref).status is WON


def test_every_active_lease_of_the_session_counts_against_its_slots(store: StoreBuilder) -> None:
    task = store.add_task()
    ref = store.add_worker(slots=2)
    first, second, third = queued(store, task, 3)
    started = claim(store, first, ref)
    store.start(first, started)  # a running Attempt's lease still holds its slot
    claim(store, second, ref)
    assert try_claim(store, candidate_of(store, third), ref).status is UNAVAILABLE


def test_a_project_quota_counts_dispatching_and_running_runs(store: StoreBuilder) -> None:
    task = store.add_task(max_concurrent_runs=1)
    free_task = store.add_task()
    ref = store.add_worker(slots=4)
    first, second = queued(store, task, 2)
    (elsewhere,) = queued(store, free_task)
    first_claim = claim(store, first, ref)
    # A free Worker slot does not help: the Project is at its quota.
    assert try_claim(store, candidate_of(store, second), ref).status is ATTEMPT_LOST
    # Another Project is not affected.
    assert try_claim(store, candidate_of(store, elsewhere), ref).status is WON
    # The first Run queued again: its place in the quota is free.
    store.revoke(first_claim.lease_id)
    second_claim = claim(store, second, ref)
    # A running Run holds its place too.
    store.start(second, second_claim)
    assert try_claim(store, candidate_of(store, first), ref).status is ATTEMPT_LOST


def test_a_task_limit_counts_the_live_leases_of_its_task(store: StoreBuilder) -> None:
    task = store.add_task(task_limit=1)
    sibling = store.add_task(beside=task)  # same Project, no limit of its own
    ref = store.add_worker(slots=4)
    first, second = queued(store, task, 2)
    (free,) = queued(store, sibling)
    first_claim = claim(store, first, ref)
    # A free Worker slot and a Project without a quota do not help.
    assert try_claim(store, candidate_of(store, second), ref).status is ATTEMPT_LOST
    assert store.attempt_state(second) == "pending"  # nothing changed
    # The limit is the Task's, not its Project's.
    assert try_claim(store, candidate_of(store, free), ref).status is WON
    # The lease is the slot: revoked, the slot is free at once.
    store.revoke(first_claim.lease_id)
    second_claim = claim(store, second, ref)
    # A started Attempt's lease holds the slot too.
    store.start(second, second_claim)
    assert try_claim(store, candidate_of(store, first), ref).status is ATTEMPT_LOST


def test_the_task_limit_is_the_pinned_revisions(store: StoreBuilder) -> None:
    task = store.add_task(task_limit=1)
    ref = store.add_worker(slots=4)
    first, pinned = queued(store, task, 2)
    store.edit_task(task)  # revision 2: no limit
    (later,) = queued(store, task)
    claim(store, first, ref)
    assert try_claim(store, candidate_of(store, pinned), ref).status is ATTEMPT_LOST
    assert try_claim(store, candidate_of(store, later), ref).status is WON


def test_the_task_limit_answers_before_session_checks(store: StoreBuilder) -> None:
    task = store.add_task(task_limit=1)
    ref = store.add_worker()
    other = store.add_worker()
    first, second = queued(store, task, 2)
    claim(store, first, other)
    store.set_session_state(ref.worker_id, "offline")
    assert try_claim(store, candidate_of(store, second), ref).status is ATTEMPT_LOST


def test_one_pull_id_carries_one_token_per_session(store: StoreBuilder) -> None:
    task = store.add_task()
    ref = store.add_worker(slots=4)
    other = store.add_worker(slots=4)
    a, b, c, d = queued(store, task, 4)
    assert try_claim(store, candidate_of(store, a), ref, pull=pull(1, "T")).status is WON
    # Same pull id, another token, same Session: refused.
    assert try_claim(store, candidate_of(store, b), ref, pull=pull(1, "U")).status is UNAVAILABLE
    # Same pull id and token: the same pull claiming a second offer.
    assert try_claim(store, candidate_of(store, b), ref, pull=pull(1, "T")).status is WON
    # A fresh pull id with another token is fine, and so is another Session.
    assert try_claim(store, candidate_of(store, c), ref, pull=pull(2, "U")).status is WON
    assert try_claim(store, candidate_of(store, d), other, pull=pull(1, "U")).status is WON


BACKOFF = seconds(5)  # the default redelivery backoff, in the fakes and the settings


def deliver(store: StoreBuilder, lease_id: str, times: int) -> None:
    """`times` counted pulls of the lease, one redelivery backoff apart."""
    t0 = store.now()
    for i in range(times):
        store.record_delivery(lease_id, t0 + BACKOFF * i)


def test_a_re_poll_inside_the_redelivery_backoff_is_not_a_delivery(store: StoreBuilder) -> None:
    task = store.add_task()
    ref = store.add_worker()
    (attempt,) = queued(store, task)
    lease = claim(store, attempt, ref)
    t0 = store.now()
    # An agent pulling five times in a second before it ACKs what it holds.
    for i in range(5):
        store.record_delivery(lease.lease_id, t0 + seconds(0.2 * i))
    assert store.revoke_over_delivered(max_deliveries=2) == 0
    # One backoff after the counted one, a pull counts again.
    store.record_delivery(lease.lease_id, t0 + BACKOFF)
    assert store.revoke_over_delivered(max_deliveries=2) == 1


def test_an_over_delivered_attempt_waits_one_backoff_then_any_session_may_claim_it(
    store: StoreBuilder,
) -> None:
    task = store.add_task()
    ref, other = store.add_worker(), store.add_worker()
    (attempt,) = queued(store, task)
    lease = claim(store, attempt, ref)
    deliver(store, lease.lease_id, 3)
    assert store.revoke_over_delivered(max_deliveries=4) == 0
    assert store.revoke_over_delivered(max_deliveries=3) == 1
    revoked_at = store.now()
    assert store.attempt_state(attempt) == "pending"
    # Held back for one redelivery backoff, for every Worker alike ...
    assert attempt not in all_candidates(store.ports())
    early = revoked_at + BACKOFF - seconds(1)
    assert attempt not in all_candidates(store.ports(), observed_at=early)
    # ... then eligible again, for the same Session too (docs/adr/0005).
    candidate = candidate_of(store, attempt, observed_at=revoked_at + BACKOFF)
    assert candidate.lease_generation == 1
    assert try_claim(store, candidate, ref).status is WON
    assert try_claim(store, candidate, other).status is ATTEMPT_LOST


def test_an_over_delivered_attempt_may_go_to_a_later_session_of_the_same_worker(
    store: StoreBuilder,
) -> None:
    task = store.add_task()
    ref = store.add_worker()
    (attempt,) = queued(store, task)
    lease = claim(store, attempt, ref)
    deliver(store, lease.lease_id, 1)
    assert store.revoke_over_delivered(max_deliveries=1) == 1
    replacement = store.replace_session(ref.worker_id)
    later = store.now() + BACKOFF
    assert (
        try_claim(store, candidate_of(store, attempt, observed_at=later), replacement).status is WON
    )


def test_the_last_delivery_round_fails_the_run_undeliverable(store: StoreBuilder) -> None:
    task = store.add_task()
    ref = store.add_worker()
    run_id, attempt = store.add_run(task, queued_at=store.now() - seconds(60))
    rounds = 3  # max_delivery_rounds, the default in the fakes and the settings
    for round_ in range(1, rounds + 1):
        later = store.now() + BACKOFF
        candidate = candidate_of(store, attempt, observed_at=later)
        assert candidate.lease_generation == round_ - 1
        outcome = try_claim(store, candidate, ref)
        assert outcome.status is WON and outcome.lease_id is not None
        deliver(store, outcome.lease_id, 1)
        assert store.revoke_over_delivered(max_deliveries=1) == 1
        expected = "pending" if round_ < rounds else "start_failed"
        assert store.attempt_state(attempt) == expected
    # Never silently queued: the Run failed and nothing is left to claim.
    assert store.run_state(run_id) == "failed"
    far = store.now() + BACKOFF * 100
    assert attempt not in all_candidates(store.ports(), observed_at=far)


def test_a_revoke_for_another_reason_returns_the_attempt_at_once(store: StoreBuilder) -> None:
    task = store.add_task()
    ref = store.add_worker()
    (attempt,) = queued(store, task)
    store.revoke(claim(store, attempt, ref).lease_id)
    assert try_claim(store, candidate_of(store, attempt), ref).status is WON


# Several rules broken at once: the first in the contract's order answers.


def test_attempt_checks_answer_before_session_checks(store: StoreBuilder) -> None:
    task = store.add_task()
    ref = store.add_worker()
    (attempt,) = queued(store, task)
    candidate = candidate_of(store, attempt)
    store.cancel_run(candidate.run_id)
    store.replace_session(ref.worker_id)
    assert try_claim(store, candidate, ref).status is ATTEMPT_LOST


def test_the_project_quota_answers_before_session_checks(store: StoreBuilder) -> None:
    task = store.add_task(max_concurrent_runs=1)
    ref = store.add_worker()
    other = store.add_worker()
    first, second = queued(store, task, 2)
    claim(store, first, other)
    store.set_session_state(ref.worker_id, "offline")
    assert try_claim(store, candidate_of(store, second), ref).status is ATTEMPT_LOST


def test_the_pull_id_check_answers_before_slots(store: StoreBuilder) -> None:
    task = store.add_task()
    ref = store.add_worker(slots=1)
    other = store.add_worker()
    waiting, filler = queued(store, task, 2)
    assert try_claim(store, candidate_of(store, filler), ref, pull=pull(7, "T")).status is WON
    # ref is now full and has pull 7 with token T.
    candidate = candidate_of(store, waiting)
    assert try_claim(store, candidate, ref, pull=pull(7, "U")).status is UNAVAILABLE
    assert try_claim(store, candidate, ref, pull=pull(7, "T")).status is UNAVAILABLE
    assert try_claim(store, candidate, other).status is WON


# A page of claims (`claim_many`, issue #12): each request answered as if the
# ones before it had been claimed one after the other.


def page(
    store: StoreBuilder,
    pairs: list[tuple[str, SessionRef]],
    *,
    pulls: list[PullCredential | None] | None = None,
) -> list[ClaimStatus]:
    """Claim `(attempt, Session)` pairs as one page; their statuses, in order."""
    requests = []
    for index, (attempt, ref) in enumerate(pairs):
        credential = None if pulls is None else pulls[index]
        request, _ = claim_request(store, candidate_of(store, attempt), ref, pull=credential)
        requests.append(request)
    outcomes = store.ports().claims.claim_many(requests)
    assert len(outcomes) == len(requests)
    return [outcome.status for outcome in outcomes]


def test_a_page_fills_a_session_in_order_and_claims_an_attempt_once(
    store: StoreBuilder,
) -> None:
    task = store.add_task()
    small, big = store.add_worker(slots=2), store.add_worker(slots=4)
    a, b, c, d = queued(store, task, 4)
    assert page(store, [(a, small), (b, small), (c, small), (d, big)]) == [
        WON,
        WON,
        UNAVAILABLE,
        WON,
    ]
    e, f = queued(store, task, 2)
    ea = candidate_of(store, e)
    twice, _ = claim_request(store, ea, big)
    again, _ = claim_request(store, ea, small)
    other, _ = claim_request(store, candidate_of(store, f), big)
    outcomes = store.ports().claims.claim_many([twice, again, other])
    assert [o.status for o in outcomes] == [WON, ATTEMPT_LOST, WON]
    assert [r.session for r in all_recoverable(store.ports(), store.now())].count(big) == 3


def test_a_page_keeps_quotas_and_answers_them_before_the_session(store: StoreBuilder) -> None:
    limited = store.add_task(max_concurrent_runs=2)
    task_limited = store.add_task(task_limit=1)
    free = store.add_task()
    ref = store.add_worker(slots=8)
    gone = store.add_worker(slots=8)
    store.set_session_state(gone.worker_id, "offline")
    p1, p2, p3 = queued(store, limited, 3)
    t1, t2 = queued(store, task_limited, 2)
    (f1,) = queued(store, free)
    statuses = page(store, [(p1, ref), (p2, ref), (p3, gone), (t1, ref), (t2, gone), (f1, ref)])
    # p3 and t2 find their quota taken by the page before the offline Session.
    assert statuses == [WON, WON, ATTEMPT_LOST, WON, ATTEMPT_LOST, WON]


def test_a_page_keeps_one_pull_id_to_one_token(store: StoreBuilder) -> None:
    task = store.add_task()
    ref = store.add_worker(slots=8)
    a, b, c, d = queued(store, task, 4)
    assert try_claim(store, candidate_of(store, a), ref, pull=pull(1, "T")).status is WON
    statuses = page(
        store,
        [(b, ref), (c, ref), (d, ref)],
        pulls=[pull(1, "U"), pull(1, "T"), pull(2, "V")],
    )
    assert statuses == [UNAVAILABLE, WON, WON]
    e, f = queued(store, task, 2)
    assert page(store, [(e, ref), (f, ref)], pulls=[pull(3, "X"), pull(3, "Y")]) == [
        WON,
        UNAVAILABLE,
    ]


def test_a_stale_or_cancelled_request_loses_alone_in_a_page(store: StoreBuilder) -> None:
    task = store.add_task()
    ref = store.add_worker(slots=8)
    a, b, c = queued(store, task, 3)
    stale = candidate_of(store, b)
    cancelled = candidate_of(store, c)
    claim(store, b, ref)  # a rival won `b` since our read
    store.cancel_run(cancelled.run_id)
    requests = [
        claim_request(store, candidate_of(store, a), ref)[0],
        claim_request(store, stale, ref)[0],
        claim_request(store, cancelled, ref)[0],
    ]
    outcomes = store.ports().claims.claim_many(requests)
    assert [o.status for o in outcomes] == [WON, ATTEMPT_LOST, ATTEMPT_LOST]
