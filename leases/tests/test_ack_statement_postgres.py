"""The one-statement ACK (leases.ack_statement) against the portable path, on PostgreSQL.

Every case is played twice on identical rows: once with the one statement
turned off (the portable path alone: lock, checks and writes in a
transaction) and once as `lease_ack` runs it. The answers (result or error
class, code and message) and the rows afterwards (states, versions, times
relative to each other, history rows, webhook deliveries) must be the same;
the cases the statement applies must take exactly one statement, the others
must leave everything to the portable path. Then the new path's own races:
a row changed between its snapshot and its locks, and two copies of one ACK.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction
from django.db.models import F
from django.test.utils import CaptureQueriesContext

from leases import ack as ack_module
from leases import policy
from leases.ack import AckPhase, AckResult, lease_ack
from leases.ack_statement import ack_in_one_statement
from leases.errors import LeaseError, LostRace, Outcome
from leases.models import LeaseState, RunLease
from leases.tests.racing import assert_locks_in_order, conninfo, held_by_someone, race
from leases.timeout import timeout_margin
from notifications.models import WebhookDelivery
from qinglong import testing
from qinglong.clock import db_now
from runs.models import Attempt, AttemptEvent, AttemptState, Run
from workers.models import SessionState, WorkerSession

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@dataclass
class Lease:
    """One claimed lease and what an ACK of it sends."""

    session: WorkerSession
    run: Run
    attempt: Attempt
    lease: RunLease
    token: str


@dataclass(frozen=True)
class Case:
    name: str
    phase: AckPhase
    before: tuple[AckPhase, ...] = ()  # ACKs applied first
    setup: Callable[[Lease], None] = lambda lease: None
    kwargs: dict[str, Any] = field(default_factory=dict)  # ACK fields to override
    applies: bool = False  # the one statement applies it
    other_session: bool = False  # sent by another Session of another Worker


def _claimed(subscribed: bool = False) -> Lease:
    session = testing.open_session().session
    run = testing.make_run()
    if subscribed:
        testing.subscribe_to_success(run)
    attempt = testing.pending_attempt(run)
    outcome, offer_id, token = testing.claim(attempt, session)
    assert outcome.status == "won"
    lease = RunLease.objects.get(offer_id=offer_id)
    return Lease(session=session, run=run, attempt=attempt, lease=lease, token=token)


def _ack(held: Lease, phase: AckPhase, **overrides: Any) -> AckResult:
    fields: dict[str, Any] = {
        "session": held.session,
        "offer_id": held.lease.offer_id,
        "phase": phase,
        "lease_token": held.token,
        "spec_sha256": held.lease.spec_digest,
        "executor_handle": "pid:1",
        "exit_code": 0,
    }
    fields.update(overrides)
    return lease_ack(**fields)


def _updated(model: type[Any], pk: int, **values: Any) -> None:
    assert model._default_manager.filter(pk=pk).update(**values) == 1


def _seconds(delta: timedelta | None) -> float | None:
    return None if delta is None else round(delta.total_seconds(), 3)


CASES = [
    Case("starting", AckPhase.STARTING, applies=True),
    Case(
        "starting, Session draining",
        AckPhase.STARTING,
        setup=lambda h: _updated(WorkerSession, h.session.pk, state=SessionState.DRAINING),
        applies=True,
    ),
    Case(
        "starting, Session offline",
        AckPhase.STARTING,
        setup=lambda h: _updated(WorkerSession, h.session.pk, state=SessionState.OFFLINE),
    ),
    Case(
        "starting, Session of another generation",
        AckPhase.STARTING,
        setup=lambda h: _updated(WorkerSession, h.session.pk, generation=h.session.generation + 1),
    ),
    Case("starting, wrong token", AckPhase.STARTING, kwargs={"lease_token": "x" * 43}),
    Case("starting, wrong spec", AckPhase.STARTING, kwargs={"spec_sha256": "0" * 64}),
    Case("starting, unknown offer", AckPhase.STARTING, kwargs={"offer_id": "no-such-offer"}),
    Case("starting, another Session's lease", AckPhase.STARTING, other_session=True),
    Case(
        "starting, expired",
        AckPhase.STARTING,
        setup=lambda h: _updated(RunLease, h.lease.pk, expires_at=db_now() - timedelta(seconds=1)),
    ),
    Case(
        "starting, revoked",
        AckPhase.STARTING,
        setup=lambda h: _updated(RunLease, h.lease.pk, state=LeaseState.REVOKED),
    ),
    Case(
        "starting, stale",
        AckPhase.STARTING,
        setup=lambda h: _updated(Attempt, h.attempt.pk, lease_generation=5),
    ),
    Case(
        "starting, cancel requested",
        AckPhase.STARTING,
        setup=lambda h: _updated(Run, h.run.pk, cancel_requested=True),
    ),
    Case(
        "starting, Run already running",
        AckPhase.STARTING,
        setup=lambda h: _updated(Run, h.run.pk, state="running"),
    ),
    Case("starting again", AckPhase.STARTING, before=(AckPhase.STARTING,)),
    Case("running before starting", AckPhase.RUNNING),
    Case("running", AckPhase.RUNNING, before=(AckPhase.STARTING,), applies=True),
    Case(
        "running, long handle",
        AckPhase.RUNNING,
        before=(AckPhase.STARTING,),
        kwargs={"executor_handle": "h" * 300},
        applies=True,
    ),
    Case(
        "running, past its timeout",
        AckPhase.RUNNING,
        before=(AckPhase.STARTING,),
        setup=lambda h: _updated(
            Attempt,
            h.attempt.pk,
            deadline_at=F("started_at") - timeout_margin() - timedelta(hours=1),
        ),
    ),
    Case(
        "running, cancel requested",
        AckPhase.RUNNING,
        before=(AckPhase.STARTING,),
        setup=lambda h: _updated(Run, h.run.pk, cancel_requested=True),
        applies=True,
    ),
    Case(
        "succeeded",
        AckPhase.SUCCEEDED,
        before=(AckPhase.STARTING, AckPhase.RUNNING),
        kwargs={"exit_code": 0, "error_code": "e" * 70},
        applies=True,
    ),
    Case("succeeded before running", AckPhase.SUCCEEDED, before=(AckPhase.STARTING,)),
    Case(
        "succeeded, cancel requested",
        AckPhase.SUCCEEDED,
        before=(AckPhase.STARTING, AckPhase.RUNNING),
        setup=lambda h: _updated(Run, h.run.pk, cancel_requested=True),
    ),
    Case(
        "succeeded with an output tail",
        AckPhase.SUCCEEDED,
        before=(AckPhase.STARTING, AckPhase.RUNNING),
        kwargs={"output_tail": "done\n"},
    ),
    Case(
        "succeeded again",
        AckPhase.SUCCEEDED,
        before=(AckPhase.STARTING, AckPhase.RUNNING, AckPhase.SUCCEEDED),
    ),
    Case(
        "failed",
        AckPhase.FAILED,
        before=(AckPhase.STARTING, AckPhase.RUNNING),
        kwargs={"exit_code": 3},
    ),
]


def _answer(call: Callable[[], AckResult]) -> tuple[Any, ...]:
    try:
        result = call()
    except LeaseError as err:
        return ("refused", type(err).__name__, err.code, err.status, str(err))
    return (
        "answered",
        result.attempt_state,
        result.run_state,
        result.cancel_requested,
        result.outcome,
    )


def _rows(held: Lease) -> dict[str, Any]:
    attempt = Attempt.objects.get(pk=held.attempt.pk)
    run = Run.objects.get(pk=held.run.pk)
    lease = RunLease.objects.get(pk=held.lease.pk)
    started = attempt.started_at
    return {
        "attempt": (
            attempt.state,
            attempt.version,
            attempt.lease_generation,
            attempt.executor_handle,
            attempt.exit_code,
            attempt.error_code,
            attempt.output_tail,
            _seconds(
                None
                if started is None or attempt.deadline_at is None
                else attempt.deadline_at - started
            ),
            attempt.finished_at is None,
        ),
        "run": (run.state, run.version, run.cancel_requested, run.finished_at is None),
        "lease": (
            lease.state,
            lease.version,
            lease.end_reason,
            lease.ended_at is None,
            # A starting ACK stamps the Attempt and renews the lease at one clock.
            _seconds(lease.expires_at - started)
            if started and attempt.state == "starting"
            else None,
            lease.ended_at == attempt.finished_at if lease.ended_at else None,
        ),
        "history": [
            (*transition, "worker" if actor == f"worker:{held.session.worker_id}" else actor)
            for *transition, actor in AttemptEvent.objects.filter(attempt_id=attempt.pk)
            .order_by("id")
            .values_list("from_state", "to_state", "reason", "actor")
        ],
        "deliveries": WebhookDelivery.objects.filter(subscription__project_id=run.project_id)
        .values_list("event", flat=True)
        .count(),
        "next attempts": Attempt.objects.filter(run_id=run.pk).count(),
    }


def _play(case: Case, *, one_statement: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    held = _claimed(subscribed="subscription" in case.name)
    for phase in case.before:
        _ack(held, phase)
    case.setup(held)
    kwargs = dict(case.kwargs)
    if case.other_session:
        kwargs["session"] = testing.open_session().session
    with monkeypatch.context() as patched:
        if not one_statement:
            patched.setattr(ack_module, "decides_in_one_statement", lambda *a, **k: False)
        with CaptureQueriesContext(connection) as queries:
            answer = _answer(functools.partial(_ack, held, case.phase, **kwargs))
    return answer, _rows(held), len(queries.captured_queries)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_the_one_statement_answers_and_writes_like_the_portable_path(
    case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    portable, portable_rows, _ = _play(case, one_statement=False, monkeypatch=monkeypatch)
    answer, rows, statements = _play(case, one_statement=True, monkeypatch=monkeypatch)
    assert answer == portable
    assert rows == portable_rows
    if case.applies:
        assert answer[0] == "answered" and answer[-1] is Outcome.APPLIED
        assert statements == 1
    else:
        assert statements > 1  # the portable path decided


def test_a_success_in_a_subscribed_project_is_left_to_the_portable_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    case = Case(
        "succeeded, webhook subscription",
        AckPhase.SUCCEEDED,
        before=(AckPhase.STARTING, AckPhase.RUNNING),
    )
    portable, portable_rows, _ = _play(case, one_statement=False, monkeypatch=monkeypatch)
    answer, rows, statements = _play(case, one_statement=True, monkeypatch=monkeypatch)
    assert (answer, rows) == (portable, portable_rows)
    assert rows["deliveries"] == 1
    assert statements > 1


def test_an_ack_that_waited_on_a_renewal_applies_whole() -> None:
    """The snapshot's lease row is older than the locked one: the statement
    writes nothing and the portable path applies the ACK (without `fresh`,
    the Attempt would be written and the lease's compare-and-set would miss)."""
    held = _claimed()
    _ack(held, AckPhase.STARTING)
    before = RunLease.objects.get(pk=held.lease.pk)
    renewer = psycopg.connect(conninfo(), autocommit=False)
    answers: list[Any] = []
    statements: list[int] = []

    def ack() -> None:
        try:
            with CaptureQueriesContext(connection) as queries:
                answers.append(_answer(functools.partial(_ack, held, AckPhase.RUNNING)))
            statements.append(len(queries.captured_queries))
        finally:
            connection.close()

    try:
        # A heartbeat's renewal (leases.renew) holds the lease row …
        renewer.execute(
            f'UPDATE "{RunLease._meta.db_table}" SET version = version + 1 WHERE id = %s',
            [held.lease.pk],
        )
        sent_at = db_now()
        acking = threading.Thread(target=ack)
        acking.start()
        time.sleep(0.5)  # … while the ACK's statement waits for it
        assert acking.is_alive()
        renewer.commit()
        acking.join(20)
    finally:
        renewer.close()
    assert answers == [("answered", AttemptState.RUNNING, "running", False, Outcome.APPLIED)], (
        answers
    )
    assert statements[0] > 1  # the one statement wrote nothing, the portable path applied it
    after = RunLease.objects.get(pk=held.lease.pk)
    attempt = Attempt.objects.get(pk=held.attempt.pk)
    assert (attempt.state, attempt.executor_handle) == (AttemptState.RUNNING, "pid:1")
    assert after.version == before.version + 2  # the renewal's and the ACK's
    assert after.expires_at >= sent_at + policy.lease_ttl()  # the ACK's renewal


def test_a_write_that_touches_no_row_undoes_the_whole_statement() -> None:
    """Should the lease's write touch no row after the Attempt's did (the
    locks and the snapshot check exclude it; a trigger that skips the
    lease's update forces it here), the statement fails whole: the Attempt
    and its history stay as they were and the caller gets `LostRace`.

    Before: the Attempt's new state and its history row were committed
    (autocommit) and only then was `LostRace` raised."""
    held = _claimed()
    table = RunLease._meta.db_table
    events = AttemptEvent.objects.filter(attempt_id=held.attempt.pk).count()
    version = Attempt.objects.get(pk=held.attempt.pk).version
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION ql_test_skip() RETURNS trigger LANGUAGE plpgsql "
            "AS $$ BEGIN RETURN NULL; END $$"
        )
        cursor.execute(
            f'CREATE TRIGGER ql_test_skip BEFORE UPDATE ON "{table}" '
            "FOR EACH ROW EXECUTE FUNCTION ql_test_skip()"
        )
    try:
        with pytest.raises(LostRace):
            ack_in_one_statement(
                session=held.session,
                offer_id=held.lease.offer_id,
                phase=AckPhase.STARTING,
                lease_token=held.token,
                spec_sha256=held.lease.spec_digest,
            )
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f'DROP TRIGGER ql_test_skip ON "{table}"')
            cursor.execute("DROP FUNCTION ql_test_skip()")
    attempt = Attempt.objects.get(pk=held.attempt.pk)
    assert (attempt.state, attempt.version) == (AttemptState.CLAIMED, version)
    assert AttemptEvent.objects.filter(attempt_id=held.attempt.pk).count() == events
    # The connection is usable and the ACK still applies once the lease can be written.
    assert _answer(functools.partial(_ack, held, AckPhase.STARTING))[-1] == Outcome.APPLIED


