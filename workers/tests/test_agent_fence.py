"""The agent fences itself: no heartbeat accepted for a Session timeout ends
every process of the Session before the control plane's lost-execution grace
lets a retry start elsewhere (docs/adr/0005, docs/adr/0008; Nomad's
`stop_after_client_disconnect`).

Before: an agent cut off by a partition kept its work running; the control
plane declared the Session offline, waited the grace and ran the retry on
another Worker beside it — two executions of one Run at once.
"""

from __future__ import annotations

import contextlib
import json
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings

from dispatch.sweeps import sweep_stale_sessions
from leases.models import RunLease
from qinglong.testing import make_worker
from runs.models import Attempt, Run
from workers.agent import procfs
from workers.agent.agent import Agent
from workers.agent.executor import ProcessSpawner
from workers.agent.journal import Journal, Outcome, Phase
from workers.agent.protocol import Response
from workers.tests.markers import offer_id
from workers.tests.polling import eventually
from workers.tests.test_agent_faults import (
    AgentProcess,
    alive,
    assert_no_overlap,
    attempt_running,
    executions,
    setup,  # noqa: F401  (a fixture)
)
from workers.tests.test_agent_inbox import FakeControlPlane, Spawner, an_offer
from workers.tests.test_agent_inbox import eventually as soon

needs_proc = pytest.mark.skipif(not procfs.procfs_available(), reason="needs Linux /proc")


# ------------------------------------------------------- against a fake plane


def test_the_session_open_answer_sets_the_fence_and_an_old_one_gets_three_beats() -> None:
    plane = FakeControlPlane(heartbeat_interval_s=2, session_timeout_s=7)
    agent = Agent(
        transport=plane,
        credential="c" * 43,
        slots=1,
        executor="process",
        spawn=Spawner(Journal.memory()),
    )
    assert agent.open_session().timeout_s == 7
    original = plane.post

    def older(path: str, body: Mapping[str, Any], *, token: str) -> Response:
        answer = original(path, body, token=token)
        if path.endswith("/sessions"):
            # A control plane from before `session_timeout_s`.
            return Response(answer.status, {**answer.body, "session_timeout_s": None})
        return answer

    plane.post = older  # type: ignore[method-assign]
    assert agent.open_session().timeout_s == 6  # 3 x heartbeat_interval_s


@needs_proc
def test_no_accepted_heartbeat_for_the_timeout_ends_the_work_though_its_runner_hangs(
    tmp_path: Path,
) -> None:
    """A real process; its runner hangs in the `running` ACK (a partition
    leaves requests hanging for their whole timeout) and every heartbeat
    fails. At the Session timeout the fence thread ends the process group
    itself (TERM, then KILL after the grace: the job ignores TERM), journals
    it killed, and once the control plane answers again a new Session
    reports it through the reconcile before any pull."""
    plane = FakeControlPlane(heartbeat_interval_s=0.2, session_timeout_s=1.5)
    journal = Journal.open(tmp_path / "state")
    job = [sys.executable, "-c", "import signal, time; signal.signal(15, signal.SIG_IGN); "
           "time.sleep(60)"]  # fmt: skip
    offer = an_offer(1, command=job, timeout_s=120)
    plane.offers = [offer]
    released = threading.Event()

    def hang(body: Mapping[str, Any]) -> Response:
        released.wait(30)
        return Response(200, {"cancel_requested": False})

    plane.hooks[(offer_id(1), "running")] = hang
    agent = Agent(
        transport=plane,
        credential="c" * 43,
        slots=1,
        executor="process",
        spawn=ProcessSpawner(tmp_path),
        journal=journal,
        poll_interval_s=0.05,
        stop_grace_s=0.5,
        retry_initial_s=0.05,
        retry_cap_s=0.2,
    )
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        soon(lambda: (ex := journal.get(offer_id(1))) is not None and ex.pid is not None)
        execution = journal.get(offer_id(1))
        assert execution is not None and execution.pid is not None
        pid = execution.pid
        soon(lambda: "ack:running" in plane.kinds())
        plane.down = True  # the partition: nothing gets through from now on
        cut_at = time.monotonic()
        soon(lambda: not alive(pid), timeout=10)
        dead_after = time.monotonic() - cut_at
        # The timeout counts from the last accepted beat (at most one
        # interval before the cut), plus the grace before the KILL.
        assert 1.5 - 0.2 <= dead_after <= 1.5 + 0.5 + 1.0, dead_after
        assert not released.is_set()  # its runner was still hanging
        time.sleep(1)
        plane.down = False  # the control plane is back
        released.set()
        soon(lambda: "reconcile" in plane.kinds(), timeout=15)
    finally:
        released.set()
        plane.down = False
        agent.abort()
        thread.join(15)
        journal.close()
    [body] = plane.record("reconcile")
    [item] = body["executions"]
    assert (item["offer_id"], item["outcome"]) == (offer_id(1), "killed")
    assert item["exit_code"] == -signal.SIGKILL
    kinds = plane.kinds()
    opens = [i for i, k in enumerate(kinds) if k == "sessions"]
    assert len(opens) == 2 and opens[1] < kinds.index("reconcile")
    assert "pull" not in kinds[opens[1] : kinds.index("reconcile")]
    assert plane.record("sessions")  # the second open: after the fence, not before


