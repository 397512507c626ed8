"""A page of claims in one transaction on PostgreSQL (issue #12, docs/adr/0011).

`lease_claim_many` answers each request as `lease_claim` would if the page
were claimed one request after the other, in a constant number of
statements; these tests hold it to that, make it lose races against real
concurrent connections (a pair held elsewhere, two pages for the same rows,
a Session filled and a quota reached while the page waited for its locks),
and check the order it takes its locks in.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from dispatch.core.ports import ClaimRequest, ClaimStatus
from leases import claim as claim_module
from leases.ack import AckPhase, lease_ack
from leases.claim import lease_claim, lease_claim_many
from leases.end import lease_revoke
from leases.errors import Outcome
from leases.locks import BatchKey, lock_claim_batch, lock_claim_batch_limits
from leases.models import LeaseState, RunLease
from leases.quota import project_live_lease_count, task_live_lease_count
from leases.tests.racing import HeldRows, assert_locks_in_order, race
from qinglong import testing
from qinglong.clock import db_now
from qinglong.logging import JsonFormatter, RedactionFilter
from runs.models import Attempt, AttemptEvent, AttemptState, Project, Run, RunState
from workers.models import WorkerSession

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

WON, LOST, UNAVAILABLE = (
    ClaimStatus.WON,
    ClaimStatus.ATTEMPT_LOST,
    ClaimStatus.WORKER_UNAVAILABLE,
)


def _session(slots: int) -> WorkerSession:
    worker, _ = testing.make_worker(slots=slots)
    return testing.open_session(worker).session


def _attempts(n: int, task: Any = None) -> list[Attempt]:
    task = task or testing.make_task()
    return [testing.pending_attempt(testing.make_run(task)) for _ in range(n)]


def _requests(attempts: list[Attempt], session: WorkerSession, **kwargs: Any) -> list[ClaimRequest]:
    return [testing.claim_request(a, session, **kwargs)[0] for a in attempts]


def _statuses(outcomes: list[Any]) -> list[ClaimStatus]:
    return [o.status for o in outcomes]


def _limited_project(limit: int) -> Project:
    """A Project whose `max_concurrent_runs` is `limit`."""
    project = testing.make_project()
    Project.objects.filter(pk=project.pk).update(max_concurrent_runs=limit)
    project.max_concurrent_runs = limit
    return project


def _active(session: WorkerSession) -> int:
    return RunLease.objects.filter(session=session, state=LeaseState.ACTIVE).count()


# ------------------------------------------------------------- what it answers


def test_a_page_is_claimed_in_one_transaction_of_four_statements() -> None:
    one = _session(4)
    two = _session(4)
    attempts = _attempts(6)
    requests = [
        testing.claim_request(a, one if i % 2 else two, skip_locked=True)[0]
        for i, a in enumerate(attempts)
    ]
    with CaptureQueriesContext(connection) as queries:
        outcomes = lease_claim_many(requests)
    statements = [q["sql"] for q in queries.captured_queries]
    # BEGIN, the locks (and counts), the checks and writes, COMMIT.
    assert (statements[0], statements[-1], len(statements)) == ("BEGIN", "COMMIT", 4), statements
    assert _statuses(outcomes) == [WON] * 6
    for attempt, request, outcome in zip(attempts, requests, outcomes, strict=True):
        lease = RunLease.objects.get(pk=int(str(outcome.lease_id)))
        assert (lease.attempt_id, lease.offer_id, lease.token_digest) == (
            attempt.pk,
            request.offer_id,
            request.token_digest,
        )
        assert lease.expires_at == outcome.expires_at
        assert (lease.state, lease.lease_generation, lease.source) == ("active", 1, "new_claim")
        assert lease.claimed_at < lease.expires_at
        attempt.refresh_from_db()
        assert (attempt.state, attempt.version, attempt.lease_generation) == ("claimed", 1, 1)
        run = Run.objects.get(pk=attempt.run_id)
        assert (run.state, run.version) == (RunState.DISPATCHING, 1)
        (event,) = AttemptEvent.objects.filter(attempt=attempt)
        assert (event.from_state, event.to_state, event.reason) == ("pending", "claimed", "claim")
        assert event.actor == f"worker:{lease.worker_id}"
    assert (_active(one), _active(two)) == (3, 3)


def test_each_request_sees_the_grants_before_it() -> None:
    session = _session(2)
    other = _session(4)
    a, b, c, d = _attempts(4)
    twice = testing.claim_request(a, other)[0]
    requests = [
        *_requests([a, b, c], session),  # the third finds the Session full
        twice,  # `a` again, on a Session with room: already claimed by the first
        testing.claim_request(d, other)[0],
    ]
    assert _statuses(lease_claim_many(requests)) == [WON, WON, UNAVAILABLE, LOST, WON]
    assert (_active(session), _active(other)) == (2, 1)
    assert Attempt.objects.get(pk=c.pk).state == AttemptState.PENDING


def test_one_stale_request_loses_alone() -> None:
    session = _session(4)
    a, b, c = _attempts(3)
    stale = testing.claim_request(b, session, expected_version=b.version + 1)[0]
    wrong_generation = testing.claim_request(c, session, lease_generation=2)[0]
    requests = [testing.claim_request(a, session)[0], stale, wrong_generation]
    assert _statuses(lease_claim_many(requests)) == [WON, LOST, LOST]
    assert _active(session) == 1


def test_a_cancelled_run_and_an_unknown_id_lose_and_a_gone_session_is_unavailable() -> None:
    session = _session(4)
    gone = _session(4)
    a, b, c, d = _attempts(4)
    Run.objects.filter(pk=b.run_id).update(cancel_requested=True)
    WorkerSession.objects.filter(pk=gone.pk).update(state="offline")
    unknown = dataclasses.replace(testing.claim_request(c, session)[0], attempt_id="999999")
    not_an_id = dataclasses.replace(testing.claim_request(c, session)[0], run_id="x")
    requests = [
        testing.claim_request(a, session)[0],
        testing.claim_request(b, session)[0],
        unknown,
        not_an_id,
        testing.claim_request(d, gone)[0],
        testing.claim_request(c, session)[0],
    ]
    assert _statuses(lease_claim_many(requests)) == [WON, LOST, LOST, LOST, UNAVAILABLE, WON]


def test_one_pull_id_carries_one_token_within_a_page_too() -> None:
    session = _session(8)
    a, b, c, d = _attempts(4)
    pull = "6f1f7a36-0000-4000-8000-000000000001"
    earlier = testing.claim_request(a, session, pull_id=pull, token="T" * 43)[0]
    assert lease_claim(earlier).status is WON
    requests = [
        testing.claim_request(b, session, pull_id=pull, token="U" * 43)[0],  # another token
        testing.claim_request(c, session, pull_id=pull, token="T" * 43)[0],  # the same pull
        testing.claim_request(
            d, session, pull_id="6f1f7a36-0000-4000-8000-000000000002", token="V" * 43
        )[0],
    ]
    assert _statuses(lease_claim_many(requests)) == [UNAVAILABLE, WON, WON]
    a2, b2 = _attempts(2)
    fresh = "6f1f7a36-0000-4000-8000-000000000003"
    same_page = [
        testing.claim_request(a2, session, pull_id=fresh, token="X" * 43)[0],
        testing.claim_request(b2, session, pull_id=fresh, token="Y" * 43)[0],
    ]
    assert _statuses(lease_claim_many(same_page)) == [WON, UNAVAILABLE]


def test_quotas_count_the_grants_before_each_request() -> None:
    project = _limited_project(2)
    limited = testing.make_task(testing.make_project(), max_concurrent_runs=1)
    session = _session(8)
    in_project = _attempts(3, testing.make_task(project))
    in_task = _attempts(2, limited)
    free = _attempts(1)
    requests = _requests([*in_project, *in_task, *free], session)
    with CaptureQueriesContext(connection) as queries:
        outcomes = lease_claim_many(requests)
    assert _statuses(outcomes) == [WON, WON, LOST, WON, LOST, WON]
    # A limit adds one statement: Projects, Tasks, then Sessions, locked in order.
    assert len(queries.captured_queries) == 5
    # The quota answers before the Session checks, as in `lease_claim`.
    more = _attempts(1, testing.make_task(project))
    WorkerSession.objects.filter(pk=session.pk).update(state="offline")
    other = _session(8)
    page = [testing.claim_request(more[0], session)[0], *_requests(_attempts(1), other)]
    assert _statuses(lease_claim_many(page)) == [LOST, WON]


def test_a_page_of_one_is_a_plain_claim() -> None:
    session = _session(2)
    (attempt,) = _attempts(1)
    requests = _requests([attempt], session)
    with CaptureQueriesContext(connection) as queries:
        (outcome,) = lease_claim_many(requests)
    assert outcome.status is WON
    assert len(queries.captured_queries) == 4


def _claim_lines(requests: list[ClaimRequest]) -> tuple[list[Any], list[logging.LogRecord]]:
    lines: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if getattr(record, "event", None) in ("lease_claimed", "leases_claimed"):
                lines.append(record)

    log = logging.getLogger("qinglong.dispatch")
    handler, level = Keep(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        outcomes = lease_claim_many(requests)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return outcomes, lines


def test_the_claims_a_page_won_are_one_line_and_a_page_of_one_keeps_its_own() -> None:
    session = _session(2)
    a, b, c, d = _attempts(4)
    pairs = [testing.claim_request(x, session) for x in (a, b, c)]
    outcomes, lines = _claim_lines([request for request, _ in pairs])
    assert _statuses(outcomes) == [WON, WON, UNAVAILABLE]
    assert [r.event for r in lines] == ["leases_claimed"], lines  # type: ignore[attr-defined]
    (line,) = lines
    assert line.getMessage() == "leases claimed"
    assert line.count == 2  # type: ignore[attr-defined]
    leases = [RunLease.objects.get(pk=int(str(o.lease_id))) for o in outcomes[:2]]
    logged = list(
        zip(
            line.lease_ids,  # type: ignore[attr-defined]
            line.attempt_ids,  # type: ignore[attr-defined]
            line.worker_ids,  # type: ignore[attr-defined]
            line.lease_generations,  # type: ignore[attr-defined]
            strict=True,
        )
    )
    assert logged == [
        (lease.pk, lease.attempt_id, lease.worker_id, lease.lease_generation) for lease in leases
    ]
    # As written: through the redaction filter and the JSON formatter, ids and
    # generations only (no token or its digest, no spec or its digest).
    RedactionFilter().filter(line)
    written = JsonFormatter().format(line)
    assert json.loads(written)["lease_ids"] == [lease.pk for lease in leases]
    assert json.loads(written)["worker_ids"] == [lease.worker_id for lease in leases]
    for (request, token), lease in zip(pairs, leases, strict=False):
        assert token not in written and request.token_digest not in written
        assert lease.offer_id not in written and lease.spec_digest not in written
    # A page of one is a single claim: its own line, as before.
    (outcome,), lines = _claim_lines(_requests([d], _session(1)))
    assert outcome.status is WON
    assert [r.event for r in lines] == ["lease_claimed"], lines  # type: ignore[attr-defined]
    assert lines[0].lease_id == int(str(outcome.lease_id))  # type: ignore[attr-defined]


def test_delivered_claims_are_written_delivered() -> None:
    session = _session(4)
    a, b, c, d = _attempts(4)
    announced = lease_claim_many(_requests([a, b], session), delivered=True)
    pulled = lease_claim_many(
        _requests([c, d], session, pull_id="6f1f7a36-0000-4000-8000-000000000009", token="P" * 43),
        delivered=True,
    )
    for outcome, count in [*((o, 0) for o in announced), *((o, 1) for o in pulled)]:
        lease = RunLease.objects.get(pk=int(str(outcome.lease_id)))
        assert (lease.last_delivered_at, lease.delivery_count) == (lease.claimed_at, count)


def _columns(row: Any, *, leave_out: tuple[str, ...]) -> dict[str, Any]:
    return {
        f.attname: getattr(row, f.attname)
        for f in row._meta.concrete_fields
        if f.attname not in leave_out
    }


@pytest.mark.parametrize("pull_id", [None, "6f1f7a36-0000-4000-8000-00000000000a"])
@pytest.mark.parametrize("delivered", [False, True])
def test_a_page_writes_every_column_as_a_claim_of_its_own_does(
    pull_id: str | None, delivered: bool
) -> None:
    # The page's statement writes the varying columns from arrays and every
    # other one from the model's defaults: row for row what `lease_claim`
    # (the ORM's `save()` values) writes.
    session = _session(4)
    single, first, second = _attempts(3)
    kwargs: dict[str, Any] = {"pull_id": pull_id, "token": "P" * 43} if pull_id else {}
    (alone,) = _requests([single], session, **kwargs)
    assert lease_claim(alone, delivered=delivered).status is WON
    page = lease_claim_many(_requests([first, second], session, **kwargs), delivered=delivered)
    assert _statuses(page) == [WON, WON]
    # What differs by nature: ids, the Attempt's own keys and spec (a global claim's
    # token is derived from its offer id), the clock readings.
    differs: tuple[str, ...] = (
        "id",
        "attempt_id",
        "run_id",
        "offer_id",
        "spec_digest",
        "claimed_at",
        "expires_at",
    )
    if pull_id is None:
        differs += ("token_digest",)
    reference = RunLease.objects.get(attempt=single)
    for attempt in (first, second):
        lease = RunLease.objects.get(attempt=attempt)
        assert _columns(lease, leave_out=(*differs, "last_delivered_at")) == _columns(
            reference, leave_out=(*differs, "last_delivered_at")
        )
        assert lease.expires_at - lease.claimed_at == reference.expires_at - reference.claimed_at
        assert lease.last_delivered_at == (lease.claimed_at if delivered else None)
        assert lease.pull_id == (None if pull_id is None else uuid.UUID(pull_id))
        (event,) = AttemptEvent.objects.filter(attempt=attempt)
        (alone_event,) = AttemptEvent.objects.filter(attempt=single)
        event_differs = ("id", "attempt_id", "run_id", "at")
        assert _columns(event, leave_out=event_differs) == _columns(
            alone_event, leave_out=event_differs
        )
        assert event.at is not None


def test_the_page_write_is_planned_once_and_kept_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue #12: a prepared statement PostgreSQL plans again on every execution
    # (it judged the plan made for the arrays at hand cheaper) costs the server
    # as much as an unprepared one; and psycopg parses again every execution
    # a statement over 4,096 characters or 50 parameters.
    from psycopg import _queries

    from leases.writes import _claim_batch_sql

    text = _claim_batch_sql()
    assert len(text) <= _queries.MAX_CACHED_STATEMENT_LENGTH
    assert text.count("%s") <= _queries.MAX_CACHED_STATEMENT_PARAMS
    session = _session(16)
    for attempts in [_attempts(2) for _ in range(7)]:  # past PostgreSQL's five custom plans
        assert _statuses(lease_claim_many(_requests(attempts, session))) == [WON, WON]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
            "WHERE statement LIKE %s",
            ["%guard AS (SELECT%LEFT JOIN sc ON sc.session_id = g.k%"],
        )
        ((generic, custom),) = cursor.fetchall()
    assert (generic, custom) == (7, 0)


def _lease_rows_scanned(plan: dict[str, Any]) -> int:
    """Lease rows a plan's scans of `dispatch_runlease` looked at, every loop
    counted (the page's own inserts are not a scan)."""
    seen = 0
    if plan.get("Relation Name") == "dispatch_runlease" and "Scan" in str(plan["Node Type"]):
        rows = int(plan.get("Actual Rows", 0)) + int(plan.get("Rows Removed by Filter", 0))
        seen += rows * int(plan.get("Actual Loops", 1))
    for child in plan.get("Plans", ()):
        seen += _lease_rows_scanned(child)
    return seen


def test_a_page_reads_each_active_lease_once_under_statistics_older_than_the_leases() -> None:
    # Issue #12: analysed while no lease existed (dispatch_bench's (c); a box
    # without autovacuum), the plans of a page's lock statement and of its
    # write counted each Session's slots by reading every active lease through
    # another partial index on active leases: Sessions x leases in flight, twice
    # per page. Counted in one pass, each active lease is read at most once.
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE dispatch_runlease")
    sessions = [_session(16) for _ in range(6)]
    for session in sessions:  # leases in flight on every Session
        assert _statuses(lease_claim_many(_requests(_attempts(6), session))) == [WON] * 6
    active = RunLease.objects.filter(state=LeaseState.ACTIVE).count()
    assert active == 36
    plans: dict[str, dict[str, Any]] = {}

    def explained(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        kind = "lock" if "FOR UPDATE OF r, a" in sql else ""
        kind = kind or ("write" if "guard AS (SELECT" in sql else "")
        if kind:
            # The statement as it runs, analysed in a savepoint rolled back.
            savepoint = transaction.savepoint()
            execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params, many, context)
            (document,) = context["cursor"].fetchone()
            transaction.savepoint_rollback(savepoint)
            plans[kind] = (json.loads(document) if isinstance(document, str) else document)[0]
        return execute(sql, params, many, context)

    pairs = zip(_attempts(6), sessions, strict=True)
    page = [testing.claim_request(a, s, skip_locked=True)[0] for a, s in pairs]
    with connection.execute_wrapper(explained):
        assert _statuses(lease_claim_many(page)) == [WON] * 6
    assert set(plans) == {"lock", "write"}
    for kind, plan in plans.items():
        assert _lease_rows_scanned(plan["Plan"]) <= active, (kind, plan)


def test_a_pages_keys_go_as_array_text_that_reads_back_as_the_values() -> None:
    # Issue #12: a page's keys are sent as their arrays' text form (no psycopg
    # dumper per element); whatever a text holds, it must read back as itself.
    from leases.locks import _key_array

    key = uuid.uuid4()
    awkward = 'a"b\\c,{d} NULL e'
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT %s::bigint[], %s::uuid[], %s::varchar(64)[]",
            [
                _key_array([1, 2**40, None]),
                _key_array([key, None]),
                _key_array([awkward, "", None]),
            ],
        )
        assert cursor.fetchone() == ([1, 2**40, None], [key, None], [awkward, "", None])


