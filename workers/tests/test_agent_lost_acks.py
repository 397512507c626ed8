"""Issue 10, finding 4 (agent side): an ACK that meets a transport error is not dropped.

Before, the agent sent `starting` and `running` once: a connection reset or
refused on either left the runner dead and the offer forgotten, while the
control plane kept the Attempt in whatever state it had last accepted (a
`starting` whose answer was lost stayed `starting`; a spawned process whose
`running` ACK failed ran unsupervised and was never reported) and the
heartbeats renewed its lease for good: a slot held by a lease no process
stood behind. Now every ACK goes again after a pause until the control plane
answers (a repeat of an applied phase is a no-op), so the Attempt ends with
the real outcome of the one process that ran.

A real agent (in process: its threads, journal and real child processes)
against the real Worker API, with the transport failing the ACKs of one
phase: the first after the server applied it (the answer is lost, as when a
web server dies mid-response), the next ones before they leave (refused).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings

from qinglong.testing import make_project, make_worker
from runs.models import Run
from runs.services import run_enqueue, task_create
from workers.agent import procfs
from workers.agent.agent import Agent
from workers.agent.executor import ProcessSpawner
from workers.agent.journal import Journal
from workers.agent.protocol import Response, TransportError
from workers.agent.transport import HttpTransport
from workers.tests.polling import eventually

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not procfs.procfs_available(), reason="needs Linux /proc"),
]

FAILURES = 3


def _phases(body: object) -> set[str]:
    """Every ACK phase in a request body (one ACK, or several in one request)."""
    if isinstance(body, Mapping):
        found = {str(body["phase"])} if "phase" in body else set()
        for value in body.values():
            found |= _phases(value)
        return found
    if isinstance(body, list):
        return set().union(*(_phases(item) for item in body)) if body else set()
    return set()


class LosesAcks:
    """The agent's transport, failing the first FAILURES requests that carry an
    ACK of `phase`: the first one's answer is lost after the server applied
    it, the others are refused before they are sent."""

    def __init__(self, inner: HttpTransport, phase: str) -> None:
        self.inner = inner
        self.phase = phase
        self.failed = 0
        self._lock = threading.Lock()

    def post(self, path: str, body: Mapping[str, Any], *, token: str) -> Response:
        failure = 0
        if "/ack" in path and self.phase in _phases(body):
            with self._lock:
                if self.failed < FAILURES:
                    self.failed += 1
                    failure = self.failed
        if failure > 1:
            raise TransportError("ConnectionRefusedError")
        response = self.inner.post(path, body, token=token)
        if failure == 1:
            raise TransportError("ConnectionResetError")
        return response

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture
def serving() -> Iterator[Callable[[Agent], None]]:
    started: list[tuple[Agent, threading.Thread]] = []

    def serve(agent: Agent) -> None:
        thread = threading.Thread(target=agent.run, daemon=True)
        thread.start()
        started.append((agent, thread))

    yield serve
    for agent, thread in started:
        agent.abort()
        thread.join(30)
        assert not thread.is_alive()
        # Kept-alive connections hold the live server's threads (and their
        # database connections) open past the test.
        getattr(agent.transport, "close", lambda: None)()


@override_settings(QINGLONG_HEARTBEAT_INTERVAL_S=1, QINGLONG_HEARTBEAT_MIN_INTERVAL_S=0)
@pytest.mark.parametrize("phase", ["starting", "running"])
def test_an_ack_that_meets_a_transport_error_is_sent_again_until_answered(
    live_server, serving, tmp_path: Path, phase: str
) -> None:
    _, credential = make_worker(slots=1)
    task = task_create(
        project=make_project(),
        name="stamp",
        definition={
            "executor_type": "process",
            "command": ["sh", "-c", 'echo "$QL_OFFER_ID" >> executions.log; sleep 0.5'],
            "timeout_s": 60,
            "max_attempts": 2,
        },
    )
    run = run_enqueue(task=task)
    transport = LosesAcks(HttpTransport(live_server.url), phase)
    agent = Agent(
        transport=transport,
        credential=credential,
        slots=1,
        executor="process",
        spawn=ProcessSpawner(tmp_path),
        journal=Journal.open(tmp_path / "state"),
        poll_interval_s=0.1,
        stop_grace_s=1,
        retry_initial_s=0.05,
        retry_cap_s=0.2,
    )
    serving(agent)

    eventually(lambda: Run.objects.get(pk=run.pk).state == "succeeded", 30, "the Run succeeded")
    eventually(lambda: len(agent.outcomes) == 1, 10, "the outcome reported")

    assert transport.failed == FAILURES  # the faults happened
    attempt = run.attempts.get()  # no retry: nothing was lost
    assert (attempt.state, attempt.exit_code) == ("succeeded", 0)
    executions = (tmp_path / "executions.log").read_text().split()
    assert executions == [attempt.leases.get().offer_id]  # one process, the one reported
    [outcome] = agent.outcomes
    assert (outcome.ran, outcome.final_phase, outcome.report) == (True, "succeeded", "acked")
    assert agent.journal.open_executions() == []  # nothing owed, nothing held
