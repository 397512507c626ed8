"""Settings for the test suite: production settings with test-only secrets.

DEBUG stays off so tests see production behaviour; only what needs a value for
a test run (the secret key, plain-HTTP test client) is set here.
"""

from __future__ import annotations

import os

os.environ.setdefault("SECRET_KEY", "test-only-secret-key-0123456789-abcdefghijklmnopqrstuvwxyz")
os.environ.setdefault("QL_LEASE_SECRET", "test-only-lease-secret-0123456789abcdefghijklmnop")
# Throttle counters in per-process memory: the PostgreSQL pass would otherwise
# count in (and the suite's cache.clear() flush) the broker's Redis database,
# shared with any other run on this machine. The cluster rule itself is tested
# in a subprocess (workers/tests/test_throttle_cache.py).
os.environ.setdefault("QL_CACHE_URL", "memory")

from qinglong.settings import *  # noqa: F403

SECURE_SSL_REDIRECT = False
SESSION_COOKIE_SECURE = False
CSRF_COOKIE_SECURE = False
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
