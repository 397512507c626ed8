"""The agent's several-ACKs-per-request sender (workers/agent/acks.py, docs/adr/0013).

Each runner hands its ACKs to its Session's `AckSender` and gets back exactly
the answer the single ACK endpoint would have given, whatever the batching,
the control plane's version or a proxy in between did.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from workers.agent.acks import ACKS_PATH, AckSender
from workers.agent.executor import ProcessSpawner
from workers.agent.protocol import AttemptRunner, Response, TransportError, spec_sha256
from workers.tests.markers import offer_id
from workers.tests.test_agent import FakeProcess, FakeSpawner, a_spec

OFFER = offer_id(0xAB)  # per test process: workers.tests.markers
TOKEN = "t" * 43


def body(phase: str, **extra: Any) -> dict[str, Any]:
    return {"phase": phase, "lease_token": TOKEN, "spec_sha256": "0" * 64, **extra}


class Plane:
    """A Worker API in memory: `POST acks` answers one result per item (or
    `acks_answer`, when set); a single ACK answers `single(path, body)`."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()
        self.acks_answer: Callable[[list[dict[str, Any]]], Response] | None = None
        self.item_status: Callable[[dict[str, Any]], int] = lambda item: 200
        self.single: Callable[[str, Mapping[str, Any]], Response] = lambda path, body: Response(
            200, {"cancel_requested": False}
        )
        self.gate: threading.Event | None = None  # holds every POST acks until set
        self.entered = threading.Event()

    def post(self, path: str, body: Mapping[str, Any], *, token: str) -> Response:
        with self.lock:
            self.calls.append((path, dict(body)))
        if path != ACKS_PATH:
            return self.single(path, body)
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(10)
        acks = list(body["acks"])
        if self.acks_answer is not None:
            return self.acks_answer(acks)
        results = []
        for item in acks:
            status = self.item_status(item)
            result: dict[str, Any] = {"offer_id": item["offer_id"], "status": status}
            if status == 200:
                result.update(attempt_state=item["phase"], run_state="running")
                result["cancel_requested"] = False
            else:
                result["error"] = {"code": f"code_{status}", "message": "m"}
            results.append(result)
        return Response(200, {"results": results})

    def paths(self) -> list[str]:
        with self.lock:
            return ["acks" if p == ACKS_PATH else "ack" for p, _ in self.calls]


def test_one_ack_alone_goes_to_the_single_endpoint() -> None:
    plane = Plane()
    answer = AckSender(plane, token="s").post(OFFER, body("starting"))
    assert answer.status == 200
    assert plane.calls == [(f"/api/v1/worker/leases/{OFFER}/ack", body("starting"))]


def test_acks_handed_over_during_a_request_go_together_in_the_next_one() -> None:
    plane = Plane()
    sender = AckSender(plane, token="s")
    plane.gate = threading.Event()
    answers: dict[str, Response] = {}

    def send(offer: str, ack: dict[str, Any]) -> None:
        answers[offer] = sender.post_many([(offer, ack), (offer, body("succeeded", exit_code=0))])[
            1
        ]

    first = threading.Thread(target=send, args=("1" * 64, body("running", executor_handle="x")))
    first.start()
    assert plane.entered.wait(5)  # the first request is in flight, held
    others = [
        threading.Thread(target=send, args=(str(n) * 64, body("running", executor_handle="x")))
        for n in range(2, 6)
    ]
    for thread in others:
        thread.start()
    time.sleep(0.2)  # all four queued behind it
    plane.gate.set()
    for thread in [first, *others]:
        thread.join(5)
    assert plane.paths() == ["acks", "acks"]
    assert len(plane.calls[0][1]["acks"]) == 2
    second = plane.calls[1][1]["acks"]
    assert len(second) == 8
    # Each group's items stay together and in order.
    assert [i["phase"] for i in second] == ["running", "succeeded"] * 4
    assert {offer: a.status for offer, a in answers.items()} == {
        str(n) * 64: 200 for n in range(1, 6)
    }
    assert sender.supported is True
    assert (sender.requests, sender.acks) == (2, 10)


