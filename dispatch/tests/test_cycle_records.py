"""DispatchCycle recording (issue #12): a new outcome at once, its repeats summed.

An idle system must cost nearly nothing: no row and no INFO line per idle
cycle or per pull. Runs on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import logging
import secrets
import uuid
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import pytest
from django.forms.models import model_to_dict
from django.test.utils import override_settings

from dispatch import cycles
from dispatch.core.budget import DispatchBudget
from dispatch.core.ports import DispatchScope, PullCredential, SessionRef
from dispatch.cycles import CycleRecorder, dispatch_cycle, dispatch_set_paused
from dispatch.models import DispatchCycle
from leases.models import RunLease
from qinglong import testing
from runs.services import task_update

pytestmark = pytest.mark.django_db

GLOBAL = DispatchScope.global_()


def budget(**overrides: int) -> Any:
    return override_settings(QINGLONG_DISPATCH={**asdict(DispatchBudget()), **overrides})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def at(self, level: int) -> list[logging.LogRecord]:
        return [r for r in self.records if r.levelno == level]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    fake = Clock()
    recorder = CycleRecorder(window_s=lambda: 60.0, monotonic=fake)
    monkeypatch.setattr(cycles, "cycle_recorder", recorder)
    yield fake
    recorder.reset()  # nothing left for its exit hook to write


@pytest.fixture
def logs() -> Iterator[Records]:
    handler = Records()
    logger = logging.getLogger("qinglong.dispatch")
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(previous)


def rows() -> list[tuple[str, str, str, int]]:
    return list(
        DispatchCycle.objects.order_by("id").values_list("scope", "status", "reason", "cycles")
    )


def test_idle_cycles_write_one_row_then_one_summary_per_window(clock: Clock, logs: Records) -> None:
    for _ in range(50):
        dispatch_cycle(scope=GLOBAL)
        clock.now += 1.0
    # The first idle cycle is a row and an INFO line; the other 49 are neither.
    assert rows() == [("global", "idle", "no_candidates", 1)]
    assert len(logs.at(logging.INFO)) == 1
    assert (
        len([r for r in logs.at(logging.DEBUG) if getattr(r, "event", "") == "dispatch_cycle"])
        == 49
    )

    clock.now += 10.0  # the window is over: its repeats become one summary row
    dispatch_cycle(scope=GLOBAL)
    assert rows() == [
        ("global", "idle", "no_candidates", 1),
        ("global", "idle", "no_candidates", 49),
        ("global", "idle", "no_candidates", 1),  # the first idle cycle of the new window
    ]
    summary = DispatchCycle.objects.order_by("id")[1]
    assert summary.counts["claims_won"] == 0
    infos = logs.at(logging.INFO)
    assert [getattr(r, "event", "") for r in infos] == [
        "dispatch_cycle",
        "dispatch_cycle_summary",
        "dispatch_cycle",
    ]
    assert getattr(infos[1], "cycles", None) == 49


def test_a_new_outcome_is_a_row_at_once_and_summaries_sum_the_counts(clock: Clock) -> None:
    session = testing.open_session(testing.make_worker(slots=8)[0]).session
    dispatch_cycle(scope=GLOBAL)  # idle
    task = testing.make_task()
    for _ in range(3):
        testing.make_run(task)
        dispatch_cycle(scope=GLOBAL)  # offered/claimed: one claim each
    dispatch_cycle(scope=GLOBAL)  # idle again: seen in this window, so summed
    assert rows() == [
        ("global", "idle", "no_candidates", 1),
        ("global", "offered", "claimed", 1),
    ]
    assert cycles.cycle_recorder.flush() == 2
    claimed = DispatchCycle.objects.filter(reason="claimed")
    assert sorted(claimed.values_list("cycles", flat=True)) == [1, 2]
    # Every claim a cycle won is in exactly one row's counts.
    assert sum(c["claims_won"] for c in claimed.values_list("counts", flat=True)) == 3
    assert session.leases.count() == 3
    assert cycles.cycle_recorder.flush() == 0  # nothing left to write


def test_pulls_of_an_idle_session_write_no_row_per_pull(clock: Clock) -> None:
    session = testing.open_session().session
    scope = DispatchScope.for_session(
        SessionRef(str(session.worker_id), str(session.session_id), session.generation)
    )
    for _ in range(20):
        credential = PullCredential(pull_id=str(uuid.uuid4()), token=secrets.token_urlsafe(32))
        dispatch_cycle(scope=scope, pull=credential, session_pk=session.pk)
    assert rows() == [("session", "idle", "no_candidates", 1)]
    cycles.cycle_recorder.flush()
    summary = DispatchCycle.objects.order_by("id").last()
    assert summary is not None
    assert (summary.cycles, summary.session_id) == (19, session.session_id)


def test_a_paused_dispatcher_writes_one_row_per_window(clock: Clock) -> None:
    dispatch_set_paused(paused=True, reason="maintenance", actor="ops")
    for _ in range(30):
        dispatch_cycle(scope=GLOBAL)
    assert rows() == [("global", "paused", "dispatch_paused", 1)]


def test_a_rejected_cycle_is_always_a_row_of_its_own(clock: Clock) -> None:
    testing.open_session()
    testing.make_run()
    dispatch_cycle(scope=GLOBAL)
    with budget(redelivery_backoff_s=0):
        RunLease.objects.update(spec_digest="0" * 64)
        for _ in range(3):
            dispatch_cycle(scope=GLOBAL)
    assert [r for r in rows() if r[1] == "rejected"] == [
        ("global", "rejected", "recovery_spec_drift", 1)
    ] * 3


def test_summary_rows_hold_only_counts(clock: Clock) -> None:
    testing.open_session(testing.make_worker(slots=4)[0])
    task = testing.make_task()
    task_update(task=task, definition=testing.canary_definition())
    for _ in range(3):
        testing.make_run(task)
        dispatch_cycle(scope=GLOBAL)
    cycles.cycle_recorder.flush()
    dumped = str([model_to_dict(row) for row in DispatchCycle.objects.all()])
    for secret in (testing.CANARY_COMMAND, testing.CANARY_ENV, testing.CANARY_CWD):
        assert secret not in dumped
