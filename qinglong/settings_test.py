"""Settings for the test suite: production settings with test-only secrets.

DEBUG stays off so tests see production behaviour; only what needs a value for
a test run (the secret key, plain-HTTP test client) is set here.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

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

# The SQLite pass tests a file database, as the embedded default runs one (WAL,
# BEGIN IMMEDIATE, the busy timeout): one per pytest process, in the temporary
# directory, named after DATABASE_URL's file and the process (two runs side
# by side never share one, as two in-memory databases never did; Django
# deletes it at the end). Django's own default, one in-memory database in
# shared-cache mode, locks per table and answers a second writer, or a writer
# beside an open read, with "database table is locked" at once: SQLite never
# calls the busy handler for a shared-cache lock, so a thread with a
# connection of its own (the dispatcher's webhook sender beside its cycles)
# failed now and then where the product waits its turn; and a live server
# handed its request threads the test thread's one connection (the tests
# with a real agent had to serialize it). SQLITE_TEST_NAME still names a file of your own,
# or ":memory:" for Django's default.
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":  # noqa: F405
    _sqlite = DATABASES["default"]  # noqa: F405
    if not _sqlite["TEST"]["NAME"]:
        _stem = Path(_sqlite["NAME"]).stem
        _sqlite["TEST"]["NAME"] = str(
            Path(tempfile.gettempdir()) / f"test_{_stem}_{os.getpid()}.sqlite3"
        )
