"""`dispatch_cycle` end to end on the real database (docs/adr/0001, database level).

Runs on SQLite and on PostgreSQL. Cross-connection races live in
`leases/tests/test_lost_races_postgres.py` and `test_race_postgres.py`.
"""

from __future__ import annotations

import json
import logging
import secrets
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from typing import Any

import pytest
from django.db import connection, transaction
from django.forms.models import model_to_dict
from django.test.utils import CaptureQueriesContext, override_settings

from dispatch.adapters.orm import OrmLeaseRecoverySource, revisions_read
from dispatch.core import spec as spec_module
from dispatch.core.budget import DispatchBudget
from dispatch.core.offer import ClaimedExecutionOffer, OfferSource
from dispatch.core.ports import DispatchScope, PullCredential, SessionRef
from dispatch.core.result import CycleReason, CycleStatus
from dispatch.core.spec import spec_sha256, validate_spec
from dispatch.cycles import cycle_recorder, dispatch_cycle, dispatch_paused, dispatch_set_paused
from dispatch.models import DispatchCycle
from leases.end import run_cancel
from leases.models import LeaseState, RunLease
from qinglong import testing
from qinglong.clock import db_now
from runs.models import Attempt, AttemptState, Run, RunState
from runs.services import attempt_spec, task_update
from workers.models import WorkerSession
from workers.services import session_open

pytestmark = pytest.mark.django_db

GLOBAL = DispatchScope.global_()
DEFAULTS = asdict(DispatchBudget())


def budget(**overrides: int) -> Any:
    return override_settings(QINGLONG_DISPATCH={**DEFAULTS, **overrides})


def ref(session: WorkerSession) -> SessionRef:
    return SessionRef(str(session.worker_id), str(session.session_id), session.generation)


def session_scope(session: WorkerSession) -> DispatchScope:
    return DispatchScope.for_session(ref(session))


def pull() -> PullCredential:
    return PullCredential(pull_id=str(uuid.uuid4()), token=secrets.token_urlsafe(32))


def touched(queries: CaptureQueriesContext, table: str) -> list[str]:
    return [q["sql"] for q in queries.captured_queries if table in q["sql"]]


def read_from(queries: CaptureQueriesContext, table: str) -> list[str]:
    """Queries that read `table` itself (not the recovery read, whose join
    checks a lease's Session is still current)."""
    return [
        q["sql"]
        for q in queries.captured_queries
        if f'FROM "{table}"' in q["sql"] and not q["sql"].startswith(_RECOVERY_READS)
    ]


# The recovery read, alone or with a global cycle's clock (dispatch.cycles.global_start).
_RECOVERY_READS = ("WITH l AS", "WITH RECURSIVE h AS")


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def dispatch_log() -> Iterator[ListHandler]:
    # The "qinglong" logger does not propagate to root, so caplog cannot see it.
    handler = ListHandler()
    logger = logging.getLogger("qinglong.dispatch")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


class RecordingNotifier:
    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def notify(self, offers: Sequence[ClaimedExecutionOffer]) -> None:
        self.calls.append([offer.offer_id for offer in offers])


# ------------------------------------------------------------ order and scope


def test_no_candidate_reads_no_workers_plans_or_claims() -> None:
    testing.open_session()
    with CaptureQueriesContext(connection) as queries:
        result = dispatch_cycle(scope=GLOBAL)
    assert (result.status, result.reason) == (CycleStatus.IDLE, CycleReason.NO_CANDIDATES)
    # The one candidate page is the queue walk (docs/adr/0012), which found no
    # queue: it names the Sessions only to judge a queue it finds.
    walks = [sql for sql in touched(queries, "runs_run") if sql.startswith("WITH RECURSIVE")]
    assert len(walks) == 1
    assert [sql for sql in read_from(queries, "workers_workersession") if sql not in walks] == []
    # No Run was read, and no plan (which would read an Attempt by id).
    assert read_from(queries, "runs_attempt") == []
    assert not any(sql.startswith("INSERT") for sql in touched(queries, "dispatch_runlease"))
    assert RunLease.objects.count() == 0
    assert result.counts.workers_seen == result.counts.plans_built == 0
    assert result.counts.claims_attempted == 0


