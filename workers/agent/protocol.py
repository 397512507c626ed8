"""The pure parts of the agent: digest check and the ACK sequence of one Attempt.

Everything here talks to the control plane through a `Transport` and to the
operating system through a `Spawner`, so tests drive it with fakes.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
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
    "SpecRefused",
    "Transport",
    "TransportError",
    "canonical_json",
    "clean_output_tail",
    "output_tail_wire_bytes",
    "spec_sha256",
    "verify_offer",
]

# The output tail limit, defined on what is sent (README "Worker API"): the
# tail's JSON string escaping with UTF-8 left as is (json.dumps(tail,
# ensure_ascii=False) without its quotes), in UTF-8 bytes. A quote, backslash
# or control character counts as its escape (2 or 6 bytes), so a tail within
# the limit keeps the whole ACK body under the server's 80 KiB request cap,
# however the output looks. The control plane imports this very definition.
MAX_OUTPUT_TAIL_BYTES = 64 * 1024

# NUL (a database text column refuses it) and lone surrogates (not UTF-8 at all).
_UNSENDABLE = re.compile("[\x00\ud800-\udfff]")
# The characters json.dumps(ensure_ascii=False) escapes as two bytes.
_SHORT_ESCAPES = frozenset('"\\\b\f\n\r\t')


def _wire_size(char: str) -> int:
    """The UTF-8 bytes one character takes inside a JSON string (ensure_ascii=False)."""
    code = ord(char)
    if char in _SHORT_ESCAPES:
        return 2
    if code < 0x20:
        return 6  # \u00XX
    if code < 0x80:
        return 1
    if code < 0x800:
        return 2
    if code < 0x10000:
        return 3
    return 4


def output_tail_wire_bytes(text: str) -> int:
    """The size an output tail counts for against MAX_OUTPUT_TAIL_BYTES."""
    return len(json.dumps(text, ensure_ascii=False).encode("utf-8", "surrogatepass")) - 2


def clean_output_tail(text: str, limit: int = MAX_OUTPUT_TAIL_BYTES) -> str:
    """The tail as the control plane stores it: U+FFFD for NUL and lone
    surrogates, then the newest characters whose escaped size fits `limit`.

    The cut falls between two characters (never inside a UTF-8 sequence or an
    escape); replacing never grows the size (a NUL counts 6, U+FFFD 3).
    """
    cleaned = _UNSENDABLE.sub("\ufffd", text)
    if output_tail_wire_bytes(cleaned) <= limit:
        return cleaned
    total = 0
    start = len(cleaned)
    while start > 0:
        total += _wire_size(cleaned[start - 1])
        if total > limit:
            break
        start -= 1
    return cleaned[start:]


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
    """README "Worker API": sorted keys, no insignificant whitespace, UTF-8."""
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


class SpecRefused(Exception):
    """The executor will not run this spec (e.g. its cwd leaves the work
    directory): the Attempt ends `start_failed` with `code` as its error code."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


# Pauses before the terminal ACK is sent again after a 5xx, a 429 or a
# transport error: four tries over about 7 seconds.
TERMINAL_ACK_RETRY_DELAYS_S = (1.0, 2.0, 4.0)


def _transient(status: int) -> bool:
    return status >= 500 or status == 429


def _body_refused(status: int) -> bool:
    """A 4xx about the request itself: worth a smaller body (409: the lease is gone)."""
    return 400 <= status < 500 and status not in (409, 429)


class AckRejected(Exception):
    """The control plane refused an ACK: stop the Attempt (README "Worker API")."""

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
        sleep: Callable[[float], None] | None = None,
    ) -> None:
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
        self._sleep = sleep or time.sleep
        # Set by the heartbeat loop on a cancel verdict, or by any 409.
        self.stop = threading.Event()
        self.stop_reason = ""
        self.timed_out = False

    def cancel(self, reason: str) -> None:
        self.stop_reason = self.stop_reason or reason
        self.stop.set()

    def _post_ack(self, phase: str, extra: Mapping[str, Any]) -> Response:
        body = {
            "phase": phase,
            "lease_token": self.lease_token,
            "spec_sha256": self.offer["spec_sha256"],
            **extra,
        }
        return self.transport.post(
            f"/api/v1/worker/leases/{self.offer_id}/ack", body, token=self.session_token
        )

    def _accepted(self, phase: str, response: Response) -> Response:
        if response.status != 200:
            raise AckRejected(phase, response)
        if response.body.get("cancel_requested"):
            self.cancel("cancelled")
        return response

    def _ack(self, phase: str, **extra: Any) -> Response:
        return self._accepted(phase, self._post_ack(phase, extra))

    def _post_patiently(self, phase: str, extra: Mapping[str, Any]) -> Response:
        """One terminal ACK body, sent again after a pause on 5xx, 429 or a
        transport error (the same phase twice is a no-op on the server).

        Bounded: a control plane that stays away longer is issue 10's job (a
        journal replayed later); here the last error goes back to the caller.
        """
        for delay in TERMINAL_ACK_RETRY_DELAYS_S:
            try:
                response = self._post_ack(phase, extra)
            except TransportError:
                pass
            else:
                if not _transient(response.status):
                    return response
            self._sleep(delay)
        return self._post_ack(phase, extra)

    def _ack_final(self, phase: str, **extra: Any) -> Response:
        """A terminal ACK: a finished process is always reported.

        Everything but the outcome is a courtesy. The tail is cleaned and
        trimmed to its limit first; if the control plane still refuses the
        body with a 4xx other than 409 (a 400 from a stricter server, a 413
        from a proxy with a smaller cap, a 411, a 422, ...), the ACK goes again
        without the tail, then with only what every server requires (the phase,
        lease token, spec digest and exit code). A 409 means the lease is gone:
        stop. Without this the Attempt would stay `running` until the agent
        stopped, then end `failed` although the process had exited 0.
        """
        if "output_tail" in extra:
            extra["output_tail"] = clean_output_tail(str(extra["output_tail"]))
        bodies = [extra]
        without_tail = {k: v for k, v in extra.items() if k != "output_tail"}
        minimal = {k: v for k, v in extra.items() if k == "exit_code"}
        for body in (without_tail, minimal):
            if body != bodies[-1]:
                bodies.append(body)
        for body in bodies[:-1]:
            response = self._post_patiently(phase, body)
            if not _body_refused(response.status):
                return self._accepted(phase, response)
        return self._accepted(phase, self._post_patiently(phase, bodies[-1]))

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
            return self._start_failed(outcome, "spec_digest_mismatch")
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
        except SpecRefused as err:
            # The executor's own checks (e.g. a cwd outside its work directory).
            return self._start_failed(outcome, err.code)
        except (OSError, ValueError) as err:
            # ValueError: what exec refuses before trying (e.g. a NUL in argv).
            return self._start_failed(outcome, "spawn_failed", output_tail=type(err).__name__)
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
        return self._start_failed(outcome, "cancelled", stopped=self.stop_reason)

    def _start_failed(
        self, outcome: AttemptOutcome, code: str, *, stopped: str | None = None, **extra: Any
    ) -> AttemptOutcome:
        """Nothing ran: ACK `start_failed` with `code` (a 409 just ends it)."""
        try:
            self._ack_final("start_failed", error_code=code, **extra)
            outcome.acks.append("start_failed")
            outcome.final_phase = "start_failed"
        except AckRejected:
            pass
        outcome.stopped = code if stopped is None else stopped
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