def test_each_ack_gets_its_own_answer_shaped_like_the_single_one() -> None:
    plane = Plane()
    plane.item_status = lambda item: 409 if item["phase"] == "succeeded" else 200
    running, final = AckSender(plane, token="s").post_many(
        [(OFFER, body("running", executor_handle="x")), (OFFER, body("succeeded", exit_code=0))]
    )
    assert (running.status, running.body.get("cancel_requested")) == (200, False)
    assert (final.status, final.error_code) == (409, "code_409")


def test_a_control_plane_without_post_acks_gets_single_acks_from_then_on() -> None:
    plane = Plane()
    plane.acks_answer = lambda acks: Response(404, {"error": {"code": "not_found"}})
    sender = AckSender(plane, token="s")
    pair = [(OFFER, body("running", executor_handle="x")), (OFFER, body("succeeded"))]
    assert [a.status for a in sender.post_many(pair)] == [200, 200]
    assert sender.supported is False
    assert [a.status for a in sender.post_many(pair)] == [200, 200]
    assert plane.paths() == ["acks", "ack", "ack", "ack", "ack"]


def test_an_answer_that_is_not_one_result_per_item_is_never_guessed_at() -> None:
    plane = Plane()
    plane.acks_answer = lambda acks: Response(200, {"results": []})
    sender = AckSender(plane, token="s")
    pair = [(OFFER, body("running", executor_handle="x")), (OFFER, body("succeeded"))]
    assert [a.status for a in sender.post_many(pair)] == [200, 200]
    assert sender.supported is False
    assert plane.paths() == ["acks", "ack", "ack"]


@pytest.mark.parametrize("status", [400, 411, 413, 422])
def test_a_request_refused_for_its_body_goes_again_ack_by_ack(status: int) -> None:
    plane = Plane()
    plane.acks_answer = lambda acks: Response(status, {"error": {"code": "x"}})
    plane.single = lambda path, body: Response(
        413 if "output_tail" in body else 200, {"cancel_requested": False}
    )
    sender = AckSender(plane, token="s")
    answers = sender.post_many(
        [(OFFER, body("running", executor_handle="x")), (OFFER, body("failed", output_tail="t"))]
    )
    # Each ACK got the single endpoint's own answer: the runner shrinks the refused one.
    assert [a.status for a in answers] == [200, 413]
    assert sender.supported is None  # not learned: the next request tries again
    assert plane.paths() == ["acks", "ack", "ack"]


@pytest.mark.parametrize("status", [401, 403, 429, 503])
def test_any_other_answer_to_the_request_is_every_acks_answer(status: int) -> None:
    plane = Plane()
    plane.acks_answer = lambda acks: Response(status, {"error": {"code": "whole"}})
    answers = AckSender(plane, token="s").post_many(
        [(OFFER, body("running", executor_handle="x")), (OFFER, body("succeeded"))]
    )
    assert [(a.status, a.error_code) for a in answers] == [(status, "whole")] * 2


def test_no_answer_at_all_is_every_callers_transport_error() -> None:
    plane = Plane()

    def down(acks: list[dict[str, Any]]) -> Response:
        raise TransportError("ConnectionResetError")

    plane.acks_answer = down
    with pytest.raises(TransportError):
        AckSender(plane, token="s").post_many([(OFFER, body("starting")), ("c" * 64, body("x"))])


