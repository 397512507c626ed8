"""Concurrent appends of one Attempt's output, on real PostgreSQL connections.

A Worker re-sends a chunk whose answer it never got; two web processes may
serve the original and the retry at the same instant. The append lock (the
Attempt's AttemptOutput row) and the (attempt, seq) unique index make it one
stored chunk either way.
"""

from __future__ import annotations

import functools

import pytest

from leases.ack import AckPhase, lease_ack
from leases.models import RunLease
from leases.tests.racing import race
from output.models import AttemptOutput, OutputChunk
from output.services import output_append
from qinglong import testing

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _started():
    opened = testing.open_session()
    attempt = testing.pending_attempt(testing.make_run())
    _, offer_id, token = testing.claim(attempt, opened.session)
    lease = RunLease.objects.get(offer_id=offer_id)
    lease_ack(
        session=opened.session,
        offer_id=offer_id,
        phase=AckPhase.STARTING,
        lease_token=token,
        spec_sha256=lease.spec_digest,
    )
    return opened.session, offer_id, token, attempt


def test_the_same_sequence_number_sent_twice_at_once_is_stored_once() -> None:
    for _ in range(5):
        session, offer_id, token, attempt = _started()
        append = functools.partial(
            output_append,
            session=session,
            offer_id=offer_id,
            lease_token=token,
            seq=1,
            chunk="once\n",
        )
        results = race(append, append, append)
        assert sorted(r.stored for r in results) == [False, False, True], results
        assert list(OutputChunk.objects.filter(attempt=attempt).values_list("seq", "text")) == [
            (1, "once\n")
        ]
        assert AttemptOutput.objects.get(attempt=attempt).stored_bytes == 5


def test_appends_of_different_numbers_at_once_all_land_and_the_books_add_up() -> None:
    session, offer_id, token, attempt = _started()
    calls = [
        functools.partial(
            output_append,
            session=session,
            offer_id=offer_id,
            lease_token=token,
            seq=seq,
            chunk=f"{seq}\n",
        )
        for seq in range(1, 5)
    ]
    results = race(*calls)
    assert all(not isinstance(r, Exception) for r in results), results
    book = AttemptOutput.objects.get(attempt=attempt)
    rows = list(OutputChunk.objects.filter(attempt=attempt).values_list("seq", "size"))
    # Whatever order they landed in, a number below the highest one seen is a
    # repeat (the Worker sends in order; only retries come late): the books
    # always match the stored rows.
    assert book.last_seq == max(seq for seq, _ in rows)
    assert book.stored_bytes == sum(size for _, size in rows)
    assert sum(r.stored for r in results) == len(rows)
