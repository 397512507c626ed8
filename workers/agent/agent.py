"""The agent: a durable inbox, one Session at a time, and loops that never wait on each other.

docs/adr/0008. Threads:

- main: at start, ends what the journal says may still run from an earlier
  agent process, opens a Session and reports those executions through the
  reconcile endpoint; then the pull loop (it pulls only when every offer in
  hand has had its `starting` answer, and counts offers in hand as taken slots);
- heartbeat: every `heartbeat_interval_s`, listing the offers held (`held`);
  obeys `cancel` and `stop`; a 401 anywhere means the Session is gone;
- fence: once no heartbeat has been accepted for the Session timeout (a
  partition, a control plane down), the Session counts as lost: every process
  it started is ended (TERM, then KILL after the grace) by this thread itself,
  whatever the runners are waiting for, before the control plane's
  lost-execution grace lets a retry start elsewhere (docs/adr/0005, 0008);
- one runner per Attempt (`AttemptRunner`), on a thread of a pool kept
  between Attempts: ACKs, spawns its process and outlives it (the child's
  parent-death signal is bound to this thread), retries its ACKs until
  answered.

A lost Session ends every process it started (its leases ended with it), and
the agent opens a new Session and reconciles before it pulls again; nothing of
the old Session is ever spawned again.
"""

from __future__ import annotations

import contextlib
import json
import queue
import secrets
import sys
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from workers.agent import AGENT_VERSION, procfs
from workers.agent.acks import AckSender
from workers.agent.journal import (
    LIVE_PHASES,
    Execution,
    Journal,
    OfferVerdict,
    Outcome,
    Phase,
)
from workers.agent.output import output_watcher
from workers.agent.protocol import (
    AGENT_STOPPING,
    CANCELLED,
    RETRY_CAP_S,
    RETRY_INITIAL_S,
    SESSION_LOST,
    STOP_GRACE_S,
    STOPPED,
    AttemptOutcome,
    AttemptRunner,
    Backoff,
    Response,
    Spawner,
    Transport,
    TransportError,
)

__all__ = ["Agent", "SessionHandle", "SessionLost", "SessionRefused", "log"]

# The pull endpoint accepts 1..16 offers per request (README "Worker API").
MAX_OFFERS_PER_PULL = 16
# The reconcile endpoint takes 1..64 executions per request.
MAX_RECONCILE_ITEMS = 64
# The heartbeat's `held` list is capped by the server (a Session has at most
# 256 slots, so an agent never holds more).
MAX_HELD = 256
# How often the fence thread looks at the time since the last accepted
# heartbeat (it also wakes exactly when the Session timeout is reached).
FENCE_CHECK_S = 0.5
# A control plane that does not say its Session timeout (older than
# `session_timeout_s` in the Session open answer) has the default one: three
# heartbeat intervals (30 s and 10 s).
DEFAULT_TIMEOUT_HEARTBEATS = 3
# Phases whose Attempt the control plane knows as started: a `stop` verdict
# for an offer still waiting for its `starting` answer is left to that answer.
_STARTED_PHASES = frozenset({Phase.STARTED, Phase.SPAWNING, Phase.RUNNING, Phase.FINISHED})


def log(event: str, **fields: Any) -> None:
    """One JSON line on stderr: ids and states only, never a spec or token."""
    # One write per line: threads log concurrently.
    sys.stderr.write(json.dumps({"event": event, **fields}, sort_keys=True) + "\n")
    sys.stderr.flush()


class SessionLost(Exception):
    """The Session was replaced or went offline (401): open a new one."""


class SessionRefused(Exception):
    """The control plane refused to open a Session (bad credential, disabled Worker)."""


class _Unanswered(Exception):
    """A 5xx or a 429: try again after a pause."""


class _Stopping(Exception):
    """The agent was told to stop while waiting for the control plane."""


@dataclass
class SessionHandle:
    token: str
    session_id: str
    generation: int = 0
    lost: threading.Event = field(default_factory=threading.Event)
    # The control plane declares a Session offline after this long without a
    # recorded heartbeat (`session_timeout_s` of the Session open answer).
    timeout_s: float = 30.0
    # time.monotonic() when the newest heartbeat the control plane accepted
    # (or the Session open) was SENT: the server recorded it later, so a fence
    # counted from here always comes before the server's own verdict.
    accepted_at: float = field(default_factory=time.monotonic)
    # Where the Session's runners send their ACKs, several per request
    # (workers/agent/acks.py); None: one request per ACK.
    acks: AckSender | None = None

    def __repr__(self) -> str:
        return f"SessionHandle(session_id={self.session_id!r}, generation={self.generation})"