def test_a_request_carries_at_most_its_item_and_byte_bounds() -> None:
    plane = Plane()
    sender = AckSender(plane, token="s", max_items=3, max_body_bytes=4096)
    plane.gate = threading.Event()
    done = []

    def send(n: int, size: int) -> None:
        ack = body("failed", exit_code=1, output_tail="x" * size)
        done.append(sender.post_many([(f"{n:064d}", ack), (f"{n:064d}", ack)]))

    threads = [threading.Thread(target=send, args=(0, 10))]
    threads[0].start()
    assert plane.entered.wait(5)
    for n in range(1, 6):
        threads.append(threading.Thread(target=send, args=(n, 1000)))
        threads[-1].start()
    time.sleep(0.2)
    plane.gate.set()
    for thread in threads:
        thread.join(5)
    assert len(done) == 6
    for path, sent in plane.calls:
        if path == ACKS_PATH:
            assert len(sent["acks"]) <= 3
    # Groups are never split: 2 items each, so one group per request here.
    assert all(len(sent["acks"]) == 2 for path, sent in plane.calls if path == ACKS_PATH)


# ------------------------------------------------------------- the runner


def runner_on(plane: Plane, process: FakeProcess | None = None, **kwargs: Any) -> AttemptRunner:
    spec = a_spec()
    offer = {"offer_id": OFFER, "spec": spec, "spec_sha256": spec_sha256(spec)}
    return AttemptRunner(
        transport=plane,
        session_token="s",
        offer=offer,
        lease_token=TOKEN,
        spawn=FakeSpawner(process or FakeProcess(), []),
        acks=AckSender(plane, token="s"),
        retry_initial_s=0.01,
        retry_cap_s=0.02,
        **kwargs,
    )


def test_a_process_that_ended_before_its_running_ack_is_reported_in_one_request() -> None:
    plane = Plane()
    outcome = runner_on(plane).run()
    assert (outcome.final_phase, outcome.acks, outcome.report) == (
        "succeeded",
        ["starting", "running", "succeeded"],
        "acked",
    )
    # `starting` alone (single endpoint), then `running` + the outcome together.
    assert plane.paths() == ["ack", "acks"]
    assert [i["phase"] for i in plane.calls[1][1]["acks"]] == ["running", "succeeded"]
    assert plane.calls[1][1]["acks"][1]["output_tail"] == "hello\n"


def test_a_refused_running_in_the_pair_stops_it_and_is_never_resent() -> None:
    plane = Plane()
    plane.item_status = lambda item: 409 if item["phase"] != "starting" else 200
    plane.single = lambda path, body: Response(200, {"cancel_requested": False})
    outcome = runner_on(plane).run()
    assert (outcome.final_phase, outcome.report, outcome.stopped) == (None, "conflict", "code_409")
    assert plane.paths() == ["ack", "acks"]


def test_an_outcome_accepted_with_running_refused_is_a_repeat_after_a_lost_answer() -> None:
    plane = Plane()
    # `running` was applied by a try whose answer was lost: the Attempt has
    # ended since, so its repeat is refused while the outcome's is a no-op.
    plane.item_status = lambda item: 409 if item["phase"] == "running" else 200
    outcome = runner_on(plane).run()
    assert (outcome.final_phase, outcome.report) == ("succeeded", "acked")


def test_an_unanswered_pair_goes_again_until_answered() -> None:
    plane = Plane()
    tries = {"n": 0}

    def flaky(acks: list[dict[str, Any]]) -> Response:
        tries["n"] += 1
        if tries["n"] < 3:
            return Response(503, {"error": {"code": "database_unavailable"}})
        return Response(
            200,
            {
                "results": [
                    {"offer_id": i["offer_id"], "status": 200, "cancel_requested": False}
                    for i in acks
                ]
            },
        )

    plane.acks_answer = flaky
    outcome = runner_on(plane).run()
    assert (outcome.final_phase, outcome.report) == ("succeeded", "acked")
    assert plane.paths() == ["ack", "acks", "acks", "acks"]


