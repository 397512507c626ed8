"""`eventually` passes over SQLite's lock errors only; plain predicates, no database."""

from __future__ import annotations

import time

import pytest
from django.db import OperationalError

from workers.tests.polling import eventually


def test_an_operational_error_other_than_a_lock_propagates_at_once() -> None:
    calls = 0

    def predicate() -> bool:
        nonlocal calls
        calls += 1
        raise OperationalError("no such table: workers_worker")

    started = time.monotonic()
    with pytest.raises(OperationalError, match="no such table"):
        eventually(predicate, timeout=5.0, what="a missing table")
    assert calls == 1
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("message", ["database table is locked: runs_run", "database is locked"])
def test_a_lock_error_then_success_passes(message: str) -> None:
    answers: list[Exception | bool] = [OperationalError(message), True]

    def predicate() -> bool:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    eventually(predicate, timeout=5.0, what="the table unlocked")
    assert answers == []


def test_a_timeout_after_lock_errors_chains_the_last_one() -> None:
    def predicate() -> bool:
        raise OperationalError("database table is locked: runs_run")

    with pytest.raises(AssertionError, match="timed out waiting for: never unlocked") as caught:
        eventually(predicate, timeout=0.2, what="never unlocked")
    cause = caught.value.__cause__
    assert isinstance(cause, OperationalError)
    assert "database table is locked" in str(cause)


def test_a_timeout_without_errors_has_no_cause() -> None:
    with pytest.raises(AssertionError, match="timed out waiting for: false") as caught:
        eventually(lambda: False, timeout=0.2, what="false")
    assert caught.value.__cause__ is None
