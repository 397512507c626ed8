"""Live output end to end: the reference agent as a real process against the live server.

While the Attempt runs its output is already stored and grows, redacted of the
Task's env values, and the operator API serves it; after the end the stored
chunks hold the whole output and the terminal ACK's tail agrees with them.
"""

from __future__ import annotations

import itertools
import time

import pytest

from output.models import OutputChunk
from output.redaction import REDACTED
from qinglong.testing import make_project
from runs.models import AttemptState
from runs.services import run_enqueue, task_create
from workers.tests.test_agent_e2e import agent, credential_file  # noqa: F401  (fixture)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

SECRET = "live-output-secret-4711"


def _stored_text(attempt_id: int) -> str:
    return "".join(OutputChunk.objects.filter(attempt_id=attempt_id).values_list("text", flat=True))


def test_a_running_attempts_output_is_stored_while_it_runs_and_grows(
    live_server,
    credential_file,  # noqa: F811
):
    path, _ = credential_file
    task = task_create(
        project=make_project(),
        name="ticker",
        definition={
            "executor_type": "process",
            "command": [
                "sh",
                "-c",
                'for i in $(seq 1 12); do echo "tick $i $TOKEN"; sleep 0.25; done',
            ],
            "env": {"TOKEN": SECRET},
            "timeout_s": 60,
        },
    )
    run = run_enqueue(task=task)
    proc = agent(live_server, path, "--once")
    try:
        seen: list[str] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            attempt = run.attempts.get()
            text = _stored_text(attempt.pk)
            if attempt.state == AttemptState.RUNNING and text and text not in seen:
                seen.append(text)
            if attempt.state in (AttemptState.SUCCEEDED, AttemptState.FAILED):
                break
            time.sleep(0.1)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    # Seen at least twice while it ran, each time longer (it grows, in order).
    assert len(seen) >= 2, seen
    assert all(a and b.startswith(a) and len(b) > len(a) for a, b in itertools.pairwise(seen))
    attempt = run.attempts.get()
    assert attempt.state == AttemptState.SUCCEEDED
    final = _stored_text(attempt.pk)
    assert final == "".join(f"tick {i} {REDACTED}\n" for i in range(1, 13))
    assert attempt.output_tail == final
    assert SECRET not in final + attempt.output_tail + out + err
