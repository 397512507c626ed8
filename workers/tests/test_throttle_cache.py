"""Where the API rate-limit counters live (issue 8 item 6).

Before the fix they were in each web process's memory unless QL_CACHE_URL was
set, so every limit multiplied with the number of processes. The rule now
(README "Configuration"): PostgreSQL (the cluster) counts in Redis — QL_CACHE_URL,
else the Celery broker when it is Redis; SQLite (the embedded default) and
QL_CACHE_URL=memory count per process. A cache outage never fails a Worker call.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from django.test import Client, override_settings
from rest_framework.settings import api_settings

from workers.tests.api_helpers import WorkerClient, error_code

ROOT = Path(__file__).resolve().parents[2]
PG = "postgres://u@db.example:5432/ql"
LOCMEM = "django.core.cache.backends.locmem.LocMemCache"
REDIS = "qinglong.cache.RedisCache"
# Only this module uses Redis db 13.
REDIS_URL = "redis://127.0.0.1:6379/13"


def _resolved_cache(**env: str) -> dict[str, Any]:
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in {"QL_CACHE_URL", "CELERY_BROKER_URL", "DATABASE_URL"}
    }
    base.update(
        {
            "DJANGO_SETTINGS_MODULE": "qinglong.settings",
            "SECRET_KEY": "x" * 60,
            "DATABASE_URL": "sqlite://:memory:",
        }
    )
    base.update(env)
    code = "import json; from django.conf import settings; print(json.dumps(settings.CACHES))"
    result = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", code],
        cwd=ROOT,
        env=base,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    # The last line: `shell` may print its auto-import notice first.
    default: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])["default"]
    return default


@pytest.mark.parametrize(
    ("env", "backend", "location"),
    [
        ({}, LOCMEM, None),  # the embedded default: one box, no Redis
        ({"DATABASE_URL": PG}, REDIS, "redis://127.0.0.1:6379/0"),  # the broker's default
        (
            {"DATABASE_URL": PG, "CELERY_BROKER_URL": "redis://broker:6379/4"},
            REDIS,
            "redis://broker:6379/4",
        ),
        (
            {"DATABASE_URL": PG, "QL_CACHE_URL": "rediss://cache:6380/2"},
            REDIS,
            "rediss://cache:6380/2",
        ),
        ({"DATABASE_URL": PG, "QL_CACHE_URL": "memory"}, LOCMEM, None),
        ({"DATABASE_URL": PG, "CELERY_BROKER_URL": "amqp://mq//"}, LOCMEM, None),
        ({"QL_CACHE_URL": "redis://cache:6379/1"}, REDIS, "redis://cache:6379/1"),
    ],
    ids=["sqlite", "pg-broker-default", "pg-broker", "pg-cache-url", "pg-memory", "pg-amqp", "url"],
)
def test_the_cluster_shares_throttle_counters_in_redis_by_default(
    env: dict[str, str], backend: str, location: str | None
) -> None:
    cache = _resolved_cache(**env)
    assert cache["BACKEND"] == backend
    assert cache.get("LOCATION") == location


def test_the_redis_cache_keeps_one_client_per_connection_pool() -> None:
    """Django's backend built a `redis.Redis` (and its callback table) per call."""
    from qinglong.cache import RedisCache

    backend: Any = RedisCache("redis://127.0.0.1:1/0", {"OPTIONS": {"socket_connect_timeout": 0.5}})
    client = backend._cache.get_client(write=True)
    assert backend._cache.get_client() is client
    assert backend._cache.get_client(write=True) is client
    assert client.connection_pool is backend._cache._get_connection_pool(True)


def _rates(**rates: str) -> dict[str, Any]:
    return {**api_settings.user_settings, "DEFAULT_THROTTLE_RATES": rates}


def _redis_cache(url: str) -> dict[str, Any]:
    return {
        "default": {
            "BACKEND": REDIS,
            "LOCATION": url,
            "OPTIONS": {"socket_connect_timeout": 0.5, "socket_timeout": 0.5},
        }
    }


