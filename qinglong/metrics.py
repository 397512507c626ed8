"""Prometheus metrics of the control plane (README "Metrics"), defined once.

Each counter is incremented at the one place its event happens:

| metric | where |
|---|---|
| `qinglong_claims_total{outcome}` | `leases.claim.DatabaseClaimPort`: every claim of a cycle |
| `qinglong_lost_races_total{operation}` | the `LostRace` branch of claim, lease end, ACK, cancel |
| `qinglong_lease_expiries_total` | `leases.end.lease_end`: an applied expiry |
| `qinglong_redeliveries_total{scope}` | `dispatch.cycles`, per recorded cycle (`cycle_observed`) |
| `qinglong_cycle_truncations_total{reason}` | the same |
| `qinglong_cycle_duration_seconds{scope}` | the same (a histogram) |
| `qinglong_webhook_failures_total{event}` | the webhook delivery: each failed try |

Gauges of the database (Runs by state, queue age) are not kept here: the
`/metrics` view computes them at scrape time with bounded queries.

Labels are small fixed vocabularies (outcomes, scopes, reasons, events): never
an id, a name, a command or a token.

Multi-process: with `PROMETHEUS_MULTIPROC_DIR` set (checked by the settings),
prometheus_client keeps every value in per-process files in that directory and
`registry_for_scrape` sums them, so one scrape of any web process reports the
gunicorn workers and any dispatcher or Celery process started with the same
directory. Without it, values live in this process only.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from dispatch.core.result import DispatchCycleResult

__all__ = [
    "CLAIMS",
    "CYCLE_DURATION",
    "LEASE_EXPIRIES",
    "LOST_RACES",
    "REDELIVERIES",
    "REGISTRY",
    "TRUNCATIONS",
    "WEBHOOK_FAILURES",
    "cycle_observed",
    "multiprocess_dir",
    "registry_for_scrape",
]

MULTIPROC_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"

# This process's metrics; not prometheus_client's global default registry, so
# nothing another library registers there is exported by accident.
REGISTRY: Final = CollectorRegistry(auto_describe=True)

CLAIMS: Final = Counter(
    "qinglong_claims",
    "Claims made by dispatch cycles, by outcome (won, attempt_lost, worker_unavailable).",
    ["outcome"],
    registry=REGISTRY,
)
LOST_RACES: Final = Counter(
    "qinglong_lost_races",
    "Compare-and-sets (or unique inserts) that another writer won, by operation.",
    ["operation"],
    registry=REGISTRY,
)
LEASE_EXPIRIES: Final = Counter(
    "qinglong_lease_expiries",
    "Leases that ended because they expired (sweeper or audit).",
    registry=REGISTRY,
)
REDELIVERIES: Final = Counter(
    "qinglong_redeliveries",
    "Offers of an existing lease delivered again (recovery), by cycle scope.",
    ["scope"],
    registry=REGISTRY,
)
TRUNCATIONS: Final = Counter(
    "qinglong_cycle_truncations",
    "Dispatch cycles that stopped at a budget, by reason.",
    ["reason"],
    registry=REGISTRY,
)
CYCLE_DURATION: Final = Histogram(
    "qinglong_cycle_duration_seconds",
    "Duration of recorded dispatch cycles, by scope.",
    ["scope"],
    # A cycle is bounded (docs/adr/0001): milliseconds normally, a second is slow.
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
    registry=REGISTRY,
)
WEBHOOK_FAILURES: Final = Counter(
    "qinglong_webhook_failures",
    "Webhook delivery tries that failed (error, timeout or non-2xx answer), by event.",
    ["event"],
    registry=REGISTRY,
)


def cycle_observed(result: DispatchCycleResult) -> None:
    """Count one recorded dispatch cycle: duration, re-deliveries, truncation."""
    scope = str(result.scope)
    CYCLE_DURATION.labels(scope=scope).observe(result.duration_ms / 1000)
    if result.counts.recovered:
        REDELIVERIES.labels(scope=scope).inc(result.counts.recovered)
    if result.truncated:
        TRUNCATIONS.labels(reason=str(result.reason)).inc()


def multiprocess_dir() -> str | None:
    return os.environ.get(MULTIPROC_ENV) or None


class _Scrape(Collector):
    """Several collectors read as one registry (what `generate_latest` needs)."""

    def __init__(self, sources: Iterable[Collector]) -> None:
        self._sources = tuple(sources)

    def collect(self) -> Iterable[Metric]:
        for source in self._sources:
            yield from source.collect()


def registry_for_scrape(*extra: Collector) -> Collector:
    """What one scrape reports: the counters (every process's, in multi-process
    mode) and `extra` collectors computed now (the database gauges)."""
    path = multiprocess_dir()
    if path is None:
        return _Scrape((REGISTRY, *extra))
    merged = CollectorRegistry()
    MultiProcessCollector(merged, path=path)
    return _Scrape((merged, *extra))
