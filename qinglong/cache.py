"""The Redis cache backend of the cluster (CACHES in settings): Django's, one client kept.

Django's `RedisCache` builds a new `redis.Redis` client on every cache call
(`RedisCacheClient.get_client`); the connection pool is shared, but the
client's constructor fills its table of about 170 response callbacks each
time. Every throttled Worker request (pull, heartbeat) makes two calls, so
that was about half a millisecond of CPU per request (issue #12,
bench/request_cost.py). Here each pool keeps one client: a `redis.Redis`
is safe to share between threads (each command takes a connection from the
pool for itself), and the pool, the options, the commands and their errors
are Django's, unchanged.
"""

from __future__ import annotations

from typing import Any

from django.core.cache.backends.redis import RedisCache as DjangoRedisCache
from django.core.cache.backends.redis import RedisCacheClient as DjangoRedisCacheClient

__all__ = ["RedisCache"]


class RedisCacheClient(DjangoRedisCacheClient):
    """Django's client, whose `get_client` returns one `redis.Redis` per pool."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._clients: dict[int, Any] = {}

    def get_client(self, key: Any = None, *, write: bool = False) -> Any:
        # Django's private helpers, which django-stubs does not declare.
        django: Any = self
        index = django._get_connection_pool_index(write)
        client = self._clients.get(index)
        if client is None:
            # Two threads may both build one; either is fine (same pool).
            pool = django._get_connection_pool(write)
            client = self._clients.setdefault(index, django._client(connection_pool=pool))
        return client


class RedisCache(DjangoRedisCache):
    def __init__(self, server: Any, params: dict[str, Any]) -> None:
        super().__init__(server, params)
        self._class = RedisCacheClient
