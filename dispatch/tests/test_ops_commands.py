"""`dispatch_once`, `run_dispatcher` and `audit_leases` (README "Running it")."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.management import call_command
from django.test import override_settings
from django.utils import timezone

from dispatch.cycles import dispatch_set_paused
from dispatch.models import DispatchCycle
from leases.ack import AckPhase, lease_ack
from leases.models import LeaseState, RunLease
from qinglong.testing import claim, make_run, make_worker, open_session, pending_attempt
from runs.models import Attempt, Run
from workers.models import WorkerSession

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]
# A port nothing listens on: the broker is unreachable.
CLOSED_BROKER = "redis://127.0.0.1:1/0"


def run_command(name: str, *args: str) -> tuple[int, str]:
    out = io.StringIO()
    try:
        call_command(name, *args, stdout=out)
    except SystemExit as exit_:
        return int(exit_.code or 0), out.getvalue()
    return 0, out.getvalue()


# ------------------------------------------------------------------ dispatch_once


def test_dispatch_once_claims_for_an_open_session_and_prints_the_summary():
    opened = open_session()
    run = make_run()
    status, out = run_command("dispatch_once", "--json")
    summary = json.loads(out)
    assert status == 0
    assert summary["scope"] == "global"
    assert summary["status"] == "offered"
    assert summary["counts"]["claims_won"] == 1
    assert set(summary) == {
        "scope",
        "status",
        "reason",
        "truncated",
        "observed_at",
        "duration_ms",
        "counts",
    }
    assert RunLease.objects.get(run=run).session_id == opened.session.pk
    assert DispatchCycle.objects.filter(status="offered").count() == 1


def test_dispatch_once_with_nothing_queued_is_idle_and_exits_zero():
    status, out = run_command("dispatch_once")
    assert status == 0
    assert "idle" in out


def test_dispatch_once_honours_the_kill_switch():
    open_session()
    run = make_run()
    dispatch_set_paused(paused=True, reason="maintenance", actor="test")
    status, out = run_command("dispatch_once", "--json")
    assert (status, json.loads(out)["status"]) == (0, "paused")
    assert Run.objects.get(pk=run.pk).state == "queued"
    assert DispatchCycle.objects.get().status == "paused"


# ----------------------------------------------------------------- run_dispatcher


@override_settings(CELERY_BROKER_URL=CLOSED_BROKER)
def test_run_dispatcher_keeps_dispatching_with_no_broker_reachable():
    open_session(make_worker(slots=4)[0])
    runs = [make_run() for _ in range(3)]
    status, out = run_command("run_dispatcher", "--max-cycles", "4", "--interval", "0.01", "--json")
    events = [json.loads(line) for line in out.splitlines()]
    assert status == 0
    assert events[-1]["event"] == "stopped"
    assert events[-1]["cycles"] == 4
    assert events[-1]["errors"] == 0
    assert events[-1]["sweeps"] == 1
    assert {e["event"] for e in events} == {"cycle", "sweep", "stopped"}
    assert Run.objects.filter(pk__in=[r.pk for r in runs], state="dispatching").count() == 3
    # A new outcome is a row at once; its repeats are summed into one row,
    # written when the loop stops: every cycle is accounted for.
    assert sum(DispatchCycle.objects.values_list("cycles", flat=True)) == 4
    assert DispatchCycle.objects.count() < 4


def test_run_dispatcher_logs_a_failing_cycle_and_carries_on(monkeypatch, caplog):
    from dispatch.management.commands import run_dispatcher

    calls = {"n": 0}
    real = run_dispatcher.dispatch_cycle

    def flaky(**kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("database went away")
        return real(**kwargs)

    monkeypatch.setattr(run_dispatcher, "dispatch_cycle", flaky)
    monkeypatch.setattr(run_dispatcher, "MAX_BACKOFF_S", 0.01)
    status, out = run_command("run_dispatcher", "--max-cycles", "3", "--interval", "0.01", "--json")
    stopped = json.loads(out.splitlines()[-1])
    assert status == 0
    assert (stopped["cycles"], stopped["errors"]) == (3, 1)
    assert any(r.getMessage() == "dispatch cycle failed" for r in caplog.records)


def test_run_dispatcher_stops_after_the_current_cycle_on_sigterm(tmp_path):
    """A real process on a file SQLite database, no broker: SIGTERM → clean exit 0."""
    db = tmp_path / "loop.sqlite3"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "qinglong.settings_test",
        "DATABASE_URL": f"sqlite:///{db}",
        "CELERY_BROKER_URL": CLOSED_BROKER,
    }
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v0"],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=60,
    )
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "run_dispatcher", "--interval", "0.05", "--json"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())  # the first sweep or cycle
        assert first["event"] in {"sweep", "cycle"}
        proc.terminate()
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert json.loads(out.splitlines()[-1])["event"] == "stopped"


# ------------------------------------------------------------------- audit_leases


def _lease_for(session, *, ack: AckPhase | None = None):
    attempt = pending_attempt(make_run())
    _, offer_id, token = claim(attempt, session)
    lease = RunLease.objects.get(offer_id=offer_id)
    if ack is not None:
        lease_ack(
            session=session,
            offer_id=offer_id,
            phase=ack,
            lease_token=token,
            spec_sha256=lease.spec_digest,
        )
    return lease


def seed_every_category() -> dict[str, int]:
    """One active lease per audit category; returns category → lease id."""
    worker, _ = make_worker(slots=16)
    session = open_session(worker).session
    leases = {
        "deliverable": _lease_for(session),
        "awaiting_start": _lease_for(session),
        "running": _lease_for(session, ack=AckPhase.STARTING),
        "expired": _lease_for(session),
        "cancelled": _lease_for(session),
        "cancelling": _lease_for(session, ack=AckPhase.STARTING),
        "spec_drift": _lease_for(session),
        "orphaned": _lease_for(session, ack=AckPhase.STARTING),
        "over_delivered": _lease_for(session),
    }
    RunLease.objects.filter(pk=leases["awaiting_start"].pk).update(
        delivery_count=1, last_delivered_at=timezone.now()
    )
    # Pulled max_deliveries times without a starting ACK, not yet revoked.
    RunLease.objects.filter(pk=leases["over_delivered"].pk).update(
        delivery_count=5, last_delivered_at=timezone.now()
    )
    RunLease.objects.filter(pk=leases["expired"].pk).update(
        expires_at=timezone.now() - timedelta(seconds=5)
    )
    # A cancel whose revoke never ran (claimed) vs. one waiting for the Worker.
    for category in ("cancelled", "cancelling"):
        Run.objects.filter(pk=leases[category].run_id).update(cancel_requested=True)
    RunLease.objects.filter(pk=leases["spec_drift"].pk).update(spec_digest="0" * 64)
    # A completion that never closed its lease (a crash between two writes).
    Attempt.objects.filter(pk=leases["orphaned"].attempt_id).update(state="failed")
    # Fenced Sessions whose lease ending never ran (crash after the fence).
    for category, state in (("session_replaced", "replaced"), ("session_offline", "offline")):
        other = open_session(make_worker(slots=2)[0]).session
        leases[category] = _lease_for(other)
        WorkerSession.objects.filter(pk=other.pk).update(state=state)
    return {category: lease.pk for category, lease in leases.items()}


def test_audit_reports_each_category_and_exits_one_when_problems_exist():
    seeded = seed_every_category()
    status, out = run_command("audit_leases", "--json")
    report = json.loads(out)
    assert status == 1
    assert {row["lease_id"]: row["category"] for row in report["rows"]} == {
        lease_id: category for category, lease_id in seeded.items()
    }
    assert all(count == 1 for count in report["counts"].values())
    assert report["problems"] == 7
    # Read-only: nothing changed.
    assert RunLease.objects.filter(state=LeaseState.ACTIVE).count() == len(seeded)


def test_audit_expire_repairs_everything_then_a_second_run_has_nothing_to_fix():
    seeded = seed_every_category()
    status, out = run_command("audit_leases", "--expire", "--json")
    report = json.loads(out)
    assert (status, report["unrepaired"]) == (0, 0)
    assert report["repaired"] == {"applied": 7}
    ended = dict(RunLease.objects.filter(pk__in=seeded.values()).values_list("pk", "end_reason"))
    assert ended[seeded["expired"]] == "lease_expired"
    assert ended[seeded["session_replaced"]] == "worker_restarted"
    assert ended[seeded["session_offline"]] == "worker_lost"
    assert ended[seeded["over_delivered"]] == "max_deliveries"
    assert ended[seeded["spec_drift"]] == "spec_drift"
    assert RunLease.objects.get(pk=seeded["deliverable"]).state == LeaseState.ACTIVE
    assert RunLease.objects.get(pk=seeded["running"]).state == LeaseState.ACTIVE
    # An in-progress cancel is healthy: the Worker is stopping it, not the audit.
    assert RunLease.objects.get(pk=seeded["cancelling"]).state == LeaseState.ACTIVE
    # The expired claim went back to pending; the drifted one too.
    assert RunLease.objects.get(pk=seeded["expired"]).attempt.state == "pending"
    again_status, again = run_command("audit_leases")
    assert again_status == 0
    assert "0 problems" in again


def test_audit_on_a_healthy_database_exits_zero():
    _lease_for(open_session().session)
    status, out = run_command("audit_leases", "--json")
    assert status == 0
    assert json.loads(out)["counts"]["deliverable"] == 1


def test_every_ops_command_documents_itself_in_help():
    for name, needle in (
        ("audit_leases", "Exit status"),
        ("run_dispatcher", "--max-cycles"),
        ("dispatch_once", "--json"),
    ):
        result = subprocess.run(
            [sys.executable, "manage.py", name, "--help"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "DJANGO_SETTINGS_MODULE": "qinglong.settings_test"},
        )
        assert result.returncode == 0
        assert needle in result.stdout