# ---------------------------------------------------------------- lost races


def test_two_pages_for_the_same_rows_claim_each_attempt_once() -> None:
    for skip_locked in (True, False):
        one = _session(8)
        two = _session(8)
        attempts = _attempts(6)
        first = _requests(attempts, one, skip_locked=skip_locked)
        second = _requests(list(reversed(attempts)), two, skip_locked=skip_locked)
        outcomes = race(
            functools.partial(lease_claim_many, first), functools.partial(lease_claim_many, second)
        )
        assert all(isinstance(o, list) for o in outcomes), outcomes
        won = [o for page in outcomes for o in page if o.status is WON]
        assert len(won) == 6, outcomes
        assert {o.status for page in outcomes for o in page} <= {WON, LOST}
        for attempt in attempts:
            assert RunLease.objects.filter(attempt=attempt, state=LeaseState.ACTIVE).count() == 1
            attempt.refresh_from_db()
            assert (attempt.state, attempt.lease_generation) == (AttemptState.CLAIMED, 1)


def test_a_pair_held_elsewhere_is_a_lost_race_for_that_request_only() -> None:
    session = _session(8)
    a, b, c = _attempts(3)
    with HeldRows((Run, b.run_id)):
        started = time.monotonic()
        outcomes = lease_claim_many(_requests([a, b, c], session, skip_locked=True))
        elapsed = time.monotonic() - started
    assert _statuses(outcomes) == [WON, LOST, WON]
    assert elapsed < 2.0  # SKIP LOCKED: no wait
    assert lease_claim(testing.claim_request(b, session)[0]).status is WON