def test_placement_claims_the_matching_worker_with_its_session_identity() -> None:
    plain = testing.open_session(labels={"zone": "a"}).session
    gpu_far = testing.open_session(labels={"gpu": "yes", "zone": "b"}).session
    gpu_near = testing.open_session(labels={"gpu": "yes", "zone": "a"}).session
    run = testing.make_run(
        placement={
            "required_labels": {"gpu": "yes"},
            "preferred": [{"labels": {"zone": "a"}, "weight": 10}],
        }
    )
    result = dispatch_cycle(scope=GLOBAL)
    assert result.status is CycleStatus.OFFERED
    (offer,) = result.offers
    lease = RunLease.objects.get(run=run)
    assert lease.session_id == gpu_near.pk
    assert lease.worker_id == gpu_near.worker_id
    assert lease.session_generation == gpu_near.generation
    assert lease.placement_score == offer.placement_score == 10
    assert (offer.worker_id, offer.session_id) == (
        str(gpu_near.worker_id),
        str(gpu_near.session_id),
    )
    assert plain.pk != lease.session_id != gpu_far.pk


def test_recovery_comes_before_candidates_and_survives_a_restart() -> None:
    testing.open_session(slots=4)
    first_run = testing.make_run()
    with budget(redelivery_backoff_s=0):
        first = dispatch_cycle(scope=GLOBAL)
        (claimed,) = first.offers
        testing.make_run()  # a fresh candidate that must wait for the recovery
        # A "restart": dispatch_cycle wires brand-new ports every call.
        second = dispatch_cycle(scope=GLOBAL)
    assert claimed.source is OfferSource.NEW_CLAIM
    (recovered,) = second.offers
    assert recovered.source is OfferSource.LEASE_RECOVERY
    assert second.counts.claims_attempted == 0 and second.counts.candidates_seen == 0
    assert recovered.offer_id == claimed.offer_id
    assert recovered.lease.token == claimed.lease.token is not None
    assert recovered.spec_sha256 == claimed.spec_sha256
    assert recovered.lease.lease_id == claimed.lease.lease_id
    assert recovered.run_id == str(first_run.pk)


def test_global_recovery_waits_for_the_redelivery_backoff() -> None:
    testing.open_session(slots=4)
    testing.make_run()
    with budget(redelivery_backoff_s=3600):
        dispatch_cycle(scope=GLOBAL)
        again = dispatch_cycle(scope=GLOBAL)
    assert again.counts.recovered == 0
    assert again.status is CycleStatus.IDLE


def test_global_announcements_do_not_count_as_deliveries() -> None:
    testing.open_session()
    testing.make_run()
    with budget(redelivery_backoff_s=0, max_deliveries=2):
        for _ in range(4):
            dispatch_cycle(scope=GLOBAL)
    lease = RunLease.objects.get()
    # Only a Worker's pull counts toward max_deliveries (README "Worker API"); the
    # global cycle's content-free nudges only restart the backoff.
    assert (lease.state, lease.delivery_count) == (LeaseState.ACTIVE, 0)
    assert lease.last_delivered_at is not None


def test_cancelled_run_is_not_redelivered() -> None:
    testing.open_session()
    run = testing.make_run()
    with budget(redelivery_backoff_s=0):
        dispatch_cycle(scope=GLOBAL)
        run_cancel(run=run)
        after = dispatch_cycle(scope=GLOBAL)
    assert after.offers == ()
    assert Run.objects.get(pk=run.pk).state == RunState.CANCELLED
    assert RunLease.objects.get(run=run).state == LeaseState.REVOKED