def test_a_tail_the_server_refuses_is_dropped_and_the_outcome_still_arrives() -> None:
    plane = Plane()
    plane.acks_answer = lambda acks: Response(413, {"error": {"code": "payload_too_large"}})
    plane.single = lambda path, body: Response(
        413 if "output_tail" in body else 200, {"cancel_requested": False}
    )
    outcome = runner_on(plane).run()
    assert (outcome.final_phase, outcome.report) == ("succeeded", "acked")
    phases = [(p, b.get("phase"), "output_tail" in b) for p, b in plane.calls if p != ACKS_PATH]
    assert phases[-2:] == [
        (f"/api/v1/worker/leases/{OFFER}/ack", "succeeded", True),
        (f"/api/v1/worker/leases/{OFFER}/ack", "succeeded", False),
    ]


def test_a_process_still_running_after_one_poll_interval_gets_its_running_ack_alone() -> None:
    plane = Plane()
    process = FakeProcess(runs_until_stopped=True)
    runner = runner_on(plane, process, poll_interval_s=0.05)
    thread = threading.Thread(target=runner.run)
    thread.start()
    deadline = time.monotonic() + 5
    while ("ack", "running") not in [(k, b.get("phase")) for k, b in _kinds(plane)]:
        assert time.monotonic() < deadline, plane.calls
        time.sleep(0.01)
    process.terminate()
    thread.join(5)
    kinds = [(k, b.get("phase")) for k, b in _kinds(plane)]
    assert kinds[:2] == [("ack", "starting"), ("ack", "running")]
    assert kinds[-1] == ("ack", "failed")


def _kinds(plane: Plane) -> list[tuple[str, dict[str, Any]]]:
    with plane.lock:
        return [("acks" if p == ACKS_PATH else "ack", b) for p, b in plane.calls]


# ------------------------------------------------------------- exit wakes


def test_a_real_childs_exit_wakes_its_runner_at_once(tmp_path: Path) -> None:
    """`LocalProcess.on_exit`: the wait for the process ends when it exits, not
    at the next poll (a poll interval of 10 s here would fail the bound)."""
    plane = Plane()
    spec = {**a_spec(), "command": [sys.executable, "-c", "pass"], "cwd": None}
    offer = {"offer_id": OFFER, "spec": spec, "spec_sha256": spec_sha256(spec)}
    runner = AttemptRunner(
        transport=plane,
        session_token="s",
        offer=offer,
        lease_token=TOKEN,
        spawn=ProcessSpawner(tmp_path),
        acks=AckSender(plane, token="s"),
        poll_interval_s=10.0,
    )
    outcome: list[Any] = []
    thread = threading.Thread(target=lambda: outcome.append(runner.run()))
    thread.start()
    thread.join(8)
    assert not thread.is_alive(), "the runner waited for its poll interval"
    assert (outcome[0].final_phase, outcome[0].exit_code) == ("succeeded", 0)
    assert [i["phase"] for i in plane.calls[-1][1]["acks"]] == ["running", "succeeded"]


class _CountingSpawner:
    """The real spawner, counting how often the runner looks at its process."""

    def __init__(self, workdir: Path) -> None:
        self.spawn = ProcessSpawner(workdir)
        self.polls = 0

    def __call__(self, spec: Mapping[str, Any], *, offer_id: str = "") -> Any:
        process = self.spawn(spec, offer_id=offer_id)
        poll = process.poll

        def counted() -> int | None:
            self.polls += 1
            return poll()

        process.poll = counted  # type: ignore[method-assign]
        return process


def _run_real(tmp_path: Path, code: str, **spec: Any) -> tuple[Any, _CountingSpawner, float]:
    plane = Plane()
    full = {**a_spec(), "command": [sys.executable, "-c", code], "cwd": None, **spec}
    offer = {"offer_id": OFFER, "spec": full, "spec_sha256": spec_sha256(full)}
    spawner = _CountingSpawner(tmp_path)
    runner = AttemptRunner(
        transport=plane,
        session_token="s",
        offer=offer,
        lease_token=TOKEN,
        spawn=spawner,
        acks=AckSender(plane, token="s"),
        poll_interval_s=0.02,
        stop_grace_s=1.0,
    )
    started = time.monotonic()
    outcome = runner.run()
    return outcome, spawner, time.monotonic() - started


