"""The pure parts of the agent: digest check and the ACK sequence of one Attempt.

Everything here talks to the control plane through a `Transport` and to the
operating system through a `Spawner`, so tests drive it with fakes.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from workers.agent.journal import Journal, Outcome, Phase

__all__ = [
    "MAX_OUTPUT_TAIL_BYTES",
    "Abandoned",
    "AckPoster",
    "AckRejected",
    "AttemptOutcome",
    "AttemptRunner",
    "Backoff",
    "Process",
    "Response",
    "Spawner",
    "SpecRefused",
    "Transport",
    "TransportError",
    "ack_path",
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


class AckPoster(Protocol):
    """Where a runner hands its ACKs (workers.agent.acks.AckSender): one
    answer per ACK, as the single ACK endpoint would give it."""

    def post_many(self, items: Sequence[tuple[str, Mapping[str, Any]]]) -> list[Response]: ...


class Process(Protocol):
    """One Attempt's process: `poll`/`wait` see the main process exit without
    reaping it; `release` ends what is left of its process group and reaps."""

    pid: int
    pgid: int
    start_time: int | None  # /proc/<pid>/stat field 22; None where unknown

    def wait(self, timeout: float | None = None) -> int: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...
    def poll(self) -> int | None: ...
    def release(self, grace_s: float) -> int: ...
    def output_tail(self, limit: int) -> str: ...
    def close(self) -> None: ...


class Spawner(Protocol):
    def __call__(self, spec: Mapping[str, Any], *, offer_id: str = "") -> Process: ...


def ack_path(offer_id: str) -> str:
    """The single ACK endpoint of one offer."""
    return f"/api/v1/worker/leases/{offer_id}/ack"


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


# Pauses between tries of a request the control plane did not answer (a
# transport error, a 5xx, a 429): exponential from RETRY_INITIAL_S, capped at
# RETRY_CAP_S, each with jitter, for as long as it takes (docs/adr/0008).
RETRY_INITIAL_S = 0.5
RETRY_CAP_S = 10.0
# How long a process group gets between SIGTERM and SIGKILL.
STOP_GRACE_S = 5.0


class Backoff:
    """Exponential backoff with "equal jitter": half the step fixed, half random.

    The fixed half keeps a crowd of agents from hammering a control plane that
    just came back; the random half spreads them out.
    """

    def __init__(
        self,
        *,
        initial_s: float = RETRY_INITIAL_S,
        cap_s: float = RETRY_CAP_S,
        rng: Callable[[], float] | None = None,
    ) -> None:
        self.initial_s = initial_s
        self.cap_s = cap_s
        self._rng = rng or random.random
        self._tries = 0

    def next(self) -> float:
        step = min(self.cap_s, self.initial_s * 2.0 ** min(self._tries, 30))
        self._tries += 1
        return step / 2 + self._rng() * step / 2

    def reset(self) -> None:
        self._tries = 0


def _transient(status: int) -> bool:
    return status >= 500 or status == 429


def _body_refused(status: int) -> bool:
    """A 4xx about the request itself: worth a smaller body (409: the lease is gone)."""
    return 400 <= status < 500 and status not in (401, 409, 429)


class AckRejected(Exception):
    """The control plane refused an ACK: stop the Attempt (README "Worker API")."""

    def __init__(self, phase: str, response: Response) -> None:
        super().__init__(f"{phase} ACK refused: {response.status} {response.error_code}")
        self.phase = phase
        self.response = response


class Abandoned(Exception):
    """Nothing more is sent under this Session: it is gone (401), or the agent
    is stopping. What is owed stays in the journal for the reconcile."""


# Why an Attempt's process is stopped early. Those that also end all talk
# under the Session; the outcome goes through the reconcile endpoint instead.
SESSION_LOST = "session_lost"
AGENT_STOPPING = "agent_stopping"
ABANDON_REASONS = frozenset({SESSION_LOST, AGENT_STOPPING})
CANCELLED = "cancelled"  # the Run was cancelled: reported as failed/cancelled
STOPPED = "stopped"  # the heartbeat said stop (the lease is no longer ours)


@dataclass
class AttemptOutcome:
    offer_id: str
    ran: bool  # a process was spawned
    final_phase: str | None  # the terminal phase ACKed, if any
    exit_code: int | None = None
    stopped: str = ""  # why the agent stopped early ("", "cancelled", "conflict", …)
    acks: list[str] = field(default_factory=list)
    report: str = ""  # how the control plane learned the outcome ("" = still owed)


# The longest a runner waits without looking at its process when the
# executor wakes it at the exit (`Process.on_exit`): a safety net, not a poll.
WATCHED_WAIT_S = 5.0


class AttemptRunner:
    """Runs one offer: verify → ACK starting → spawn → ACK running → wait → ACK outcome.

    Each step is journaled before the agent acts on it (docs/adr/0008), and
    every ACK the control plane does not answer is sent again with backoff
    until it answers (a 409 is an answer: stop, never resend) or the Session
    is gone, whatever the outage costs.
    """

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
        journal: Journal | None = None,
        stop_grace_s: float = STOP_GRACE_S,
        retry_initial_s: float = RETRY_INITIAL_S,
        retry_cap_s: float = RETRY_CAP_S,
        rng: Callable[[], float] | None = None,
        on_change: Callable[[], None] | None = None,
        on_session_lost: Callable[[], None] | None = None,
        watch_output: Callable[[AttemptRunner, Process], Callable[[], None] | None] | None = None,
        log: Callable[..., None] | None = None,
        acks: AckPoster | None = None,
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
        self._sleep = sleep
        # Without a journal (tests, embedding) the records go nowhere.
        self.journal = journal if journal is not None else Journal.memory()
        self.stop_grace_s = stop_grace_s
        self._retry = (retry_initial_s, retry_cap_s, rng)
        self._on_change = on_change
        self._on_session_lost = on_session_lost
        self._log = log
        # The Session's ACK sender (several ACKs per request); None: each ACK
        # is its own request.
        self._acks = acks
        # Live output (workers/agent/output.py): started once the process runs;
        # returns the call that sends the rest and stops it.
        self._watch_output = watch_output
        # Set by the heartbeat loop on a cancel or stop verdict, by any 409,
        # by a lost Session or by the agent stopping.
        self.stop = threading.Event()
        self.stop_reason = ""
        # Wakes the wait for the process: set with `stop` and when the
        # process exits (when its executor can tell, `Process.on_exit`).
        self._wake = threading.Event()
        # Set when nothing more may be sent under this Session.
        self.abandoned = threading.Event()
        self.abandon_reason = ""
        # Set once the starting ACK is answered (or will never be sent): the
        # agent pulls for more only when every offer in hand has its answer.
        self.starting_answered = threading.Event()
        # The control plane's answer to this offer's `starting` ACK, when the
        # agent sent it with the rest of its pull before starting this runner
        # (`Agent.pull`): 200, or a refusal the runner acts on as its own.
        self.starting_answer: Response | None = None
        self.timed_out = False
        self.phase = Phase.RECEIVED
        self._stopped_by_agent = False
        # The agent's fence ended this Attempt's processes from another thread.
        self._fenced = False
        self._running_acked = False
        self._verified: bool | None = None

    @property
    def verified(self) -> bool:
        """Whether the spec hashes to the offer's digest (worked out once:
        the offer is the one received and is never changed)."""
        if self._verified is None:
            self._verified = verify_offer(self.offer)
        return self._verified

    # ------------------------------------------------------------ control

    def cancel(self, reason: str) -> None:
        """Stop the process (and, for a lost Session or a stopping agent,
        stop talking to the control plane too)."""
        self.stop_reason = self.stop_reason or reason
        if reason in ABANDON_REASONS:
            self.abandon_reason = self.abandon_reason or reason
            self.abandoned.set()
        self.stop.set()
        self._wake.set()

    def fence(self) -> None:
        """The agent fenced the Session (no heartbeat accepted for its
        timeout) and ends this Attempt's processes itself: stop, talk no more
        under the Session, and journal a death by signal as killed."""
        self._fenced = True
        self.cancel(SESSION_LOST)

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()

    def _set_phase(self, phase: Phase) -> None:
        self.phase = phase
        self._changed()

    def _pause(self, delay: float) -> None:
        if self._sleep is not None:
            self._sleep(delay)
        else:
            self.abandoned.wait(delay)
        if self.abandoned.is_set():
            raise Abandoned(self.abandon_reason)

    def _backoff(self) -> Backoff:
        initial, cap, rng = self._retry
        return Backoff(initial_s=initial, cap_s=cap, rng=rng)

    # ------------------------------------------------------------ requests

    def ack_body(self, phase: str, extra: Mapping[str, Any]) -> dict[str, Any]:
        spec_digest = str(self.offer.get("spec_sha256", ""))
        return {
            "phase": phase,
            "lease_token": self.lease_token,
            "spec_sha256": spec_digest,
            **extra,
        }

    def _post_acks(self, acks: Sequence[tuple[str, Mapping[str, Any]]]) -> list[Response]:
        """ACKs of this offer, in order, in one request when a sender batches them."""
        if self.abandoned.is_set():
            raise Abandoned(self.abandon_reason)
        bodies = [(self.offer_id, self.ack_body(phase, extra)) for phase, extra in acks]
        if self._acks is not None:
            responses = self._acks.post_many(bodies)
        else:
            responses = [
                self.transport.post(ack_path(offer_id), body, token=self.session_token)
                for offer_id, body in bodies
            ]
        if any(response.status == 401 for response in responses):
            # The Session is gone: its leases ended with it. The agent opens a
            # new one and reports this execution through the reconcile.
            self.cancel(SESSION_LOST)
            if self._on_session_lost is not None:
                self._on_session_lost()
            raise Abandoned(SESSION_LOST)
        return responses

    def _post_ack(self, phase: str, extra: Mapping[str, Any]) -> Response:
        return self._post_acks([(phase, extra)])[0]

    def _accepted(self, phase: str, response: Response) -> Response:
        if response.status != 200:
            raise AckRejected(phase, response)
        if response.body.get("cancel_requested"):
            self.cancel(CANCELLED)
        return response

    def _post_until_answered(self, phase: str, extra: Mapping[str, Any]) -> Response:
        """One ACK body, sent again after a pause on a transport error, a 5xx
        or a 429 (the same phase twice is a no-op on the server) until the
        control plane answers; Abandoned if the Session goes or the agent stops."""
        return self._post_all_until_answered([(phase, extra)])[0]

    def _post_all_until_answered(
        self, acks: Sequence[tuple[str, Mapping[str, Any]]]
    ) -> list[Response]:
        """ACKs sent together (in one request when batched), all sent again
        while any of them is unanswered (a repeat of an applied phase is a no-op)."""
        backoff = self._backoff()
        tries = 0
        phases = "+".join(phase for phase, _ in acks)
        while True:
            tries += 1
            try:
                responses = self._post_acks(acks)
            except TransportError as err:
                failure = str(err)
            else:
                unanswered = [r.status for r in responses if _transient(r.status)]
                if not unanswered:
                    return responses
                failure = str(unanswered[0])
            delay = backoff.next()
            if self._log is not None and (tries == 1 or tries % 10 == 0):
                # The first failure, then every tenth: an outage is visible
                # without a line per try.
                self._log(
                    "ack_retry",
                    offer_id=self.offer_id,
                    phase=phases,
                    error=failure,
                    tries=tries,
                    retry_in_s=round(delay, 3),
                )
            self._pause(delay)

    def _ack_final(self, phase: str, *, first: Response | None = None, **extra: Any) -> Response:
        """A terminal ACK: a finished process is always reported.

        Everything but the outcome is a courtesy. The tail is cleaned and
        trimmed to its limit first; if the control plane still refuses the
        body with a 4xx other than 409 (a 400 from a stricter server, a 413
        from a proxy with a smaller cap, a 411, a 422, ...), the ACK goes again
        without the tail, then with only what every server requires (the phase,
        lease token, spec digest and exit code). A 409 means the lease is gone:
        stop. Without this the Attempt would stay `running` until the agent
        stopped, then end `failed` although the process had exited 0.
        `first`: the answer the full body already got (sent with `running`).
        """
        if "output_tail" in extra:
            extra["output_tail"] = clean_output_tail(str(extra["output_tail"]))
        bodies = [extra]
        without_tail = {k: v for k, v in extra.items() if k != "output_tail"}
        minimal = {k: v for k, v in extra.items() if k == "exit_code"}
        for body in (without_tail, minimal):
            if body != bodies[-1]:
                bodies.append(body)
        for index, body in enumerate(bodies[:-1]):
            if index == 0 and first is not None:
                response = first
            else:
                response = self._post_until_answered(phase, body)
            if not _body_refused(response.status):
                return self._accepted(phase, response)
        if first is not None and len(bodies) == 1:
            return self._accepted(phase, first)
        return self._accepted(phase, self._post_until_answered(phase, bodies[-1]))

    def _ack_starting(self) -> None:
        candidates = [self.lease_token, *self.fallback_tokens]
        for index, token in enumerate(candidates):
            self.lease_token = token
            if index == 0 and self.starting_answer is not None:
                # Sent by the agent with its pull's other offers (one request).
                response = self.starting_answer
            else:
                response = self._post_until_answered("starting", {})
            if response.status == 200:
                if index:
                    # The reconcile after a crash needs the token that works.
                    self.journal.set_lease_token(self.offer_id, token)
                self._accepted("starting", response)
                return
            wrong_token = response.error_code == "lease_token_invalid"
            if not wrong_token or index == len(candidates) - 1:
                raise AckRejected("starting", response)

    # ------------------------------------------------------------ journal

    def _finish(self, outcome: Outcome, exit_code: int | None = None) -> None:
        self.journal.mark_finished(self.offer_id, outcome=outcome, exit_code=exit_code)
        self._set_phase(Phase.FINISHED)

    def _settle(self, outcome: AttemptOutcome, report: str) -> AttemptOutcome:
        self.journal.mark_reported(self.offer_id, report=report)
        outcome.report = report
        self._set_phase(Phase.REPORTED)
        return outcome

    def _settle_refusal(self, outcome: AttemptOutcome, response: Response) -> AttemptOutcome:
        # A 409: the lease is gone, never resend. Any other answer that is not
        # a success will not change by resending the same thing either.
        return self._settle(outcome, "conflict" if response.status == 409 else "refused")

    # ------------------------------------------------------------ the Attempt

    def run(self) -> AttemptOutcome:
        outcome = AttemptOutcome(offer_id=self.offer_id, ran=False, final_phase=None)
        try:
            return self._run(outcome)
        except Abandoned:
            # The journal keeps what is owed; the reconcile reports it.
            outcome.stopped = self.abandon_reason or self.stop_reason
            return outcome
        finally:
            self.starting_answered.set()
            self._changed()

    def _run(self, outcome: AttemptOutcome) -> AttemptOutcome:
        if not self.verified:
            # Never run a spec that is not the one the lease was granted for.
            self.starting_answered.set()
            self._finish(Outcome.NOT_STARTED)
            return self._start_failed(outcome, "spec_digest_mismatch")
        try:
            # The starting ACK comes BEFORE the spawn: a 409 here (expired,
            # revoked, cancelled) means this Worker must not run it at all.
            self._ack_starting()
            outcome.acks.append("starting")
        except AckRejected as err:
            self._finish(Outcome.NOT_STARTED)
            outcome.stopped = err.response.error_code or "conflict"
            return self._settle_refusal(outcome, err.response)
        except Abandoned:
            self._finish(Outcome.NOT_STARTED)
            raise
        stopped = self.stop.is_set()
        if stopped:
            self.journal.mark_started(self.offer_id)
        else:
            # Started, and the crash barrier, in one write: committed before
            # the process can exist (`spawning` implies `started`).
            self.journal.mark_spawning(self.offer_id)
        self.starting_answered.set()
        self._set_phase(Phase.STARTED if stopped else Phase.SPAWNING)
        if stopped:
            if self.abandoned.is_set():
                self._finish(Outcome.NOT_STARTED)
                raise Abandoned(self.abandon_reason)
            return self._finish_unstarted(outcome)
        spec = self.offer["spec"]
        try:
            process = self.spawn(spec, offer_id=self.offer_id)
        except SpecRefused as err:
            # The executor's own checks (e.g. a cwd outside its work directory).
            self._finish(Outcome.NOT_STARTED)
            return self._start_failed(outcome, err.code)
        except (OSError, ValueError) as err:
            # ValueError: what exec refuses before trying (e.g. a NUL in argv).
            self._finish(Outcome.NOT_STARTED)
            return self._start_failed(outcome, "spawn_failed", output_tail=type(err).__name__)
        outcome.ran = True
        try:
            try:
                self.journal.mark_running(
                    self.offer_id,
                    pid=process.pid,
                    start_time=process.start_time,
                    pgid=process.pgid,
                )
                self._set_phase(Phase.RUNNING)
                close_output = self._watch_output(self, process) if self._watch_output else None
                try:
                    exit_code = self._supervise(
                        process, timeout_s=float(spec.get("timeout_s", 3600))
                    )
                finally:
                    if close_output is not None:
                        close_output()  # the last output goes before the terminal ACK
            except BaseException:
                # A bug or an interrupt here must not leave the process behind.
                process.kill()
                process.release(0)
                self._finish(Outcome.KILLED)
                raise
            killed = self._stopped_by_agent or (self._fenced and exit_code < 0)
            self._finish(Outcome.KILLED if killed else Outcome.EXITED, exit_code)
            outcome.exit_code = exit_code
            outcome.stopped = self.stop_reason
            return self._report(outcome, process)
        finally:
            process.close()

    def _report(self, outcome: AttemptOutcome, process: Process) -> AttemptOutcome:
        if self.abandoned.is_set():
            raise Abandoned(self.abandon_reason)
        if self.stop_reason and self.stop_reason not in (CANCELLED, STOPPED):
            # A 409 fenced us off the lease: nobody will accept an outcome.
            return self._settle(outcome, "conflict")
        ok = outcome.exit_code == 0 and not self.stop_reason and not self.timed_out
        phase = "succeeded" if ok else "failed"
        extra: dict[str, Any] = {
            "exit_code": outcome.exit_code,
            "output_tail": clean_output_tail(process.output_tail(MAX_OUTPUT_TAIL_BYTES)),
        }
        if self.stop_reason in (CANCELLED, STOPPED):
            extra["error_code"] = self.stop_reason
        elif self.timed_out:
            extra["error_code"] = "timeout"
        elif phase == "failed":
            extra["error_code"] = "exit_nonzero"
        first: Response | None = None
        if self._running_acked:
            outcome.acks.append("running")
        elif self._acks is not None:
            # `succeeded`/`failed` are legal only after `running`: a process
            # that ended before its `running` ACK went out is reported with
            # both in one request, applied in this order.
            running, first = self._post_all_until_answered(
                [("running", self._running_body(process)), (phase, extra)]
            )
            if running.status == 200 or first.status == 200:
                # (The outcome alone accepted: `running` was applied by an
                # earlier try whose answer was lost.)
                self._running_acked = True
                outcome.acks.append("running")
            else:
                outcome.stopped = outcome.stopped or running.error_code or "conflict"
                return self._settle_refusal(outcome, running)
        else:
            response = self._post_until_answered("running", self._running_body(process))
            if response.status != 200:
                outcome.stopped = outcome.stopped or response.error_code or "conflict"
                return self._settle_refusal(outcome, response)
            self._running_acked = True
            outcome.acks.append("running")
        try:
            self._ack_final(phase, first=first, **extra)
        except AckRejected as err:
            outcome.stopped = outcome.stopped or err.response.error_code or "conflict"
            return self._settle_refusal(outcome, err.response)
        outcome.acks.append(phase)
        outcome.final_phase = phase
        return self._settle(outcome, "acked")

    @staticmethod
    def _running_body(process: Process) -> dict[str, Any]:
        return {"executor_handle": f"pid:{process.pid}"}

    def _try_running_ack(self, process: Process, backoff: Backoff) -> float:
        """One try of the `running` ACK; returns the pause before the next one
        (0: done). Never blocks the wait for more than one request."""
        try:
            response = self._post_ack("running", self._running_body(process))
        except TransportError:
            return backoff.next()
        except Abandoned:
            return 0.0  # cancel(SESSION_LOST) already stopped the process
        if _transient(response.status):
            return backoff.next()
        try:
            self._accepted("running", response)
        except AckRejected as err:
            self.cancel(err.response.error_code or "conflict")
            return 0.0
        self._running_acked = True
        return 0.0

    def _supervise(self, process: Process, *, timeout_s: float) -> int:
        """Wait for the process (ACKing `running` meanwhile), stop it on a
        verdict or its timeout, then end what it left in its process group.

        With a batching ACK sender the `running` ACK waits one poll interval:
        a process that ends sooner is reported with `running` and its outcome
        in one request (`_report`). Its exit wakes this wait at once when the
        executor tells (`Process.on_exit` returning True): then nothing is
        polled, the wait lasts until the exit, a verdict (`cancel` wakes it),
        the next `running` try or the timeout (at most `WATCHED_WAIT_S`, a
        safety net); otherwise the process is polled every poll interval."""
        deadline = self.clock() + timeout_s
        backoff = self._backoff()
        first_try = self.clock() + (self.poll_interval_s if self._acks is not None else 0.0)
        next_running_try: float | None = first_try
        on_exit = getattr(process, "on_exit", None)
        watched = callable(on_exit) and on_exit(self._wake.set) is True
        while True:
            # Cleared before looking: an exit or a verdict from here on
            # still ends the wait below.
            self._wake.clear()
            code = process.poll()
            if code is not None:
                break
            if self.stop.is_set() or self.clock() >= deadline:
                # A timeout is an ordinary failure, ACKed as such.
                self.timed_out = not self.stop.is_set()
                self._stopped_by_agent = True
                _stop_process(process, self.stop_grace_s)
                break
            if next_running_try is not None and self.clock() >= next_running_try:
                pause = self._try_running_ack(process, backoff)
                next_running_try = self.clock() + pause if pause else None
                continue
            wait = WATCHED_WAIT_S if watched else self.poll_interval_s
            if watched:
                wait = min(wait, max(0.0, deadline - self.clock()))
            if next_running_try is not None:
                wait = max(0.0, min(wait, next_running_try - self.clock()))
            self._wake.wait(wait)
        return process.release(self.stop_grace_s)

    def _finish_unstarted(self, outcome: AttemptOutcome) -> AttemptOutcome:
        # Cancelled between the starting ACK and the spawn: report, spawn nothing.
        self._finish(Outcome.NOT_STARTED)
        return self._start_failed(outcome, "cancelled", stopped=self.stop_reason)

    def _start_failed(
        self, outcome: AttemptOutcome, code: str, *, stopped: str | None = None, **extra: Any
    ) -> AttemptOutcome:
        """Nothing ran: ACK `start_failed` with `code` (a 409 just ends it)."""
        outcome.stopped = code if stopped is None else stopped
        try:
            self._ack_final("start_failed", error_code=code, **extra)
        except AckRejected as err:
            return self._settle_refusal(outcome, err.response)
        outcome.acks.append("start_failed")
        outcome.final_phase = "start_failed"
        return self._settle(outcome, "acked")


def _stop_process(process: Process, grace_s: float) -> int:
    process.terminate()
    try:
        return process.wait(timeout=grace_s)
    except Exception:  # noqa: BLE001  (TimeoutExpired or a fake's equivalent)
        process.kill()
        return process.wait(timeout=grace_s)