class _Pause:
    """Holds `leases.claim.lease_grant` of one thread after its writes, before COMMIT."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, thread_name: str) -> None:
        self.written, self.release = threading.Event(), threading.Event()
        original = claim_module.lease_grant

        def grant(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            if threading.current_thread().name == thread_name:
                self.written.set()
                self.release.wait(20)
            return result

        monkeypatch.setattr(claim_module, "lease_grant", grant)


def _count_writes(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Every `_write_page` of the page: True when it wrote, False when its counts failed."""
    seen: list[bool] = []
    original = claim_module._write_page

    def write(page: Any) -> Any:
        written = original(page)
        seen.append(written is not None)
        return written

    monkeypatch.setattr(claim_module, "_write_page", write)
    return seen


def _claim_in_thread(request: ClaimRequest, name: str) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["outcome"] = lease_claim(request)
        finally:
            connection.close()

    thread = threading.Thread(target=run, name=name)
    thread.start()
    return thread, out


def _page_behind_a_paused_rival(
    monkeypatch: pytest.MonkeyPatch,
    session: WorkerSession,
    rival_attempt: Attempt,
    page: list[Attempt],
) -> tuple[Any, list[Any], list[bool]]:
    """A rival single claim writes its lease and pauses, uncommitted, holding
    its locks; the page of `page` starts meanwhile (its lock statement takes
    its snapshot and waits); then the rival commits. Returns the rival's
    outcome, the page's outcomes and which of the page's writes wrote."""
    pause = _Pause(monkeypatch, "rival")
    writes = _count_writes(monkeypatch)
    rival, rival_out = _claim_in_thread(testing.claim_request(rival_attempt, session)[0], "rival")
    out: dict[str, Any] = {}
    try:
        assert pause.written.wait(10)

        def claim_page() -> None:
            try:
                out["outcomes"] = lease_claim_many(_requests(page, session))
            finally:
                connection.close()

        claimer = threading.Thread(target=claim_page)
        claimer.start()
        time.sleep(0.5)  # the page's lock statement has its snapshot and waits
    finally:
        pause.release.set()
        rival.join(20)
    claimer.join(20)
    return rival_out["outcome"], out["outcomes"], writes


