"""The test database lets threads wait their turn, as the embedded default does.

A thread with a connection of its own (the dispatcher's webhook sender beside
its cycles, notifications/tests/test_senders.py) writes while another holds a
write transaction or reads the same table. The embedded default's SQLite file
(WAL, BEGIN IMMEDIATE, the busy timeout) makes the second wait; Django's
in-memory shared-cache test database answered "database table is locked" at
once (qinglong/settings_test.py), which made that test fail now and then.
"""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, transaction

from qinglong.testing import make_project
from runs.models import Project

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_second_writer_waits_for_the_first_to_commit() -> None:
    holding, writing = threading.Event(), threading.Event()
    released_at: list[float] = []

    def hold_a_write() -> None:
        try:
            with transaction.atomic():
                make_project()
                holding.set()
                # Let go only once the other thread is about to write, and a
                # moment later, so that its write has begun to wait for this one.
                writing.wait(10)
                time.sleep(0.2)
                released_at.append(time.monotonic())
        finally:
            connection.close()  # this thread's own

    first = threading.Thread(target=hold_a_write)
    first.start()
    try:
        assert holding.wait(10)
        writing.set()
        with transaction.atomic():
            make_project()
        written_at = time.monotonic()
    finally:
        writing.set()
        first.join(10)
    assert Project.objects.count() == 2
    if connection.vendor == "sqlite":
        # One writer at a time: this write went through only after the first
        # committed (had it not met the first's lock at all, it would have
        # finished before the first let go).
        assert released_at and written_at > released_at[0]


def test_a_writer_waits_for_a_read_in_progress_on_another_thread() -> None:
    make_project()
    reading, release = threading.Event(), threading.Event()

    def read() -> None:
        try:
            with transaction.atomic():
                assert Project.objects.count() == 1
                reading.set()
                release.wait(10)
        finally:
            connection.close()

    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert reading.wait(10)
        # Written while the other thread's read is still open (it is let go
        # only afterwards): WAL lets a writer beside a reader go on.
        make_project()
    finally:
        release.set()
        reader.join(10)
    assert Project.objects.count() == 2
