"""The long-poll bounds without Redis: the per-process waiter slots and the wake rules.

The end-to-end checks (20 concurrent long polls of one Session, the
connection count, fencing) run on PostgreSQL with Redis in
dispatch/tests/test_long_poll_bounds_postgres.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings

from dispatch.notify import OfferSubscription, Wake, offer_channel, waiters_channel
from qinglong.testing import open_session
from workers.api import pull
from workers.api.pull import waiter_slots, worker_pull


class FakePubSub:
    """Hands out queued messages, then None (the caller's timeout)."""

    def __init__(self, messages: list[dict[str, Any]]) -> None:
        self.messages = list(messages)

    def get_message(self, ignore_subscribe_messages: bool, timeout: float) -> Any:
        return self.messages.pop(0) if self.messages else None


def _message(channel: str, data: bytes) -> dict[str, Any]:
    return {"type": "message", "channel": channel.encode(), "data": data}


def _waiter(number: int, messages: list[dict[str, Any]], session_id: str) -> OfferSubscription:
    subscription = OfferSubscription(FakePubSub(messages), session_id=session_id, url="redis://x")
    subscription._number = number  # what take_over() got from the Session's counter
    return subscription


def test_an_older_waiter_stops_on_a_newer_number_or_a_fence_and_ignores_older_numbers() -> None:
    sid = str(uuid.uuid4())
    waiters = waiters_channel(sid)
    older = [_message(waiters, b"3"), _message(waiters, b"5")]
    assert _waiter(5, older, sid).wait(0.05) is Wake.TIMEOUT
    assert _waiter(5, [*older, _message(waiters, b"6")], sid).wait(1) is Wake.SUPERSEDED
    assert _waiter(5, [_message(waiters, b"fenced")], sid).wait(1) is Wake.SUPERSEDED
    assert _waiter(5, [_message(waiters, b"junk")], sid).wait(0.05) is Wake.TIMEOUT
    assert _waiter(5, [_message(offer_channel(sid), b"a" * 64)], sid).wait(1) is Wake.OFFER


def test_waiter_slots_hold_the_bound_and_give_slots_back() -> None:
    with override_settings(QINGLONG_PULL_WAIT_MAX_WAITERS=2):
        with (
            waiter_slots.slot() as first,
            waiter_slots.slot() as second,
            waiter_slots.slot() as third,
        ):
            assert (first, second, third) == (True, True, False)
            assert waiter_slots.waiting == 2
        assert waiter_slots.waiting == 0
        with pytest.raises(RuntimeError), waiter_slots.slot():
            raise RuntimeError("a failing pull")
        assert waiter_slots.waiting == 0


@pytest.mark.django_db(transaction=True)
@override_settings(QINGLONG_PULL_WAIT_MAX_S=10, QINGLONG_PULL_WAIT_MAX_WAITERS=0)
def test_a_pull_past_the_bound_answers_at_once_without_subscribing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    @contextmanager
    def refuse(session_id: str) -> Iterator[None]:
        raise AssertionError("a pull past the bound must not subscribe")
        yield  # pragma: no cover

    monkeypatch.setattr(pull, "offer_subscription", refuse)
    session = open_session(slots=1).session
    result = worker_pull(
        session=session, pull_id=uuid.uuid4(), lease_token="t" * 43, max_offers=1, wait_s=10
    )
    assert result.offers == ()


def _max_waiters(**env: str) -> int:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("QL_WEB_", "QL_PULL_"))}
    base.update(
        DJANGO_SETTINGS_MODULE="qinglong.settings",
        SECRET_KEY="x" * 60,
        DATABASE_URL="sqlite://:memory:",
        **env,
    )
    code = "from django.conf import settings; print(settings.QINGLONG_PULL_WAIT_MAX_WAITERS)"
    result = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", code],
        cwd=Path(__file__).resolve().parents[2],
        env=base,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return int(result.stdout.strip().splitlines()[-1])


def test_the_waiter_bound_defaults_to_half_the_web_threads() -> None:
    assert _max_waiters() == 4  # gunicorn.conf.py: 8 threads per process
    assert _max_waiters(QL_WEB_THREADS="16") == 8
    assert _max_waiters(QL_WEB_THREADS="16", QL_PULL_WAIT_MAX_WAITERS="3") == 3
