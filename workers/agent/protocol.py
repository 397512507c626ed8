"""The pure parts of the agent: digest check and the ACK sequence of one Attempt.

Everything here talks to the control plane through a `Transport` and to the
operating system through a `Spawner`, so tests drive it with fakes.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "MAX_OUTPUT_TAIL_BYTES",
    "AckRejected",
    "AttemptOutcome",
    "AttemptRunner",
    "Process",
    "Response",
    "Spawner",
    "Transport",
    "TransportError",
    "canonical_json",
    "clean_output_tail",
    "spec_sha256",
    "verify_offer",
]

# DESIGN §4: an ACK's output tail is at most 64 KiB.
MAX_OUTPUT_TAIL_BYTES = 64 * 1024

# NUL (a database text column refuses it) and lone surrogates (not UTF-8 at all).
_UNSENDABLE = re.compile("[\x00\ud800-\udfff]")


def clean_output_tail(text: str, limit: int = MAX_OUTPUT_TAIL_BYTES) -> str:
    """The tail as the control plane stores it: U+FFFD for NUL and lone
    surrogates, at most `limit` bytes of UTF-8 (the oldest characters go)."""
    cleaned = _UNSENDABLE.sub("\ufffd", text)
    encoded = cleaned.encode("utf-8")
    if len(encoded) <= limit:
        return cleaned
    # Cut at a character boundary: a leading partial sequence is dropped.
    return encoded[-limit:].decode("utf-8", "ignore")


class TransportError(Exception):
    """The control plane could not be reached (no HTTP status)."""


@dataclass(frozen=True)
class Response:
    status: int
    body: Mapping[str, Any]

    @property
    def error_code(self) -> str:
        error = self.body.get("error")
        return str(error.get("code", "")) if isinstance(error, Mapping) else ""


class Transport(Protocol):
    def post(self, path: str, body: Mapping[str, Any], *, token: str) -> Response: ...


class Process(Protocol):
    pid: int

    def wait(self, timeout: float | None = None) -> int: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...
    def poll(self) -> int | None: ...
    def output_tail(self, limit: int) -> str: ...


class Spawner(Protocol):
    def __call__(self, spec: Mapping[str, Any]) -> Process: ...


def canonical_json(spec: Mapping[str, Any]) -> bytes:
    """DESIGN §4: sorted keys, no insignificant whitespace, UTF-8."""
    return json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(
        "utf-8"
    )


def spec_sha256(spec: Mapping[str, Any]) -> str:
    return hashlib.sha256(canonical_json(spec)).hexdigest()


def verify_offer(offer: Mapping[str, Any]) -> bool:
    """The spec must hash to the digest the lease was claimed with."""
    spec = offer.get("spec")
    declared = offer.get("spec_sha256")
    if not isinstance(spec, Mapping) or not isinstance(declared, str):
        return False
    return spec_sha256(spec) == declared


class AckRejected(Exception):
    """The control plane refused an ACK: stop the Attempt (DESIGN §4)."""

    def __init__(self, phase: str, response: Response) -> None:
        super().__init__(f"{phase} ACK refused: {response.status} {response.error_code}")
        self.phase = phase
        self.response = response


@dataclass
class AttemptOutcome:
    offer_id: str
    ran: bool  # a process was spawned
    final_phase: str | None  # the terminal phase ACKed, if any
    exit_code: int | None = None
    stopped: str = ""  # why the agent stopped early ("", "cancelled", "conflict", …)
    acks: list[str] = field(default_factory=list)


class AttemptRunner:
    """Runs one offer: verify → ACK starting → spawn → ACK running → wait → ACK outcome."""

    def __init__(
        self,
        *,
        transport: Transport,
        session_token: str,
        offer: Mapping[str, Any],
        lease_token: str,
        spawn: Spawner,
        fallback_tokens: Sequence[str] = (),
        poll_interval_s: float = 0.2,
        clock: Callable[[], float] | None = None,
    ) -> None:
        import time

        self.transport = transport
        self.session_token = session_token
        self.offer = offer
        self.offer_id = str(offer["offer_id"])
        self.lease_token = lease_token
        # A re-delivered pull claim comes with "token": null (the server cannot
        # reproduce a Worker's token): one of our recent pull tokens is it.
        self.fallback_tokens = [t for t in fallback_tokens if t != lease_token]
        self.spawn = spawn
        self.poll_interval_s = poll_interval_s
        self.clock = clock or time.monotonic
        # Set by the heartbeat loop on a cancel verdict, or by any 409.
        self.stop = threading.Event()
        self.stop_reason = ""
        self.timed_out = False

    def cancel(self, reason: str) -> None:
        self.stop_reason = self.stop_reason or reason
        self.stop.set()

    def _ack(self, phase: str, **extra: Any) -> Response:
        body = {
            "phase": phase,
            "lease_token": self.lease_token,
            "spec_sha256": self.offer["spec_sha256"],
            **extra,
        }
        response = self.transport.post(
            f"/api/v1/worker/leases/{self.offer_id}/ack", body, token=self.session_token
        )
        if response.status != 200:
            raise AckRejected(phase, response)
        if response.body.get("cancel_requested"):
            self.cancel("cancelled")
        return response

    def _ack_final(self, phase: str, **extra: Any) -> Response:
        """A terminal ACK; its output tail must never be why it fails.

        The tail is cleaned first; if the control plane still answers 400 (an
        older server, a stricter proxy), the ACK goes once more without it: the
        outcome matters, the tail is a courtesy. Without this the Attempt would
        stay `running` until its lease expired.
        """
        if "output_tail" in extra:
            extra["output_tail"] = clean_output_tail(str(extra["output_tail"]))
        try:
            return self._ack(phase, **extra)
        except AckRejected as err:
            if err.response.status != 400 or "output_tail" not in extra:
                raise
        del extra["output_tail"]
        return self._ack(phase, **extra)

    def _ack_starting(self) -> None:
        candidates = [self.lease_token, *self.fallback_tokens]
        for index, token in enumerate(candidates):
            self.lease_token = token
            try:
                self._ack("starting")
                return
            except AckRejected as err:
                wrong_token = err.response.error_code == "lease_token_invalid"
                if not wrong_token or index == len(candidates) - 1:
                    raise

    def run(self) -> AttemptOutcome:
        outcome = AttemptOutcome(offer_id=self.offer_id, ran=False, final_phase=None)
        if not verify_offer(self.offer):
            # Never run a spec that is not the one the lease was granted for.
            try:
                self._ack("start_failed", error_code="spec_digest_mismatch")
                outcome.acks.append("start_failed")
                outcome.final_phase = "start_failed"
            except AckRejected:
                pass
            outcome.stopped = "spec_digest_mismatch"
            return outcome
        try:
            # The starting ACK comes BEFORE the spawn: a 409 here (expired,
            # revoked, cancelled) means this Worker must not run it at all.
            self._ack_starting()
            outcome.acks.append("starting")
        except AckRejected as err:
            outcome.stopped = err.response.error_code or "conflict"
            return outcome
        if self.stop.is_set():
            return self._finish_unstarted(outcome)
        spec = self.offer["spec"]
        try:
            process = self.spawn(spec)
        except OSError as err:
            try:
                self._ack_final(
                    "start_failed", error_code="spawn_failed", output_tail=type(err).__name__
                )
                outcome.acks.append("start_failed")
                outcome.final_phase = "start_failed"
            except AckRejected:
                pass
            outcome.stopped = "spawn_failed"
            return outcome
        outcome.ran = True
        try:
            self._ack("running", executor_handle=f"pid:{process.pid}")
            outcome.acks.append("running")
        except AckRejected as err:
            self.cancel(err.response.error_code or "conflict")
        exit_code = self._wait(process, timeout_s=float(spec.get("timeout_s", 3600)))
        outcome.exit_code = exit_code
        outcome.stopped = self.stop_reason
        if self.stop_reason and self.stop_reason != "cancelled":
            # A 409 fenced us off the lease: nobody will accept an outcome.
            return outcome
        ok = exit_code == 0 and not self.stop_reason and not self.timed_out
        phase = "succeeded" if ok else "failed"
        extra: dict[str, Any] = {
            "exit_code": exit_code,
            "output_tail": process.output_tail(MAX_OUTPUT_TAIL_BYTES),
        }
        if self.stop_reason == "cancelled":
            extra["error_code"] = "cancelled"
        elif self.timed_out:
            extra["error_code"] = "timeout"
        elif phase == "failed":
            extra["error_code"] = "exit_nonzero"
        try:
            self._ack_final(phase, **extra)
            outcome.acks.append(phase)
            outcome.final_phase = phase
        except AckRejected as err:
            outcome.stopped = outcome.stopped or err.response.error_code or "conflict"
        return outcome

    def _finish_unstarted(self, outcome: AttemptOutcome) -> AttemptOutcome:
        # Cancelled between the starting ACK and the spawn: report, spawn nothing.
        try:
            self._ack("start_failed", error_code="cancelled")
            outcome.acks.append("start_failed")
            outcome.final_phase = "start_failed"
        except AckRejected:
            pass
        outcome.stopped = self.stop_reason
        return outcome

    def _wait(self, process: Process, *, timeout_s: float) -> int:
        deadline = self.clock() + timeout_s
        while True:
            code = process.poll()
            if code is not None:
                return code
            if self.stop.is_set() or self.clock() >= deadline:
                # A timeout is an ordinary failure, ACKed as such.
                self.timed_out = not self.stop.is_set()
                return _stop_process(process)
            self.stop.wait(self.poll_interval_s)


def _stop_process(process: Process) -> int:
    process.terminate()
    try:
        return process.wait(timeout=5)
    except Exception:  # noqa: BLE001  (TimeoutExpired or a fake's equivalent)
        process.kill()
        return process.wait(timeout=5)