def test_a_runner_told_of_the_exit_does_not_poll_its_process(tmp_path: Path) -> None:
    # Issue 12: with the exit watcher, a running Attempt's runner sleeps until
    # the exit (polling every 0.02 s would look about 60 times in 1.2 s).
    outcome, spawner, _ = _run_real(tmp_path, "import time; time.sleep(1.2)")
    assert (outcome.final_phase, outcome.exit_code) == ("succeeded", 0)
    assert spawner.polls <= 5


def test_a_watched_process_past_its_timeout_is_stopped_on_time(tmp_path: Path) -> None:
    # The long wait is bounded by the timeout, not by the safety net.
    outcome, _, seconds = _run_real(tmp_path, "import time; time.sleep(30)", timeout_s=1)
    assert outcome.final_phase == "failed"
    assert seconds < 4.5


def test_on_exit_never_reaps_the_child(tmp_path: Path) -> None:
    spawn = ProcessSpawner(tmp_path)
    process = spawn({**a_spec(), "command": ["true"], "cwd": None}, offer_id=OFFER)
    exited = threading.Event()
    process.on_exit(exited.set)
    assert exited.wait(5)
    # Unreaped: its pid still names it (a zombie) until release reaps it.
    assert subprocess.run(["ps", "-o", "stat=", "-p", str(process.pid)], capture_output=True,
                          text=True).stdout.strip().startswith("Z")  # fmt: skip
    assert process.release(1.0) == 0
    process.close()


# ------------------------------------------------------------- a pull's starts


class AgentPlane(Plane):
    """Plane plus what an Agent needs: a Session, heartbeats and one pull of `offers`."""

    def __init__(self, offers: list[dict[str, Any]]) -> None:
        super().__init__()
        self.offers = offers
        base = self.single
        self.single = lambda path, body: self._route(path, body, base)

    def _route(self, path: str, body: Mapping[str, Any], base: Any) -> Response:
        kind = path.rsplit("/", 1)[-1].split("?")[0]
        if kind == "sessions":
            return Response(
                201,
                {
                    "session_id": "sid",
                    "generation": 1,
                    "session_token": "s",
                    "heartbeat_interval_s": 10,
                    "session_timeout_s": 30,
                },
            )
        if kind == "heartbeat":
            return Response(200, {"session_state": "online", "cancel": [], "stop": []})
        if kind == "reconcile":
            return Response(200, {"results": []})
        if kind == "pull":
            handed, self.offers = self.offers, []
            return Response(200, {"offers": handed, "status": "offered", "reason": ""})
        return base(path, body)


def offers(count: int) -> list[dict[str, Any]]:
    spec = a_spec()
    return [
        {
            "offer_id": offer_id(n),
            "spec": spec,
            "spec_sha256": spec_sha256(spec),
            "lease": {"token": TOKEN},
        }
        for n in range(1, count + 1)
    ]


def pull_once(plane: AgentPlane, slots: int = 4) -> tuple[Any, list[str]]:
    from workers.agent.agent import Agent

    log: list[str] = []
    spawner = FakeSpawner(FakeProcess(), log)
    agent = Agent(
        transport=plane,
        credential="c" * 43,
        slots=slots,
        executor="process",
        spawn=spawner,
        retry_initial_s=0.01,
        retry_cap_s=0.02,
    )
    agent.open_session()
    agent.pull()
    for entry in list(agent.runners.values()):
        entry.thread.join(10)
    return agent, spawner.offer_ids


