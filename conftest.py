"""Suite-wide pytest configuration.

The suite runs twice (README command 2): once on SQLite, once on PostgreSQL.
Tests marked `postgres` need real concurrent connections or processes; on the
SQLite pass they are skipped with a reason, and they run on the PostgreSQL pass.
"""

from __future__ import annotations

import pytest
from django.db import connection


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if connection.vendor == "postgresql":
        return
    skip = pytest.mark.skip(reason="needs PostgreSQL; runs in the PostgreSQL pass")
    for item in items:
        if "postgres" in item.keywords:
            item.add_marker(skip)
