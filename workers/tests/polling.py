"""Waiting on a condition that a live server or an agent thread makes true."""

from __future__ import annotations

import time
from collections.abc import Callable

from django.db import OperationalError

# SQLite answers these while another connection writes: a shared in-memory
# database at once ("database table is locked: <table>"), the file database of
# the SQLite pass past its busy timeout ("database is locked"); they pass.
_SQLITE_LOCK_MESSAGES = ("database table is locked", "database is locked")


def eventually(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Ask `predicate` every 0.1 s until it holds; fail after `timeout` seconds.

    A SQLite lock error counts as "not yet" (the last one is chained into the
    timeout's AssertionError); any other OperationalError (a missing table, a
    broken connection) propagates at once.
    """
    deadline = time.monotonic() + timeout
    last_error: OperationalError | None = None
    while True:
        try:
            if predicate():
                return
        except OperationalError as err:
            if not _is_sqlite_lock(err):
                raise
            last_error = err
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}") from last_error
        time.sleep(0.1)


def _is_sqlite_lock(err: OperationalError) -> bool:
    message = str(err)
    return any(lock in message for lock in _SQLITE_LOCK_MESSAGES)