def test_a_session_filled_while_the_page_waited_for_its_lock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    session = _session(2)
    rival_attempt, a, b = _attempts(3)
    # The rival writes its lease and holds the Session, uncommitted.
    rival, page, writes = _page_behind_a_paused_rival(monkeypatch, session, rival_attempt, [a, b])
    assert rival.status is WON
    # Its counts missed the rival's lease; its write found that out and it
    # decided again under the same locks: one slot was left.
    assert _statuses(page) == [WON, UNAVAILABLE]
    assert writes == [False, True]
    assert _active(session) == 2


def test_a_quota_reached_while_the_page_waited_for_its_lock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    project = _limited_project(2)
    task = testing.make_task(project)
    session = _session(8)
    rival_attempt, a, b = _attempts(3, task)
    # The rival writes its lease and holds the Project and the Session, uncommitted.
    rival, page, writes = _page_behind_a_paused_rival(monkeypatch, session, rival_attempt, [a, b])
    assert rival.status is WON
    assert _statuses(page) == [WON, LOST]
    assert writes == [False, True]
    busy = Run.objects.filter(project=project, state=RunState.DISPATCHING).count()
    assert busy == 2


def test_a_second_round_relocks_only_what_the_first_held(monkeypatch: pytest.MonkeyPatch) -> None:
    # docs/adr/0014: the page's first round passes over a pair another
    # transaction holds (SKIP LOCKED); that one lets go before the page
    # decides again. The second round must not take the pair (and so lock
    # its Session after ones already held, out of order: the lock cycle
    # PostgreSQL used to detect): it stays a lost race of this page.
    session = _session(8)
    a, b, c = _attempts(3)
    rounds: list[int] = []
    original = claim_module._write_page

    with HeldRows((Run, b.run_id)) as held:

        def write(page: Any) -> Any:
            rounds.append(len(page.granted))
            if len(rounds) == 1:
                held.release()  # the pair is free before the second round...
                return None  # ...which this first write forces (a count "grew")
            return original(page)

        monkeypatch.setattr(claim_module, "_write_page", write)
        outcomes = lease_claim_many(_requests([a, b, c], session, skip_locked=True))
    assert rounds == [2, 2]
    assert _statuses(outcomes) == [WON, LOST, WON]
    assert Attempt.objects.get(pk=b.pk).state == AttemptState.PENDING
    assert _active(session) == 2


