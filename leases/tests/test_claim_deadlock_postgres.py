"""A page of claims that PostgreSQL aborts to break a deadlock (docs/adr/0014).

The race tests with four global dispatchers and two pulling Workers saw
PostgreSQL detect a lock cycle on a Session row now and then. The aborted
page is rolled back whole; `lease_claim_many` must then treat it as a lost
race and claim its requests one by one — never fail the cycle, never leave a
half-written claim.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from django.db import OperationalError

from dispatch.core.ports import ClaimRequest, ClaimStatus
from leases import claim as claim_module
from leases.claim import lease_claim_many
from leases.models import LeaseState, RunLease
from qinglong import testing
from qinglong.metrics import LOST_RACES
from runs.models import Attempt, AttemptState

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _deadlock() -> OperationalError:
    err = OperationalError("deadlock detected")
    err.__cause__ = psycopg.errors.DeadlockDetected("deadlock detected")
    return err


def _page(size: int) -> tuple[list[Attempt], list[ClaimRequest]]:
    """`size` pending Attempts and their claim requests for one Session of 8 slots."""
    worker, _ = testing.make_worker(slots=8)
    session = testing.open_session(worker).session
    task = testing.make_task()
    attempts = [testing.pending_attempt(testing.make_run(task)) for _ in range(size)]
    return attempts, [testing.claim_request(a, session)[0] for a in attempts]


def test_a_page_aborted_by_a_deadlock_is_claimed_request_by_request(monkeypatch: Any) -> None:
    attempts, requests = _page(3)
    real_page = claim_module._claim_page
    calls = []

    def aborted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        real_page(*args, **kwargs)  # its writes happen, then PostgreSQL aborts it
        raise _deadlock()

    monkeypatch.setattr(claim_module, "_claim_page", aborted)
    lost_before = LOST_RACES.labels(operation="claim")._value.get()

    outcomes = lease_claim_many(requests)

    assert calls == [1]
    assert [o.status for o in outcomes] == [ClaimStatus.WON] * 3
    assert LOST_RACES.labels(operation="claim")._value.get() == lost_before + 1
    for attempt in attempts:
        # One lease each: the aborted page's writes were rolled back.
        assert RunLease.objects.filter(attempt=attempt, state=LeaseState.ACTIVE).count() == 1
        attempt = Attempt.objects.get(pk=attempt.pk)
        assert (attempt.state, attempt.lease_generation) == (AttemptState.CLAIMED, 1)


def test_other_database_errors_still_fail_the_page(monkeypatch: Any) -> None:
    attempts, requests = _page(2)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OperationalError("the server closed the connection")

    monkeypatch.setattr(claim_module, "_claim_page", broken)
    with pytest.raises(OperationalError):
        lease_claim_many(requests)
    assert not RunLease.objects.filter(attempt__in=attempts).exists()
