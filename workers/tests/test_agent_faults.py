"""The reference agent as a real process under faults, against the real Worker API
(issue 10, docs/adr/0008).

- Finding 1: the agent alone is killed (`kill -9`); the work it started goes on
  in its process group. The restarted agent (same --state-dir) ends it before
  its new Session exists, reports it, and only then does the Run's retry run:
  no two executions of one Run overlap, and the old offer never runs again.
- The parent-death signal: killed, the agent takes its direct child with it.
- Finding 3: the control plane goes away (connections reset, then refused)
  while a job runs; its terminal ACK is retried until the control plane is
  back and is accepted; the Attempt does not stay `running`.

Each task writes its own start, heartbeat and end stamps to a log file, so the
test sees executions as the operating system ran them.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.test import override_settings

from dispatch.sweeps import sweep_stale_sessions
from leases.end import lease_revoke
from leases.models import RunLease
from qinglong.testing import make_project, make_worker
from runs.models import Attempt, Run
from runs.services import run_enqueue, task_create
from workers.agent import procfs
from workers.tests.polling import eventually

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not procfs.procfs_available(), reason="needs Linux /proc"),
]

ROOT = Path(__file__).resolve().parents[2]

# The job: its direct child (what the agent spawned) starts the work as a
# grandchild in the same process group and waits for it, so when the agent's
# child dies the work can go on: an orphan. The first execution of a Run works
# for `long` seconds; any later one (the flag file exists) a moment.
WORK = """\
import os, subprocess, sys, time
log, flag, long_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
if len(sys.argv) == 4:
    child = subprocess.Popen([sys.executable, *sys.argv[:4], "work"])
    sys.exit(child.wait())
first = not os.path.exists(flag)
open(flag, "a").close()
def stamp(kind):
    with open(log, "a") as out:
        out.write(f"{kind} {os.getpid()} {os.environ.get('QL_OFFER_ID', '-')} {time.time():.6f}\\n")
stamp("start")
until = time.time() + (long_s if first else 0.3)
while time.time() < until:
    stamp("beat")
    time.sleep(0.05)
