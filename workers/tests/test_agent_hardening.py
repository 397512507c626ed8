"""The reference agent's hardening: clean output tails, a terminal ACK that
survives a refused tail, and a transport that keeps its Bearer secret home."""

from __future__ import annotations

import http.server
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from workers.agent.__main__ import main
from workers.agent.executor import ProcessSpawner
from workers.agent.protocol import (
    MAX_OUTPUT_TAIL_BYTES,
    AttemptRunner,
    Response,
    clean_output_tail,
    output_tail_wire_bytes,
    spec_sha256,
)
from workers.agent.transport import HttpTransport, is_loopback_host
from workers.tests.test_agent import FakeProcess, FakeSpawner, a_spec, an_offer

TOKEN = "t" * 43

# ------------------------------------------------------------- output tails


class DirtyProcess(FakeProcess):
    """A Process whose tail holds what a real program may print."""

    def output_tail(self, limit: int) -> str:
        return "out\x00put\ud800tail"


class ScriptedTransport:
    """Answers each ACK phase from a queue (then 200); records every call."""

    def __init__(self, script: Mapping[str, list[Response]]) -> None:
        self.script = {phase: list(answers) for phase, answers in script.items()}
        self.calls: list[dict[str, Any]] = []

    def post(self, path: str, body: Mapping[str, Any], *, token: str) -> Response:
        self.calls.append(dict(body))
        queue = self.script.get(str(body.get("phase")), [])
        return queue.pop(0) if queue else Response(200, {"cancel_requested": False})


def _runner(transport: ScriptedTransport, process: FakeProcess | None = None) -> AttemptRunner:
    return AttemptRunner(
        transport=transport,
        session_token="s" * 43,
        offer=an_offer(),
        lease_token=TOKEN,
        spawn=FakeSpawner(process or DirtyProcess(), []),
        poll_interval_s=0.01,
    )


def _terminal_calls(transport: ScriptedTransport) -> list[dict[str, Any]]:
    return [c for c in transport.calls if c["phase"] in ("succeeded", "failed", "start_failed")]


BAD_TAIL = Response(400, {"error": {"code": "invalid_request", "message": "output_tail: x"}})


def test_the_agent_sends_a_cleaned_tail() -> None:
    transport = ScriptedTransport({})
    outcome = _runner(transport).run()
    assert outcome.final_phase == "succeeded"
    [done] = _terminal_calls(transport)
    assert done["output_tail"] == "out\ufffdput\ufffdtail"


def test_a_terminal_ack_refused_with_400_is_retried_once_without_the_tail() -> None:
    transport = ScriptedTransport({"succeeded": [BAD_TAIL]})
    outcome = _runner(transport).run()
    first, second = _terminal_calls(transport)
    assert "output_tail" in first
    assert "output_tail" not in second
    assert second["exit_code"] == 0 and second["phase"] == "succeeded"
    assert (outcome.final_phase, outcome.stopped) == ("succeeded", "")


def test_after_the_tail_the_error_code_goes_too_then_the_agent_stops() -> None:
    # The whole fallback sequence is in test_agent_tail.py.
    transport = ScriptedTransport({"failed": [BAD_TAIL, BAD_TAIL, BAD_TAIL]})
    outcome = _runner(transport, DirtyProcess(exit_code=2)).run()
    full, without_tail, minimal = _terminal_calls(transport)
    assert "output_tail" in full and "output_tail" not in without_tail
    assert "error_code" in without_tail and "error_code" not in minimal
    assert outcome.final_phase is None
    assert outcome.stopped == "invalid_request"


def test_a_409_on_the_terminal_ack_is_not_retried() -> None:
    transport = ScriptedTransport({"succeeded": [Response(409, {"error": {"code": "x"}})]})
    outcome = _runner(transport).run()
    assert len(_terminal_calls(transport)) == 1
    assert outcome.final_phase is None


def _tail_of(tmp_path: Any, payload: str) -> str:
    script = f"import sys; sys.stdout.buffer.write({payload})"
    process = ProcessSpawner(tmp_path)(a_spec(command=[sys.executable, "-c", script]))
    assert process.wait(timeout=30) == 0
    assert process.release(grace_s=1) == 0
    tail = process.output_tail(MAX_OUTPUT_TAIL_BYTES)
    process.close()
    return tail


def test_the_spawner_tail_has_no_nul_and_is_valid_utf8(tmp_path: Any) -> None:
    # NUL and invalid UTF-8 become U+FFFD: what the server would store anyway.
    assert _tail_of(tmp_path, "b'a\\x00b\\xff\\xfec'") == "a\ufffdb\ufffd\ufffdc"
    # NULs grow 1 → 3 bytes when replaced: the tail is re-trimmed to the limit.
    tail = _tail_of(tmp_path, "b'\\x00' * 30000 + 'é'.encode() * 20000")
    assert "\x00" not in tail
    assert len(tail.encode("utf-8")) <= output_tail_wire_bytes(tail) <= MAX_OUTPUT_TAIL_BYTES
    assert tail.endswith("é" * 20000)