def test_replaced_session_lease_is_not_redelivered_and_the_attempt_is_reclaimed() -> None:
    opened = testing.open_session()
    run = testing.make_run()
    with budget(redelivery_backoff_s=0):
        (old_offer,) = dispatch_cycle(scope=GLOBAL).offers
        worker = opened.session.worker
        new = session_open(
            worker=worker,
            executor_types=list(worker.executor_types),
            labels=dict(worker.labels),
            slots=worker.slots,
        ).session
        after = dispatch_cycle(scope=GLOBAL)
    assert old_offer.offer_id not in {o.offer_id for o in after.offers}
    (offer,) = after.offers
    assert offer.source is OfferSource.NEW_CLAIM
    assert (offer.session_id, offer.session_generation) == (str(new.session_id), new.generation)
    assert offer.lease.generation == 2
    assert Attempt.objects.get(run=run).lease_generation == 2


def test_spec_drift_on_a_lease_fails_the_cycle_closed() -> None:
    testing.open_session()
    testing.make_run()
    with budget(redelivery_backoff_s=0):
        dispatch_cycle(scope=GLOBAL)
        RunLease.objects.update(spec_digest="0" * 64)
        result = dispatch_cycle(scope=GLOBAL)
    assert (result.status, result.reason) == (
        CycleStatus.REJECTED,
        CycleReason.RECOVERY_SPEC_DRIFT,
    )
    assert result.offers == ()
    row = DispatchCycle.objects.order_by("-id").first()
    assert row is not None and row.reason == "recovery_spec_drift"


def test_lease_of_a_superseded_attempt_generation_is_not_recoverable() -> None:
    testing.open_session()
    testing.make_run()
    dispatch_cycle(scope=GLOBAL)
    Attempt.objects.update(lease_generation=7)
    page = OrmLeaseRecoverySource().recover_page(
        scope=GLOBAL,
        observed_at=db_now(),
        due_before=None,
        max_deliveries=5,
        cursor=None,
        limit=8,
    )
    assert page.items == ()


# ---------------------------------------------------------------- kill switch


def test_paused_dispatch_reads_nothing_and_records_a_paused_cycle() -> None:
    testing.open_session()
    run = testing.make_run()
    dispatch_set_paused(paused=True, reason="maintenance", actor="ops")
    assert dispatch_paused() is True
    with CaptureQueriesContext(connection) as queries:
        result = dispatch_cycle(scope=GLOBAL)
    assert (result.status, result.reason) == (CycleStatus.PAUSED, CycleReason.DISPATCH_PAUSED)
    statements = [q["sql"] for q in queries.captured_queries]
    if connection.vendor == "postgresql":
        # The first statement reads the kill switch, the clock and the first
        # recovery page at once; paused, its one-time filter reads no lease.
        start = statements.pop(0)
        assert start.startswith("WITH RECURSIVE h AS")
        with connection.cursor() as cursor:
            cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {start}")
            plan = cursor.fetchone()[0][0]["Plan"]
        scans = list(_scans_of(plan, "dispatch_runlease"))
        assert scans
        assert [node["Actual Loops"] for node in scans] == [0] * len(scans)
    for table in ("runs_attempt", "workers_workersession", "dispatch_runlease"):
        assert [sql for sql in statements if table in sql] == []
    row = DispatchCycle.objects.get()
    assert (row.status, row.reason, row.scope) == ("paused", "dispatch_paused", "global")
    assert Run.objects.get(pk=run.pk).state == RunState.QUEUED

    dispatch_set_paused(paused=False)
    assert dispatch_cycle(scope=GLOBAL).status is CycleStatus.OFFERED


def _scans_of(plan: dict[str, Any], table: str) -> Iterator[dict[str, Any]]:
    """The nodes of an EXPLAIN (FORMAT JSON) plan that scan `table`."""
    if plan.get("Relation Name") == table:
        yield plan
    for child in plan.get("Plans", ()):
        yield from _scans_of(child, table)


# ------------------------------------------------------------------ redaction


