"""Several ACKs in one transaction on PostgreSQL (issue 12, docs/adr/0013): locks, lost races.

`lease_ack_each` locks every lease's Run and Attempt (sorted by Run id), then
the Session, then the leases (sorted by id), in one statement; each ACK is
then decided and written under those locks. These tests hold rows from
another connection to see the order, and race the batch against what can end
or fence its leases (a cancel, a new Session of the Worker, the expiry sweep,
another batch or single ACK of the same Session): every outcome must be one a
single ACK could have had, no lease may stay active on an ended Attempt, and
nothing may deadlock.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction

import leases.ack as ack_use_case
from dispatch.sweeps import sweep_expired_leases
from leases.ack import AckItem, AckPhase, AckResult, lease_ack, lease_ack_each
from leases.end import run_cancel
from leases.errors import LeaseConflict, LeaseError, Outcome
from leases.locks import lock_leases_for_acks
from leases.models import LeaseState, RunLease
from leases.tests.acking import items, leased
from leases.tests.racing import assert_locks_in_order, held_by_someone, race
from qinglong import testing
from qinglong.clock import db_now
from qinglong.logging import JsonFormatter, RedactionFilter
from runs.models import Attempt, AttemptEvent, AttemptState, Run, RunState
from workers.models import WorkerSession
from workers.services import session_open

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def batch(session: WorkerSession, acks: list[AckItem]) -> list[AckResult | LeaseError]:
    return list(lease_ack_each(session=WorkerSession.objects.get(pk=session.pk), items=acks))


def started(pairs: list[tuple[RunLease, str]], session: WorkerSession) -> None:
    answers = batch(session, items(pairs, AckPhase.STARTING))
    assert all(isinstance(a, AckResult) for a in answers), answers


def no_active_lease_on_an_ended_attempt() -> None:
    for lease in RunLease.objects.filter(state=LeaseState.ACTIVE).select_related("attempt"):
        assert lease.attempt.state in (
            AttemptState.CLAIMED,
            AttemptState.STARTING,
            AttemptState.RUNNING,
        ), (lease.pk, lease.attempt.state)


# ------------------------------------------------------------- lock order


def test_the_batch_locks_runs_and_attempts_by_run_id_then_the_session_then_the_leases() -> None:
    session = testing.open_session(testing.make_worker(slots=4)[0]).session
    pairs = leased(session, 2)
    (one, _), (two, _) = pairs
    # The lock order, row by row: every row before the one held elsewhere is
    # held by the batch while it waits, none after it.
    rows = [
        ("runs_run", one.run_id),
        ("runs_attempt", one.attempt_id),
        ("runs_run", two.run_id),
        ("runs_attempt", two.attempt_id),
        ("workers_workersession", session.pk),
        ("dispatch_runlease", one.pk),
        ("dispatch_runlease", two.pk),
    ]
    # Listed newest first: the statement sorts them itself.
    offer_ids = [two.offer_id, one.offer_id]
    assert_locks_in_order(
        rows, lambda: lock_leases_for_acks(offer_ids=offer_ids, session_pk=session.pk)
    )


def test_a_batch_naming_another_sessions_leases_locks_nothing_and_refuses_them() -> None:
    owner = testing.open_session(testing.make_worker(slots=4)[0]).session
    stranger = testing.open_session(testing.make_worker(slots=4)[0]).session
    pairs = leased(owner, 2)
    with transaction.atomic():
        assert (
            lock_leases_for_acks(
                offer_ids=[lease.offer_id for lease, _ in pairs], session_pk=stranger.pk
            )
            == {}
        )
        for lease, _ in pairs:
            assert not held_by_someone("runs_run", lease.run_id)
            assert not held_by_someone("dispatch_runlease", lease.pk)
    answers = batch(stranger, items(pairs, AckPhase.STARTING))
    assert all(isinstance(a, LeaseError) for a in answers)
    assert [a.code for a in answers if isinstance(a, LeaseError)] == ["lease_forbidden"] * 2
    assert set(Attempt.objects.values_list("state", flat=True)) == {AttemptState.CLAIMED}


# ------------------------------------------------------------- lost races


def test_a_batch_racing_a_cancel_ends_each_run_cancelled_or_started_never_both() -> None:
    outcomes: set[str] = set()
    for _ in range(6):
        session = testing.open_session(testing.make_worker(slots=4)[0]).session
        pairs = leased(session, 3)
        target = Run.objects.get(pk=pairs[1][0].run_id)
        answers, cancelled = race(
            functools.partial(batch, session, items(pairs, AckPhase.STARTING)),
            functools.partial(run_cancel, run=target),
        )
        assert cancelled in (Outcome.APPLIED, Outcome.LOST_RACE), cancelled
        if cancelled is Outcome.LOST_RACE:
            assert run_cancel(run=Run.objects.get(pk=target.pk)) is Outcome.APPLIED
        assert isinstance(answers[0], AckResult) and isinstance(answers[2], AckResult)
        target.refresh_from_db()
        attempt = Attempt.objects.get(pk=pairs[1][0].attempt_id)
        if isinstance(answers[1], AckResult):
            # Started first: the cancel is a request the Worker's next ACK sees.
            outcomes.add("started")
            assert (attempt.state, target.state) == (AttemptState.STARTING, RunState.RUNNING)
            assert target.cancel_requested
        else:
            outcomes.add("cancelled")
            assert isinstance(answers[1], LeaseConflict), answers[1]
            assert answers[1].code in ("lease_revoked", "run_cancelled"), answers[1].code
            assert (attempt.state, target.state) == (AttemptState.CANCELLED, RunState.CANCELLED)
        no_active_lease_on_an_ended_attempt()
    print("batch/cancel outcomes:", outcomes)


def test_a_batch_racing_a_new_session_of_its_worker_never_starts_under_a_fenced_session() -> None:
    outcomes: set[str] = set()
    for _ in range(6):
        worker, _ = testing.make_worker(slots=4)
        session = testing.open_session(worker).session
        pairs = leased(session, 3)

        def reopen(worker: Any = worker) -> int:
            return session_open(
                worker=worker, executor_types=["process"], labels={}, slots=4
            ).session.generation

        answers, generation = race(
            functools.partial(batch, session, items(pairs, AckPhase.STARTING)),
            reopen,
        )
        assert generation == session.generation + 1
        applied = [a for a in answers if isinstance(a, AckResult)]
        refused = [a for a in answers if isinstance(a, LeaseConflict)]
        # One transaction: all started before the fence, or none after it.
        assert len(applied) in (0, 3), answers
        assert len(applied) + len(refused) == 3
        for answer in refused:
            assert answer.code in ("session_replaced", "lease_revoked"), answer.code
        outcomes.add("started" if applied else "fenced")
        # Either way the fence ended every lease of the old Session.
        assert not RunLease.objects.filter(session=session, state=LeaseState.ACTIVE).exists()
        for lease, _ in pairs:
            state = Attempt.objects.get(pk=lease.attempt_id).state
            assert state in (AttemptState.LOST, AttemptState.PENDING), state
        no_active_lease_on_an_ended_attempt()
    print("batch/fence outcomes:", outcomes)


def test_a_batch_and_the_expiry_sweep_never_both_win_a_lease() -> None:
    wins = {"ack": 0, "expire": 0}
    for round_ in range(6):
        session = testing.open_session(testing.make_worker(slots=4)[0]).session
        pairs = leased(session, 2)
        lease = pairs[0][0]
        deadline = db_now() + timedelta(milliseconds=40 + 10 * round_)
        RunLease.objects.filter(pk=lease.pk).update(expires_at=deadline)
        time.sleep(0.04)

        def sweep(lease: RunLease = lease) -> int:
            for _ in range(100):
                swept = sweep_expired_leases()
                if swept.applied:
                    return swept.applied
                if RunLease.objects.get(pk=lease.pk).state != LeaseState.ACTIVE:
                    return 0
                if Attempt.objects.get(pk=lease.attempt_id).state != AttemptState.CLAIMED:
                    return 0
                time.sleep(0.005)
            return 0

        answers, expired = race(
            functools.partial(batch, session, items(pairs, AckPhase.STARTING)), sweep
        )
        assert isinstance(answers[1], AckResult)  # the other lease never expired
        ack_won = isinstance(answers[0], AckResult)
        assert ack_won != bool(expired), (answers, expired)
        lease.refresh_from_db()
        attempt = Attempt.objects.get(pk=lease.attempt_id)
        if ack_won:
            wins["ack"] += 1
            assert (attempt.state, lease.state) == (AttemptState.STARTING, LeaseState.ACTIVE)
            assert lease.expires_at > deadline  # renewed by the ACK
        else:
            wins["expire"] += 1
            assert isinstance(answers[0], LeaseConflict)
            assert answers[0].code == "lease_expired"
            assert (attempt.state, lease.state) == (AttemptState.PENDING, LeaseState.EXPIRED)
    print("batch/expiry winners:", wins)


def test_overlapping_batches_and_single_acks_of_one_session_never_deadlock() -> None:
    for _ in range(4):
        session = testing.open_session(testing.make_worker(slots=8)[0]).session
        pairs = leased(session, 4)
        forward = items(pairs, AckPhase.STARTING)
        backward = list(reversed(forward))
        last_lease, last_token = pairs[-1]

        def single(
            session: WorkerSession = session,
            last_lease: RunLease = last_lease,
            last_token: str = last_token,
        ) -> Any:
            return lease_ack(
                session=WorkerSession.objects.get(pk=session.pk),
                offer_id=last_lease.offer_id,
                phase=AckPhase.STARTING,
                lease_token=last_token,
                spec_sha256=last_lease.spec_digest,
            )

        one, two, three = race(
            functools.partial(batch, session, forward),
            functools.partial(batch, session, backward),
            single,
        )
        for answers in (one, two):
            assert all(isinstance(a, AckResult) for a in answers), answers
        assert isinstance(three, AckResult)
        # Each phase applied exactly once, whoever came first; the rest were no-ops.
        applied = [a for a in [*one, *two, three] if a.outcome is Outcome.APPLIED]
        assert len(applied) == 4
        for lease, _ in pairs:
            events = AttemptEvent.objects.filter(attempt_id=lease.attempt_id, to_state="starting")
            assert events.count() == 1


def test_a_batch_waiting_behind_a_cancel_sees_what_it_committed(monkeypatch) -> None:
    """Held under its locks with its checks passed (`_apply`), the batch makes a
    cancel of one of its Runs wait; the cancel then finds it started."""
    session = testing.open_session(testing.make_worker(slots=4)[0]).session
    pairs = leased(session, 2)
    started(pairs, session)
    entered, results = threading.Event(), {}
    real = ack_use_case._apply

    def slow(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == "batch":
            entered.set()
            time.sleep(0.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(ack_use_case, "_apply", slow)

    def in_thread(name: str, fn: Callable[[], Any]) -> threading.Thread:
        def runner() -> None:
            try:
                results[name] = fn()
            except Exception as err:
                results[name] = err
            finally:
                connection.close()

        thread = threading.Thread(target=runner, name=name)
        thread.start()
        return thread

    acks = items(pairs, AckPhase.RUNNING, AckPhase.SUCCEEDED)
    batch_thread = in_thread("batch", lambda: batch(session, acks))
    assert entered.wait(10)
    target = Run.objects.get(pk=pairs[0][0].run_id)
    cancel_thread = in_thread("cancel", lambda: run_cancel(run=target))
    batch_thread.join(20)
    cancel_thread.join(20)
    assert all(isinstance(a, AckResult) for a in results["batch"]), results["batch"]
    # The Run had succeeded by the time the cancel got its lock: nothing to cancel.
    assert Run.objects.get(pk=target.pk).state == RunState.SUCCEEDED
    assert results["cancel"] in (Outcome.UNCHANGED, Outcome.LOST_RACE)
    no_active_lease_on_an_ended_attempt()


def test_a_batch_holding_its_locks_past_an_expiry_wins_and_the_sweeper_backs_off(
    monkeypatch,
) -> None:
    """Held under its locks, checks passed (`_apply`), while its lease's expiry
    passes: the sweeper waits for the lock, then finds the lease renewed."""
    session = testing.open_session(testing.make_worker(slots=4)[0]).session
    pairs = leased(session, 2)
    lease = pairs[0][0]
    RunLease.objects.filter(pk=lease.pk).update(expires_at=db_now() + timedelta(seconds=0.3))
    entered, results = threading.Event(), {}
    real = ack_use_case._apply

    def slow(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == "batch" and not entered.is_set():
            entered.set()
            time.sleep(0.8)
        return real(*args, **kwargs)

    monkeypatch.setattr(ack_use_case, "_apply", slow)

    def runner(name: str, fn: Callable[[], Any]) -> threading.Thread:
        def run() -> None:
            try:
                results[name] = fn()
            finally:
                connection.close()

        thread = threading.Thread(target=run, name=name)
        thread.start()
        return thread

    batch_thread = runner("batch", lambda: batch(session, items(pairs, AckPhase.STARTING)))
    assert entered.wait(10)
    time.sleep(0.4)  # past expires_at now, the batch uncommitted
    sweeper = runner("sweeper", sweep_expired_leases)
    batch_thread.join(20)
    sweeper.join(20)
    assert all(isinstance(a, AckResult) for a in results["batch"]), results["batch"]
    assert results["sweeper"].applied == 0
    lease.refresh_from_db()
    assert lease.state == LeaseState.ACTIVE and lease.expires_at > db_now()
    assert Attempt.objects.get(pk=lease.attempt_id).state == AttemptState.STARTING


# ------------------------------------------------- the set-based write


def test_a_wave_that_misses_a_row_rolls_the_batch_back_and_each_ack_goes_alone() -> None:
    """The batch's writes are one statement per wave (`leases.writes.AckWrites`),
    each compare-and-set counted per kind. Should one touch no row (the locks
    exclude it; a trigger that skips one lease's update forces it here), the
    whole transaction rolls back — the other leases' Attempts, history rows
    and Runs of that wave included — and every ACK is applied again alone:
    the two others land once, the skipped one is refused `lease_conflict`
    and left as it was."""
    session = testing.open_session(testing.make_worker(slots=4)[0]).session
    pairs = leased(session, 3)
    skipped = pairs[1][0]
    table = RunLease._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION ql_test_skip() RETURNS trigger LANGUAGE plpgsql AS "
            f"$$ BEGIN IF OLD.id = {int(skipped.pk)} THEN RETURN NULL; END IF; RETURN NEW; END $$"
        )
        cursor.execute(
            f'CREATE TRIGGER ql_test_skip BEFORE UPDATE ON "{table}" '
            "FOR EACH ROW EXECUTE FUNCTION ql_test_skip()"
        )
    try:
        answers = batch(session, items(pairs, AckPhase.STARTING))
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f'DROP TRIGGER ql_test_skip ON "{table}"')
            cursor.execute("DROP FUNCTION ql_test_skip()")
    assert isinstance(answers[0], AckResult) and isinstance(answers[2], AckResult), answers
    assert isinstance(answers[1], LeaseConflict) and answers[1].code == "lease_conflict"
    for index, (lease, _) in enumerate(pairs):
        history = list(
            AttemptEvent.objects.filter(attempt_id=lease.attempt_id)
            .order_by("id")
            .values_list("to_state", flat=True)
        )
        if index == 1:
            assert history == ["claimed"]
            assert Attempt.objects.get(pk=lease.attempt_id).state == AttemptState.CLAIMED
            assert Run.objects.get(pk=lease.run_id).state == RunState.DISPATCHING
        else:
            assert history == ["claimed", "starting"]
            assert Run.objects.get(pk=lease.run_id).state == RunState.RUNNING


def test_running_and_succeeded_of_several_offers_in_one_batch_apply_in_order() -> None:
    """Two waves (one row is written once per statement): every item's answer,
    history rows and final rows are those of the same ACKs sent one by one."""
    session = testing.open_session(testing.make_worker(slots=8)[0]).session
    pairs, alone = leased(session, 3), leased(session, 3)
    started(pairs, session)
    started(alone, session)
    acks = items(pairs, AckPhase.RUNNING, AckPhase.SUCCEEDED)
    acks.append(acks[1])  # a repeat of an applied phase in the same batch: UNCHANGED
    answers = batch(session, acks)
    assert [a.outcome for a in answers if isinstance(a, AckResult)] == [Outcome.APPLIED] * 6 + [
        Outcome.UNCHANGED
    ], answers
    for ack in items(alone, AckPhase.RUNNING, AckPhase.SUCCEEDED):
        assert batch(session, [ack])[0].outcome == Outcome.APPLIED  # type: ignore[union-attr]

    def rows(lease: RunLease) -> tuple[Any, ...]:
        return (
            RunLease.objects.filter(pk=lease.pk)
            .values_list("state", "version", "end_reason")
            .get(),
            Attempt.objects.filter(pk=lease.attempt_id)
            .values_list("state", "version", "executor_handle", "exit_code", "error_code")
            .get(),
            Run.objects.filter(pk=lease.run_id).values_list("state", "version").get(),
            list(
                AttemptEvent.objects.filter(attempt_id=lease.attempt_id)
                .order_by("id")
                .values_list("from_state", "to_state", "reason", "actor")
            ),
        )

    assert [rows(lease) for lease, _ in pairs] == [rows(lease) for lease, _ in alone]
    assert rows(pairs[0][0])[2][0] == RunState.SUCCEEDED


def _lose_once(attempt_id: int, to_state: str) -> Callable[[], None]:
    """A trigger that skips, the first time only, the update taking this
    Attempt to `to_state` (a sequence counts: it survives the rollback); returns
    the cleanup."""
    table = Attempt._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute("CREATE SEQUENCE ql_test_once")
        cursor.execute(
            "CREATE FUNCTION ql_test_lose_once() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            f"IF OLD.id = {int(attempt_id)} AND NEW.state = '{to_state}' THEN "
            "IF nextval('ql_test_once') = 1 THEN RETURN NULL; END IF; END IF; "
            "RETURN NEW; END $$"
        )
        cursor.execute(
            f'CREATE TRIGGER ql_test_lose_once BEFORE UPDATE ON "{table}" '
            "FOR EACH ROW EXECUTE FUNCTION ql_test_lose_once()"
        )

    def cleanup() -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT last_value, is_called FROM ql_test_once")
            fired = cursor.fetchone()
            cursor.execute(f'DROP TRIGGER ql_test_lose_once ON "{table}"')
            cursor.execute("DROP FUNCTION ql_test_lose_once()")
            cursor.execute("DROP SEQUENCE ql_test_once")
        assert fired is not None and fired[1], "the trigger never skipped an update"

    return cleanup


def _alone_counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many items each fallback to one-by-one (`_each_alone`) was given."""
    calls: list[int] = []
    real = ack_use_case._each_alone

    def counted(session: WorkerSession, acks: Any) -> Any:
        calls.append(len(acks))
        return real(session, acks)

    monkeypatch.setattr(ack_use_case, "_each_alone", counted)
    return calls


def _history(lease: RunLease) -> list[str]:
    return list(
        AttemptEvent.objects.filter(attempt_id=lease.attempt_id)
        .order_by("id")
        .values_list("to_state", flat=True)
    )


def test_a_wave_of_one_ack_that_loses_its_race_rolls_back_and_each_ack_goes_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`running` then `succeeded` of one offer: two waves of one ACK, each
    written by that ACK's own `Writes` statement (`leases.writes._apply_wave`).
    Should the second touch no row (a trigger skips it, once), the batch rolls
    back — the first wave's writes too — and each ACK is applied again alone:
    both land, once each."""
    session = testing.open_session(testing.make_worker(slots=4)[0]).session
    pairs = leased(session, 1)
    started(pairs, session)
    lease = pairs[0][0]
    alone = _alone_counted(monkeypatch)
    cleanup = _lose_once(lease.attempt_id, "succeeded")
    try:
        answers = batch(session, items(pairs, AckPhase.RUNNING, AckPhase.SUCCEEDED))
    finally:
        cleanup()
    assert alone == [2], alone  # the batch fell back, with both items
    assert [a.outcome for a in answers if isinstance(a, AckResult)] == [Outcome.APPLIED] * 2
    assert _history(lease) == ["claimed", "starting", "running", "succeeded"]
    assert Run.objects.get(pk=lease.run_id).state == RunState.SUCCEEDED
    assert RunLease.objects.get(pk=lease.pk).state == LeaseState.RELEASED


def test_a_lost_race_when_an_ending_first_applies_the_waves_rolls_back_and_goes_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A `start_failed` ends through `attempt_finish`, which first has the batch's
    waves so far applied (`sink.flush()` inside `_apply`). Should that wave
    lose its race (a trigger skips one row, once), the batch rolls back and
    each ACK is applied again alone: all three land, once each."""
    session = testing.open_session(testing.make_worker(slots=4)[0]).session
    pairs = leased(session, 3)
    started(pairs, session)
    (first, token1), (second, token2), (ending, token3) = pairs
    acks = [
        *items([(first, token1), (second, token2)], AckPhase.RUNNING),
        AckItem(
            offer_id=ending.offer_id,
            phase=AckPhase.START_FAILED,
            lease_token=token3,
            spec_sha256=ending.spec_digest,
            error_code="spawn_failed",
        ),
    ]
    alone = _alone_counted(monkeypatch)
    cleanup = _lose_once(second.attempt_id, "running")
    try:
        answers = batch(session, acks)
    finally:
        cleanup()
    assert alone == [3], alone
    assert [a.outcome for a in answers if isinstance(a, AckResult)] == [Outcome.APPLIED] * 3
    assert _history(first) == ["claimed", "starting", "running"]
    assert _history(second) == ["claimed", "starting", "running"]
    assert _history(ending) == ["claimed", "starting", "start_failed"]
    assert RunLease.objects.get(pk=ending.pk).state == LeaseState.RELEASED
    no_active_lease_on_an_ended_attempt()


def test_the_applied_acks_of_a_batch_are_one_line_with_the_state_each_left() -> None:
    """One line for the batch. Several ACKs of one offer share its rows, which
    end in the last one's state: the line tells the Attempt's state each ACK left."""
    session = testing.open_session(testing.make_worker(slots=4)[0]).session
    pairs = leased(session, 2)
    lines: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if getattr(record, "event", None) in ("lease_ack", "lease_acks"):
                lines.append(record)

    log = logging.getLogger("qinglong.dispatch")
    handler, level = Keep(level=logging.INFO), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        answers = batch(
            session, items(pairs, AckPhase.STARTING, AckPhase.RUNNING, AckPhase.SUCCEEDED)
        )
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert all(isinstance(a, AckResult) for a in answers), answers
    assert [r.event for r in lines] == ["lease_acks"], lines  # type: ignore[attr-defined]
    (line,) = lines
    assert line.getMessage() == "lease acks"
    assert line.count == 6  # type: ignore[attr-defined]
    logged = list(zip(line.lease_ids, line.phases, line.attempt_states, strict=True))  # type: ignore[attr-defined]
    assert logged == [
        (lease.pk, phase, phase)
        for lease, _ in pairs
        for phase in ("starting", "running", "succeeded")
    ], logged
    # As written: through the redaction filter and the JSON formatter, ids and
    # state names only (no token, no spec digest).
    RedactionFilter().filter(line)
    written = JsonFormatter().format(line)
    assert json.loads(written)["lease_ids"] == [lease.pk for lease, _ in pairs for _ in range(3)]
    for lease, token in pairs:
        assert token not in written and lease.offer_id not in written
        assert lease.spec_digest not in written


# Text the array form of a wave must carry as it is: its quoting and escape
# characters, its separators, the word NULL, the empty string, any script.
_AWKWARD = ['a "b" c', 'back\\slash \\"', "{x,y}", "NULL", "", " lead, trail ", "ok 😀 雪\n\t"]


def test_a_wave_writes_awkward_text_and_times_exactly() -> None:
    """Waves of several ACKs send each column as one array (`leases.writes._array_text`):
    every executor handle, output tail and time lands exactly as given."""
    session = testing.open_session(testing.make_worker(slots=8)[0]).session
    pairs = leased(session, len(_AWKWARD))
    started(pairs, session)
    acks = [
        AckItem(
            offer_id=lease.offer_id,
            phase=phase,
            lease_token=token,
            spec_sha256=lease.spec_digest,
            executor_handle=f"pid:{text}" if phase is AckPhase.RUNNING else "",
            exit_code=0 if phase is AckPhase.SUCCEEDED else None,
            output_tail=text if phase is AckPhase.SUCCEEDED else "",
        )
        for (lease, token), text in zip(pairs, _AWKWARD, strict=True)
        for phase in (AckPhase.RUNNING, AckPhase.SUCCEEDED)
    ]
    answers = batch(session, acks)
    assert [a.outcome for a in answers if isinstance(a, AckResult)] == [Outcome.APPLIED] * len(
        acks
    ), answers
    for (lease, _), text in zip(pairs, _AWKWARD, strict=True):
        attempt = Attempt.objects.get(pk=lease.attempt_id)
        assert (attempt.executor_handle, attempt.output_tail) == (f"pid:{text}", text)
        ended = RunLease.objects.get(pk=lease.pk)
        assert ended.ended_at == attempt.finished_at is not None
        assert Run.objects.get(pk=lease.run_id).finished_at == attempt.finished_at


def test_the_array_text_of_a_column_reads_back_as_the_values() -> None:
    from leases.writes import _array_text

    at = db_now().replace(microsecond=123456)
    columns: list[tuple[str, list[Any]]] = [
        ("bigint[]", [1, -2, 2**40, None]),
        ("varchar[]", [*_AWKWARD, None]),
        ("timestamptz[]", [at, at.replace(microsecond=0), None]),
        ("boolean[]", [True, False, None]),
    ]
    with connection.cursor() as cursor:
        for kind, values in columns:
            text = _array_text(values)
            assert isinstance(text, str), text
            cursor.execute(f"SELECT %s::{kind}", [text])
            assert cursor.fetchone()[0] == values, kind