def test_a_limited_page_stamps_its_leases_after_its_limit_locks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A page with a Project limit waits for the Project lock of a rival
    # claim; meanwhile another lease of the Project ends. The page's leases
    # are stamped after the wait, so `claimed_at` of the lease taking the
    # freed slot is never before `ended_at` of the one that freed it.
    project = _limited_project(2)
    task = testing.make_task(project)
    early, rival_attempt, a, b = _attempts(4, task)
    ending = lease_claim(testing.claim_request(early, _session(1))[0])
    assert ending.status is WON and ending.lease_id is not None
    pause = _Pause(monkeypatch, "rival")
    rival, rival_out = _claim_in_thread(
        testing.claim_request(rival_attempt, _session(1))[0], "rival"
    )
    page_session = _session(8)
    out: dict[str, Any] = {}
    try:
        assert pause.written.wait(10)

        def claim_page() -> None:
            try:
                out["outcomes"] = lease_claim_many(_requests([a, b], page_session))
            finally:
                connection.close()

        claimer = threading.Thread(target=claim_page)
        claimer.start()
        time.sleep(0.5)  # the page holds its Runs and waits for the Project
        assert lease_revoke(int(ending.lease_id), reason="operator_revoke") is Outcome.APPLIED
    finally:
        pause.release.set()
        rival.join(20)
    claimer.join(20)
    assert rival_out["outcome"].status is WON
    assert _statuses(out["outcomes"]) == [WON, LOST]
    freed = RunLease.objects.get(pk=ending.lease_id)
    taken = RunLease.objects.get(pk=out["outcomes"][0].lease_id)
    assert freed.ended_at is not None
    assert taken.claimed_at >= freed.ended_at


