"""Shared helpers for the PostgreSQL race and lock-order tests.

`race` releases calls at one barrier, one thread and Django connection each;
`held_by_someone` probes a row lock from a separate psycopg connection;
`assert_locks_in_order` holds each row in turn elsewhere and checks which of
the others the statement already holds while it waits for it; `HeldRows`
holds rows `FOR UPDATE` in another connection until released.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

import psycopg
from django.db import connection, transaction
from django.db.models import Model


def race(*calls: Callable[[], Any], timeout: float = 30) -> list[Any]:
    """Run the calls at the same instant, one thread and connection each.

    Returns each call's result, or the exception it raised.
    """
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)

    def runner(index: int, call: Callable[[], Any]) -> None:
        try:
            barrier.wait()
            results[index] = call()
        except Exception as err:  # the outcome under test may be an exception
            results[index] = err
        finally:
            connection.close()

    threads = [threading.Thread(target=runner, args=item) for item in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive(), "a racer hung (a deadlock?)"
    return results


def conninfo() -> str:
    """A libpq connection string for the test database (a second, raw connection)."""
    db = connection.settings_dict
    host = db["HOST"] or "127.0.0.1"
    password = f" password={db['PASSWORD']}" if db.get("PASSWORD") else ""
    return f"host={host} port={db['PORT'] or 5432} dbname={db['NAME']} user={db['USER']}{password}"


def held_by_someone(table: str, pk: int) -> bool:
    """Is the row locked by another transaction right now? (A NOWAIT probe.)"""
    with psycopg.connect(conninfo(), autocommit=False) as probe:
        try:
            probe.execute(f'SELECT 1 FROM "{table}" WHERE id = %s FOR UPDATE NOWAIT', [pk])
        except psycopg.errors.LockNotAvailable:
            return True
        probe.rollback()
        return False


def assert_locks_in_order(rows: list[tuple[str, int]], statement: Callable[[], Any]) -> None:
    """`statement` locks `rows` in exactly this order.

    For each row in turn: hold it on another connection, start `statement` in
    a transaction of its own, and check that while it waits for that row it
    holds every row listed before it and none listed after it.
    """
    for position, (blocked_table, blocked_pk) in enumerate(rows):
        blocker = psycopg.connect(conninfo(), autocommit=False)
        blocker.execute(f'SELECT 1 FROM "{blocked_table}" WHERE id = %s FOR UPDATE', [blocked_pk])
        done = threading.Event()

        def run(done: threading.Event = done) -> None:
            try:
                with transaction.atomic():
                    statement()
            finally:
                connection.close()
                done.set()

        worker = threading.Thread(target=run)
        worker.start()
        try:
            time.sleep(0.5)  # the statement now waits on the blocked row
            assert not done.is_set(), f"the statement did not wait for {blocked_table}:{blocked_pk}"
            held = {
                f"{table}:{pk}": held_by_someone(table, pk)
                for index, (table, pk) in enumerate(rows)
                if index != position
            }
            expected = {
                f"{table}:{pk}": index < position
                for index, (table, pk) in enumerate(rows)
                if index != position
            }
            assert held == expected, f"waiting for {blocked_table}:{blocked_pk}"
        finally:
            blocker.rollback()
            blocker.close()
            worker.join(10)


class HeldRows:
    """Rows locked `FOR UPDATE`, in that order, by another connection (a
    thread) from `with` until `release()` or the end of the block."""

    def __init__(self, *rows: tuple[type[Model], int]) -> None:
        self.rows = rows
        self._locked, self._release = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._hold)

    def _hold(self) -> None:
        try:
            with transaction.atomic():
                for model, pk in self.rows:
                    model._default_manager.select_for_update().get(pk=pk)
                self._locked.set()
                self._release.wait(20)
        finally:
            connection.close()

    def __enter__(self) -> HeldRows:
        self._thread.start()
        assert self._locked.wait(10), "the rows were not locked in time"
        return self

    def release(self) -> None:
        self._release.set()
        self._thread.join(20)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.release()