def test_a_heartbeat_accepted_in_time_never_fences() -> None:
    """An outage shorter than the Session timeout (less than one timeout
    since the last accepted beat) leaves the work alone."""
    plane = FakeControlPlane(heartbeat_interval_s=0.1, session_timeout_s=1.0)
    journal = Journal.memory()
    spawner = Spawner(journal, runs_until_stopped=True)
    agent = Agent(
        transport=plane,
        credential="c" * 43,
        slots=1,
        executor="process",
        spawn=spawner,
        journal=journal,
        poll_interval_s=0.02,
        stop_grace_s=0.2,
        retry_initial_s=0.01,
        retry_cap_s=0.05,
    )
    plane.offers = [an_offer(1)]
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        soon(lambda: "ack:running" in plane.kinds())
        for _ in range(3):
            plane.down = True
            time.sleep(0.6)
            plane.down = False
            time.sleep(0.3)
        assert not spawner.processes[offer_id(1)].terminated.is_set()
        assert plane.sessions == 1
        execution = journal.get(offer_id(1))
        assert execution is not None and execution.phase is Phase.RUNNING
    finally:
        agent.abort()
        thread.join(10)
    execution = journal.get(offer_id(1))
    assert execution is not None and execution.outcome is Outcome.KILLED


def _one_offer_agent() -> tuple[FakeControlPlane, Journal, Agent]:
    """An agent against a fake plane (Session timeout 1 s) with one offer
    whose fake process runs until stopped."""
    plane = FakeControlPlane(heartbeat_interval_s=0.1, session_timeout_s=1.0)
    journal = Journal.memory()
    agent = Agent(
        transport=plane,
        credential="c" * 43,
        slots=1,
        executor="process",
        spawn=Spawner(journal, runs_until_stopped=True),
        journal=journal,
        poll_interval_s=0.02,
        stop_grace_s=0.2,
        retry_initial_s=0.01,
        retry_cap_s=0.05,
    )
    plane.offers = [an_offer(1)]
    return plane, journal, agent


def _fenced_offers(
    plane: FakeControlPlane, agent: Agent, capsys: pytest.CaptureFixture[str]
) -> list[str]:
    """Runs the agent until its offer runs, cuts the plane off until the fence
    reports an execution, and returns the offer ids of its `execution_fenced`
    events (waits at most 10 s for one)."""
    err: list[str] = []

    def fenced() -> bool:
        err.append(capsys.readouterr().err)
        return '"execution_fenced"' in "".join(err)

    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        soon(lambda: "ack:running" in plane.kinds())
        plane.down = True
        soon(fenced, timeout=10)
    finally:
        plane.down = False
        agent.abort()
        thread.join(10)
    err.append(capsys.readouterr().err)
    events = [json.loads(line) for line in "".join(err).splitlines()]
    return [e["offer_id"] for e in events if e["event"] == "execution_fenced"]