def test_a_pulls_offers_are_started_with_one_request_before_any_spawn() -> None:
    plane = AgentPlane(offers(3))
    agent, spawned = pull_once(plane)
    first_acks = next(b for p, b in plane.calls if p == ACKS_PATH)
    assert [i["phase"] for i in first_acks["acks"]] == ["starting"] * 3
    # Nothing but the Session, the pull and that request came before the spawns.
    assert [p.rsplit("/", 1)[-1] for p, _ in plane.calls[:3]] == ["sessions", "pull", "acks"]
    assert sorted(spawned) == [offer_id(n) for n in range(1, 4)]
    assert {o.final_phase for o in agent.outcomes} == {"succeeded"}
    # No `starting` went again on its own.
    assert not [b for p, b in plane.calls if p != ACKS_PATH and b.get("phase") == "starting"]


def test_an_offer_refused_in_the_pulls_start_request_is_never_spawned() -> None:
    plane = AgentPlane(offers(3))
    refused = offer_id(2)
    plane.item_status = lambda item: (
        409 if item["offer_id"] == refused and item["phase"] == "starting" else 200
    )
    agent, spawned = pull_once(plane)
    assert refused not in spawned and len(spawned) == 2
    [outcome] = [o for o in agent.outcomes if o.offer_id == refused]
    assert (outcome.ran, outcome.report, outcome.stopped) == (False, "conflict", "code_409")


def test_an_unanswered_start_request_leaves_each_start_to_its_runner() -> None:
    plane = AgentPlane(offers(3))
    calls = {"n": 0}

    def first_fails(acks: list[dict[str, Any]]) -> Response:
        calls["n"] += 1
        if calls["n"] == 1:
            raise TransportError("ConnectionResetError")
        return Response(
            200,
            {
                "results": [
                    {"offer_id": i["offer_id"], "status": 200, "cancel_requested": False}
                    for i in acks
                ]
            },
        )

    plane.acks_answer = first_fails
    agent, spawned = pull_once(plane)
    assert len(spawned) == 3
    assert {o.final_phase for o in agent.outcomes} == {"succeeded"}


def test_with_two_requests_in_flight_the_second_goes_at_once() -> None:
    plane = Plane()
    sender = AckSender(plane, token="s", max_in_flight=2)
    plane.gate = threading.Event()
    pair = [(OFFER, body("running", executor_handle="x")), (OFFER, body("succeeded"))]
    first = threading.Thread(target=sender.post_many, args=(pair,))
    first.start()
    assert plane.entered.wait(5)
    second = threading.Thread(target=sender.post_many, args=(pair,))
    second.start()
    deadline = time.monotonic() + 5
    while len(plane.calls) < 2:  # sent while the first is still held
        assert time.monotonic() < deadline
        time.sleep(0.01)
    plane.gate.set()
    first.join(5)
    second.join(5)
    assert plane.paths() == ["acks", "acks"]


# ---------------------------------------------------------------- linger
# A busy Session's ACK that gates nothing waits up to `linger_s` for others
# to share its request (workers/agent/acks.py). The tests give it a linger
# far longer than they wait, so only the rule under test can end it.

LONG = 60.0


def _busy(sender: AckSender, plane: Plane) -> None:
    """One request sent just now: the Session is busy."""
    sender.post_many([("9" * 64, body("running", executor_handle="x")), ("9" * 64, body("x"))])
    plane.calls.clear()


def _post_in_thread(sender: AckSender, items: list[tuple[str, dict[str, Any]]]) -> threading.Thread:
    thread = threading.Thread(target=sender.post_many, args=(items,), daemon=True)
    thread.start()
    return thread


def test_a_busy_sessions_outcome_waits_for_company_and_shares_its_request() -> None:
    plane = Plane()
    sender = AckSender(plane, token="s", max_items=4, linger_s=LONG)
    _busy(sender, plane)
    first = _post_in_thread(sender, [("1" * 64, body("running", executor_handle="x"))])
    first.join(0.3)
    assert first.is_alive() and plane.calls == []  # lingering: nothing sent yet
    second = _post_in_thread(sender, [("2" * 64, body("succeeded", exit_code=0))])
    second.join(0.3)
    assert second.is_alive() and plane.calls == []
    # The request is full once a fourth item is queued: it goes at once, all in one.
    last = _post_in_thread(
        sender, [("3" * 64, body("running", executor_handle="x")), ("3" * 64, body("failed"))]
    )
    for thread in (first, second, last):
        thread.join(5)
        assert not thread.is_alive()
    assert plane.paths() == ["acks"]
    assert [item["offer_id"][0] for item in plane.calls[0][1]["acks"]] == ["1", "2", "3", "3"]


