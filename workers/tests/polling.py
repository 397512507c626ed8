"""Waiting on a condition that a live server or an agent thread makes true."""

from __future__ import annotations

import time
from collections.abc import Callable

from django.db import OperationalError


def eventually(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Ask `predicate` every 0.1 s until it holds; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not _holds(predicate):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        time.sleep(0.1)


def _holds(predicate: Callable[[], bool]) -> bool:
    try:
        return predicate()
    except OperationalError:
        # SQLite's shared in-memory test database: "table is locked" while
        # the live server writes. Ask again.
        return False