def test_cycle_record_and_log_are_exactly_the_summary_and_leak_nothing(
    dispatch_log: ListHandler,
) -> None:
    testing.open_session()
    task = testing.make_task()
    task_update(task=task, definition=testing.canary_definition())
    testing.make_run(task)
    result = dispatch_cycle(scope=GLOBAL)
    (offer,) = result.offers
    assert offer.lease.token is not None
    row = DispatchCycle.objects.get()
    summary = result.summary()
    stored = {
        "scope": row.scope,
        "status": row.status,
        "reason": row.reason,
        "truncated": row.truncated,
        "observed_at": row.observed_at,
        "duration_ms": row.duration_ms,
        "counts": row.counts,
    }
    assert stored == {**summary, "observed_at": result.observed_at}
    assert row.session_id is None

    (cycle_log,) = [r for r in dispatch_log.records if getattr(r, "event", "") == "dispatch_cycle"]
    assert {key: getattr(cycle_log, key) for key in summary} == summary
    dumped = json.dumps(model_to_dict(row), default=str) + json.dumps(
        [vars(r) for r in dispatch_log.records], default=str
    )
    for secret in (
        testing.CANARY_COMMAND,
        testing.CANARY_ENV,
        testing.CANARY_CWD,
        offer.lease.token,
    ):
        assert secret not in dumped


# -------------------------------------------------------------- session scope


def test_pull_token_is_echoed_only_to_the_same_pull() -> None:
    session = testing.open_session().session
    testing.make_run()
    credential = pull()
    scope = session_scope(session)
    first = dispatch_cycle(scope=scope, pull=credential, session_pk=session.pk)
    (claimed,) = first.offers
    assert claimed.source is OfferSource.NEW_CLAIM
    assert claimed.lease.token == credential.token
    lease = RunLease.objects.get()
    assert (lease.source, str(lease.pull_id)) == ("pull_claim", credential.pull_id)

    replay = dispatch_cycle(scope=scope, pull=credential)
    (same,) = replay.offers
    assert (same.source, same.offer_id) == (OfferSource.LEASE_RECOVERY, claimed.offer_id)
    assert same.lease.token == credential.token

    other = dispatch_cycle(scope=scope, pull=pull())
    (redelivered,) = other.offers
    assert redelivered.offer_id == claimed.offer_id
    assert redelivered.lease.token is None
    # A new outcome is a row at once; the repeat waits for the summary row.
    rows = DispatchCycle.objects.filter(session_id=session.session_id)
    assert sorted(rows.values_list("reason", "cycles")) == [("claimed", 1), ("recovered", 1)]
    assert cycle_recorder.flush() == 1
    assert sum(rows.values_list("cycles", flat=True)) == 3
    # Three pulls inside one redelivery backoff: one delivery, two re-polls
    # (docs/adr/0005).
    assert RunLease.objects.get().delivery_count == 1


def test_session_scope_claims_only_for_the_pulling_session() -> None:
    testing.open_session(labels={"gpu": "yes"})
    mine = testing.open_session().session
    testing.make_run()
    result = dispatch_cycle(scope=session_scope(mine), pull=pull())
    (offer,) = result.offers
    assert offer.session_id == str(mine.session_id)
    assert result.counts.workers_seen == 1


def test_over_delivered_lease_is_revoked_on_pull() -> None:
    session = testing.open_session().session
    run = testing.make_run()
    credential = pull()
    with budget(max_deliveries=2, redelivery_backoff_s=0):
        dispatch_cycle(scope=session_scope(session), pull=credential)
        dispatch_cycle(scope=session_scope(session), pull=credential)
        first = RunLease.objects.get()
        assert first.delivery_count == 2
        result = dispatch_cycle(scope=session_scope(session), pull=credential)
    first.refresh_from_db()
    assert (first.state, first.end_reason) == (LeaseState.REVOKED, "max_deliveries")
    # The Attempt went back to the queue and, with no backoff to wait, the same
    # pull claimed it again: an over-delivered Attempt is not barred from the
    # Session that did not start it (docs/adr/0005), so one Worker never strands it.
    (offer,) = result.offers
    assert offer.source is OfferSource.NEW_CLAIM
    assert offer.lease.generation == 2
    assert offer.session_id == str(session.session_id)
    attempt = Attempt.objects.get(run=run)
    assert (attempt.state, attempt.lease_generation) == (AttemptState.CLAIMED, 2)


