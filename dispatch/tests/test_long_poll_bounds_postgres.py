"""Long polls are bounded (issue 8 item 4), with real threads, PostgreSQL and Redis.

Before the fix each waiting `?wait_s=` pull held a database connection for its
whole wait, and one Session could hold any number of them (20 concurrent long
polls held 14 PostgreSQL connections). Now at most one pull per Session waits
(a newer one makes the older answer at once), a waiting pull holds no database
connection, at most QL_PULL_WAIT_MAX_WAITERS wait per process, and a fenced
Session's waiting pull answers at once.

Redis on loopback, db 12 (only this module uses it; its keys are per Session
UUID, so nothing needs flushing).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection
from django.test import override_settings

from dispatch.core.ports import DispatchScope
from dispatch.cycles import dispatch_cycle
from dispatch.notify import RedisOfferNotifier
from qinglong import testing
from workers.api.pull import PullResult, waiter_slots, worker_pull
from workers.models import WorkerSession
from workers.services import worker_rotate_credential

REDIS_URL = "redis://127.0.0.1:6379/12"

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

LONG_POLL = override_settings(
    QINGLONG_PULL_WAIT_MAX_S=20,
    QINGLONG_NOTIFY_REDIS_URL=REDIS_URL,
    QINGLONG_PULL_WAIT_MAX_WAITERS=32,
)


def _start_pull(
    session_pk: int, out: dict[int, Any], key: int, *, barrier: threading.Barrier | None = None
) -> threading.Thread:
    def run() -> None:
        try:
            session = WorkerSession.objects.select_related("worker").get(pk=session_pk)
            if barrier is not None:
                barrier.wait(10)
            started = time.monotonic()
            result = worker_pull(
                session=session,
                pull_id=uuid.uuid4(),
                lease_token=f"{key:043d}",
                max_offers=1,
                wait_s=15,
            )
            out[key] = (result, time.monotonic() - started)
        except Exception as err:
            out[key] = err
        finally:
            connection.close()

    thread = threading.Thread(target=run, name=f"pull-{key}")
    thread.start()
    return thread


def _until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def _other_backends() -> int:
    """Connections to the test database other than this thread's own."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        row = cursor.fetchone()
    assert row is not None
    return int(row[0])


@LONG_POLL
def test_twenty_concurrent_long_polls_of_one_session_leave_one_waiter_and_no_connection():
    session = testing.open_session(slots=1).session
    out: dict[int, Any] = {}
    barrier = threading.Barrier(20)
    threads = [_start_pull(session.pk, out, i, barrier=barrier) for i in range(20)]

    # All but one answer at once (each newer waiter supersedes the older).
    assert _until(lambda: sum(t.is_alive() for t in threads) <= 1, 10)
    [waiter] = [t for t in threads if t.is_alive()]
    answered = list(out.values())
    assert len(answered) == 19
    assert all(isinstance(value, tuple) and value[0].offers == () for value in answered)
    # The one waiting pull holds no database connection while it waits.
    assert _until(lambda: _other_backends() == 0, 5), _other_backends()
    assert waiter.is_alive()
    assert waiter_slots.waiting == 1

    # And it still works: the global cycle's announcement wakes it with the offer.
    run = testing.make_run()
    cycle = dispatch_cycle(scope=DispatchScope.global_(), notifier=RedisOfferNotifier(REDIS_URL))
    assert cycle.counts.claims_won == 1
    waiter.join(10)
    results = [value[0] for value in out.values()]
    assert all(isinstance(result, PullResult) for result in results)
    [offered] = [result for result in results if result.offers]
    assert offered.offers[0].run_id == str(run.pk)
    assert waiter_slots.waiting == 0


@LONG_POLL
def test_waiting_pulls_per_process_are_bounded_and_a_fenced_sessions_waiter_answers_at_once():
    sessions = [testing.open_session(slots=1).session for _ in range(3)]
    out: dict[int, Any] = {}
    with override_settings(QINGLONG_PULL_WAIT_MAX_WAITERS=2):
        waiting = [_start_pull(sessions[i].pk, out, i) for i in range(2)]
        assert _until(lambda: waiter_slots.waiting == 2, 5)
        # Past the bound a pull does not wait at all.
        _start_pull(sessions[2].pk, out, 2).join(10)
        result, elapsed = out[2]
        assert (result.offers, elapsed < 2) == ((), True)
        assert all(thread.is_alive() for thread in waiting)

        # Rotating a credential fences its Session: that Session's waiter answers at once.
        started = time.monotonic()
        worker_rotate_credential(worker=sessions[0].worker)
        waiting[0].join(5)
        assert not waiting[0].is_alive()
        assert time.monotonic() - started < 3
        assert out[0][0].offers == ()
        assert waiting[1].is_alive()
        worker_rotate_credential(worker=sessions[1].worker)
        waiting[1].join(5)
        assert not waiting[1].is_alive()
    assert waiter_slots.waiting == 0
