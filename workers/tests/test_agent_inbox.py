"""The agent loop over its durable inbox, against an in-memory control plane
(issue 10, docs/adr/0008): dedupe and refusal, the crash barrier, `held` and
`stop`, ACK `starting` before pulling more, liveness under a hanging ACK and an
outage, a lost Session, and the reconcile at start."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from workers.agent import procfs
from workers.agent.agent import Agent
from workers.agent.journal import Journal, Outcome, Phase
from workers.agent.protocol import Response, TransportError, spec_sha256
from workers.tests.markers import offer_id
from workers.tests.test_agent import FakeProcess, a_spec

OK = Response(200, {"cancel_requested": False})
Hook = Callable[[Mapping[str, Any]], Response]


def an_offer(n: int, **spec_overrides: Any) -> dict[str, Any]:
    spec = a_spec(run_id=str(n), **spec_overrides)
    return {
        "offer_id": offer_id(n),
        "run_id": str(n),
        "spec": spec,
        "spec_sha256": spec_sha256(spec),
        "lease": {"token": f"lease-token-{n:04d}-" + "x" * 30},
    }


class FakeControlPlane:
    """The Worker API in memory: Sessions, heartbeats, pulls, ACKs, reconcile.

    `offers` are handed out by pulls (up to max_offers); `hooks[(offer_id,
    phase)]` answers an ACK (a callable may block or raise); everything is
    recorded in `calls` in arrival order.
    """

    def __init__(
        self, *, heartbeat_interval_s: float = 0.05, session_timeout_s: float = 30.0
    ) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, str, dict[str, Any]]] = []
        self.offers: list[dict[str, Any]] = []
        self.hooks: dict[tuple[str, str], Hook] = {}
        self.sessions = 0
        self.token = ""
        self.heartbeat_interval_s = heartbeat_interval_s
        # As the real one: far longer than the outages these tests make (an
        # agent fences its Session after this long without an accepted beat).
        self.session_timeout_s = session_timeout_s
        self.stop_ids: list[str] = []
        self.cancel_ids: list[str] = []
        self.down = False  # every call: a transport error
        self.reconcile_answers: list[Response] = []
        self.pull_hook: Callable[[], None] | None = None

    def record(self, kind: str) -> list[dict[str, Any]]:
        with self.lock:
            return [body for k, _, body in self.calls if k == kind]

    def kinds(self) -> list[str]:
        with self.lock:
            return [k for k, _, _ in self.calls]

    def post(self, path: str, body: Mapping[str, Any], *, token: str) -> Response:
        kind = path.rsplit("/", 1)[-1].split("?")[0]
        if "/leases/" in path:
            kind = "ack:" + str(body.get("phase"))
        with self.lock:
            self.calls.append((kind, token, dict(body)))
        if self.down:
            raise TransportError("ConnectionRefusedError")
        if kind == "sessions":
            with self.lock:
                self.sessions += 1
                self.token = f"session-{self.sessions}"
            return Response(
                201,
                {
                    "session_id": f"sid-{self.sessions}",
                    "generation": self.sessions,
                    "session_token": self.token,
                    "heartbeat_interval_s": self.heartbeat_interval_s,
                    "session_timeout_s": self.session_timeout_s,
                },
            )
        if token != self.token:
            return Response(401, {"error": {"code": "session_replaced"}})
        if kind == "heartbeat":
            stop, self.stop_ids = self.stop_ids, []
            cancel, self.cancel_ids = self.cancel_ids, []
            return Response(200, {"session_state": "online", "cancel": cancel, "stop": stop})
        if kind == "pull":
            if self.pull_hook is not None:
                self.pull_hook()
            with self.lock:
                count = int(body["max_offers"])
                handed, self.offers = self.offers[:count], self.offers[count:]
            return Response(200, {"offers": handed, "status": "offered", "reason": ""})
        if kind == "reconcile":
            if self.reconcile_answers:
                return self.reconcile_answers.pop(0)
            results = [
                {"offer_id": item["offer_id"], "status": "confirmed"} for item in body["executions"]
            ]
            return Response(200, {"results": results})
        hook = self.hooks.get((path.split("/")[-2], str(body.get("phase"))))
        return hook(body) if hook is not None else OK


class Spawner:
    """Hands out FakeProcesses (one per offer) and checks the crash barrier."""

    def __init__(self, journal: Journal, *, runs_until_stopped: bool = False) -> None:
        self.journal = journal
        self.runs_until_stopped = runs_until_stopped
        self.spawned: list[str] = []
        self.processes: dict[str, FakeProcess] = {}
        self.phase_at_spawn: dict[str, Phase | None] = {}

    def __call__(self, spec: Mapping[str, Any], *, offer_id: str = "") -> FakeProcess:
        execution = self.journal.get(offer_id)
        self.phase_at_spawn[offer_id] = execution.phase if execution else None
        self.spawned.append(offer_id)
        process = FakeProcess(runs_until_stopped=self.runs_until_stopped)
        self.processes[offer_id] = process
        return process


def make_agent(
    plane: FakeControlPlane, *, slots: int = 2, runs_until_stopped: bool = False
) -> tuple[Agent, Spawner]:
    journal = Journal.memory()
    spawner = Spawner(journal, runs_until_stopped=runs_until_stopped)
    agent = Agent(
        transport=plane,
        credential="c" * 43,
        slots=slots,
        executor="process",
        spawn=spawner,
        journal=journal,
        poll_interval_s=0.02,
        stop_grace_s=0.2,
        retry_initial_s=0.01,
        retry_cap_s=0.05,
    )
    return agent, spawner


def eventually(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


@pytest.fixture
def serving() -> Iterator[Callable[[Agent], threading.Thread]]:
    started: list[tuple[Agent, threading.Thread]] = []

    def serve(agent: Agent) -> threading.Thread:
        thread = threading.Thread(target=agent.run, daemon=True)
        thread.start()
        started.append((agent, thread))
        return thread

    yield serve
    for agent, thread in started:
        agent.abort()
        thread.join(10)
        assert not thread.is_alive()


def join_runners(agent: Agent) -> None:
    for entry in list(agent.runners.values()):
        entry.thread.join(10)


# ------------------------------------------------------------------ the inbox


def test_a_repeated_offer_id_is_run_once() -> None:
    plane = FakeControlPlane()
    agent, spawner = make_agent(plane)
    agent.open_session()
    plane.offers = [an_offer(1)]
    assert agent.pull() == 1
    join_runners(agent)
    plane.offers = [an_offer(1)]  # delivered again (a replayed pull, a bug, ...)
    assert agent.pull() == 0
    join_runners(agent)
    assert spawner.spawned == [offer_id(1)]
    assert plane.kinds().count("ack:starting") == 1
    execution = agent.journal.get(offer_id(1))
    assert execution is not None and (execution.phase, execution.report) == (
        Phase.REPORTED,
        "acked",
    )


def test_the_same_offer_id_with_another_digest_is_refused_and_reported() -> None:
    plane = FakeControlPlane()
    agent, spawner = make_agent(plane, runs_until_stopped=True)
    agent.open_session()
    plane.offers = [an_offer(1)]
    assert agent.pull() == 1
    eventually(lambda: offer_id(1) in spawner.spawned)
    tampered = an_offer(1, command=["rm", "-rf", "/"])
    plane.offers = [tampered]
    assert agent.pull() == 0
    eventually(lambda: len(plane.record("ack:start_failed")) == 1)
    [refusal] = plane.record("ack:start_failed")
    assert refusal["error_code"] == "spec_digest_conflict"
    assert refusal["spec_sha256"] == tampered["spec_sha256"]
    assert spawner.spawned == [offer_id(1)]  # the tampered spec never ran
    execution = agent.journal.get(offer_id(1))
    assert execution is not None and execution.spec_sha256 == an_offer(1)["spec_sha256"]
    agent.abort()
    join_runners(agent)


def test_the_crash_barrier_is_committed_before_the_spawn_and_the_pid_right_after() -> None:
    plane = FakeControlPlane()
    agent, spawner = make_agent(plane)
    agent.open_session()
    seen: list[Phase | None] = []

    def running(body: Mapping[str, Any]) -> Response:
        execution = agent.journal.get(offer_id(1))
        seen.append(execution.phase if execution else None)
        assert execution is not None
        assert (execution.pid, execution.start_time, execution.pgid) == (4242, 777, 4242)
        return OK

    plane.hooks[(offer_id(1), "running")] = running
    plane.offers = [an_offer(1)]
    agent.pull()
    join_runners(agent)
    assert spawner.phase_at_spawn[offer_id(1)] is Phase.SPAWNING
    # The fake process exits at once: its outcome is recorded by the time the
    # running ACK goes; the pid was recorded before either.
    assert seen == [Phase.FINISHED]
    [outcome] = agent.outcomes
    assert (outcome.ran, outcome.final_phase, outcome.report) == (True, "succeeded", "acked")


# ------------------------------------------------------------- held and stop


def test_heartbeats_list_every_offer_held_and_stop_ends_a_started_one() -> None:
    plane = FakeControlPlane()
    agent, spawner = make_agent(plane, runs_until_stopped=True)
    agent.open_session()
    plane.offers = [an_offer(1), an_offer(2)]
    assert agent.pull() == 2
    eventually(lambda: len(spawner.spawned) == 2)
    agent.heartbeat()
    assert sorted(plane.record("heartbeat")[-1]["held"]) == [offer_id(1), offer_id(2)]

    plane.stop_ids = [offer_id(1)]
    plane.hooks[(offer_id(1), "failed")] = lambda body: Response(
        409, {"error": {"code": "lease_revoked"}}
    )
    agent.heartbeat()
    eventually(lambda: offer_id(1) not in agent.runners)
    assert spawner.processes[offer_id(1)].terminated.is_set()
    assert not spawner.processes[offer_id(2)].terminated.is_set()
    stopped = agent.journal.get(offer_id(1))
    assert stopped is not None and (stopped.phase, stopped.outcome) == (
        Phase.REPORTED,
        Outcome.KILLED,
    )
    agent.heartbeat()
    assert plane.record("heartbeat")[-1]["held"] == [offer_id(2)]
    agent.abort()
    join_runners(agent)


def test_a_stop_for_an_offer_still_waiting_for_its_starting_answer_is_left_to_it() -> None:
    plane = FakeControlPlane()
    agent, spawner = make_agent(plane)
    agent.open_session()
    release = threading.Event()

    def slow_starting(body: Mapping[str, Any]) -> Response:
        release.wait(10)
        return OK

    plane.hooks[(offer_id(1), "starting")] = slow_starting
    plane.offers = [an_offer(1)]
    agent.pull()
    eventually(lambda: "ack:starting" in plane.kinds())
    plane.stop_ids = [offer_id(1)]
    agent.heartbeat()  # built while the starting ACK was unanswered
    assert plane.record("heartbeat")[-1]["held"] == [offer_id(1)]
    release.set()
    join_runners(agent)
    assert spawner.spawned == [offer_id(1)]
    [outcome] = agent.outcomes
    assert outcome.final_phase == "succeeded"


def test_a_control_plane_without_held_gets_the_old_heartbeat() -> None:
    plane = FakeControlPlane()
    agent, _ = make_agent(plane)
    agent.open_session()
    original = plane.post

    def strict(path: str, body: Mapping[str, Any], *, token: str) -> Response:
        if path.endswith("/heartbeat") and "held" in body:
            return Response(400, {"error": {"code": "invalid_request", "message": "held: x"}})
        return original(path, body, token=token)

    plane.post = strict  # type: ignore[method-assign]
    agent.heartbeat()
    agent.heartbeat()
    assert plane.record("heartbeat") == [{"draining": False}, {"draining": False}]


# ---------------------------------------------------------------- delivery


def test_no_pull_while_an_offer_in_hand_waits_for_its_starting_answer(serving) -> None:
    plane = FakeControlPlane()
    agent, _ = make_agent(plane, slots=4, runs_until_stopped=True)
    release = threading.Event()
    plane.hooks[(offer_id(1), "starting")] = lambda body: (release.wait(10), OK)[1]
    plane.offers = [an_offer(1)]
    serving(agent)
    eventually(lambda: "ack:starting" in plane.kinds())
    time.sleep(0.3)  # 15 poll intervals
    assert plane.kinds().count("pull") == 1
    release.set()
    eventually(lambda: plane.kinds().count("pull") >= 3)
    # The offer in hand (now running) takes one of the four slots.
    assert {body["max_offers"] for body in plane.record("pull")[1:]} == {3}


def test_offers_in_hand_and_owed_reports_count_against_the_free_slots(serving) -> None:
    plane = FakeControlPlane()
    agent, _ = make_agent(plane, slots=3)
    hang = threading.Event()
    plane.hooks[(offer_id(1), "succeeded")] = lambda body: (hang.wait(10), OK)[1]
    plane.offers = [an_offer(1), an_offer(2), an_offer(3)]
    serving(agent)
    eventually(lambda: len(agent.outcomes) == 2)
    pulls_before = plane.kinds().count("pull")
    eventually(lambda: plane.kinds().count("pull") > pulls_before + 2)
    # Offer 1 exited, but its report is still owed: its slot stays taken.
    assert plane.record("pull")[-1]["max_offers"] == 2
    hang.set()
    eventually(lambda: plane.record("pull")[-1]["max_offers"] == 3)


# ---------------------------------------------------------------- liveness


def test_pulls_and_heartbeats_go_on_while_one_ack_hangs(serving) -> None:
    plane = FakeControlPlane(heartbeat_interval_s=0.05)
    agent, _ = make_agent(plane, slots=2)
    hang = threading.Event()
    plane.hooks[(offer_id(1), "succeeded")] = lambda body: (hang.wait(10), OK)[1]
    plane.offers = [an_offer(1)]
    serving(agent)
    eventually(lambda: "ack:succeeded" in plane.kinds())
    kinds = plane.kinds()
    pulls, beats = kinds.count("pull"), kinds.count("heartbeat")
    plane.offers = [an_offer(2)]
    eventually(lambda: offer_id(2) in [o.offer_id for o in agent.outcomes])
    eventually(lambda: plane.kinds().count("heartbeat") >= beats + 3)
    assert plane.kinds().count("pull") > pulls + 3
    assert not hang.is_set()  # all of it while the first ACK still hangs
    hang.set()
    eventually(lambda: len(agent.outcomes) == 2)
    assert {o.report for o in agent.outcomes} == {"acked"}


def test_after_an_outage_pulls_resume_within_the_capped_backoff(serving) -> None:
    plane = FakeControlPlane()
    agent, _ = make_agent(plane)
    serving(agent)
    eventually(lambda: plane.kinds().count("pull") >= 2)
    plane.down = True
    time.sleep(1.0)  # far past the 0.05 s backoff cap
    during = plane.kinds().count("pull")
    plane.down = False
    back = time.monotonic()
    eventually(lambda: plane.kinds().count("pull") > during + 1, timeout=2)
    # Down for a second: many tries, each 0.025-0.05 s apart, not one per second.
    assert during > 10
    assert time.monotonic() - back < 1.0


def test_a_terminal_ack_meeting_an_outage_is_retried_until_accepted(serving) -> None:
    plane = FakeControlPlane()
    agent, _ = make_agent(plane)
    failures = iter([TransportError("ConnectionResetError")] * 30)

    def flaky(body: Mapping[str, Any]) -> Response:
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return OK

    plane.hooks[(offer_id(1), "succeeded")] = flaky
    plane.offers = [an_offer(1)]
    serving(agent)
    eventually(lambda: len(agent.outcomes) == 1)
    [outcome] = agent.outcomes
    assert (outcome.ran, outcome.final_phase, outcome.report) == (True, "succeeded", "acked")
    assert plane.kinds().count("ack:succeeded") == 31


# ------------------------------------------------------------ lost Session


def test_a_lost_session_ends_its_processes_and_reconciles_before_pulling_again(
    serving,
) -> None:
    plane = FakeControlPlane(heartbeat_interval_s=0.05)
    agent, spawner = make_agent(plane, runs_until_stopped=True)
    plane.offers = [an_offer(1)]
    serving(agent)
    eventually(lambda: offer_id(1) in spawner.spawned)
    eventually(lambda: "ack:running" in plane.kinds())
    plane.token = "replaced"  # the next call under session-1 gets a 401
    eventually(lambda: plane.sessions == 2)
    eventually(lambda: "reconcile" in plane.kinds())
    assert spawner.processes[offer_id(1)].terminated.is_set()
    [(_, token, body)] = [call for call in plane.calls if call[0] == "reconcile"]
    assert token == "session-2"
    [item] = body["executions"]
    assert item["offer_id"] == offer_id(1)
    assert item["lease_token"] == an_offer(1)["lease"]["token"]
    assert (item["outcome"], item["exit_code"]) == ("killed", -15)
    eventually(lambda: plane.kinds()[-1] in ("pull", "heartbeat"))
    kinds = plane.kinds()
    second_open = [i for i, k in enumerate(kinds) if k == "sessions"][1]
    assert kinds.index("reconcile") > second_open
    assert "pull" not in kinds[second_open : kinds.index("reconcile")]
    assert spawner.spawned == [offer_id(1)]  # never again
    execution = agent.journal.get(offer_id(1))
    assert execution is not None and execution.report == "reconciled:confirmed"


# ----------------------------------------------------- reconcile at start


@pytest.mark.skipif(not procfs.procfs_available(), reason="needs Linux /proc")
def test_at_start_what_an_earlier_agent_left_running_is_ended_then_reported(
    tmp_path: Path,
) -> None:
    journal = Journal.open(tmp_path / "state")
    orphan = subprocess.Popen(
        ["sleep", "60"], start_new_session=True, env={**os.environ, "QL_OFFER_ID": offer_id(1)}
    )
    # Spawned just before the earlier agent died, before it recorded the pid:
    # only its QL_OFFER_ID marker tells whose it is.
    unrecorded = subprocess.Popen(
        ["sleep", "60"], start_new_session=True, env={**os.environ, "QL_OFFER_ID": offer_id(5)}
    )
    info = procfs.proc_info(orphan.pid)
    assert info is not None
    # What the earlier agent had journaled: one running, one whose report was
    # owed, one in hand never started, one past the crash barrier.
    token = an_offer(1)["lease"]["token"]
    for n in (1, 2, 3, 5):
        journal.record_offer(
            offer_id=offer_id(n), spec_sha256="d" * 64, lease_token=token, session_id="old"
        )
    journal.mark_started(offer_id(1))
    journal.mark_spawning(offer_id(1))
    journal.mark_running(offer_id(1), pid=orphan.pid, start_time=info.start_time, pgid=orphan.pid)
    journal.mark_finished(offer_id(2), outcome=Outcome.EXITED, exit_code=0)
    journal.mark_started(offer_id(5))
    journal.mark_spawning(offer_id(5))

    plane = FakeControlPlane()
    plane.reconcile_answers = [Response(503, {}), Response(502, {})]
    plane.offers = [an_offer(1), an_offer(4)]
    spawner = Spawner(journal)
    agent = Agent(
        transport=plane,
        credential="c" * 43,
        slots=2,
        executor="process",
        spawn=spawner,
        journal=journal,
        poll_interval_s=0.02,
        stop_grace_s=0.5,
        retry_initial_s=0.01,
        retry_cap_s=0.05,
    )
    orphan_gone_before_open: list[bool] = []
    original = plane.post

    def watch(path: str, body: Mapping[str, Any], *, token: str) -> Response:
        if path.endswith("/sessions"):
            orphan_gone_before_open.append(
                orphan.poll() is not None and unrecorded.poll() is not None
            )
        return original(path, body, token=token)

    plane.post = watch  # type: ignore[method-assign]
    try:
        assert agent.run(once=True) == 0
    finally:
        for process in (orphan, unrecorded):
            if process.poll() is None:
                process.kill()
            process.wait()
        journal.close()
    assert orphan_gone_before_open == [True]
    assert orphan.returncode == unrecorded.returncode == -signal.SIGTERM
    kinds = plane.kinds()
    assert kinds[:4] == ["sessions", "reconcile", "reconcile", "reconcile"] or (
        kinds.index("reconcile") < kinds.index("pull")
    )
    assert kinds.count("reconcile") == 3  # 503, 502, answered
    last = plane.record("reconcile")[-1]["executions"]
    assert {(i["offer_id"], i["outcome"], i["exit_code"]) for i in last} == {
        (offer_id(1), "killed", None),
        (offer_id(2), "exited", 0),
        (offer_id(3), "not_started", None),
        (offer_id(5), "killed", None),
    }
    assert kinds.index("pull") > max(i for i, k in enumerate(kinds) if k == "reconcile")
    # The old offer came again in the pull: recognized, never spawned again.
    assert spawner.spawned == [offer_id(4)]


def test_reconcile_reports_in_batches_of_at_most_64() -> None:
    plane = FakeControlPlane()
    agent, _ = make_agent(plane)
    for n in range(70):
        agent.journal.record_offer(
            offer_id=offer_id(n), spec_sha256="d" * 64, lease_token="t" * 43, session_id="old"
        )
    agent.open_session()
    agent.reconcile()
    assert [len(body["executions"]) for body in plane.record("reconcile")] == [64, 6]
    assert agent.journal.open_executions() == []


def test_a_runner_that_fails_on_a_bug_frees_its_slot_and_the_agent_goes_on() -> None:
    plane = FakeControlPlane()
    agent, spawner = make_agent(plane, slots=1)
    agent.open_session()

    def broken(spec: Mapping[str, Any], *, offer_id: str = "") -> FakeProcess:
        raise RuntimeError("a bug")

    agent.spawn = broken
    plane.offers = [an_offer(1)]
    agent.pull()
    join_runners(agent)
    execution = agent.journal.get(offer_id(1))
    assert execution is not None and (execution.phase, execution.report) == (
        Phase.REPORTED,
        "error",
    )
    assert agent.free_slots() == 1  # not held any more, so not_held on the server
    agent.spawn = spawner
    plane.offers = [an_offer(2)]
    assert agent.pull() == 1
    join_runners(agent)
    assert spawner.spawned == [offer_id(2)]


def test_a_slot_freed_while_all_were_taken_is_pulled_for_at_once(
    serving: Callable[[Agent], threading.Thread],
) -> None:
    # Reviewer R0: with every slot taken, the loop used to count that as an
    # empty pull and wait a whole poll interval (here 30 s) after a slot freed.
    plane = FakeControlPlane()
    plane.offers = [an_offer(1)]
    journal = Journal.memory()
    spawner = Spawner(journal, runs_until_stopped=True)
    agent = Agent(
        transport=plane,
        credential="c" * 43,
        slots=1,
        executor="process",
        spawn=spawner,
        journal=journal,
        poll_interval_s=30.0,
        stop_grace_s=0.2,
        retry_initial_s=0.01,
        retry_cap_s=0.05,
    )
    serving(agent)
    eventually(lambda: len(spawner.spawned) == 1)
    time.sleep(0.3)  # the loop finds its one slot taken, again and again
    with plane.lock:
        plane.offers = [an_offer(2)]
    spawner.processes[spawner.spawned[0]].terminate()
    eventually(lambda: len(spawner.spawned) == 2, timeout=5.0)