stamp("end")
"""


@dataclass
class Execution:
    pid: int
    offer_id: str
    started: float
    last: float  # its last stamp: when it ended, or about when it was killed
    ended: bool


def executions(log: Path) -> list[Execution]:
    found: dict[int, Execution] = {}
    if not log.exists():
        return []
    for line in log.read_text().splitlines():
        kind, pid_text, offer_id, at_text = line.split()
        pid, at = int(pid_text), float(at_text)
        if kind == "start":
            found[pid] = Execution(pid, offer_id, at, at, False)
        else:
            found[pid].last = at
            found[pid].ended = found[pid].ended or kind == "end"
    return sorted(found.values(), key=lambda e: e.started)


def assert_no_overlap(runs: list[Execution]) -> None:
    for earlier, later in itertools.pairwise(runs):
        assert later.started > earlier.last, (
            f"execution {later.pid} started {later.started - earlier.last:.3f}s "
            f"after execution {earlier.pid}'s last stamp: they overlapped"
        )


def alive(pid: int) -> bool:
    info = procfs.proc_info(pid)
    return info is not None and info.alive


class AgentProcess:
    def __init__(self, url: str, credential: Path, state_dir: Path, workdir: Path) -> None:
        self.args = [
            sys.executable, "-m", "workers.agent", "--url", url,
            "--credential-file", str(credential), "--state-dir", str(state_dir),
            "--workdir", str(workdir), "--poll-interval", "0.2", "--stop-grace", "1",
        ]  # fmt: skip
        self.logs: list[Path] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self.workdir = workdir

    def start(self) -> None:
        log = self.workdir / f"agent-{len(self.logs)}.log"
        self.logs.append(log)
        with log.open("wb") as err:
            self.proc = subprocess.Popen(self.args, cwd=ROOT, stderr=err)

    def events(self) -> list[dict[str, object]]:
        lines = []
        for log in self.logs:
            lines += [json.loads(line) for line in log.read_text().splitlines() if line]
        return lines

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Callable[..., tuple[Run, AgentProcess, Path]]]:
    agents: list[AgentProcess] = []
    leftovers: list[Path] = []

    def make(url: str, *, long_s: float, max_attempts: int = 2, slots: int = 1):
        _, credential = make_worker(slots=slots)
        credential_file = tmp_path / "worker.credential"
        credential_file.write_text(credential)
        script = tmp_path / "work.py"
        script.write_text(WORK)
        log = tmp_path / "executions.log"
        leftovers.append(log)
        task = task_create(
            project=make_project(),
            name="work",
            definition={
                "executor_type": "process",
                "command": [sys.executable, str(script), str(log), str(tmp_path / "flag"),
                            str(long_s)],
                "timeout_s": 120,
                "max_attempts": max_attempts,
            },
        )  # fmt: skip
        agent = AgentProcess(url, credential_file, tmp_path / "state", tmp_path)
        agents.append(agent)
        return run_enqueue(task=task), agent, log

    yield make
    for agent in agents:
        agent.stop()
    for log in leftovers:  # never leave a test's job behind
        for execution in executions(log):
            with contextlib.suppress(ProcessLookupError):
                os.kill(execution.pid, signal.SIGKILL)


def attempt_running(run: Run) -> bool:
    return run.attempts.filter(state="running").exists()


@override_settings(QINGLONG_HEARTBEAT_INTERVAL_S=1, QINGLONG_HEARTBEAT_MIN_INTERVAL_S=0)
def test_finding_1_a_restarted_agent_ends_the_orphan_first_and_the_retry_never_overlaps(
    live_server, setup
) -> None:
    run, agent, log = setup(live_server.url, long_s=60)
    agent.start()
    eventually(lambda: len(executions(log)) == 1 and attempt_running(run), 30, "running")
    [first] = executions(log)
    first_attempt = run.attempts.get()

    agent.kill9()  # the agent alone: its job's work goes on
    time.sleep(0.5)
    assert alive(first.pid), "the work should have outlived the agent (an orphan)"

    agent.start()  # same --state-dir
    eventually(lambda: Run.objects.get(pk=run.pk).state == "succeeded", 30, "the retry done")

    runs = executions(log)
    assert_no_overlap(runs)
    assert not alive(first.pid)  # ended by the restarted agent
    assert len(first.offer_id) == 64  # the marker (QL_OFFER_ID) reached the grandchild
    assert len(runs) == 2  # the first, then its retry: the old offer never ran again
    assert [e.offer_id for e in runs].count(first.offer_id) == 1
    assert runs[1].ended and not runs[0].ended
    lost, retry = run.attempts.order_by("number")
    assert lost.pk == first_attempt.pk
    assert (lost.state, retry.state) == ("lost", "succeeded")
    lease = RunLease.objects.get(offer_id=first.offer_id)
    assert lease.end_reason == "worker_restarted"
    assert (lease.execution_outcome, lease.execution_confirmed_at is not None) == ("killed", True)
    events = agent.events()
    assert any(e["event"] == "orphan_ended" and e["offer_id"] == first.offer_id for e in events)
    reconciled = [e for e in events if e["event"] == "execution_reconciled"]
    assert [(e["offer_id"], e["status"]) for e in reconciled] == [(first.offer_id, "confirmed")]
    # The orphan was gone before the new Session existed.
    opened = [i for i, e in enumerate(events) if e["event"] == "session_opened"]
    ended = next(i for i, e in enumerate(events) if e["event"] == "orphan_ended")
    assert opened[0] < ended < opened[1]


@override_settings(QINGLONG_HEARTBEAT_INTERVAL_S=1, QINGLONG_HEARTBEAT_MIN_INTERVAL_S=0)
def test_the_agents_direct_child_dies_with_it(live_server, setup) -> None:
    run, agent, _ = setup(live_server.url, long_s=60)
    agent.start()
    eventually(lambda: attempt_running(run), 30, "running")
    handle = Attempt.objects.get(run=run).executor_handle
    child = int(handle.removeprefix("pid:"))
    assert alive(child)
    agent.kill9()
    # PR_SET_PDEATHSIG: SIGKILL when the runner thread died with the agent.
    eventually(lambda: not alive(child), 5, "the direct child killed by the parent-death signal")


# ----------------------------------------------------------- finding 3


class FlakyProxy:
    """A TCP forwarder in front of the live server that can fail like a
    restarting web server: reset every connection, or refuse them. Going down
    also drops the connections already open (the agent keeps them alive)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.mode = "up"  # up | reset | refused
        self.open: set[socket.socket] = set()
        self.listener = self._listen(0)
        self.port = self.listener.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @staticmethod
    def _listen(port: int) -> socket.socket:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(64)
        listener.settimeout(0.1)
        return listener

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set(self, mode: str) -> None:
        if mode == "refused" and self.mode != "refused":
            self.listener.close()
        elif mode != "refused" and self.mode == "refused":
            self.listener = self._listen(self.port)
        self.mode = mode
        if mode != "up":
            for client in list(self.open):
                with contextlib.suppress(OSError):
                    client.shutdown(socket.SHUT_RDWR)

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self.mode == "refused":
                time.sleep(0.05)
                continue
            try:
                client, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            if self.mode == "reset":
                # Close with an RST: the agent sees "connection reset by peer".
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()
                continue
            threading.Thread(target=self._pipe, args=(client,), daemon=True).start()

    def _pipe(self, client: socket.socket) -> None:
        self.open.add(client)
        try:
            with client, socket.create_connection(self.target) as upstream:
                sockets = [client, upstream]
                while True:
                    ready, _, _ = select.select(sockets, [], [], 30)
                    if not ready:
                        return
                    for source in ready:
                        try:
                            data = source.recv(65536)
                            if not data:
                                return
                            (upstream if source is client else client).sendall(data)
                        except OSError:  # dropped by set() going down
                            return
        finally:
            self.open.discard(client)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        with contextlib.suppress(OSError):
            self.listener.close()


