"""The agent's live output sender (workers/agent/output.py), against a fake control plane.

It sends what the process wrote in numbered chunks within the size limit, re-sends
a chunk with the same number until it is answered, stops for good when the lease
is gone, skips ahead (and says so) when it falls behind, and cancels the Attempt
when the answer says the Run was cancelled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest

from workers.agent.output import (
    MAX_BACKLOG_BYTES,
    MAX_OUTPUT_CHUNK_BYTES,
    OutputSender,
    output_watcher,
    split_chunk,
)
from workers.agent.protocol import Response, TransportError, output_tail_wire_bytes


class FakeOutput:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    def read_output(self, offset: int, limit: int) -> bytes:
        return bytes(self.data[offset : offset + limit])

    def output_size(self) -> int:
        return len(self.data)


class FakeTransport:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.answers: list[Response | Exception] = []

    def post(self, path: str, body: Mapping[str, Any], *, token: str) -> Response:
        assert path.endswith("/output") and token == "session-token"
        self.requests.append(dict(body))
        answer = self.answers.pop(0) if self.answers else Response(200, {"stored": True})
        if isinstance(answer, Exception):
            raise answer
        return answer


def make_sender(output: FakeOutput, transport: FakeTransport, cancels: list[str] | None = None):
    cancelled = cancels if cancels is not None else []
    return OutputSender(
        transport=transport,
        session_token="session-token",
        offer_id="f" * 64,
        lease_token="lease-token",
        read=output.read_output,
        size=output.output_size,
        on_cancel=lambda: cancelled.append("cancelled"),
        interval_s=0.01,
    )


def drain(sender: OutputSender) -> None:
    while sender.step():
        pass


def test_output_goes_out_in_numbered_chunks_with_the_lease_token():
    output, transport = FakeOutput(), FakeTransport()
    sender = make_sender(output, transport)
    assert sender.step() is False  # nothing written yet: no request
    assert transport.requests == []
    output.write(b"one\n")
    drain(sender)
    output.write(b"two\nthree\n")
    drain(sender)
    assert [(r["seq"], r["chunk"]) for r in transport.requests] == [
        (1, "one\n"),
        (2, "two\nthree\n"),
    ]
    assert all(r["lease_token"] == "lease-token" for r in transport.requests)
    assert all(r["skipped_bytes"] == 0 for r in transport.requests)


def test_big_output_is_cut_within_the_limit_at_newlines():
    output, transport = FakeOutput(), FakeTransport()
    sender = make_sender(output, transport)
    line = ("x" * 99 + "\n").encode()
    output.write(line * 500)  # 50,000 bytes
    drain(sender)
    chunks = [r["chunk"] for r in transport.requests]
    assert "".join(chunks) == (line * 500).decode()
    assert len(chunks) >= 4
    for chunk in chunks:
        assert output_tail_wire_bytes(chunk) <= MAX_OUTPUT_CHUNK_BYTES
    assert all(chunk.endswith("\n") for chunk in chunks)
    assert [r["seq"] for r in transport.requests] == list(range(1, len(chunks) + 1))


def test_a_utf8_sequence_split_by_a_read_is_never_split_in_the_text():
    output, transport = FakeOutput(), FakeTransport()
    sender = make_sender(output, transport)
    data = "héllo wörld ✓\n".encode()
    output.write(data[:2])  # ends inside "é"
    drain(sender)
    output.write(data[2:])
    drain(sender)
    assert "".join(r["chunk"] for r in transport.requests) == "héllo wörld ✓\n"
    assert "\ufffd" not in "".join(r["chunk"] for r in transport.requests)


def test_split_chunk_counts_escapes_as_sent():
    text = '"' * (MAX_OUTPUT_CHUNK_BYTES // 2 + 10)  # each quote is 2 bytes as sent
    head, rest = split_chunk(text)
    assert output_tail_wire_bytes(head) <= MAX_OUTPUT_CHUNK_BYTES
    assert head + rest == text and rest


@pytest.mark.parametrize(
    "failure", [TransportError("URLError"), Response(503, {}), Response(429, {})]
)
def test_an_unanswered_chunk_is_sent_again_with_the_same_number(failure):
    output, transport = FakeOutput(), FakeTransport()
    sender = make_sender(output, transport)
    output.write(b"important\n")
    transport.answers = [failure]
    assert sender._guarded_step() is False
    drain(sender)
    assert [(r["seq"], r["chunk"]) for r in transport.requests] == [
        (1, "important\n"),
        (1, "important\n"),
    ]


@pytest.mark.parametrize("status", [401, 403, 404, 409])
def test_a_lease_that_is_gone_stops_the_sender_for_good(status):
    output, transport = FakeOutput(), FakeTransport()
    sender = make_sender(output, transport)
    output.write(b"a\n")
    transport.answers = [Response(status, {"error": {"code": "lease_released"}})]
    assert sender.step() is False
    output.write(b"b\n")
    assert sender.step() is False
    assert len(transport.requests) == 1
    assert sender.stopped


def test_a_refused_body_is_dropped_and_the_rest_keeps_flowing():
    output, transport = FakeOutput(), FakeTransport()
    sender = make_sender(output, transport)
    output.write(b"bad\n")
    transport.answers = [Response(400, {})]
    drain(sender)
    output.write(b"good\n")
    drain(sender)
    assert [(r["seq"], r["chunk"]) for r in transport.requests] == [(1, "bad\n"), (2, "good\n")]


def test_falling_far_behind_skips_to_the_newest_output_and_says_how_much():
    output, transport = FakeOutput(), FakeTransport()
    sender = make_sender(output, transport)
    total = MAX_BACKLOG_BYTES * 4
    output.write(b"y" * (total - 6) + b"\nlast\n")
    drain(sender)
    first = transport.requests[0]
    assert first["skipped_bytes"] > 0
    sent = sum(len(r["chunk"].encode()) for r in transport.requests)
    assert first["skipped_bytes"] + sent == total
    assert "".join(r["chunk"] for r in transport.requests).endswith("\nlast\n")
    assert all(r["skipped_bytes"] == 0 for r in transport.requests[1:])


def test_a_cancel_in_the_answer_cancels_the_attempt():
    output, transport, cancels = FakeOutput(), FakeTransport(), []
    sender = make_sender(output, transport, cancels)
    output.write(b"x\n")
    transport.answers = [Response(200, {"stored": True, "cancel_requested": True})]
    sender.step()
    assert cancels == ["cancelled"]


def test_the_thread_sends_on_its_own_and_close_flushes_the_rest():
    output, transport = FakeOutput(), FakeTransport()
    sender = make_sender(output, transport)
    sender.start()
    output.write(b"early\n")
    import time

    deadline = time.monotonic() + 5
    while not transport.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    output.write(b"at the end\n")
    sender.close()
    assert "".join(r["chunk"] for r in transport.requests) == "early\nat the end\n"


def test_the_runner_hook_needs_a_readable_output_file():
    class NoFile:
        pass

    assert output_watcher(object(), NoFile()) is None


def test_requests_are_plain_json():
    output, transport = FakeOutput(), FakeTransport()
    sender = make_sender(output, transport)
    output.write(b"\x00\xff binary\n")
    drain(sender)
    json.dumps(transport.requests)
    assert transport.requests[0]["chunk"] == "\x00\ufffd binary\n"


def test_a_sender_closed_within_its_first_interval_starts_no_thread_and_sends_its_output():
    # Nothing is sent before the first interval ends: an Attempt that ends
    # sooner costs no thread (issue 12); its output goes in the last flush.
    import time

    output, transport = FakeOutput(), FakeTransport()
    sender = OutputSender(
        transport=transport,
        session_token="session-token",
        offer_id="e" * 64,
        lease_token="lease-token",
        read=output.read_output,
        size=output.output_size,
        on_cancel=lambda: None,
        interval_s=0.05,
    )
    sender.start()
    output.write(b"quick\n")
    sender.close()
    time.sleep(0.2)  # past the interval: the thread is still never started
    assert sender._thread is None
    assert [r["chunk"] for r in transport.requests] == ["quick\n"]
    assert [r["seq"] for r in transport.requests] == [1]


def test_a_sender_still_open_after_its_first_interval_sends_on_its_own_thread():
    import time

    output, transport = FakeOutput(), FakeTransport()
    sender = make_sender(output, transport)
    output.write(b"first\n")
    sender.start()
    deadline = time.monotonic() + 5
    while not transport.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sender._thread is not None
    assert transport.requests[0]["chunk"] == "first\n"
    sender.close()
