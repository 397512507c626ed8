"""The agent loop: one Session, heartbeats, pulls, one thread per running Attempt."""

from __future__ import annotations

import json
import secrets
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from workers.agent import AGENT_VERSION
from workers.agent.protocol import (
    AttemptOutcome,
    AttemptRunner,
    Response,
    Spawner,
    Transport,
    TransportError,
)

__all__ = ["Agent", "SessionLost", "log"]

# The pull endpoint accepts 1..16 offers per request (README "Worker API").
MAX_OFFERS_PER_PULL = 16


def log(event: str, **fields: Any) -> None:
    """One JSON line on stderr: ids and states only, never a spec or token."""
    print(json.dumps({"event": event, **fields}, sort_keys=True), file=sys.stderr, flush=True)


class SessionLost(Exception):
    """The Session was replaced or went offline (401): open a new one."""


class Agent:
    def __init__(
        self,
        *,
        transport: Transport,
        credential: str,
        slots: int,
        executor: str,
        spawn: Spawner,
        poll_interval_s: float = 1.0,
        long_poll_s: int = 0,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        self.transport = transport
        self.credential = credential
        self.slots = slots
        self.executor = executor
        self.spawn = spawn
        self.poll_interval_s = poll_interval_s
        self.long_poll_s = long_poll_s
        self.stopping = threading.Event()
        self._sleep = sleep or self.stopping.wait
        self.session_token = ""
        self.session_id = ""
        self.heartbeat_interval_s = 10.0
        self.runners: dict[str, tuple[AttemptRunner, threading.Thread]] = {}
        self.outcomes: list[AttemptOutcome] = []
        self._recent_tokens: deque[str] = deque(maxlen=16)
        self._lock = threading.Lock()

    # --------------------------------------------------------------- session

    def open_session(self) -> None:
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
        if response.status != 201 and response.status != 200:
            raise RuntimeError(f"session open refused: {response.status} {response.error_code}")
        self.session_token = str(response.body["session_token"])
        self.session_id = str(response.body["session_id"])
        self.heartbeat_interval_s = float(response.body.get("heartbeat_interval_s", 10))
        log("session_opened", session_id=self.session_id, generation=response.body["generation"])

    def _open_session_patiently(self) -> None:
        # The control plane may still be starting (scripts/dev) or restarting.
        delay = 0.5
        while True:
            try:
                self.open_session()
                return
            except TransportError as err:
                log("control_plane_unreachable", error=str(err), retry_in_s=delay)
                if self.stopping.is_set():
                    raise
                self._sleep(delay)
                delay = min(delay * 2, 10.0)

    def _session_call(self, path: str, body: dict[str, Any]) -> Response:
        response = self.transport.post(path, body, token=self.session_token)
        if response.status == 401:
            raise SessionLost(response.error_code)
        return response

    def heartbeat(self) -> None:
        response = self._session_call(
            "/api/v1/worker/heartbeat", {"draining": self.stopping.is_set()}
        )
        if response.status != 200:
            log("heartbeat_refused", status=response.status, code=response.error_code)
            return
        for offer_id in response.body.get("cancel", []):
            entry = self.runners.get(str(offer_id))
            if entry is not None:
                entry[0].cancel("cancelled")

    # ------------------------------------------------------------------ pull

    def free_slots(self) -> int:
        self._reap()
        return self.slots - len(self.runners)

    def pull(self) -> int:
        """One pull for up to the free slots (the API takes at most 16 per pull)."""
        free = self.free_slots()
        if free <= 0:
            return 0
        pull_token = secrets.token_urlsafe(32)
        body: dict[str, Any] = {
            "pull_id": str(uuid.uuid4()),
            "lease_token": pull_token,
            "max_offers": min(free, MAX_OFFERS_PER_PULL),
        }
        self._recent_tokens.append(pull_token)
        path = "/api/v1/worker/pull"
        # A long poll (cluster) never outlasts half a heartbeat interval: the
        # same loop keeps the Session alive.
        wait_s = min(self.long_poll_s, int(self.heartbeat_interval_s // 2))
        if wait_s > 0:
            path += f"?wait_s={wait_s}"
        try:
            response = self._session_call(path, body)
        except TransportError:
            # The response may be lost after the claim committed: replaying the
            # same pull_id + token rebuilds the same answer (docs/adr/0003).
            response = self._session_call(path, body)
        if response.status != 200:
            log("pull_refused", status=response.status, code=response.error_code)
            return 0
        offers = response.body.get("offers", [])
        for offer in offers:
            self._start(offer, pull_token=pull_token)
        return len(offers)

    def _start(self, offer: dict[str, Any], *, pull_token: str) -> None:
        offer_id = str(offer["offer_id"])
        if offer_id in self.runners:
            return  # already running it (a re-delivery of our own lease)
        lease = offer.get("lease") or {}
        token = lease.get("token") or pull_token
        runner = AttemptRunner(
            transport=self.transport,
            session_token=self.session_token,
            offer=offer,
            lease_token=token,
            spawn=self.spawn,
            fallback_tokens=list(reversed(self._recent_tokens)),
        )
        thread = threading.Thread(target=self._run, args=(runner,), name=f"attempt-{offer_id[:8]}")
        self.runners[offer_id] = (runner, thread)
        log(
            "offer_received",
            offer_id=offer_id,
            run_id=offer.get("run_id"),
            attempt_id=offer.get("attempt_id"),
            source=offer.get("source"),
        )
        thread.start()

    def _run(self, runner: AttemptRunner) -> None:
        try:
            outcome = runner.run()
        except TransportError as err:
            outcome = AttemptOutcome(
                runner.offer_id, ran=False, final_phase=None, stopped=f"transport:{err}"
            )
        with self._lock:
            self.outcomes.append(outcome)
        log(
            "attempt_done",
            offer_id=outcome.offer_id,
            ran=outcome.ran,
            phase=outcome.final_phase,
            exit_code=outcome.exit_code,
            stopped=outcome.stopped,
        )

    def _reap(self) -> None:
        for offer_id, (_, thread) in list(self.runners.items()):
            if not thread.is_alive():
                thread.join()
                del self.runners[offer_id]

    # ------------------------------------------------------------------ loop

    def run(self, *, once: bool = False) -> int:
        """Serve until stopped; `once`: one pull, run its offers, exit."""
        self._open_session_patiently()
        next_heartbeat = 0.0
        pulled = False
        while True:
            try:
                if time.monotonic() >= next_heartbeat:
                    self.heartbeat()
                    next_heartbeat = time.monotonic() + self.heartbeat_interval_s
                if once and pulled:
                    if self.free_slots() == self.slots:
                        return 0
                elif not self.stopping.is_set():
                    got = self.pull()
                    pulled = True
                    if got:
                        continue
                elif self.free_slots() == self.slots:
                    return 0
            except SessionLost as err:
                log("session_lost", code=str(err))
                # Our leases ended with the Session; running Attempts get 409s
                # and stop. A fresh Session takes the next generation.
                for runner, _ in self.runners.values():
                    runner.cancel("session_lost")
                self._open_session_patiently()
                next_heartbeat = 0.0
                continue
            except TransportError as err:
                log("control_plane_unreachable", error=str(err))
            self._sleep(self.poll_interval_s if not once else 0.2)