@override_settings(QINGLONG_HEARTBEAT_INTERVAL_S=1, QINGLONG_HEARTBEAT_MIN_INTERVAL_S=0)
def test_finding_3_a_terminal_ack_that_meets_an_outage_is_retried_until_accepted(
    live_server, setup
) -> None:
    host, port = live_server.thread.host, live_server.thread.port
    proxy = FlakyProxy((host, port))
    try:
        run, agent, log = setup(proxy.url, long_s=1.5, max_attempts=1)
        agent.start()
        eventually(lambda: attempt_running(run), 30, "running")
        proxy.set("reset")  # the web server goes down while the job runs
        eventually(lambda: any(e.ended for e in executions(log)), 10, "the job exited")
        time.sleep(3)
        proxy.set("refused")
        time.sleep(6)  # longer than the old agent's ~7 s of tries, all told
        assert Attempt.objects.get(run=run).state == "running"  # nothing got through
        proxy.set("up")
        eventually(lambda: Run.objects.get(pk=run.pk).state == "succeeded", 30, "succeeded")
    finally:
        agent.stop()
        proxy.close()
    attempt = Attempt.objects.get(run=run)
    assert (attempt.state, attempt.exit_code) == ("succeeded", 0)
    events = agent.events()
    [done] = [e for e in events if e["event"] == "attempt_done"]
    assert (done["ran"], done["phase"], done["report"]) == (True, "succeeded", "acked")
    assert any(e["event"] == "control_plane_unreachable" for e in events)
    assert len(executions(log)) == 1