def test_clean_output_tail_is_the_servers_rule() -> None:
    from workers.api.serializers import clean_output_tail as server_clean

    # One definition, imported by the server: the two can never drift.
    assert server_clean is clean_output_tail
    for text, limit in (("a\x00\ud800b", 100), ("é" * 10 + "\x00" * 5, 12), ("ok 😀", 5)):
        assert clean_output_tail(text, limit) == server_clean(text, limit)


# ---------------------------------------------------------------- transport


@pytest.mark.parametrize(
    "url",
    [
        "https://control.example.org",
        "https://10.0.0.1:8443/",
        "http://127.0.0.1:8000",
        "http://127.9.9.9",
        "http://localhost:8000/",
        "http://LOCALHOST",
        "http://[::1]:8000",
    ],
)
def test_https_anywhere_and_plain_http_on_loopback_are_accepted(url: str) -> None:
    assert HttpTransport(url).base_url == url.rstrip("/")


@pytest.mark.parametrize(
    "url",
    [
        "http://control.example.org",
        "http://10.0.0.1:8000",
        "http://[::2]:8000",
        "http://localhost.example.org",
        "http://127.0.0.1.nip.io",
        "ftp://127.0.0.1",
        "127.0.0.1:8000",
        "https://",
    ],
)
def test_plain_http_off_loopback_and_other_schemes_are_refused(url: str) -> None:
    with pytest.raises(ValueError, match="http"):
        HttpTransport(url)


def test_is_loopback_host() -> None:
    assert is_loopback_host("127.0.0.1") and is_loopback_host("::1")
    assert not is_loopback_host("0.0.0.0") and not is_loopback_host("example.org")


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Answers every POST with `status` and a Location to `location`."""

    status = 200
    location = ""
    seen: list[dict[str, str]]

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        self.seen.append({"path": self.path, "authorization": self.headers["Authorization"]})
        body = b'{"ok": true}'
        self.send_response(self.status)
        if self.location:
            self.send_header("Location", self.location)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _serve(status: int, location: str = "") -> tuple[http.server.HTTPServer, list[dict[str, str]]]:
    seen: list[dict[str, str]] = []
    handler = type("Handler", (_Recorder,), {"status": status, "location": location, "seen": seen})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


@pytest.fixture
def elsewhere() -> Iterator[tuple[str, list[dict[str, str]]]]:
    """The host a redirect points to: it must never hear from the agent."""
    server, seen = _serve(200)
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_redirects_are_never_followed_and_the_bearer_is_not_resent(
    elsewhere: tuple[str, list[dict[str, str]]], status: int
) -> None:
    target, target_seen = elsewhere
    server, seen = _serve(status, location=f"{target}/api/v1/worker/pull")
    try:
        transport = HttpTransport(f"http://127.0.0.1:{server.server_address[1]}")
        response = transport.post("/api/v1/worker/pull", {"a": 1}, token="secret-token")
    finally:
        server.shutdown()
        server.server_close()
    assert response.status == status
    assert response.body == {}
    assert seen == [{"path": "/api/v1/worker/pull", "authorization": "Bearer secret-token"}]
    assert target_seen == []


def test_a_redirect_on_starting_means_nothing_runs(
    elsewhere: tuple[str, list[dict[str, str]]],
) -> None:
    target, target_seen = elsewhere
    server, _ = _serve(307, location=target)
    try:
        spawner = FakeSpawner(FakeProcess(), [])
        runner = AttemptRunner(
            transport=HttpTransport(f"http://127.0.0.1:{server.server_address[1]}"),
            session_token="s" * 43,
            offer=an_offer(),
            lease_token=TOKEN,
            spawn=spawner,
        )
        outcome = runner.run()
    finally:
        server.shutdown()
        server.server_close()
    assert spawner.specs == []
    assert outcome.ran is False
    assert target_seen == []
    assert spec_sha256(a_spec())  # the offer was valid: only the 3xx stopped it


def test_the_cli_refuses_plain_http_to_a_remote_host(tmp_path: Any) -> None:
    credential = tmp_path / "credential"
    credential.write_text("c" * 43)
    code = main(["--url", "http://control.example.org", "--credential-file", str(credential)])
    assert code == 2


def test_a_spec_exec_refuses_outright_ends_start_failed_instead_of_killing_the_thread(
    tmp_path: Any,
) -> None:
    # Popen raises ValueError (not OSError) for a NUL in argv; the control
    # plane refuses such a spec, but the agent must still report, not crash.
    spec = a_spec(command=["echo", "a\x00b"])
    transport = ScriptedTransport({})
    runner = AttemptRunner(
        transport=transport,
        session_token="s" * 43,
        offer=an_offer(spec),
        lease_token=TOKEN,
        spawn=ProcessSpawner(tmp_path),
    )
    outcome = runner.run()
    [done] = _terminal_calls(transport)
    assert (done["phase"], done["error_code"]) == ("start_failed", "spawn_failed")
    assert done["output_tail"] == "ValueError"
    assert (outcome.ran, outcome.stopped) == (False, "spawn_failed")