def test_racing_pages_never_overfill_a_session_or_a_quota() -> None:
    project = _limited_project(3)
    task = testing.make_task(project)
    small = _session(2)
    attempts = _attempts(8, task)
    others = _attempts(8)
    pages = [_requests(attempts[i::4] + others[i::4], small, skip_locked=True) for i in range(4)]
    outcomes = race(*(functools.partial(lease_claim_many, page) for page in pages))
    assert all(isinstance(o, list) for o in outcomes), outcomes
    assert _active(small) == 2
    assert Run.objects.filter(project=project, state=RunState.DISPATCHING).count() <= 2
    won = sum(o.status is WON for page in outcomes for o in page)
    assert won == 2


# ---------------------------------------------------------------- lock order


def _keys(requests: list[ClaimRequest]) -> list[BatchKey]:
    keys = [claim_module._batch_key(i, r) for i, r in enumerate(requests)]
    assert all(k is not None for k in keys)
    return keys  # type: ignore[return-value]


def test_a_page_locks_every_run_and_attempt_in_run_order_then_the_sessions() -> None:
    one, two = _session(2), _session(2)
    first, second = _attempts(2)
    # Asked in the reverse order: the statement still locks by Run id.
    requests = [testing.claim_request(second, two)[0], testing.claim_request(first, one)[0]]
    rows = [
        ("runs_run", first.run_id),
        ("runs_attempt", first.pk),
        ("runs_run", second.run_id),
        ("runs_attempt", second.pk),
        ("workers_workersession", min(one.pk, two.pk)),
        ("workers_workersession", max(one.pk, two.pk)),
    ]
    assert_locks_in_order(rows, lambda: lock_claim_batch(_keys(requests), skip_locked=False))