@override_settings(QINGLONG_HEARTBEAT_INTERVAL_S=1, QINGLONG_HEARTBEAT_MIN_INTERVAL_S=0)
def test_sigterm_drains_a_second_one_ends_the_work_and_the_next_start_reports_it(
    live_server, setup
) -> None:
    run, agent, log = setup(live_server.url, long_s=60, max_attempts=1)
    agent.start()
    eventually(lambda: len(executions(log)) == 1 and attempt_running(run), 30, "running")
    [work] = executions(log)
    assert agent.proc is not None
    agent.proc.send_signal(signal.SIGTERM)  # drain: the running job goes on
    time.sleep(1.5)
    assert agent.proc.poll() is None and alive(work.pid)
    agent.proc.send_signal(signal.SIGTERM)  # now: end it and exit
    assert agent.proc.wait(15) == 0
    assert not alive(work.pid)
    assert Attempt.objects.get(run=run).state == "running"  # its report is owed

    agent.start()

    def reconciled_events() -> list[dict[str, object]]:
        return [e for e in agent.events() if e["event"] == "execution_reconciled"]

    eventually(lambda: bool(reconciled_events()), 30, "reported")
    reconciled = reconciled_events()
    assert [(e["offer_id"], e["outcome"], e["status"]) for e in reconciled] == [
        (work.offer_id, "killed", "confirmed")
    ]
    assert len(executions(log)) == 1  # nothing ran again
    lease = RunLease.objects.get(offer_id=work.offer_id)
    assert (lease.execution_outcome, lease.execution_exit_code) == ("killed", -signal.SIGTERM)


@override_settings(QINGLONG_HEARTBEAT_INTERVAL_S=1, QINGLONG_HEARTBEAT_MIN_INTERVAL_S=0)
def test_a_lease_revoked_under_a_running_job_is_stopped_by_the_heartbeat_answer(
    live_server, setup
) -> None:
    run, agent, log = setup(live_server.url, long_s=60, max_attempts=1)
    agent.start()
    eventually(lambda: len(executions(log)) == 1 and attempt_running(run), 30, "running")
    [work] = executions(log)
    lease = RunLease.objects.get(offer_id=work.offer_id)
    lease_revoke(lease.pk, reason="operator")
    # The next heartbeat lists the offer as held; the answer says stop.
    eventually(lambda: not alive(work.pid), 15, "the job stopped")
    events = agent.events()
    assert any(
        e["event"] == "attempt_stop_requested" and e["offer_id"] == work.offer_id for e in events
    )
    eventually(lambda: any(e["event"] == "attempt_done" for e in agent.events()), 15, "reported")
    [done] = [e for e in agent.events() if e["event"] == "attempt_done"]
    assert (done["ran"], done["stopped"]) == (True, "stopped")
    assert not any(e["event"] == "heartbeat_held_unsupported" for e in events)


@override_settings(
    QINGLONG_HEARTBEAT_INTERVAL_S=1,
    QINGLONG_HEARTBEAT_MIN_INTERVAL_S=0,
    QINGLONG_SESSION_TIMEOUT_S=2,
    QINGLONG_LOST_EXECUTION_GRACE_S=120,
)
def test_finding_1_another_worker_does_not_start_the_retry_beside_the_orphan(
    live_server, setup, tmp_path
) -> None:
    """The agent stays dead for a while: its Session goes offline and another
    Worker is idle. The retry waits (the lost-execution grace) instead of
    running beside the orphan, until the restarted agent has ended the orphan
    and reported it."""
    run, first_agent, log = setup(live_server.url, long_s=60)
    first_agent.start()
    eventually(lambda: len(executions(log)) == 1 and attempt_running(run), 30, "running")
    [first] = executions(log)
    _, other_credential = make_worker(slots=1)
    other_file = tmp_path / "other.credential"
    other_file.write_text(other_credential)
    other = AgentProcess(live_server.url, other_file, tmp_path / "other-state", tmp_path)
    other.start()
    try:
        first_agent.kill9()
        time.sleep(2.5)
        assert sweep_stale_sessions().applied == 1  # the first Worker's Session: offline
        time.sleep(3)  # the other Worker pulls all along
        assert len(executions(log)) == 1 and alive(first.pid)
        lost = Attempt.objects.get(run=run, number=1)
        assert (lost.state, lost.error_code) == ("lost", "worker_lost")

        first_agent.start()  # ends the orphan, reports it: the retry may go
        eventually(lambda: Run.objects.get(pk=run.pk).state == "succeeded", 30, "retry done")
    finally:
        other.stop()
    runs = executions(log)
    assert_no_overlap(runs)
    assert len(runs) == 2 and not alive(first.pid)
