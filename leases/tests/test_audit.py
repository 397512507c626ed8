"""The lease audit's bounded page classifies exactly as the full audit (one classifier)."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from dispatch.tests.test_ops_commands import seed_every_category
from leases.audit import CATEGORIES, audit, audit_page

pytestmark = pytest.mark.django_db


def test_the_page_names_each_lease_as_the_full_audit_does():
    seeded = seed_every_category()
    now = timezone.now()
    full = {f.lease_id: f.category for f in audit(now=now)}
    page, more = audit_page(now=now, limit=50)
    assert not more
    assert {f.lease_id: f.category for f in page} == full
    assert set(full.values()) == set(CATEGORIES) == set(seeded)


def test_the_page_is_one_query_and_says_when_leases_were_left_out():
    seeded = seed_every_category()
    with CaptureQueriesContext(connection) as captured:
        page, more = audit_page(now=timezone.now(), limit=3)
    assert len(captured.captured_queries) == 1
    assert more
    assert [f.lease_id for f in page] == sorted(seeded.values())[:3]