def test_with_a_limit_a_page_locks_projects_then_tasks_then_sessions() -> None:
    project = _limited_project(5)
    task = testing.make_task(project, max_concurrent_runs=5)
    session = _session(2)
    a, b = _attempts(2, task)
    requests = _requests([a, b], session)
    rows = [
        ("runs_project", project.pk),
        ("runs_task", task.pk),
        ("workers_workersession", session.pk),
    ]

    def statement() -> None:
        keys = _keys(requests)
        locked = lock_claim_batch(keys, skip_locked=False)
        assert locked.limits is None  # the Session is left to the next statement
        assert locked.now is not None
        lock_claim_batch_limits(keys, locked.rows, now=locked.now)

    assert_locks_in_order(rows, statement)


def test_a_page_counts_quotas_exactly_as_leases_quota_does() -> None:
    project = _limited_project(50)
    task = testing.make_task(project, max_concurrent_runs=50)
    sibling = testing.make_task(project)
    session = _session(16)
    held = _attempts(3, task) + _attempts(2, sibling)
    for attempt in held:
        assert lease_claim(testing.claim_request(attempt, session)[0]).status is WON
    # One lease past its expiry (not swept yet), one ended: neither holds a slot.
    leases = list(RunLease.objects.filter(session=session).order_by("pk"))
    RunLease.objects.filter(pk=leases[0].pk).update(expires_at=db_now() - timedelta(seconds=1))
    assert lease_revoke(leases[3].pk, reason="operator_revoke") is Outcome.APPLIED
    waiting = _attempts(1, task)
    keys = _keys(_requests(waiting, session))
    with transaction.atomic():
        locked = lock_claim_batch(keys, skip_locked=False)
        assert locked.now is not None
        limits = lock_claim_batch_limits(keys, locked.rows, now=locked.now)
        assert limits.project_busy == {
            project.pk: project_live_lease_count(project.pk, now=locked.now)
        }
        assert limits.task_live == {task.pk: task_live_lease_count(task.pk, now=locked.now)}
    assert (limits.project_busy[project.pk], limits.task_live[task.pk]) == (3, 2)
    assert limits.sessions[session.session_id][1] == 4  # every active lease holds a slot