def test_session_scope_without_pull_credential_is_refused() -> None:
    session = testing.open_session().session
    with pytest.raises(ValueError, match="pull credential"):
        dispatch_cycle(scope=session_scope(session))


# ------------------------------------------------------------- notification


def test_global_offers_are_notified_by_id_and_session_offers_are_not() -> None:
    session = testing.open_session(slots=4).session
    testing.make_run()
    notifier = RecordingNotifier()
    result = dispatch_cycle(scope=GLOBAL, notifier=notifier)
    assert notifier.calls == [[result.offers[0].offer_id]]
    testing.make_run()
    dispatch_cycle(scope=session_scope(session), pull=pull(), notifier=notifier)
    assert len(notifier.calls) == 1


def test_failing_notifier_does_not_lose_the_committed_claim(dispatch_log: ListHandler) -> None:
    class Broken:
        def notify(self, offers: Sequence[ClaimedExecutionOffer]) -> None:
            raise ConnectionError("broker down")

    testing.open_session()
    testing.make_run()
    result = dispatch_cycle(scope=GLOBAL, notifier=Broken())
    assert result.status is CycleStatus.OFFERED
    assert RunLease.objects.filter(state=LeaseState.ACTIVE).count() == 1
    assert DispatchCycle.objects.count() == 1
    assert any(getattr(r, "event", "") == "offer_notify_failed" for r in dispatch_log.records)


def test_dispatch_cycle_refuses_to_run_inside_a_transaction() -> None:
    with transaction.atomic(), pytest.raises(RuntimeError, match="inside a transaction"):
        dispatch_cycle(scope=GLOBAL)


# ------------------------------------------------------------------ boundedness


def _sessions(count: int, slots: int) -> None:
    for _ in range(count):
        testing.open_session(slots=slots)


# The first cycle's offers must not come due for re-announcement before the
# second cycle, however slow the box (the second would then recover them
# instead of claiming: seen under a load of 9 on 2 cores).
def test_query_count_per_cycle_does_not_grow_with_the_backlog() -> None:
    task = testing.make_task()
    _sessions(2, slots=2)
    for _ in range(10):
        testing.make_run(task)
    with budget(redelivery_backoff_s=3600), CaptureQueriesContext(connection) as small:
        small_result = dispatch_cycle(scope=GLOBAL)

    # Fresh capacity (the first Workers are full) and a 20x backlog.
    _sessions(2, slots=2)
    for _ in range(200):
        testing.make_run(task)
    cycle_recorder.reset()  # both cycles are written as rows of their own
    revisions_read.clear()  # and both read the Task's revision
    with budget(redelivery_backoff_s=3600), CaptureQueriesContext(connection) as large:
        large_result = dispatch_cycle(scope=GLOBAL)

    assert small_result.counts.claims_won == large_result.counts.claims_won == 4
    assert small_result.counts.candidates_seen == large_result.counts.candidates_seen
    assert len(small.captured_queries) == len(large.captured_queries)


def test_a_cycle_reads_the_revisions_it_does_not_keep_yet_in_one_statement() -> None:
    # Issue #12: a new process (or new Tasks) read each pinned revision with a
    # statement of its own, up to a claim budget of them per cycle.
    tasks = [testing.make_task(testing.make_project()) for _ in range(4)]
    for task in tasks:
        testing.make_run(task)
    _sessions(2, slots=2)
    revisions_read.clear()
    with budget(redelivery_backoff_s=3600), CaptureQueriesContext(connection) as queries:
        result = dispatch_cycle(scope=GLOBAL)
    assert result.counts.claims_won == 4
    assert len(read_from(queries, "runs_taskrevision")) == 1
    for task in tasks:
        assert revisions_read.get(int(str(task.current_revision_id))) is not None