def test_an_execution_its_runner_ends_first_is_still_reported_fenced(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Told of the fence, a runner ends its own process too and may journal it
    killed before the fence thread looks at the journal (a busy box): the
    fence still names every execution that was live when it fenced.

    Before: the live executions were read after the runners were told, so one
    its runner had already journaled was missing from `execution_fenced`."""
    from workers.agent import protocol

    plane, journal, agent = _one_offer_agent()
    told = protocol.AttemptRunner.fence

    def first_to_journal(runner: protocol.AttemptRunner) -> None:
        told(runner)
        journal.mark_finished(runner.offer_id, outcome=Outcome.KILLED, exit_code=None)

    monkeypatch.setattr(protocol.AttemptRunner, "fence", first_to_journal)
    assert _fenced_offers(plane, agent, capsys) == [offer_id(1)]


def test_an_execution_that_turns_live_while_the_fence_tells_the_runners_is_reported_fenced(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The mirror case: an execution the fence's first look did not see live
    (its runner spawned just after) is found by its second look, after the
    runners were told, and is still reported as fenced."""
    plane, _, agent = _one_offer_agent()
    looks = agent._live
    first: list[bool] = []

    def not_yet_at_first(session: Any) -> Any:
        if not first:
            first.append(True)
            return []  # as if its runner spawned right after this look
        return looks(session)

    monkeypatch.setattr(agent, "_live", not_yet_at_first)
    assert _fenced_offers(plane, agent, capsys) == [offer_id(1)]
    assert first == [True]


# ---------------------------------------------- a real agent, a real partition


class Partition:
    """A TCP forwarder in front of the live server that can cut the network:
    while cut, connections are accepted and nothing goes through either way
    (no reset, no refusal: requests hang until the agent's timeout), as in a
    partition. Healing drops every connection that lived through the cut."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.cut = threading.Event()
        self._stop = threading.Event()
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.listener.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def heal(self) -> None:
        with self._lock:
            stale, self._open = list(self._open), set()
        for sock in stale:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.cut.clear()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            threading.Thread(target=self._pipe, args=(client,), daemon=True).start()

    def _pipe(self, client: socket.socket) -> None:
        with self._lock:
            self._open.add(client)
        try:
            with client, socket.create_connection(self.target) as upstream:
                sockets = [client, upstream]
                while not self._stop.is_set():
                    if self.cut.is_set():
                        time.sleep(0.05)  # nothing crosses; the bytes wait
                        continue
                    ready, _, _ = select.select(sockets, [], [], 0.1)
                    for source in ready:
                        try:
                            data = source.recv(65536)
                            if not data:
                                return
                            (upstream if source is client else client).sendall(data)
                        except OSError:
                            return
        except OSError:
            return
        finally:
            with self._lock:
                self._open.discard(client)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.heal()
        with contextlib.suppress(OSError):
            self.listener.close()


@needs_proc
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@override_settings(
    QINGLONG_HEARTBEAT_INTERVAL_S=1,
    QINGLONG_HEARTBEAT_MIN_INTERVAL_S=0,
    QINGLONG_SESSION_TIMEOUT_S=3,
    QINGLONG_LOST_EXECUTION_GRACE_S=6,
)
def test_a_partition_longer_than_the_grace_never_overlaps_the_retry(
    live_server,
    setup,  # noqa: F811  (the fixture imported above)
    tmp_path,
) -> None:
    """Agent A runs a long job through a link that is then cut for longer
    than the Session timeout plus the lost-execution grace; agent B, on
    the same control plane, is idle. The control plane declares A's Session
    offline and, after the grace, B runs the retry. A fenced itself at the
    Session timeout: its job was gone before the retry started. When the
    link heals, A opens a new Session and reports the job killed.

    Fails without the fence: A's job runs on (60 s) beside B's retry."""
    partition = Partition((live_server.thread.host, live_server.thread.port))
    run, agent, log = setup(partition.url, long_s=60, max_attempts=2)
    _, other_credential = make_worker(slots=1)
    other_file = tmp_path / "other.credential"
    other_file.write_text(other_credential)
    (tmp_path / "other").mkdir()  # its own logs
    other = AgentProcess(live_server.url, other_file, tmp_path / "other-state", tmp_path / "other")
    try:
        agent.start()
        eventually(lambda: len(executions(log)) == 1 and attempt_running(run), 30, "running")
        [first] = executions(log)
        other.start()
        partition.cut.set()
        cut_at = time.monotonic()
        # The control plane's side: the Session goes offline after its
        # timeout (the sweep a dispatcher would run), then the grace.
        eventually(lambda: sweep_stale_sessions().applied == 1, 15, "A's Session offline")
        lost = Attempt.objects.get(run=run, number=1)
        assert (lost.state, lost.error_code) == ("lost", "worker_lost")
        eventually(lambda: len(executions(log)) == 2, 30, "the retry on B")
        assert time.monotonic() - cut_at > 3 + 6 - 1  # A was cut for longer than the grace
        assert not alive(first.pid)  # fenced by A itself, while still cut off
        eventually(lambda: Run.objects.get(pk=run.pk).state == "succeeded", 30, "retry done")
        partition.heal()
        eventually(
            lambda: RunLease.objects.get(offer_id=first.offer_id).execution_outcome == "killed",
            30,
            "A reports the fenced job",
        )
    finally:
        other.stop()
        agent.stop()
        partition.close()
    runs = executions(log)
    assert_no_overlap(runs)
    assert len(runs) == 2 and not runs[0].ended and runs[1].ended
    events = agent.events()
    fenced = [e for e in events if e["event"] == "session_fenced"]
    assert len(fenced) == 1 and fenced[0]["timeout_s"] == 3
    assert any(e["event"] == "execution_fenced" and e["offer_id"] == first.offer_id
               for e in events)  # fmt: skip
    reconciled = [e for e in events if e["event"] == "execution_reconciled"]
    assert [(e["offer_id"], e["outcome"]) for e in reconciled] == [(first.offer_id, "killed")]
