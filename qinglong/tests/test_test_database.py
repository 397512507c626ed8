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

import pytest
from django.db import connection, transaction

from qinglong.testing import make_project
from runs.models import Project

pytestmark = pytest.mark.django_db(transaction=True)


def _holding_a_write(holding: threading.Event, release: threading.Event) -> None:
    try:
        with transaction.atomic():
            make_project()
            holding.set()
            release.wait(10)
    finally:
        connection.close()  # this thread's own


def test_a_second_writer_waits_for_the_first_to_commit() -> None:
    holding, release = threading.Event(), threading.Event()
    first = threading.Thread(target=_holding_a_write, args=(holding, release))
    first.start()
    try:
        assert holding.wait(10)
        # Let go a moment after this thread's write began to wait for it.
        threading.Timer(0.2, release.set).start()
        with transaction.atomic():
            make_project()
    finally:
        release.set()
        first.join(10)
    assert Project.objects.count() == 2


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
        threading.Timer(0.2, release.set).start()
        make_project()
    finally:
        release.set()
        reader.join(10)
    assert Project.objects.count() == 2