def test_a_revisions_spec_is_validated_and_digested_once_for_all_its_claims(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Issue #12: each offer's spec was validated, deep-frozen and digested
    # (twice) per claim; a revision's part is now done once, when the process
    # first reads the revision (`revisions_read`), and each spec checks and
    # digests only its Run's ids.
    task = testing.make_task()
    _sessions(2, slots=2)
    calls: Counter[str] = Counter()
    for name in ("validate_command", "validate_env", "canonical_json"):
        real = getattr(spec_module, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(spec_module, name, counted)
    revisions_read.clear()
    offers: list[ClaimedExecutionOffer] = []
    seen: list[dict[str, int]] = []
    for _ in range(2):
        for _ in range(2):
            testing.make_run(task)
        calls.clear()
        with budget(redelivery_backoff_s=3600):
            result = dispatch_cycle(scope=GLOBAL)
        assert result.counts.claims_won == 2
        offers.extend(result.offers)
        seen.append(dict(calls))
    # The first cycle reads the revision: the definition's validator and the
    # spec template's, once each; the second claims from it and checks no body.
    assert seen[0] == {"validate_command": 2, "validate_env": 2, "canonical_json": 2}, seen
    assert seen[1] == {}, seen
    monkeypatch.undo()
    # Every offer's spec and digest are the ones the spec's own path gives.
    for offer in offers:
        attempt = Attempt.objects.select_related("run__task_revision").get(pk=offer.attempt_id)
        plain = validate_spec(
            attempt_spec(attempt=attempt, run=attempt.run, revision=attempt.run.task_revision)
        )
        wire = offer.to_wire()["spec"]
        assert isinstance(wire, dict)
        assert wire == plain and list(wire) == list(plain)
        assert offer.spec_sha256 == spec_sha256(plain)
        assert RunLease.objects.get(pk=offer.lease.lease_id).spec_digest == offer.spec_sha256


def test_query_count_of_a_full_cluster_cycle_does_not_grow_with_the_backlog() -> None:
    task = testing.make_task()
    _sessions(3, slots=1)
    for _ in range(3):
        testing.make_run(task)
    dispatch_cycle(scope=GLOBAL)  # fills every slot
    counts = []
    for extra in (7, 193):
        for _ in range(extra):
            testing.make_run(task)
        cycle_recorder.reset()  # both cycles are written as rows of their own
        with CaptureQueriesContext(connection) as queries:
            result = dispatch_cycle(scope=GLOBAL)
        # Every matching Session is full: the candidate read serves nothing
        # (docs/adr/0012), so the cycle reads no Worker and plans nothing.
        assert (result.status, result.reason) == (CycleStatus.IDLE, CycleReason.NO_CANDIDATES)
        assert result.counts.plans_built == 0
        counts.append(len(queries.captured_queries))
    assert counts[0] == counts[1]


def test_a_revision_is_validated_once_for_every_plan_made_from_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Issue #12: a revision never changes, so what the shared validator says
    # of it holds for every Run pinned to it (the rows read are kept per process).
    from runs.services import revision_definition as original

    validated: list[int] = []

    def counting(revision: Any) -> Any:
        validated.append(revision.pk)
        return original(revision)

    monkeypatch.setattr("dispatch.adapters.orm.revision_definition", counting)
    task = testing.make_task()
    runs = [testing.make_run(task) for _ in range(6)]
    _sessions(3, slots=2)
    offers = [*dispatch_cycle(scope=GLOBAL).offers, *dispatch_cycle(scope=GLOBAL).offers]
    assert sorted(o.run_id for o in offers) == sorted(str(r.pk) for r in runs)
    assert validated == [task.current_revision_id]
    # Every spec is still its own Run's, built from that one validation.
    for offer in offers:
        assert (offer.spec["run_id"], offer.spec["attempt_id"]) == (offer.run_id, offer.attempt_id)