# ------------------------------------------------- the claim's commit mode


def _commit_modes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """`synchronous_commit` inside each claim transaction, seen before its writes."""
    seen: list[str] = []

    def show() -> None:
        with connection.cursor() as cursor:
            cursor.execute("SHOW synchronous_commit")
            seen.append(cursor.fetchone()[0])

    grant, write = claim_module.lease_grant, claim_module._write_page

    def grant_and_show(*args: Any, **kwargs: Any) -> Any:
        show()
        return grant(*args, **kwargs)

    def write_and_show(page: Any) -> Any:
        show()
        return write(page)

    monkeypatch.setattr(claim_module, "lease_grant", grant_and_show)
    monkeypatch.setattr(claim_module, "_write_page", write_and_show)
    return seen


def test_a_claim_commits_without_waiting_for_its_flush_and_nothing_else_does(
    monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    session = _session(8)
    a, b, c, d = _attempts(4)
    modes = _commit_modes(monkeypatch)
    outcome, offer_id, token = testing.claim(a, session)
    assert outcome.status is WON
    assert _statuses(lease_claim_many(_requests([b, c], session))) == [WON, WON]
    assert modes == ["off", "off"]
    # Only that transaction: the connection, and an ACK after it, wait for the flush.
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        assert cursor.fetchone()[0] == "on"
    with CaptureQueriesContext(connection) as ack:
        lease = RunLease.objects.get(offer_id=offer_id)
        lease_ack(
            session=session,
            offer_id=offer_id,
            phase=AckPhase.STARTING,
            lease_token=token,
            spec_sha256=lease.spec_digest,
        )
    assert not any("synchronous_commit" in q["sql"] for q in ack.captured_queries)
    settings.QINGLONG_CLAIM_ASYNC_COMMIT = False
    assert lease_claim(testing.claim_request(d, session)[0]).status is WON
    assert modes == ["off", "off", "on"]
