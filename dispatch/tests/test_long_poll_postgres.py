"""Long-poll pulls woken by the global cycle's Redis announcement (docs/adr/0001).

Real Redis on loopback (db 14) and real threads on PostgreSQL: a Worker's pull
waits on its Session's channel; a global cycle claims for that Session and
announces the offer id; the pull wakes and returns the offer at once.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import redis
from django.db import connection
from django.test import override_settings

from dispatch.core.offer import OfferSource
from dispatch.core.ports import DispatchScope
from dispatch.cycles import dispatch_cycle
from dispatch.notify import RedisOfferNotifier, offer_subscription
from qinglong import testing
from workers.api.pull import worker_pull
from workers.models import WorkerSession

# Its own database: test_ops_celery flushes 15 (its broker).
REDIS_URL = "redis://127.0.0.1:6379/14"

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def _redis_db():
    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    yield
    client.flushdb()
    client.close()


def _pull_in_thread(session_pk: int, wait_s: int, out: dict) -> threading.Thread:
    def run() -> None:
        try:
            session = WorkerSession.objects.select_related("worker").get(pk=session_pk)
            started = time.monotonic()
            out["result"] = worker_pull(
                session=session,
                pull_id=uuid.uuid4(),
                lease_token="t" * 43,
                max_offers=1,
                wait_s=wait_s,
            )
            out["elapsed"] = time.monotonic() - started
        except Exception as err:
            out["result"] = err
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@override_settings(QINGLONG_PULL_WAIT_MAX_S=10, QINGLONG_NOTIFY_REDIS_URL=REDIS_URL)
def test_a_waiting_pull_wakes_up_on_the_global_cycles_announcement():
    session = testing.open_session(slots=1).session
    out: dict = {}
    thread = _pull_in_thread(session.pk, wait_s=8, out=out)
    time.sleep(0.5)  # the pull found nothing and now waits on its channel
    assert thread.is_alive()
    run = testing.make_run()
    cycle = dispatch_cycle(scope=DispatchScope.global_(), notifier=RedisOfferNotifier(REDIS_URL))
    assert cycle.counts.claims_won == 1
    thread.join(10)
    (offer,) = out["result"].offers
    assert offer.run_id == str(run.pk)
    assert offer.source is OfferSource.LEASE_RECOVERY  # claimed globally, fetched by the pull
    assert offer.lease.token is not None  # a global claim's token is re-derived
    assert out["elapsed"] < 5


@override_settings(QINGLONG_PULL_WAIT_MAX_S=1, QINGLONG_NOTIFY_REDIS_URL=REDIS_URL)
def test_a_waiting_pull_returns_empty_after_the_servers_maximum_wait():
    session = testing.open_session(slots=1).session
    out: dict = {}
    _pull_in_thread(session.pk, wait_s=30, out=out).join(10)
    assert out["result"].offers == ()
    assert 0.9 <= out["elapsed"] < 5  # capped at QL_PULL_WAIT_MAX_S, not the 30 asked


@override_settings(QINGLONG_PULL_WAIT_MAX_S=0, QINGLONG_NOTIFY_REDIS_URL=REDIS_URL)
def test_long_poll_off_means_the_pull_answers_at_once():
    session = testing.open_session(slots=1).session
    out: dict = {}
    _pull_in_thread(session.pk, wait_s=30, out=out).join(10)
    assert out["result"].offers == ()
    assert out["elapsed"] < 0.9


@override_settings(QINGLONG_PULL_WAIT_MAX_S=5, QINGLONG_NOTIFY_REDIS_URL="redis://127.0.0.1:1/0")
def test_unreachable_redis_degrades_to_a_plain_pull():
    session = testing.open_session(slots=1).session
    with offer_subscription(str(session.session_id)) as subscription:
        assert subscription is None
    out: dict = {}
    _pull_in_thread(session.pk, wait_s=5, out=out).join(10)
    assert out["result"].offers == ()
    assert out["elapsed"] < 3
