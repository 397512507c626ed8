"""A lease's renewal is a HOT update on PostgreSQL (issue 12, leases.0005).

Each Run's lease is renewed twice (its `starting` and `running` ACKs) and a
heartbeat renews every active lease of its Session: the columns a renewal
writes must be in no index of the table, and the table must leave room on a
page for the new row version, or every renewal takes an entry in each index.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection, transaction

from leases.locks import lock_lease_chain
from leases.models import RunLease
from leases.writes import Writes
from qinglong import testing

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

# What `Writes.lease_extend` (ACKs) and a heartbeat's renewal change.
RENEWED = {"expires_at", "version"}


def test_no_index_of_the_lease_table_reads_a_column_a_renewal_writes() -> None:
    with connection.cursor() as cursor:
        # Key columns, expressions and partial-index conditions alike.
        cursor.execute(
            """
            SELECT i.indexrelid::regclass::text, a.attname
            FROM pg_index i
            JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum > 0
            WHERE i.indrelid = 'dispatch_runlease'::regclass
              AND (a.attnum = ANY(i.indkey)
                   OR pg_get_expr(i.indpred, i.indrelid) ~ ('\\m' || a.attname || '\\M')
                   OR pg_get_expr(i.indexprs, i.indrelid) ~ ('\\m' || a.attname || '\\M'))
            """
        )
        indexed = {(index, column) for index, column in cursor.fetchall() if column in RENEWED}
        cursor.execute("SELECT reloptions FROM pg_class WHERE oid = 'dispatch_runlease'::regclass")
        (options,) = cursor.fetchone()
    assert indexed == set()
    assert "fillfactor=80" in (options or [])


def test_renewing_a_lease_updates_its_row_in_place() -> None:
    session = testing.open_session().session
    attempt = testing.pending_attempt(testing.make_run(testing.make_task()))
    _, offer_id, _ = testing.claim(attempt, session)
    lease_id = RunLease.objects.get(offer_id=offer_id).pk
    with transaction.atomic():
        for _ in range(3):
            chain = lock_lease_chain(lease_id)
            assert chain is not None
            writes = Writes()
            writes.lease_extend(chain.lease, expires_at=chain.lease.expires_at + timedelta(1))
            writes.apply()
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_stat_get_xact_tuples_updated(t), pg_stat_get_xact_tuples_hot_updated(t)"
                " FROM (SELECT 'dispatch_runlease'::regclass::oid AS t) AS x"
            )
            assert cursor.fetchone() == (3, 3)
