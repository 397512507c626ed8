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
        while time.monotonic() < deadline:
            if run.attempts.filter(state="running").exists():
                break
            time.sleep(0.2)
        assert run.attempts.filter(state="running").exists()
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
