"""A normal output tail never makes the terminal ACK impossible (issue 8, item 2).

The tail limit is defined on what is sent: the UTF-8 bytes of the tail's JSON
escaping (`output_tail_wire_bytes`). A program printing JSON log lines (quotes,
backslashes, control characters) used to fill a 64 KiB raw tail whose escaping
pushed the ACK body past the server's 80 KiB cap: a 413 the agent did not
survive, and a Run left `running` although its process had exited 0. Now the
agent trims by the escaped size, and a terminal ACK refused with any 4xx but
409 goes again without the tail, then with a minimal body.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qinglong.testing import make_project, make_worker
from runs.services import run_enqueue, task_create
from workers.agent.agent import Agent
from workers.agent.protocol import (
    MAX_OUTPUT_TAIL_BYTES,
    RETRY_CAP_S,
    RETRY_INITIAL_S,
    AttemptRunner,
    Response,
    TransportError,
    clean_output_tail,
    output_tail_wire_bytes,
)
from workers.agent.transport import HttpTransport
from workers.api.views import WORKER_MAX_BODY_BYTES, AckBatchView, WorkerApiView
from workers.tests.test_agent import FakeProcess, FakeSpawner, an_offer

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "t" * 43
TERMINAL = ("succeeded", "failed", "start_failed")

# What a service logging JSON lines prints: quotes and backslashes (2 bytes
# each once escaped), raw ANSI colour codes and other control characters (6),
# non-ASCII and non-BMP text.
LOG_LINE = (
    "\x1b[32mINFO\x1b[0m "
    + json.dumps(
        {"msg": 'said "hi" to C:\\jobs\\run', "ctl": "\x01\x02\t", "who": "雪😀"},
        ensure_ascii=False,
    )
    + "\r\n"
)


def log_output(min_bytes: int) -> str:
    lines = LOG_LINE * (min_bytes // len(LOG_LINE.encode()) + 1)
    return lines + "END-OF-OUTPUT\n"


# ------------------------------------------------------------ the definition


_ESCAPE_HEAVY = ['"', "\\", "\x00", "\x01", "\n", "\ud800", "😀", "雪", "é", "\x7f"]
_any_text = st.text(alphabet=st.characters(blacklist_categories=()), max_size=400) | (
    st.sampled_from(_ESCAPE_HEAVY).map(lambda c: c * 300)
)


@settings(max_examples=300, deadline=None)
@given(text=_any_text, limit=st.integers(0, 700))
def test_the_cleaned_tail_is_the_longest_newest_part_that_fits_the_limit(
    text: str, limit: int
) -> None:
    tail = clean_output_tail(text, limit)
    assert output_tail_wire_bytes(tail) <= limit
    tail.encode("utf-8")  # strict: no surrogate left
    assert "\x00" not in tail
    cleaned = clean_output_tail(text, 10**9)
    assert cleaned.endswith(tail)  # the newest output, cut between characters
    if len(tail) < len(cleaned):
        # Maximal: one more (older) character would not fit.
        one_more = cleaned[len(cleaned) - len(tail) - 1 :]
        assert output_tail_wire_bytes(one_more) > limit


@settings(max_examples=200, deadline=None)
@given(text=_any_text)
def test_cleaning_never_makes_a_tail_bigger_on_the_wire(text: str) -> None:
    # So a tail the server accepts is stored whole (NUL 6 bytes -> U+FFFD 3).
    assert output_tail_wire_bytes(clean_output_tail(text, 10**9)) <= output_tail_wire_bytes(text)


@pytest.mark.parametrize("char", ['"', "\\", "\x01", "\n", "\x00", "😀", "a"])
def test_a_worst_case_tail_keeps_the_ack_body_under_the_servers_cap(char: str) -> None:
    tail = clean_output_tail(char * MAX_OUTPUT_TAIL_BYTES)
    body = {
        "phase": "start_failed",
        "lease_token": "t" * 128,
        "spec_sha256": "0" * 64,
        "exit_code": -(2**31),
        "error_code": "e" * 64,
        "output_tail": tail,
    }
    # The agent's transport sends ensure_ascii=False UTF-8.
    size = len(json.dumps(body, ensure_ascii=False).encode("utf-8"))
    assert MAX_OUTPUT_TAIL_BYTES - 6 < output_tail_wire_bytes(tail) <= MAX_OUTPUT_TAIL_BYTES
    assert size < WORKER_MAX_BODY_BYTES - 8 * 1024  # with margin


def test_the_server_uses_the_agents_definition_of_the_limit() -> None:
    from workers.api import serializers

    assert serializers.MAX_OUTPUT_TAIL_BYTES == MAX_OUTPUT_TAIL_BYTES
    assert serializers.output_tail_wire_bytes is output_tail_wire_bytes
    assert serializers.clean_output_tail is clean_output_tail


# ------------------------------------------------------- the fallback sequence


class LogProcess(FakeProcess):
    def output_tail(self, limit: int) -> str:
        return log_output(2 * limit)


class Scripted:
    """Answers ACKs of each phase from a queue (then 200); an exception is raised."""

    def __init__(self, script: Mapping[str, list[Response | Exception]]) -> None:
        self.script = {phase: list(answers) for phase, answers in script.items()}
        self.calls: list[dict[str, Any]] = []

    def post(self, path: str, body: Mapping[str, Any], *, token: str) -> Response:
        self.calls.append(dict(body))
        queue = self.script.get(str(body.get("phase")), [])
        answer = queue.pop(0) if queue else Response(200, {"cancel_requested": False})
        if isinstance(answer, Exception):
            raise answer
        return answer

    def terminal(self) -> list[dict[str, Any]]:
        return [c for c in self.calls if c["phase"] in TERMINAL]


def run_with(
    script: Mapping[str, list[Response | Exception]], process: FakeProcess | None = None
) -> tuple[Any, Scripted, list[float]]:
    transport = Scripted(script)
    slept: list[float] = []
    runner = AttemptRunner(
        transport=transport,
        session_token="s" * 43,
        offer=an_offer(),
        lease_token=TOKEN,
        spawn=FakeSpawner(process or LogProcess(), []),
        poll_interval_s=0.01,
        sleep=slept.append,
    )
    return runner.run(), transport, slept


def refused(status: int, code: str = "invalid_request") -> Response:
    return Response(status, {"error": {"code": code, "message": "x"}})


def test_the_agent_sends_a_tail_that_fits_the_limit_as_sent() -> None:
    outcome, transport, _ = run_with({})
    [done] = transport.terminal()
    tail = done["output_tail"]
    assert MAX_OUTPUT_TAIL_BYTES - 6 < output_tail_wire_bytes(tail) <= MAX_OUTPUT_TAIL_BYTES
    assert tail.endswith("END-OF-OUTPUT\n")
    assert outcome.final_phase == "succeeded"


@pytest.mark.parametrize("status", [400, 403, 404, 411, 413, 415, 422])
def test_a_refused_terminal_ack_goes_again_without_the_tail(status: int) -> None:
    outcome, transport, slept = run_with({"succeeded": [refused(status)]})
    first, second = transport.terminal()
    assert "output_tail" in first
    assert second == {k: v for k, v in first.items() if k != "output_tail"}
    assert (outcome.final_phase, outcome.stopped) == ("succeeded", "")
    assert slept == []  # a refusal is not retried as is


def test_a_401_on_the_terminal_ack_leaves_it_owed_for_the_reconcile() -> None:
    # The Session is gone (contract C): nothing more is sent under it; the
    # outcome stays in the journal and goes through the next Session's reconcile.
    outcome, transport, slept = run_with({"succeeded": [refused(401, "session_replaced")]})
    assert len(transport.terminal()) == 1
    assert (outcome.ran, outcome.final_phase, outcome.report) == (True, None, "")
    assert outcome.stopped == "session_lost"
    assert slept == []


def test_then_with_a_minimal_body() -> None:
    script: dict[str, list[Response | Exception]] = {"failed": [refused(413), refused(400)]}
    outcome, transport, _ = run_with(script, LogProcess(exit_code=3))
    first, second, third = transport.terminal()
    assert "output_tail" in first and "error_code" in first
    assert "output_tail" not in second and second["error_code"] == "exit_nonzero"
    assert set(third) == {"phase", "lease_token", "spec_sha256", "exit_code"}
    assert (third["phase"], third["exit_code"]) == ("failed", 3)
    assert outcome.final_phase == "failed"


def test_a_start_failed_ack_falls_back_to_phase_token_and_digest() -> None:
    class Unspawnable(FakeSpawner):
        def __call__(self, spec: Mapping[str, Any], *, offer_id: str = "") -> FakeProcess:
            raise FileNotFoundError("no such program")

    transport = Scripted({"start_failed": [refused(422), refused(400)]})
    runner = AttemptRunner(
        transport=transport,
        session_token="s" * 43,
        offer=an_offer(),
        lease_token=TOKEN,
        spawn=Unspawnable(FakeProcess(), []),
        sleep=lambda _: None,
    )
    outcome = runner.run()
    first, second, third = transport.terminal()
    assert first["output_tail"] == "FileNotFoundError"
    assert set(second) == {"phase", "lease_token", "spec_sha256", "error_code"}
    assert set(third) == {"phase", "lease_token", "spec_sha256"}
    assert (outcome.final_phase, outcome.stopped) == ("start_failed", "spawn_failed")


def test_when_even_the_minimal_body_is_refused_the_agent_stops() -> None:
    script: dict[str, list[Response | Exception]] = {"failed": [refused(400)] * 5}
    outcome, transport, _ = run_with(script, LogProcess(exit_code=1))
    assert len(transport.terminal()) == 3  # full, without the tail, minimal
    assert (outcome.final_phase, outcome.stopped) == (None, "invalid_request")


def test_a_body_already_minimal_is_not_sent_twice() -> None:
    # succeeded without its tail is {exit_code}: already the minimal body.
    script: dict[str, list[Response | Exception]] = {"succeeded": [refused(400)] * 5}
    outcome, transport, _ = run_with(script)
    assert len(transport.terminal()) == 2
    assert outcome.final_phase is None


def test_a_409_on_the_terminal_ack_stops_at_once() -> None:
    outcome, transport, slept = run_with({"succeeded": [refused(409, "lease_expired")]})
    assert len(transport.terminal()) == 1
    assert (outcome.final_phase, outcome.stopped) == (None, "lease_expired")
    assert slept == []


@pytest.mark.parametrize(
    "failure",
    [refused(500, "internal_error"), refused(503), refused(429), TransportError("URLError")],
    ids=["500", "503", "429", "transport"],
)
def test_a_transient_failure_is_retried_with_the_same_body_after_a_pause(
    failure: Response | Exception,
) -> None:
    outcome, transport, slept = run_with({"succeeded": [failure, failure]})
    first, second, third = transport.terminal()
    assert first == second == third  # tail included: nothing was refused
    assert len(slept) == 2
    assert RETRY_INITIAL_S / 2 <= slept[0] <= RETRY_INITIAL_S  # jittered
    assert outcome.final_phase == "succeeded"


def test_a_control_plane_that_stays_away_is_waited_for_with_capped_jittered_pauses() -> None:
    # Issue 10 finding 3: the terminal ACK is never given up on a transport
    # error or a 5xx; it goes until the control plane answers.
    failures: list[Response | Exception] = [TransportError("URLError"), refused(502)] * 20
    outcome, transport, slept = run_with({"succeeded": failures})
    assert len(transport.terminal()) == 41
    assert (outcome.final_phase, outcome.report) == ("succeeded", "acked")
    assert len(slept) == 40
    assert max(slept) <= RETRY_CAP_S
    assert slept[-1] >= RETRY_CAP_S / 2  # grown to the cap
    assert slept[1] > slept[0] / 2  # and growing from the start


# ------------------------------------------------- against the real Worker API


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_413_from_a_smaller_cap_on_the_way_is_survived(live_server, monkeypatch) -> None:
    """The real server (its cap lowered, as a proxy in front of it could) answers
    413 to the ACK with the tail; the agent sends it again without, and the Run
    ends `succeeded`, not left `running`. The request carrying several ACKs
    gets the 413 first; each ACK then goes on its own."""
    monkeypatch.setattr(WorkerApiView, "max_body_bytes", 16 * 1024)
    monkeypatch.setattr(AckBatchView, "max_body_bytes", 16 * 1024)
    _, credential = make_worker(slots=1)
    task = task_create(
        project=make_project(),
        name="logger",
        definition={"executor_type": "process", "command": ["logger"], "timeout_s": 30},
    )
    run = run_enqueue(task=task)
    agent = Agent(
        transport=HttpTransport(live_server.url),
        credential=credential,
        slots=1,
        executor="process",
        spawn=FakeSpawner(LogProcess(), []),
    )
    agent.open_session()
    assert agent.pull() == 1
    for entry in list(agent.runners.values()):
        entry.thread.join(30)
    [outcome] = agent.outcomes
    assert (outcome.final_phase, outcome.stopped) == ("succeeded", "")
    run.refresh_from_db()
    attempt = run.attempts.get()
    assert (run.state, attempt.state, attempt.exit_code) == ("succeeded", "succeeded", 0)
    assert attempt.output_tail == ""  # the courtesy went, the outcome arrived


# Prints JSON log lines well past the tail limit, then a marker; exits 0.
SCRIPT = (
    "import json, sys\n"
    "line = '\\x1b[32mINFO\\x1b[0m ' + json.dumps({'msg': 'said \"hi\" to C:\\\\jobs\\\\run',"
    " 'ctl': '\\x01\\x02\\t', 'who': '\\u96ea\\U0001F600'}, ensure_ascii=False) + '\\r\\n'\n"
    "out = sys.stdout.buffer\n"
    "for _ in range(2000):\n"
    "    out.write(line.encode('utf-8'))\n"
    "out.write(b'END-OF-OUTPUT\\n')\n"
)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_task_printing_json_log_lines_ends_succeeded(live_server, tmp_path) -> None:
    """The reference agent as a real process: the terminal ACK with a full tail of
    JSON log lines is accepted the first time and the Run ends `succeeded`."""
    expected = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, check=True, timeout=30
    ).stdout.decode("utf-8")
    assert len(expected.encode()) > 2 * MAX_OUTPUT_TAIL_BYTES
    # Escaped, the newest 64 KiB of it would not fit the 80 KiB body cap.
    newest = expected.encode()[-MAX_OUTPUT_TAIL_BYTES:].decode("utf-8", "ignore")
    assert output_tail_wire_bytes(newest) > WORKER_MAX_BODY_BYTES

    _, credential = make_worker(slots=1)
    credential_file = tmp_path / "worker.credential"
    credential_file.write_text(credential)
    task = task_create(
        project=make_project(),
        name="json-logger",
        definition={
            "executor_type": "process",
            "command": [sys.executable, "-c", SCRIPT],
            "timeout_s": 60,
        },
    )
    run = run_enqueue(task=task)
    agent = subprocess.run(
        [
            sys.executable,
            "-m",
            "workers.agent",
            "--url",
            live_server.url,
            "--credential-file",
            str(credential_file),
            "--state-dir",
            str(tmp_path / "agent-state"),
            "--poll-interval",
            "0.2",
            "--once",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert agent.returncode == 0, agent.stderr
    run.refresh_from_db()
    attempt = run.attempts.get()
    assert (run.state, attempt.state, attempt.exit_code) == ("succeeded", "succeeded", 0)
    # The tail arrived, so the first ACK (the only one that carries it) was accepted.
    tail = attempt.output_tail
    assert expected.endswith(tail)
    assert tail.endswith("END-OF-OUTPUT\n")
    assert MAX_OUTPUT_TAIL_BYTES - 6 < output_tail_wire_bytes(tail) <= MAX_OUTPUT_TAIL_BYTES


def test_the_log_fixture_really_is_escape_heavy() -> None:
    text = log_output(10_000)
    assert output_tail_wire_bytes(text) > 1.3 * len(text.encode())
