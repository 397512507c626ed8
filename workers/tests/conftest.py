from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.core.cache import cache


@pytest.fixture(autouse=True)
def _fresh_throttle_cache() -> Iterator[None]:
    # Throttle counters live in the default cache, keyed by database ids that
    # a rolled-back test may hand out again.
    cache.clear()
    yield
    cache.clear()
