"""The counters of qinglong.metrics: where they count, bad settings, multi-process sums."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from leases import end as lease_end_module
from leases.end import lease_expire, lease_revoke
from leases.errors import LostRace, Outcome
from leases.models import RunLease
from qinglong.metrics import REGISTRY
from qinglong.testing import (
    claim,
    make_run,
    make_worker,
    open_session,
    pending_attempt,
)

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]


def families(body: bytes) -> dict[str, list]:
    """Sample lists by family name, parsed by the Prometheus client's own parser."""
    return {family.name: family.samples for family in text_string_to_metric_families(body.decode())}


def value(parsed: dict[str, list], family: str, sample: str, **labels: str) -> float:
    for item in parsed[family]:
        if item.name == sample and all(item.labels.get(k) == v for k, v in labels.items()):
            return item.value
    return 0.0


def counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"QL_METRICS_TOKEN": "short"}, "QL_METRICS_TOKEN"),
        ({"QL_METRICS_ALLOW": "10.0.0.0/8,not-an-address"}, "QL_METRICS_ALLOW"),
        ({"PROMETHEUS_MULTIPROC_DIR": "/nonexistent/metrics"}, "PROMETHEUS_MULTIPROC_DIR"),
    ],
)
def test_bad_metrics_settings_stop_the_process_naming_the_variable(env, needle):
    done = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "qinglong.settings_test", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert needle in done.stderr


# ----------------------------------------------------------------- counters


def test_an_applied_expiry_is_counted_once():
    session = open_session(make_worker()[0]).session
    _, offer_id, _ = claim(pending_attempt(make_run()), session)
    lease = RunLease.objects.get(offer_id=offer_id)
    before = counter("qinglong_lease_expiries_total")
    assert lease_expire(lease.pk) is Outcome.UNCHANGED  # still live: not an expiry
    assert counter("qinglong_lease_expiries_total") == before
    RunLease.objects.filter(pk=lease.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert lease_expire(lease.pk) is Outcome.APPLIED
    assert lease_expire(lease.pk) is Outcome.UNCHANGED
    assert counter("qinglong_lease_expiries_total") == before + 1


def test_a_lost_compare_and_set_is_counted_by_operation(monkeypatch):
    session = open_session(make_worker()[0]).session
    _, offer_id, _ = claim(pending_attempt(make_run()), session)
    lease = RunLease.objects.get(offer_id=offer_id)

    def lose(*args, **kwargs):
        raise LostRace("another writer")

    monkeypatch.setattr(lease_end_module, "lease_transition", lose)
    before = counter("qinglong_lost_races_total", operation="lease_end")
    assert lease_revoke(lease.pk, reason="operator_revoke") is Outcome.LOST_RACE
    assert counter("qinglong_lost_races_total", operation="lease_end") == before + 1


def test_a_lost_cancel_is_counted_and_a_cancel_that_applies_is_not(monkeypatch):
    from leases.end import run_cancel

    run = make_run()

    def lose(*args, **kwargs):
        raise LostRace("another writer")

    before = counter("qinglong_lost_races_total", operation="cancel")
    with monkeypatch.context() as patch:
        patch.setattr(lease_end_module, "run_transition", lose)
        assert run_cancel(run=run, actor="test") is Outcome.LOST_RACE
    assert counter("qinglong_lost_races_total", operation="cancel") == before + 1
    assert run_cancel(run=run, actor="test") is Outcome.APPLIED
    assert counter("qinglong_lost_races_total", operation="cancel") == before + 1


# ------------------------------------------------------------ multi-process

_CHILDREN = textwrap.dedent(
    """
    import multiprocessing, sys
    from prometheus_client import generate_latest
    from qinglong import metrics

    def work(n):
        metrics.CLAIMS.labels(outcome="won").inc(n)
        metrics.CYCLE_DURATION.labels(scope="global").observe(0.01)

    if __name__ == "__main__":
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=work, args=(n,)) for n in (2, 5)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
            assert p.exitcode == 0
        sys.stdout.write(generate_latest(metrics.registry_for_scrape()).decode())
    """
)


def test_multiprocess_mode_sums_every_process_of_the_box(tmp_path):
    script = tmp_path / "children.py"
    script.write_text(_CHILDREN)
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    parsed = families(done.stdout.encode())
    # The parent scraped what two other processes counted.
    assert value(parsed, "qinglong_claims", "qinglong_claims_total", outcome="won") == 7
    assert (
        value(
            parsed,
            "qinglong_cycle_duration_seconds",
            "qinglong_cycle_duration_seconds_count",
            scope="global",
        )
        == 2
    )
    assert list(metrics_dir.glob("counter_*.db"))


def test_gunicorn_child_exit_marks_the_worker_dead_in_multiprocess_mode(monkeypatch, tmp_path):
    import runpy

    conf = runpy.run_path(str(ROOT / "qinglong" / "gunicorn.conf.py"))
    live = tmp_path / "gauge_livesum_4242.db"
    live.write_bytes(b"")
    kept = tmp_path / "counter_4242.db"
    kept.write_bytes(b"")

    class Worker:
        pid = 4242

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    conf["child_exit"](None, Worker())
    assert live.exists()  # not in multi-process mode: nothing touched
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    conf["child_exit"](None, Worker())
    assert not live.exists()  # its live gauges are gone
    assert kept.exists()  # its counters still count


# ------------------------------------------------------------------- cycles


def test_every_cycle_counts_its_duration_truncation_and_redeliveries():
    from dispatch.core.ports import DispatchScope
    from dispatch.cycles import dispatch_cycle
    from dispatch.tests.test_cycle_orm import budget, pull, session_scope

    session = open_session(make_worker(slots=4)[0]).session
    for _ in range(3):
        make_run()
    cycles = counter("qinglong_cycle_duration_seconds_count", scope="global")
    truncated = counter("qinglong_cycle_truncations_total", reason="claim_budget_exhausted")
    with budget(max_claim_attempts=1):
        result = dispatch_cycle(scope=DispatchScope.global_())
    assert (result.truncated, str(result.reason)) == (True, "claim_budget_exhausted")
    assert counter("qinglong_cycle_duration_seconds_count", scope="global") == cycles + 1
    assert (
        counter("qinglong_cycle_truncations_total", reason="claim_budget_exhausted")
        == truncated + 1
    )
    # The Session's pull re-delivers the lease the global cycle claimed for it.
    redelivered = counter("qinglong_redeliveries_total", scope="session")
    pulled = dispatch_cycle(scope=session_scope(session), pull=pull())
    assert pulled.counts.recovered == 1
    assert counter("qinglong_redeliveries_total", scope="session") == redelivered + 1
    # Repeats of an outcome are summed into one row later; each still counts now.
    for _ in range(3):
        dispatch_cycle(scope=DispatchScope.global_())
    assert counter("qinglong_cycle_duration_seconds_count", scope="global") == cycles + 4
