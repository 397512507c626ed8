"""The overview page (an admin view) and `/metrics` (README "The operator's console").

The overview answers "is it working?" in one page: Runs by state, throughput
and failures over the last hour and day (SVG charts drawn on the server), the
queue, Workers with their slots, the lease audit's problems, recent
truncations and the dispatch kill switch. It needs a staff user who may view
Runs, Workers, leases and cycles (what it summarizes), and its reads are a
fixed number of queries (`qinglong.console.selectors`).

`/metrics` is Prometheus text for a scraper presenting `QL_METRICS_TOKEN` or
connecting from `QL_METRICS_ALLOW` (settings); the database gauges are read at
scrape time, the counters come from `qinglong.metrics`.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final

from django.conf import settings
from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dispatch.cycles import dispatch_set_paused
from dispatch.models import DispatchControl
from qinglong.admin import action_reason, holds, log_admin_change
from qinglong.clock import db_now
from qinglong.console import selectors
from qinglong.console.charts import BarChart, Series, stacked_bars
from qinglong.console.selectors import FINISHED_STATES, FinishedSeries, Step
from qinglong.metrics import registry_for_scrape

if TYPE_CHECKING:
    from django.contrib.admin import AdminSite

__all__ = ["OVERVIEW_PERMISSIONS", "DatabaseGauges", "metrics_view", "overview_view"]

# What the overview summarizes: its viewer must be allowed to see each of them.
OVERVIEW_PERMISSIONS: Final = (
    "runs.view_run",
    "workers.view_worker",
    "leases.view_runlease",
    "dispatch.view_dispatchcycle",
)
WORKER_LIMIT: Final = 50
# Active leases are at most the Sessions' slots; past this many the overview
# says so and `manage.py audit_leases` lists them all.
AUDIT_PAGE: Final = 500
PROBLEM_ROWS: Final = 20
TRUNCATION_ROWS: Final = 10
PAUSE_PERMISSION: Final = "dispatch.pause_dispatch"


# --------------------------------------------------------------------- charts


def _chart(title: str, finished: FinishedSeries, *, label_format: str, tick_every: int) -> BarChart:
    return stacked_bars(
        title=title,
        buckets=[bucket.start.strftime(label_format) for bucket in finished.buckets],
        series=[
            Series(state.value, [bucket.counts[state] for bucket in finished.buckets])
            for state in FINISHED_STATES
        ],
        tick_every=tick_every,
    )


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


# ------------------------------------------------------------------- overview


def overview_context(*, now: datetime) -> dict[str, Any]:
    """Everything the overview shows, read in a fixed number of queries."""
    by_state = selectors.runs_by_state()
    queue = selectors.queue(now=now)
    hour = selectors.runs_finished(now=now, step=Step.MINUTE, buckets=60)
    day = selectors.runs_finished(now=now, step=Step.HOUR, buckets=24)
    workers, more_workers = selectors.workers_with_slots(limit=WORKER_LIMIT)
    problems, audit_truncated = selectors.lease_problems(now=now, limit=AUDIT_PAGE)
    problem_counts: dict[str, int] = {}
    for finding in problems:
        problem_counts[finding.category] = problem_counts.get(finding.category, 0) + 1
    day_totals = day.totals()
    return {
        "now": now,
        "runs_by_state": [(state.label, state.value, n) for state, n in by_state.items()],
        "finished_day": [
            (state.label, state.value, day_totals[state]) for state in FINISHED_STATES
        ],
        "queue": queue,
        "queue_oldest_age": _age(queue.oldest_age_s(now)),
        "hour_chart": _chart(
            "Runs finished per minute, last hour", hour, label_format="%H:%M", tick_every=10
        ),
        "day_chart": _chart(
            "Runs finished per hour, last 24 hours", day, label_format="%H:00", tick_every=3
        ),
        "workers": workers,
        "more_workers": more_workers,
        "slots_used": sum(w.used for w in workers if w.current),
        "slots_free": sum(w.free for w in workers),
        "online_workers": sum(1 for w in workers if w.current),
        "problems": problems[:PROBLEM_ROWS],
        "problem_counts": sorted(problem_counts.items()),
        "problem_total": len(problems),
        "audit_truncated": audit_truncated,
        "audit_page": AUDIT_PAGE,
        "truncations": selectors.recent_truncations(limit=TRUNCATION_ROWS),
        "truncations_by_reason": selectors.truncations_by_reason(since=now - Step.HOUR.delta * 24),
        "control": selectors.dispatch_control(),
    }


def overview_view(request: HttpRequest, *, site: AdminSite) -> HttpResponse:
    """GET: the overview. POST: flip the kill switch (needs `dispatch.pause_dispatch`)."""
    if not request.user.has_perms(OVERVIEW_PERMISSIONS):
        raise PermissionDenied
    if request.method == "POST":
        return _switch(request)
    context = {
        **site.each_context(request),
        "title": "Overview",
        "may_pause": holds(request, PAUSE_PERMISSION),
        **overview_context(now=db_now()),
    }
    return TemplateResponse(request, "admin/qinglong/overview.html", context)


def _switch(request: HttpRequest) -> HttpResponse:
    if not holds(request, PAUSE_PERMISSION):
        raise PermissionDenied
    back = HttpResponseRedirect(reverse("admin:overview"))
    paused = request.POST.get("paused")
    if paused not in ("1", "0"):
        messages.error(request, "Nothing done: say pause or resume.")
        return back
    reason = action_reason(request)
    if not reason:
        messages.error(request, "Nothing done: pausing or resuming dispatch needs a reason.")
        return back
    user = getattr(request.user, "username", "")
    dispatch_set_paused(paused=paused == "1", reason=reason, actor=f"admin:{user}")
    log_admin_change(
        request,
        DispatchControl.objects.filter(pk=1),
        what="Paused dispatch" if paused == "1" else "Resumed dispatch",
        reason=reason,
    )
    messages.success(request, "Dispatch paused." if paused == "1" else "Dispatch resumed.")
    return back


# -------------------------------------------------------------------- metrics


class DatabaseGauges(Collector):
    """Gauges read from the database at scrape time (bounded queries only)."""

    def collect(self) -> Iterable[Metric]:
        now = timezone.now()
        runs = GaugeMetricFamily(
            "qinglong_runs", "Runs in each unfinished state now.", labels=["state"]
        )
        for state, count in selectors.runs_by_state().items():
            runs.add_metric([state.value], count)
        yield runs
        queue = selectors.queue(now=now)
        yield GaugeMetricFamily(
            "qinglong_queue_depth", "Pending Attempts (queued Runs).", value=queue.depth
        )
        yield GaugeMetricFamily(
            "qinglong_queue_waiting",
            "Pending Attempts not claimable yet (backoff or grace: not_before).",
            value=queue.waiting,
        )
        yield GaugeMetricFamily(
            "qinglong_queue_oldest_age_seconds",
            "Age of the oldest pending Attempt (0 when the queue is empty).",
            value=queue.oldest_age_s(now) or 0.0,
        )
        hour = selectors.runs_finished(now=now, step=Step.HOUR, buckets=2)
        finished = GaugeMetricFamily(
            "qinglong_runs_finished_recent",
            "Runs finished since the start of the previous hour, by end state.",
            labels=["state"],
        )
        for state, count in hour.totals().items():
            finished.add_metric([state.value], count)
        yield finished


def _metrics_refusal(request: HttpRequest) -> HttpResponse | None:
    """None if the scraper may read; else the refusal (README "Metrics")."""
    digest = str(settings.QINGLONG_METRICS_TOKEN_DIGEST)
    header = request.headers.get("Authorization", "")
    if header:
        scheme, _, presented = header.partition(" ")
        if (
            digest
            and scheme.lower() == "bearer"
            and hmac.compare_digest(hashlib.sha256(presented.strip().encode()).hexdigest(), digest)
        ):
            return None
        # A wrong token is refused even from an allowed address.
        return _refuse(401)
    try:
        peer = ipaddress.ip_address(request.META.get("REMOTE_ADDR", ""))
    except ValueError:
        peer = None
    if peer is not None and any(peer in network for network in settings.QINGLONG_METRICS_ALLOW):
        return None
    return _refuse(401 if digest else 403)


def _refuse(status: int) -> HttpResponse:
    response = HttpResponse(
        "metrics: present the QL_METRICS_TOKEN bearer token or scrape from QL_METRICS_ALLOW\n",
        status=status,
        content_type="text/plain; charset=utf-8",
    )
    if status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
    return response


@never_cache
@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    refusal = _metrics_refusal(request)
    if refusal is not None:
        return refusal
    body = generate_latest(registry_for_scrape(DatabaseGauges()))
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