def test_a_starting_ack_never_waits_and_takes_the_lingering_ones_along() -> None:
    plane = Plane()
    sender = AckSender(plane, token="s", linger_s=LONG)
    _busy(sender, plane)
    lingering = _post_in_thread(sender, [("1" * 64, body("succeeded", exit_code=0))])
    lingering.join(0.3)
    assert lingering.is_alive()
    starting = _post_in_thread(sender, [("2" * 64, body("starting"))])
    for thread in (starting, lingering):
        thread.join(5)
        assert not thread.is_alive()
    assert plane.paths() == ["acks"]
    assert [item["phase"] for item in plane.calls[0][1]["acks"]] == ["succeeded", "starting"]


def test_an_idle_sessions_ack_goes_at_once() -> None:
    plane = Plane()
    sender = AckSender(plane, token="s", linger_s=LONG)
    # Nothing sent yet: not busy.
    alone = _post_in_thread(sender, [("1" * 64, body("succeeded", exit_code=0))])
    alone.join(5)
    assert not alone.is_alive()
    # Nothing sent within the busy window: not busy either.
    sender._last_sent = time.monotonic() - 1.0
    again = _post_in_thread(sender, [("2" * 64, body("succeeded", exit_code=0))])
    again.join(5)
    assert not again.is_alive()
    assert plane.paths() == ["ack", "ack"]


def test_an_ack_handed_over_during_a_request_does_not_linger_after_it() -> None:
    plane = Plane()
    sender = AckSender(plane, token="s", linger_s=LONG)
    plane.gate = threading.Event()
    first = _post_in_thread(
        sender, [("1" * 64, body("running", executor_handle="x")), ("1" * 64, body("x"))]
    )
    assert plane.entered.wait(5)
    queued = _post_in_thread(sender, [("2" * 64, body("succeeded", exit_code=0))])
    queued.join(0.2)
    plane.gate.set()  # the request in flight ends: the queued ACK goes next, at once
    for thread in (first, queued):
        thread.join(5)
        assert not thread.is_alive()
    assert plane.paths() == ["acks", "ack"]


def test_with_no_linger_a_busy_sessions_ack_goes_at_once() -> None:
    plane = Plane()
    sender = AckSender(plane, token="s", linger_s=0)
    _busy(sender, plane)
    alone = _post_in_thread(sender, [("1" * 64, body("succeeded", exit_code=0))])
    alone.join(5)
    assert not alone.is_alive()
    assert plane.paths() == ["ack"]


def test_a_busy_sessions_ack_with_no_other_runner_at_work_goes_at_once() -> None:
    plane = Plane()
    others = [True]
    sender = AckSender(plane, token="s", linger_s=LONG, company=lambda: others[0])
    _busy(sender, plane)
    others[0] = False  # the Run acking is the only one: nobody to wait for
    alone = _post_in_thread(sender, [("1" * 64, body("succeeded", exit_code=0))])
    alone.join(5)
    assert not alone.is_alive()
    assert plane.paths() == ["ack"]


def test_no_linger_against_a_control_plane_without_post_acks() -> None:
    plane = Plane()
    sender = AckSender(plane, token="s", linger_s=LONG)
    _busy(sender, plane)
    sender.supported = False  # every ACK goes alone anyway
    alone = _post_in_thread(sender, [("1" * 64, body("succeeded", exit_code=0))])
    alone.join(5)
    assert not alone.is_alive()
    assert plane.paths() == ["ack"]