def test_two_copies_of_one_ack_apply_once() -> None:
    for _ in range(5):
        held = _claimed()
        first, second = race(
            functools.partial(_answer, functools.partial(_ack, held, AckPhase.STARTING)),
            functools.partial(_answer, functools.partial(_ack, held, AckPhase.STARTING)),
        )
        outcomes = sorted(str(answer[-1]) for answer in (first, second))
        assert outcomes == sorted([str(Outcome.APPLIED), str(Outcome.UNCHANGED)]), (first, second)
        history = AttemptEvent.objects.filter(attempt_id=held.attempt.pk, to_state="starting")
        assert history.count() == 1
        assert RunLease.objects.get(pk=held.lease.pk).version == held.lease.version + 1


def test_the_one_statement_locks_run_attempt_session_then_lease() -> None:
    """The lock order of leases.locks (docs/adr/0004), in its locking CTE."""
    held = _claimed()
    rows = [
        (Run._meta.db_table, held.run.pk),
        (Attempt._meta.db_table, held.attempt.pk),
        (WorkerSession._meta.db_table, held.session.pk),
        (RunLease._meta.db_table, held.lease.pk),
    ]

    def statement() -> None:
        done = ack_in_one_statement(
            session=held.session,
            offer_id=held.lease.offer_id,
            phase=AckPhase.STARTING,
            lease_token=held.token,
            spec_sha256=held.lease.spec_digest,
        )
        assert done is not None
        transaction.set_rollback(True)  # each round starts from the same rows

    assert_locks_in_order(rows, statement)


def test_the_one_statement_naming_another_sessions_lease_locks_nothing() -> None:
    held = _claimed()
    stranger = testing.open_session().session
    with transaction.atomic():
        done = ack_in_one_statement(
            session=stranger,
            offer_id=held.lease.offer_id,
            phase=AckPhase.STARTING,
            lease_token=held.token,
            spec_sha256=held.lease.spec_digest,
        )
        assert done is None
        assert not held_by_someone(Run._meta.db_table, held.run.pk)
        assert not held_by_someone(Attempt._meta.db_table, held.attempt.pk)
        assert not held_by_someone(RunLease._meta.db_table, held.lease.pk)
    assert Attempt.objects.get(pk=held.attempt.pk).state == AttemptState.CLAIMED
