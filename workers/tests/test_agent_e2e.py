"""The reference agent as a real process against the real Worker API (live server).

A canary Run goes queued → succeeded through pull, starting, running and
succeeded ACKs; a cancelled Run's process is stopped by the heartbeat verdict.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.core.signals import request_started
from django.test import override_settings

from leases.end import run_cancel
from output.redaction import REDACTED
from qinglong.testing import make_project, make_worker
from runs.models import Run
from runs.services import run_enqueue, task_create

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]


def agent(live_server, credential_file: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "workers.agent",
            "--url",
            live_server.url,
            "--credential-file",
            str(credential_file),
            "--state-dir",
            str(credential_file.parent / "agent-state"),
            "--poll-interval",
            "0.2",
            *extra,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def credential_file(tmp_path):
    _, credential = make_worker(slots=2)
    path = tmp_path / "worker.credential"
    path.write_text(credential)
    path.chmod(0o600)
    return path, credential


def test_agent_once_runs_a_queued_run_to_succeeded(live_server, credential_file):
    path, credential = credential_file
    task = task_create(
        project=make_project(),
        name="hello",
        definition={
            "executor_type": "process",
            "command": ["sh", "-c", "echo hi $WHO"],
            "env": {"WHO": "agent"},
            "timeout_s": 30,
        },
    )
    run = run_enqueue(task=task)
    proc = agent(live_server, path, "--once")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    run.refresh_from_db()
    attempt = run.attempts.get()
    assert (run.state, attempt.state, attempt.exit_code) == ("succeeded", "succeeded", 0)
    assert attempt.executor_handle.startswith("pid:")
    # The env value reached the process; the tail is stored redacted of the
    # Task's env values (output.redaction).
    assert attempt.output_tail == f"hi {REDACTED}\n"
    assert credential not in out + err


@override_settings(QINGLONG_HEARTBEAT_INTERVAL_S=1)
def test_cancel_verdict_on_heartbeat_stops_the_running_process(live_server, credential_file):
    path, _ = credential_file
    task = task_create(
        project=make_project(),
        name="sleeper",
        definition={"executor_type": "process", "command": ["sleep", "60"], "timeout_s": 120},
    )
    run = run_enqueue(task=task)
    proc = agent(live_server, path, "--once")
    try:
        deadline = time.monotonic() + 30
        running = False
        while not running and time.monotonic() < deadline:
            time.sleep(0.2)
            running = run.attempts.filter(state="running").exists()
        assert running
        run_cancel(run=run, actor="test")
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    run.refresh_from_db()
    attempt = run.attempts.get()
    assert run.state == "cancelled"
    assert (attempt.state, attempt.error_code) == ("failed", "cancelled")
    assert Run.objects.get(pk=run.pk).finished_at is not None


@pytest.mark.parametrize("batch", [True, False])
def test_the_agent_sends_its_acks_several_per_request(live_server, tmp_path, batch):
    """Four Runs of one pull: `starting` for all of them and then `running` with
    each outcome go in requests carrying several ACKs (POST acks); with
    --no-batch-acks every ACK is a request of its own, as before."""
    _, credential = make_worker(slots=4)
    path = tmp_path / "worker.credential"
    path.write_text(credential)
    path.chmod(0o600)
    task = task_create(
        project=make_project(),
        name="quick",
        definition={"executor_type": "process", "command": ["true"], "timeout_s": 30},
    )
    runs = [run_enqueue(task=task) for _ in range(4)]
    paths: list[str] = []

    def seen(sender, environ, **kwargs):
        if environ.get("PATH_INFO", "").startswith("/api/v1/worker/"):
            paths.append(environ["PATH_INFO"].rsplit("/", 1)[-1])

    request_started.connect(seen)
    try:
        proc = agent(
            live_server, path, "--once", "--slots", "4", *([] if batch else ["--no-batch-acks"])
        )
        _out, err = proc.communicate(timeout=60)
    finally:
        request_started.disconnect(seen)
    assert proc.returncode == 0, err
    for run in runs:
        run.refresh_from_db()
        assert run.state == "succeeded"
        assert [e.to_state for e in run.attempts.get().events.order_by("id")] == [
            "claimed",
            "starting",
            "running",
            "succeeded",
        ]
    acks = [p for p in paths if p in ("ack", "acks")]
    if batch:
        # At most: one request per ACK's phase group, never one per ACK (12).
        assert "acks" in acks and len(acks) < 12, paths
    else:
        assert "acks" not in acks and len(acks) >= 12, paths