class _RunnerThreads:
    """The threads Attempts run on, kept between Attempts: a runner is handed
    to an idle one, a thread is started only when none is idle, and one idle
    for `idle_s` ends. A thread started per Attempt (and its start handshake)
    cost about as much CPU as the Attempt's journal writes (issue 12).

    Work goes to a particular thread, never to a shared queue: each thread
    has an inbox of its own. `submit` takes an idle thread's inbox off the
    idle list and puts the work in it, both under the lock, or starts a new
    thread with the work already in its inbox. A thread whose idle time is
    up ends only if its inbox is still on the idle list (taken off under the
    lock); otherwise work was put in it meanwhile, and it runs that. So a
    thread is never left waiting for work that another thread took.

    A runner's thread outlives its child (the runner waits for the exit and
    reaps it), so the child's parent-death signal, bound to the thread that
    spawned it, never fires early: a thread goes back to the pool, or ends,
    only after its runner returned. The threads are daemons only if the
    thread that starts them is one (the agent's main loop on the main thread
    starts non-daemon ones): as with a thread per Attempt, the interpreter
    waits for every running child before it exits, even after an exception
    in `Agent.run`. When it does, idle threads end at once and a busy one
    ends as its runner returns (`close`, run before the interpreter waits)."""

    def __init__(
        self,
        *,
        idle_s: float = 30.0,
        start: Callable[[threading.Thread], None] = threading.Thread.start,
    ) -> None:
        self._lock = threading.Lock()
        # The inboxes of idle threads no work is promised to; the newest last
        # (taken first: the oldest run out their idle time and end).
        self._idle: list[queue.SimpleQueue[Callable[[], None] | None]] = []
        self._closed = False
        self._idle_s = idle_s
        self._start = start  # tests delay a new thread's start
        _POOLS.add(self)

    def submit(self, work: Callable[[], None]) -> None:
        with self._lock:
            if self._idle:
                self._idle.pop().put(work)
                return
        # The work is in the new thread's inbox before it starts, not in its
        # arguments: an idle thread keeps no reference to a finished work (its
        # runner, the agent, its transport and sockets).
        inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        inbox.put(work)
        self._start(threading.Thread(target=self._serve, args=(inbox,), name="runner"))

    def close(self) -> None:
        """Idle threads end now, busy ones as their runner returns; later
        work gets a thread of its own."""
        with self._lock:
            self._closed = True
            for inbox in self._idle:
                inbox.put(None)
            self._idle.clear()

    def _serve(self, inbox: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        work = inbox.get_nowait()  # put before this thread started
        while work is not None:
            work()
            work = None
            with self._lock:
                if self._closed:
                    return
                self._idle.append(inbox)
            try:
                work = inbox.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    if any(idle is inbox for idle in self._idle):
                        self._idle.remove(inbox)
                        return  # nothing was promised to this thread: it ends
                # Taken off the idle list as this thread timed out: its work
                # was put in the inbox under the lock, so it is there now.
                work = inbox.get_nowait()


def _close_pools() -> None:
    for pool in list(_POOLS):
        pool.close()


_POOLS: weakref.WeakSet[_RunnerThreads] = weakref.WeakSet()
# Before the interpreter waits for its non-daemon threads (the hook
# concurrent.futures uses): idle runner threads must not hold the exit up.
threading._register_atexit(_close_pools)  # type: ignore[attr-defined]


class RunnerThread:
    """One Attempt's run on a pooled thread, started and joined like a thread."""

    def __init__(self, pool: _RunnerThreads, target: Callable[[], None]) -> None:
        self._pool = pool
        self._target = target
        self._done = threading.Event()

    def start(self) -> None:
        self._pool.submit(self._run)

    def _run(self) -> None:
        try:
            self._target()
        finally:
            self._done.set()

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def is_alive(self) -> bool:
        return not self._done.is_set()


@dataclass
class Running:
    runner: AttemptRunner
    thread: RunnerThread
    session: SessionHandle


@dataclass
class _PendingPull:
    session_id: str
    pull_id: str
    token: str


class Agent:
    def __init__(
        self,
        *,
        transport: Transport,
        credential: str,
        slots: int,
        executor: str,
        spawn: Spawner,
        journal: Journal | None = None,
        poll_interval_s: float = 1.0,
        long_poll_s: int = 0,
        stop_grace_s: float = STOP_GRACE_S,
        retry_initial_s: float = RETRY_INITIAL_S,
        retry_cap_s: float = RETRY_CAP_S,
        rng: Callable[[], float] | None = None,
        sleep: Callable[[float], None] | None = None,
        live_output: bool = True,
        batch_acks: bool = True,
    ) -> None:
        self.transport = transport
        self.credential = credential
        self.slots = slots
        self.executor = executor
        self.spawn = spawn
        self.journal = journal if journal is not None else Journal.memory()
        self.poll_interval_s = poll_interval_s
        self.long_poll_s = long_poll_s
        self.stop_grace_s = stop_grace_s
        self.retry_initial_s = retry_initial_s
        self.retry_cap_s = retry_cap_s
        self._rng = rng
        # Send running Attempts' output as it is written (workers/agent/output.py).
        self.live_output = live_output
        # Several ACKs per request (POST acks, docs/adr/0013).
        self.batch_acks = batch_acks
        # Drain: pull nothing more, finish and report what runs, then exit.
        self.stopping = threading.Event()
        # Stop now: end every process; the journal keeps what is owed.
        self.aborting = threading.Event()
        self._closed = threading.Event()
        self._sleep = sleep
        self.session: SessionHandle | None = None
        self.heartbeat_interval_s = 10.0
        self.runners: dict[str, Running] = {}
        self.outcomes: list[AttemptOutcome] = []
        self._recent_tokens: deque[str] = deque(maxlen=16)
        self._pending_pull: _PendingPull | None = None
        self._send_held = True
        # Reentrant: the signal handlers (drain, abort) run on the main thread,
        # possibly while it holds this very lock.
        self._lock = threading.RLock()
        # Notified on every change the pull loop waits for (a runner's phase,
        # a lost Session, stopping).
        self._changed = threading.Condition(self._lock)
        self._heartbeat_now = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        self._fence_thread: threading.Thread | None = None
        self._runner_threads = _RunnerThreads()

    def _backoff(self, cap_s: float | None = None) -> Backoff:
        return Backoff(
            initial_s=self.retry_initial_s, cap_s=cap_s or self.retry_cap_s, rng=self._rng
        )

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _wait(self, timeout: float) -> None:
        """Sleep up to `timeout`, waking early on any change."""
        if self._sleep is not None:
            self._sleep(timeout)
            return
        with self._changed:
            self._changed.wait(timeout)

    @property
    def session_token(self) -> str:
        return self.session.token if self.session is not None else ""

    # --------------------------------------------------------------- stopping

    def drain(self) -> None:
        """First SIGTERM/SIGINT: pull nothing more; running Attempts finish and
        are reported; the next heartbeat (sent at once) says `draining`."""
        self.stopping.set()
        self._heartbeat_now.set()
        self._notify()

    def abort(self) -> None:
        """Second signal: end every process now (TERM, then KILL after the
        grace) and exit; the journal keeps what is owed for the next start."""
        self.aborting.set()
        self.stopping.set()
        with self._lock:
            running = list(self.runners.values())
        for entry in running:
            entry.runner.cancel(AGENT_STOPPING)
        self._notify()

    # --------------------------------------------------------------- session

    def open_session(self) -> SessionHandle:
        sent = time.monotonic()
        response = self.transport.post(
            "/api/v1/worker/sessions",
            {
                "executor_types": [self.executor],
                "labels": {},
                "slots": self.slots,
                "agent_version": AGENT_VERSION,
            },
            token=self.credential,
        )
        if _unanswered(response.status):
            raise _Unanswered(response.status)
        if response.status not in (200, 201):
            raise SessionRefused(f"{response.status} {response.error_code}")
        self.heartbeat_interval_s = float(response.body.get("heartbeat_interval_s", 10))
        timeout = response.body.get("session_timeout_s")
        session = SessionHandle(
            token=str(response.body["session_token"]),
            session_id=str(response.body["session_id"]),
            generation=int(response.body.get("generation", 0)),
            timeout_s=(
                float(timeout)
                if isinstance(timeout, int | float) and timeout > 0
                else DEFAULT_TIMEOUT_HEARTBEATS * self.heartbeat_interval_s
            ),
            accepted_at=sent,
        )
        if self.batch_acks:
            session.acks = AckSender(
                self.transport,
                token=session.token,
                # Another runner may hand over an ACK soon: worth lingering for.
                company=lambda: len(self.runners) > 1,
                log=log,
            )
        # Before any offer of it: a restarted agent ACKs what it owes under it.
        self.journal.record_session(
            session_id=session.session_id, token=session.token, timeout_s=session.timeout_s
        )
        self.session = session
        self._heartbeat_now.set()
        log("session_opened", session_id=session.session_id, generation=session.generation)
        return session

    def _open_session_patiently(self) -> SessionHandle:
        # The control plane may still be starting (scripts/dev) or restarting.
        backoff = self._backoff()
        while True:
            if self.stopping.is_set():
                raise _Stopping
            try:
                return self.open_session()
            except (TransportError, _Unanswered) as err:
                delay = backoff.next()
                log("control_plane_unreachable", call="session_open", error=str(err))
                self._pause(delay)

    def _pause(self, delay: float) -> None:
        if self._sleep is not None:
            self._sleep(delay)
        else:
            self.aborting.wait(delay)
        if self.aborting.is_set():
            raise _Stopping

    def _post(self, session: SessionHandle, path: str, body: Mapping[str, Any]) -> Response:
        response = self.transport.post(path, body, token=session.token)
        if response.status == 401:
            raise SessionLost(response.error_code)
        return response

    def _session_lost(self, session: SessionHandle, code: str) -> None:
        """Its leases ended with it: stop every process it started (they are
        reported through the reconcile under the next Session)."""
        if not session.lost.is_set():
            session.lost.set()
            log("session_lost", session_id=session.session_id, code=code)
        with self._lock:
            running = [entry for entry in self.runners.values() if entry.session is session]
        for entry in running:
            entry.runner.cancel(SESSION_LOST)
        self._notify()

    # ------------------------------------------------------------- heartbeat

    def heartbeat(self, session: SessionHandle | None = None) -> None:
        """One heartbeat with `held`; obeys `cancel` and `stop`."""
        session = session or self.session
        assert session is not None
        executions = self.journal.open_executions(session_id=session.session_id)
        # What the control plane knows as started when this beat was built:
        # only those may be stopped by its answer (see _STARTED_PHASES).
        started = {ex.offer_id for ex in executions if ex.phase in _STARTED_PHASES}
        body: dict[str, Any] = {"draining": self.stopping.is_set()}
        if self._send_held:
            body["held"] = [ex.offer_id for ex in executions][:MAX_HELD]
        sent = time.monotonic()
        response = self._post(session, "/api/v1/worker/heartbeat", body)
        if response.status == 400 and "held" in body:
            # A control plane that predates `held`: renew as before.
            sent = time.monotonic()
            legacy = self._post(session, "/api/v1/worker/heartbeat", {"draining": body["draining"]})
            if legacy.status == 200:
                self._send_held = False
                log("heartbeat_held_unsupported")
                response = legacy
        if _unanswered(response.status):
            raise _Unanswered(response.status)
        if response.status != 200:
            log("heartbeat_refused", status=response.status, code=response.error_code)
            return
        # Accepted: the Session is alive on the control plane (the fence).
        session.accepted_at = max(session.accepted_at, sent)
        for offer_id in _ids(response.body.get("cancel")):
            entry = self.runners.get(offer_id)
            if entry is not None:
                entry.runner.cancel(CANCELLED)
        for offer_id in _ids(response.body.get("stop")):
            if offer_id in started:
                self._stop(offer_id)

    def _stop(self, offer_id: str) -> None:
        """The control plane no longer counts this Attempt as ours: end it."""
        entry = self.runners.get(offer_id)
        log("attempt_stop_requested", offer_id=offer_id)
        if entry is not None:
            entry.runner.cancel(STOPPED)
            return
        execution = self.journal.get(offer_id)
        if execution is not None and execution.phase is Phase.FINISHED:
            # Only a report was owed, and nobody will take it any more.
            self.journal.mark_reported(offer_id, report="stopped")
            self._notify()

    def _heartbeat_loop(self) -> None:
        backoff = self._backoff()
        current: SessionHandle | None = None
        next_at = 0.0
        while not self._closed.is_set():
            session = self.session
            if session is None or session.lost.is_set():
                self._heartbeat_now.wait(0.1)
                self._heartbeat_now.clear()
                continue
            if session is not current:
                current, next_at = session, 0.0
                backoff.reset()
            if self._heartbeat_now.is_set():
                self._heartbeat_now.clear()
                next_at = 0.0
            delay = next_at - time.monotonic()
            if delay > 0:
                self._heartbeat_now.wait(delay)
                continue
            try:
                self.heartbeat(session)
            except SessionLost as err:
                self._session_lost(session, str(err))
                continue
            except (TransportError, _Unanswered) as err:
                # Missed beats cost the Session after the session timeout:
                # retry soon, never later than the regular cadence.
                log("control_plane_unreachable", call="heartbeat", error=str(err))
                retry = min(backoff.next(), self.heartbeat_interval_s)
                next_at = time.monotonic() + retry
                continue
            except Exception as err:  # noqa: BLE001  (the heartbeat must outlive any bug)
                log("heartbeat_error", error=type(err).__name__)
            backoff.reset()
            next_at = time.monotonic() + self.heartbeat_interval_s

    def _start_heartbeats(self) -> None:
        if self._heartbeat_thread is None:
            self._heartbeat_thread = threading.Thread(
                target=self._heartbeat_loop, name="heartbeat", daemon=True
            )
            self._heartbeat_thread.start()
        if self._fence_thread is None:
            self._fence_thread = threading.Thread(
                target=self._fence_loop, name="fence", daemon=True
            )
            self._fence_thread.start()

    # ----------------------------------------------------------------- fence

    def _fence_loop(self) -> None:
        """Watch the time since the last accepted heartbeat; fence the Session
        at its timeout. A thread of its own: a heartbeat or an ACK may hang
        in a request for its whole timeout, the fence must not wait for it."""
        while not self._closed.is_set():
            session = self.session
            wait = FENCE_CHECK_S
            if session is not None and not session.lost.is_set():
                silent = time.monotonic() - session.accepted_at
                if silent >= session.timeout_s:
                    self.fence(session, silent_s=silent)
                    continue
                wait = min(wait, session.timeout_s - silent)
            self._closed.wait(wait)

    def fence(self, session: SessionHandle, *, silent_s: float) -> None:
        """No heartbeat accepted for the Session timeout: the control plane
        declares the Session offline about now and retries its started work
        after the lost-execution grace. Like Nomad's
        `stop_after_client_disconnect`: end every process of the Session now
        (TERM, then KILL after the stop grace), journal them killed, and
        report them through the reconcile once a new Session is open.

        The processes are ended here, on this thread, all at once, from what
        the journal knows (pid and start time, process group, the
        QL_OFFER_ID marker), never waiting for a runner that may hang in a
        request. The runners stop too (they journal the outcome); the main
        loop then opens a new Session, patiently, and reconciles."""
        log(
            "session_fenced",
            session_id=session.session_id,
            silent_s=round(silent_s, 3),
            timeout_s=session.timeout_s,
        )
        # What is live is read before the runners are told (a runner ends its
        # own process too and may journal it killed first) and again after
        # (one may have spawned in between): every execution the fence ends
        # is reported as fenced.
        live = {execution.offer_id: execution for execution in self._live(session)}
        with self._lock:
            running = [entry for entry in self.runners.values() if entry.session is session]
        for entry in running:
            entry.runner.fence()
        self._session_lost(session, "heartbeat_timeout")
        live.update((execution.offer_id, execution) for execution in self._live(session))
        enders = [
            threading.Thread(target=self._end_fenced, args=(execution,), daemon=True)
            for execution in live.values()
        ]
        for thread in enders:
            thread.start()
        for thread in enders:
            thread.join()

    def _live(self, session: SessionHandle) -> list[Execution]:
        return [
            execution
            for execution in self.journal.open_executions(session_id=session.session_id)
            if execution.phase in LIVE_PHASES
        ]

    def _end_fenced(self, execution: Execution) -> None:
        killed = procfs.end_execution(
            offer_id=execution.offer_id,
            pid=execution.pid,
            start_time=execution.start_time,
            pgid=execution.pgid,
            grace_s=self.stop_grace_s,
        )
        log("execution_fenced", offer_id=execution.offer_id, killed=killed)

    # ------------------------------------------------------------------ pull

    def _occupied(self, session: SessionHandle) -> int:
        """Offers of this Session in hand, running or owing a report: each
        holds one of the Session's slots on the control plane too."""
        return self.journal.count_open(session_id=session.session_id)

    def free_slots(self) -> int:
        if self.session is None:
            return 0
        return self.slots - self._occupied(self.session)

    def _offers_answered(self) -> bool:
        """Every offer in hand has had its `starting` answer (so a pull cannot
        re-deliver one of them)."""
        with self._lock:
            return all(entry.runner.starting_answered.is_set() for entry in self.runners.values())

    def pull(self, session: SessionHandle | None = None) -> int:
        """One pull for up to the free slots; returns how many new offers started."""
        session = session or self.session
        assert session is not None
        free = self.slots - self._occupied(session)
        if free <= 0:
            return 0
        pending = self._pending_pull
        if pending is None or pending.session_id != session.session_id:
            # Kept until answered: after a lost response, the same pull_id and
            # token rebuild the same answer (docs/adr/0003).
            pending = _PendingPull(session.session_id, str(uuid.uuid4()), secrets.token_urlsafe(32))
            self._pending_pull = pending
            self._recent_tokens.append(pending.token)
        body: dict[str, Any] = {
            "pull_id": pending.pull_id,
            "lease_token": pending.token,
            "max_offers": min(free, MAX_OFFERS_PER_PULL),
        }
        path = "/api/v1/worker/pull"
        # A long poll (cluster) never outlasts half a heartbeat interval.
        wait_s = min(self.long_poll_s, int(self.heartbeat_interval_s // 2))
        if wait_s > 0:
            path += f"?wait_s={wait_s}"
        response = self._post(session, path, body)
        if _unanswered(response.status):
            raise _Unanswered(response.status)
        self._pending_pull = None
        if response.status != 200:
            log("pull_refused", status=response.status, code=response.error_code)
            return 0
        offers = response.body.get("offers")
        accepted: list[Running] = []
        for offer in offers if isinstance(offers, list) else []:
            if isinstance(offer, Mapping):
                entry = self._accept(offer, pull_token=pending.token, session=session)
                if entry is not None:
                    accepted.append(entry)
        try:
            self._start_together(session, [entry.runner for entry in accepted])
        finally:
            for entry in accepted:
                entry.thread.start()
        return len(accepted)

    def _start_together(self, session: SessionHandle, runners: list[AttemptRunner]) -> None:
        """The `starting` ACKs of a pull's new offers in one request, before their
        runners start (each would otherwise send its own): every offer is
        journaled already, and nothing is spawned before its runner has the
        answer. One that got no answer worth acting on (no answer at all, a
        5xx, a 429, a 401) is left to its runner, which sends it again."""
        acks = session.acks
        fit = [runner for runner in runners if runner.verified]
        if acks is None or len(fit) < 2:
            return
        try:
            answers = acks.post_many(
                [(runner.offer_id, runner.ack_body("starting", {})) for runner in fit]
            )
        except TransportError:
            return
        for runner, answer in zip(fit, answers, strict=True):
            if answer.status != 401 and not _unanswered(answer.status):
                runner.starting_answer = answer

    def _accept(
        self, offer: Mapping[str, Any], *, pull_token: str, session: SessionHandle
    ) -> Running | None:
        """Journal the offer first; a runner (not started yet) for a new one."""
        offer_id = offer.get("offer_id")
        if not isinstance(offer_id, str) or not offer_id:
            log("offer_malformed")
            return None
        lease = offer.get("lease")
        token = lease.get("token") if isinstance(lease, Mapping) else None
        token = token if isinstance(token, str) and token else pull_token
        digest = offer.get("spec_sha256")
        verdict = self.journal.record_offer(
            offer_id=offer_id,
            spec_sha256=digest if isinstance(digest, str) else "",
            lease_token=token,
            session_id=session.session_id,
        )
        if verdict is OfferVerdict.DUPLICATE:
            return None  # in hand, running or done already: never twice
        if verdict is OfferVerdict.CONFLICT:
            self._refuse_conflict(offer, token=token, session=session)
            return None
        runner = AttemptRunner(
            transport=self.transport,
            session_token=session.token,
            offer=offer,
            lease_token=token,
            spawn=self.spawn,
            fallback_tokens=list(reversed(self._recent_tokens)),
            journal=self.journal,
            stop_grace_s=self.stop_grace_s,
            retry_initial_s=self.retry_initial_s,
            retry_cap_s=self.retry_cap_s,
            rng=self._rng,
            on_change=self._notify,
            on_session_lost=lambda: self._session_lost(session, "ack_unauthorized"),
            watch_output=output_watcher if self.live_output else None,
            log=log,
            acks=session.acks,
        )
        # On a pooled thread, which outlives the child (the runner waits for
        # its exit): the child's parent-death signal is bound to that thread.
        thread = RunnerThread(self._runner_threads, lambda: self._run_attempt(runner))
        entry = Running(runner, thread, session)
        with self._lock:
            self.runners[offer_id] = entry
        log(
            "offer_received",
            offer_id=offer_id,
            run_id=offer.get("run_id"),
            attempt_id=offer.get("attempt_id"),
            source=offer.get("source"),
        )
        return entry

    def _refuse_conflict(
        self, offer: Mapping[str, Any], *, token: str, session: SessionHandle
    ) -> None:
        """The same offer id with another spec digest: never run it; tell the
        control plane once (start_failed), whatever it answers."""
        offer_id = str(offer["offer_id"])
        log("offer_refused", offer_id=offer_id, reason="spec_digest_conflict")
        body = {
            "phase": "start_failed",
            "lease_token": token,
            "spec_sha256": str(offer.get("spec_sha256", "")),
            "error_code": "spec_digest_conflict",
        }

        def send() -> None:
            # A courtesy: the offer is refused either way.
            with contextlib.suppress(TransportError):
                self.transport.post(
                    f"/api/v1/worker/leases/{offer_id}/ack", body, token=session.token
                )

        threading.Thread(target=send, name="refuse", daemon=True).start()

    def _run_attempt(self, runner: AttemptRunner) -> None:
        try:
            outcome = runner.run()
        except Exception as err:  # noqa: BLE001  (a bug: settle it, keep serving)
            log("attempt_error", offer_id=runner.offer_id, error=type(err).__name__)
            outcome = AttemptOutcome(runner.offer_id, ran=False, final_phase=None, stopped="error")
            execution = self.journal.get(runner.offer_id)
            if execution is not None and execution.phase is not Phase.REPORTED:
                # Nothing of it may keep running, and it must not hold a slot
                # or stay in `held`: the control plane ends it (`not_held`).
                self._settle_locally(execution)
                self.journal.mark_reported(runner.offer_id, report="error")
        # Logged before the runner leaves the table: once `run` returns (it
        # waits for every runner in the table), every line is written.
        log(
            "attempt_done",
            offer_id=outcome.offer_id,
            ran=outcome.ran,
            phase=outcome.final_phase,
            exit_code=outcome.exit_code,
            stopped=outcome.stopped,
            report=outcome.report,
        )
        with self._lock:
            self.outcomes.append(outcome)
            self.runners.pop(runner.offer_id, None)
            self._changed.notify_all()

    def _busy(self) -> bool:
        with self._lock:
            return bool(self.runners)

    def _join_runners(self, session: SessionHandle | None = None) -> None:
        with self._lock:
            threads = [
                entry.thread
                for entry in self.runners.values()
                if session is None or entry.session is session
            ]
        for thread in threads:
            thread.join()

    # ------------------------------------------------------------- reconcile

    def deliver_owed(self) -> None:
        """At start, before a new Session fences the old ones: ACK the outcome
        of every execution that ran to its end (exit code journaled) but whose
        terminal ACK the previous agent process did not get accepted, under
        the Session it ran in and with its lease token. If that Session is
        still online (the agent came back within its timeout), the Attempt
        ends with its real outcome instead of `lost` (and its Run is not run
        again). Anything else — the Session gone (401), the lease ended (409),
        no answer within the Session timeout — is left to the reconcile."""
        # Past one Session timeout from now, an old Session is offline
        # whatever it was when the previous process died.
        deadlines: dict[str, float] = {}
        for execution in self.journal.open_executions():
            if (
                execution.phase is not Phase.FINISHED
                or execution.outcome is not Outcome.EXITED
                or execution.exit_code is None
                or not execution.lease_token
            ):
                continue
            record = self.journal.session(execution.session_id)
            if record is None:
                continue  # a journal from before Session tokens were kept
            deadline = deadlines.setdefault(record.session_id, time.monotonic() + record.timeout_s)
            status = self._ack_owed(execution, record.token, deadline=deadline)
            log("owed_ack", offer_id=execution.offer_id, status=status)
            if status == "acked":
                self.journal.mark_reported(execution.offer_id, report="acked")

    def _ack_owed(self, execution: Execution, token: str, *, deadline: float) -> str:
        """`running` (a repeat is a no-op), then the terminal ACK; each sent
        again with backoff while unanswered, until `deadline`."""
        code = execution.exit_code
        base = {"lease_token": execution.lease_token, "spec_sha256": execution.spec_sha256}
        final: dict[str, Any] = {
            **base,
            "phase": "succeeded" if code == 0 else "failed",
            "exit_code": code,
        }
        if code != 0:
            final["error_code"] = "exit_nonzero"
        running = {**base, "phase": "running", "executor_handle": f"pid:{execution.pid}"}
        path = f"/api/v1/worker/leases/{execution.offer_id}/ack"
        answer = self._send_until(path, running, token=token, deadline=deadline)
        if answer is None:
            return "unanswered"
        if answer.status == 401:
            return "session_gone"
        # A `running` refused (e.g. the Attempt already ended with this very
        # outcome: the answer was lost) still lets the terminal ACK be tried:
        # a repeat of the phase the Attempt is in is a no-op.
        answer = self._send_until(path, final, token=token, deadline=deadline)
        if answer is None:
            return "unanswered"
        if answer.status == 401:
            return "session_gone"
        return "acked" if answer.status == 200 else f"refused_{answer.status}"

    def _send_until(
        self, path: str, body: Mapping[str, Any], *, token: str, deadline: float
    ) -> Response | None:
        """One request, sent again with backoff until answered; None past `deadline`."""
        backoff = self._backoff()
        while True:
            try:
                response = self.transport.post(path, body, token=token)
            except TransportError:
                pass
            else:
                if not _unanswered(response.status):
                    return response
            delay = backoff.next()
            if time.monotonic() + delay > deadline:
                return None
            self._pause(delay)

    def end_orphans(self) -> None:
        """At start, before any Session: end whatever an earlier agent process
        left running (TERM, then KILL after the grace), and record it."""
        for execution in self.journal.open_executions():
            self._settle_locally(execution)

    def _settle_locally(self, execution: Execution) -> None:
        if execution.phase in LIVE_PHASES:
            killed = procfs.end_execution(
                offer_id=execution.offer_id,
                pid=execution.pid,
                start_time=execution.start_time,
                pgid=execution.pgid,
                grace_s=self.stop_grace_s,
            )
            log("orphan_ended" if killed else "orphan_gone", offer_id=execution.offer_id)
            self.journal.mark_finished(
                execution.offer_id, outcome=Outcome.KILLED if killed else Outcome.EXITED,
                exit_code=None,
            )  # fmt: skip
        elif execution.phase in (Phase.RECEIVED, Phase.STARTED):
            # No spawning barrier: nothing of it ever ran.
            self.journal.mark_finished(
                execution.offer_id, outcome=Outcome.NOT_STARTED, exit_code=None
            )

    def reconcile(self, session: SessionHandle | None = None) -> None:
        """Report every execution of an earlier Session (retried until answered)."""
        session = session or self.session
        assert session is not None
        with self._lock:
            busy = set(self.runners)
        items: list[dict[str, Any]] = []
        for execution in self.journal.open_executions():
            if execution.session_id == session.session_id or execution.offer_id in busy:
                continue
            self._settle_locally(execution)
            settled = self.journal.get(execution.offer_id)
            if settled is None or settled.phase is not Phase.FINISHED:
                continue
            if not settled.lease_token:
                self.journal.mark_reported(settled.offer_id, report="no_token")
                continue
            items.append(
                {
                    "offer_id": settled.offer_id,
                    "lease_token": settled.lease_token,
                    "outcome": str(settled.outcome or Outcome.EXITED),
                    "exit_code": settled.exit_code,
                }
            )
        for start in range(0, len(items), MAX_RECONCILE_ITEMS):
            self._reconcile_batch(session, items[start : start + MAX_RECONCILE_ITEMS])
        self._notify()

    def _reconcile_batch(self, session: SessionHandle, batch: list[dict[str, Any]]) -> None:
        backoff = self._backoff()
        while True:
            try:
                response = self._post(session, "/api/v1/worker/reconcile", {"executions": batch})
            except TransportError as err:
                log("control_plane_unreachable", call="reconcile", error=str(err))
                self._pause(backoff.next())
                continue
            if _unanswered(response.status):
                self._pause(backoff.next())
                continue
            break
        statuses: dict[str, str] = {}
        if response.status == 200:
            results = response.body.get("results")
            for result in results if isinstance(results, list) else []:
                if isinstance(result, Mapping):
                    statuses[str(result.get("offer_id"))] = str(result.get("status"))
            default = "missing"
        elif response.status in (404, 405):
            default = "unsupported"  # a control plane without the endpoint
        else:
            log("reconcile_refused", status=response.status, code=response.error_code)
            default = "refused"
        for item in batch:
            offer_id = str(item["offer_id"])
            status = statuses.get(offer_id, default)
            self.journal.mark_reported(offer_id, report=f"reconciled:{status}")
            log(
                "execution_reconciled",
                offer_id=offer_id,
                outcome=item["outcome"],
                exit_code=item["exit_code"],
                status=status,
            )

    def _connect(self) -> SessionHandle:
        """Open a Session, start heartbeating, reconcile: ready to pull."""
        while True:
            session = self._open_session_patiently()
            self._start_heartbeats()
            try:
                self.reconcile(session)
            except SessionLost as err:
                self._session_lost(session, str(err))
                continue
            self.journal.forget_sessions(keep=session.session_id)
            return session

    # ------------------------------------------------------------------ loop

    def run(self, *, once: bool = False) -> int:
        """Serve until stopped; `once`: one pull, run its offers, exit."""
        self.journal.purge()
        self.end_orphans()
        try:
            self.deliver_owed()
            session = self._connect()
        except _Stopping:
            self._closed.set()
            return 0
        except SessionRefused as err:
            log("session_refused", error=str(err))
            self._closed.set()
            return 2
        backoff = self._backoff()
        next_pull = 0.0
        pulled = False
        try:
            while True:
                if self.aborting.is_set():
                    break
                if session.lost.is_set():
                    # Its processes are being ended by their runners.
                    self._join_runners(session)
                    if self.stopping.is_set() or once:
                        break
                    session = self._connect()
                    next_pull = 0.0
                    continue
                if self.stopping.is_set() or (once and pulled):
                    if not self._busy():
                        break
                    self._wait(0.5)
                    continue
                now = time.monotonic()
                if not self._offers_answered():
                    # ACK `starting` (or refuse) what is in hand before pulling
                    # more: a pull now would only deliver those offers again.
                    self._wait(0.05)
                    continue
                if self.slots - self._occupied(session) <= 0:
                    # Every slot taken: no pull to make, and none to put off by
                    # a poll interval — a runner that ends wakes this wait
                    # (bounded: a wake-up between the count and the wait).
                    self._wait(min(self.poll_interval_s, 0.05))
                    continue
                if now < next_pull:
                    self._wait(min(next_pull - now, 0.5))
                    continue
                try:
                    got = self.pull(session)
                except SessionLost as err:
                    self._session_lost(session, str(err))
                    continue
                except (TransportError, _Unanswered) as err:
                    # Back after an outage within the (capped, jittered) backoff.
                    delay = backoff.next()
                    log("control_plane_unreachable", call="pull", error=str(err), retry_in_s=delay)
                    next_pull = time.monotonic() + delay
                    continue
                pulled = True
                backoff.reset()
                next_pull = time.monotonic() + (0.0 if got else self.poll_interval_s)
        except _Stopping:
            pass
        except SessionRefused as err:
            # e.g. the credential was rotated while the agent ran.
            log("session_refused", error=str(err))
            return 2
        finally:
            if self.aborting.is_set():
                self.abort()
            try:
                self._join_runners()
            finally:
                # Its idle runner threads end now (a busy one, left by an
                # exception, as its runner returns: the interpreter waits).
                self._runner_threads.close()
            self._closed.set()
            self._heartbeat_now.set()
        return 0


def _unanswered(status: int) -> bool:
    """No answer worth acting on: a 5xx or a 429 (try again later)."""
    return status >= 500 or status == 429


def _ids(value: object) -> list[str]:
    return [str(item) for item in value] if isinstance(value, list) else []