@pytest.mark.django_db
def test_an_unreachable_throttle_cache_lets_worker_calls_through(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    worker = WorkerClient.open(client)
    with (
        override_settings(
            CACHES=_redis_cache("redis://127.0.0.1:1/0"),
            REST_FRAMEWORK=_rates(worker_pull="1/min", worker_heartbeat="1/min"),
        ),
        caplog.at_level(logging.WARNING, logger="qinglong.workers.throttle"),
    ):
        for _ in range(3):
            assert worker.heartbeat().status_code == 200
            assert worker.pull()[0].status_code == 200
    warnings = [r for r in caplog.records if r.name == "qinglong.workers.throttle"]
    assert len(warnings) <= 1  # one warning per interval, not one per request
    assert "127.0.0.1:1" not in caplog.text


@contextlib.contextmanager
def _redis_pulls(client: Client, rate: str) -> Iterator[tuple[redis.Redis, WorkerClient, str]]:
    """A Worker whose pulls are limited to `rate` and counted in Redis db 13:
    the raw client, the Worker and the pattern of its counter's key (deleted
    at the end)."""
    raw = redis.Redis.from_url(REDIS_URL)
    worker = WorkerClient.open(client)
    key_pattern = f"*throttle_worker_pull_session-{worker.worker.sessions.get().pk}"
    try:
        with override_settings(
            CACHES=_redis_cache(REDIS_URL), REST_FRAMEWORK=_rates(worker_pull=rate)
        ):
            yield raw, worker, key_pattern
    finally:
        for key in raw.keys(key_pattern):
            raw.delete(key)
        raw.close()


@pytest.mark.postgres
@pytest.mark.django_db
def test_throttle_counters_live_in_redis_where_every_process_counts(client: Client) -> None:
    with _redis_pulls(client, "2/min") as (raw, worker, key_pattern):
        assert worker.pull()[0].status_code == 200
        assert worker.pull()[0].status_code == 200
        [key] = raw.keys(key_pattern)
        # What another web process sees: this count, not its own zero.
        raw.delete(key)
        assert worker.pull()[0].status_code == 200  # the shared counter was reset
        assert worker.pull()[0].status_code == 200
        limited = worker.pull()[0]
        assert limited.status_code == 429
        assert error_code(limited) == "throttled"


@pytest.mark.postgres
@pytest.mark.django_db
def test_a_redis_window_is_one_counter_that_expires_with_its_window(client: Client) -> None:
    with _redis_pulls(client, "2/min") as (raw, worker, key_pattern):
        assert worker.pull()[0].status_code == 200
        [key] = raw.keys(key_pattern)
        # One integer and the window's expiry, not a list of request times.
        assert int(raw.get(key) or b"") == 1
        assert 0 < raw.pttl(key) <= 60_000
        assert worker.pull()[0].status_code == 200
        limited = worker.pull()[0]
        assert limited.status_code == 429
        assert 1 <= int(limited["Retry-After"]) <= 60
        assert int(raw.get(key) or b"") == 3


@pytest.mark.postgres
@pytest.mark.django_db
def test_a_redis_counter_without_expiry_is_given_one(client: Client) -> None:
    with _redis_pulls(client, "5/min") as (raw, worker, key_pattern):
        assert worker.pull()[0].status_code == 200
        [key] = raw.keys(key_pattern)
        raw.persist(key)  # as if its window ended between SET and INCR
        assert worker.pull()[0].status_code == 200
        assert 0 < raw.pttl(key) <= 60_000  # else it would refuse the Session forever


@pytest.mark.postgres
@pytest.mark.django_db
def test_a_pooled_redis_connection_the_server_closed_is_reopened_and_counts(
    client: Client,
) -> None:
    """The counter's commands go straight to a pooled connection (no redis-py
    command retry): one the server closed since must be replaced, the request
    counted, not let through uncounted."""
    with _redis_pulls(client, "5/min") as (raw, worker, key_pattern):
        assert worker.pull()[0].status_code == 200
        own = raw.client_id()
        for found in raw.client_list():
            if found["db"] == "13" and int(found["id"]) != own:
                raw.client_kill_filter(_id=found["id"])
        assert worker.pull()[0].status_code == 200
        [key] = raw.keys(key_pattern)
        assert int(raw.get(key) or b"") == 2


@pytest.mark.postgres
@pytest.mark.django_db
def test_a_redis_error_reply_drops_the_connection_so_no_reply_answers_another_command(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """Three commands are written at once: when one fails, its siblings' replies
    are still unread on the connection, which must never serve the next request."""
    with (
        _redis_pulls(client, "5/min") as (raw, worker, key_pattern),
        caplog.at_level(logging.WARNING, logger="qinglong.workers.throttle"),
    ):
        assert worker.pull()[0].status_code == 200
        [key] = raw.keys(key_pattern)
        raw.set(key, "not a number", ex=60)  # INCR fails: an error reply
        assert worker.pull()[0].status_code == 200  # fails open
        raw.delete(key)
        assert worker.pull()[0].status_code == 200
        assert int(raw.get(key) or b"") == 1  # a new window, counted right
        assert 0 < raw.pttl(key) <= 60_000


@pytest.mark.django_db
def test_a_memory_window_refuses_until_it_ends_then_allows_again(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1_000_000.0]
    monkeypatch.setattr("workers.api.throttles._clock", lambda: now[0])
    worker = WorkerClient.open(client)
    with override_settings(
        CACHES={"default": {"BACKEND": LOCMEM, "LOCATION": "throttle-window"}},
        REST_FRAMEWORK=_rates(worker_pull="2/min"),
    ):
        assert worker.pull()[0].status_code == 200
        now[0] += 20
        assert worker.pull()[0].status_code == 200
        limited = worker.pull()[0]
        assert limited.status_code == 429
        assert int(limited["Retry-After"]) == 40  # what is left of the window
        now[0] += 40.5
        assert worker.pull()[0].status_code == 200  # a new window
