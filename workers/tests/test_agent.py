"""The reference agent's pure parts with a fake transport and a fake process.

README "Worker API": verify the spec digest; ACK `starting` BEFORE
spawning (a 409 there means do not run); `running` carries `pid:<pid>`; the
outcome carries the exit code and a bounded output tail; a cancel verdict or
any 409 stops the Attempt.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from dispatch.core.spec import spec_sha256 as server_spec_sha256
from workers.agent.executor import ProcessSpawner
from workers.agent.journal import Phase
from workers.agent.protocol import (
    MAX_OUTPUT_TAIL_BYTES,
    AttemptRunner,
    Response,
    spec_sha256,
    verify_offer,
)
from workers.tests.markers import offer_id

ROOT = Path(__file__).resolve().parents[2]
OFFER_ID = offer_id(0xAB)  # per test process: workers.tests.markers
TOKEN = "t" * 43


def a_spec(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "spec_version": 1,
        "run_id": "1",
        "attempt_id": "2",
        "project_id": "3",
        "task_id": "4",
        "task_revision": 1,
        "executor_type": "process",
        "command": ["echo", "雪"],
        "cwd": None,
        "env": {"B": "ü", "A": "1"},
        "timeout_s": 30,
        "resources": {"cpu_millis": 1000, "memory_mb": 256},
    }
    spec.update(overrides)
    return spec


def an_offer(spec: dict[str, Any] | None = None, digest: str | None = None) -> dict[str, Any]:
    spec = spec or a_spec()
    return {
        "offer_id": OFFER_ID,
        "spec": spec,
        "spec_sha256": digest or spec_sha256(spec),
        "lease": {"token": TOKEN},
    }


class FakeTransport:
    """Records every call; answers from a per-phase script (default 200)."""

    def __init__(self, answers: Mapping[str, Response] | None = None, log: list | None = None):
        self.answers = dict(answers or {})
        self.calls: list[dict[str, Any]] = []
        self.log = log if log is not None else []

    def post(self, path: str, body: Mapping[str, Any], *, token: str) -> Response:
        self.calls.append({"path": path, "token": token, **body})
        phase = str(body.get("phase"))
        self.log.append(f"ack:{phase}")
        answer = self.answers.get(f"{phase}:{body.get('lease_token')}") or self.answers.get(phase)
        return answer or Response(200, {"cancel_requested": False})


class FakeProcess:
    def __init__(self, exit_code: int = 0, *, runs_until_stopped: bool = False) -> None:
        self.pid = 4242
        self.pgid = 4242
        self.start_time: int | None = 777
        self.released = False
        self.closed = False
        self.exit_code = exit_code
        self.runs_until_stopped = runs_until_stopped
        self.terminated = threading.Event()

    def poll(self) -> int | None:
        if self.runs_until_stopped and not self.terminated.is_set():
            return None
        return -15 if self.terminated.is_set() else self.exit_code

    def wait(self, timeout: float | None = None) -> int:
        return -15 if self.terminated.is_set() else self.exit_code

    def terminate(self) -> None:
        self.terminated.set()

    def kill(self) -> None:
        self.terminated.set()

    def release(self, grace_s: float) -> int:
        self.released = True
        return self.wait()

    def output_tail(self, limit: int) -> str:
        return "hello\n"

    def close(self) -> None:
        self.closed = True


class FakeSpawner:
    def __init__(self, process: FakeProcess, log: list) -> None:
        self.process = process
        self.log = log
        self.specs: list[Mapping[str, Any]] = []
        self.offer_ids: list[str] = []

    def __call__(self, spec: Mapping[str, Any], *, offer_id: str = "") -> FakeProcess:
        self.log.append("spawn")
        self.specs.append(spec)
        self.offer_ids.append(offer_id)
        return self.process


def runner_with(answers=None, process=None, offer=None, **kwargs: Any) -> tuple[Any, ...]:
    log: list[str] = []
    transport = FakeTransport(answers, log)
    spawner = FakeSpawner(process or FakeProcess(), log)
    runner = AttemptRunner(
        transport=transport,
        session_token="qls_session",
        offer=offer or an_offer(),
        lease_token=TOKEN,
        spawn=spawner,
        poll_interval_s=0.01,
        **kwargs,
    )
    return runner, transport, spawner, log


def test_agent_digest_is_the_servers_canonical_json_sha256():
    spec = a_spec()
    assert spec_sha256(spec) == server_spec_sha256(spec)
    assert verify_offer(an_offer(spec))


def test_tampered_spec_fails_verification_and_is_never_started_or_spawned():
    spec = a_spec()
    offer = an_offer(spec, digest=spec_sha256(spec))
    offer["spec"] = a_spec(command=["rm", "-rf", "/"])
    runner, transport, _, log = runner_with(offer=offer)
    outcome = runner.run()
    assert not verify_offer(offer)
    assert log == ["ack:start_failed"]  # no starting ACK, no spawn
    assert transport.calls[0]["error_code"] == "spec_digest_mismatch"
    assert (outcome.ran, outcome.stopped) == (False, "spec_digest_mismatch")


def test_acks_starting_before_spawning_then_running_with_pid_then_the_outcome():
    runner, transport, _, log = runner_with()
    outcome = runner.run()
    assert log == ["ack:starting", "spawn", "ack:running", "ack:succeeded"]
    running, done = transport.calls[1], transport.calls[2]
    assert running["executor_handle"] == "pid:4242"
    assert (done["exit_code"], done["output_tail"]) == (0, "hello\n")
    assert all(call["spec_sha256"] == spec_sha256(a_spec()) for call in transport.calls)
    assert all(call["path"] == f"/api/v1/worker/leases/{OFFER_ID}/ack" for call in transport.calls)
    assert (outcome.ran, outcome.final_phase, outcome.exit_code) == (True, "succeeded", 0)


def test_non_zero_exit_is_acked_failed_with_its_exit_code():
    runner, transport, _, _ = runner_with(process=FakeProcess(exit_code=3))
    outcome = runner.run()
    assert (outcome.final_phase, transport.calls[-1]["exit_code"]) == ("failed", 3)


def test_a_409_on_starting_means_nothing_is_spawned():
    answers = {"starting": Response(409, {"error": {"code": "lease_expired"}})}
    runner, _, spawner, log = runner_with(answers)
    outcome = runner.run()
    assert log == ["ack:starting"]
    assert spawner.specs == []
    assert (outcome.ran, outcome.stopped) == (False, "lease_expired")


def test_a_409_on_running_stops_the_process_and_reports_nothing_more():
    answers = {"running": Response(409, {"error": {"code": "lease_revoked"}})}
    process = FakeProcess(runs_until_stopped=True)
    runner, _, _, log = runner_with(answers, process=process)
    outcome = runner.run()
    assert process.terminated.is_set()
    assert log == ["ack:starting", "spawn", "ack:running"]
    assert (outcome.final_phase, outcome.stopped) == (None, "lease_revoked")


def test_a_cancel_verdict_stops_the_process_and_acks_failed_cancelled():
    process = FakeProcess(runs_until_stopped=True)
    runner, transport, _, _ = runner_with(process=process)
    thread = threading.Thread(target=runner.run)
    thread.start()
    deadline = time.monotonic() + 5
    while runner.phase is not Phase.RUNNING and time.monotonic() < deadline:
        time.sleep(0.005)
    runner.cancel("cancelled")  # what the heartbeat loop does on a cancel verdict
    thread.join(5)
    assert process.terminated.is_set()
    assert transport.calls[-1]["phase"] == "failed"
    assert transport.calls[-1]["error_code"] == "cancelled"


def test_cancel_requested_on_the_starting_ack_spawns_nothing():
    answers = {"starting": Response(200, {"cancel_requested": True})}
    runner, _, spawner, log = runner_with(answers)
    runner.run()
    assert spawner.specs == []
    assert log == ["ack:starting", "ack:start_failed"]


def test_a_redelivered_offer_without_token_tries_the_agents_recent_pull_tokens():
    right = "r" * 43
    answers = {f"starting:{TOKEN}": Response(403, {"error": {"code": "lease_token_invalid"}})}
    runner, transport, _, _ = runner_with(answers, fallback_tokens=[right])
    outcome = runner.run()
    assert [c["lease_token"] for c in transport.calls] == [TOKEN, right, right, right]
    assert outcome.final_phase == "succeeded"


def test_real_process_spawner_runs_the_spec_and_bounds_the_output_tail(tmp_path):
    spawn = ProcessSpawner(tmp_path)
    script = "import os,sys; sys.stdout.write('x' * 70000 + os.environ['GREETING'] + os.getcwd())"
    process = spawn(a_spec(command=[sys.executable, "-c", script], env={"GREETING": "END"}))
    assert process.wait(timeout=30) == 0
    assert process.release(grace_s=1) == 0
    tail = process.output_tail(MAX_OUTPUT_TAIL_BYTES)
    process.close()
    assert len(tail.encode()) <= MAX_OUTPUT_TAIL_BYTES
    assert tail.endswith("END" + str(tmp_path))


def test_a_childs_exit_wakes_its_runner_without_reaping_it_and_no_thread_per_child(tmp_path):
    # The agent-wide exit watcher (a pidfd per child, issue 12): told at the
    # exit, while the child stays unreaped (its pid still names the group).
    spawn = ProcessSpawner(tmp_path)
    command = [sys.executable, "-c", "import time; time.sleep(0.5)"]
    processes = [spawn(a_spec(command=command)) for _ in range(4)]
    woken = [threading.Event() for _ in processes]
    for process, event in zip(processes, woken, strict=True):
        process.on_exit(event.set)
    # While they run: no thread of their own waits for any of them.
    waiting = [t.name for t in threading.enumerate() if t.name.startswith("exit-")]
    assert waiting == ["exit-watcher"]
    assert all(event.wait(30) for event in woken)
    for process in processes:
        assert Path(f"/proc/{process.pid}").exists()  # a zombie: not reaped
        assert process.poll() == 0
        assert process.release(grace_s=1) == 0
        process.close()


def test_without_pidfds_a_thread_of_its_own_waits_for_the_childs_exit(tmp_path, monkeypatch):
    # The fallback (a kernel before 5.3): told at the exit all the same, unreaped.
    import os

    def no_pidfd(pid: int) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    process = ProcessSpawner(tmp_path)(
        a_spec(command=[sys.executable, "-c", "import time; time.sleep(0.3)"])
    )
    woken = threading.Event()
    process.on_exit(woken.set)
    assert f"exit-{process.pid}" in [t.name for t in threading.enumerate()]
    assert woken.wait(30)
    assert Path(f"/proc/{process.pid}").exists()  # a zombie: not reaped
    assert process.release(grace_s=1) == 0
    process.close()


def test_agent_package_imports_no_django():
    code = (
        "import sys; import workers.agent.__main__, workers.agent.agent; "
        "bad = [m for m in sys.modules if m == 'django' or m.startswith('django.')]; "
        "sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=30, check=False)
    assert result.returncode == 0


@pytest.mark.parametrize("argv", [["--help"]])
def test_agent_cli_documents_itself(argv):
    result = subprocess.run(
        [sys.executable, "-m", "workers.agent", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0
    assert "--credential-file" in result.stdout and "--once" in result.stdout


def test_pull_asks_for_at_most_sixteen_offers_however_many_slots():
    from workers.agent.agent import MAX_OFFERS_PER_PULL, Agent, SessionHandle

    transport = FakeTransport(answers={"None": Response(200, {"offers": []})})
    agent = Agent(
        transport=transport,
        credential="c" * 43,
        slots=40,
        executor="process",
        spawn=FakeSpawner(FakeProcess(), []),
    )
    agent.session = SessionHandle(token="s" * 43, session_id="session-1")
    agent.pull()
    (call,) = [c for c in transport.calls if c["path"].endswith("/pull")]
    assert call["max_offers"] == MAX_OFFERS_PER_PULL == 16


def test_long_poll_asks_the_server_to_wait_at_most_half_a_heartbeat():
    from workers.agent.agent import Agent, SessionHandle

    transport = FakeTransport(answers={"None": Response(200, {"offers": []})})
    agent = Agent(
        transport=transport,
        credential="c" * 43,
        slots=1,
        executor="process",
        spawn=FakeSpawner(FakeProcess(), []),
        long_poll_s=30,
    )
    agent.session = SessionHandle(token="s" * 43, session_id="session-1")
    agent.heartbeat_interval_s = 10.0
    agent.pull()
    (call,) = transport.calls
    assert call["path"] == "/api/v1/worker/pull?wait_s=5"
