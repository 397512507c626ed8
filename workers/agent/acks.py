"""Several ACKs per request: the agent's side of `POST /api/v1/worker/acks` (docs/adr/0013).

Every runner of a Session hands its ACKs to that Session's `AckSender` and
waits for its own answer, exactly as if it had posted the single ACK itself:
the sender gives back one `Response` per ACK with the status and body the
single `POST leases/{offer_id}/ack` would have answered, so the runner's rules
(resend while unanswered, a 409 means stop, smaller bodies after a 4xx) stay
where they are and never see the batching.

Batching is group commit, without a thread of its own: the first runner
with an ACK to send while no request is in flight sends it; ACKs handed over
meanwhile queue up, and the next free caller sends all of them in one
request (at most `MAX_ITEMS` and `MAX_BODY_BYTES`). An idle agent sends each
ACK as soon as it has it; a busy one sends one request per round trip for
all its slots.

A busy agent also lingers (`LINGER_S`, 5 ms): when a request of the Session
went out within the last `BUSY_WINDOW_S`, none is in flight and another of
its runners is at work (`company`; an agent running one Run at a time never
lingers), an ACK that
gates nothing opens a request that gathers for up to the linger; the ACKs
that gate nothing handed over meanwhile join it, and it goes when the linger
is over, when it could carry no more, or when another caller sends. `starting` never waits:
its answer is what a spawn waits for. On the 2-core bench box this cut the
ACK requests per Run by about a quarter and the web tier's CPU per Run
with them (bench/README, 2026-12-05); what it costs is at most the linger on
when a `running` or an outcome reaches the control plane, and so on when
its slot is free again.

A group (`post_many`) goes in one request, its items in order: `running`
then the outcome of a process that ended before its `running` ACK was sent
costs one request, and the control plane applies them one after the other.

What the control plane cannot do is never guessed:

- a control plane without the endpoint (404/405, or an answer that is not
  one result per item) gets every ACK on its own from then on;
- a request it refuses as a whole for its body (400, 411, 413, 422: a
  stricter or smaller-capped server or proxy) is sent again ACK by ACK, so a
  body one server refuses costs only its own ACK;
- any other answer to the whole request (401, 403, 429, 5xx) is every
  item's answer, and no answer at all is every item's `TransportError`.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from workers.agent.protocol import Response, Transport, TransportError, ack_path

__all__ = [
    "ACKS_PATH",
    "BUSY_WINDOW_S",
    "LINGER_S",
    "MAX_BODY_BYTES",
    "MAX_ITEMS",
    "AckSender",
    "ack_path",
]

ACKS_PATH: Final = "/api/v1/worker/acks"
# The server's bounds (workers.api.serializers): 64 items, 1 MiB.
MAX_ITEMS: Final = 64
MAX_BODY_BYTES: Final = 1024 * 1024
# Requests of one Session in flight at once; what is handed over while they
# are queues for the next one. One batches best: on the 2-core bench box two
# cost more CPU per Run (smaller requests) for no faster drain.
MAX_IN_FLIGHT: Final = 1
# How long a busy Session's ACK that gates nothing waits for company, and
# what "busy" means: a request of the Session went out this recently.
LINGER_S: Final = 0.005
BUSY_WINDOW_S: Final = 0.05
# Phases whose answer something waits for (the spawn waits for `starting`'s).
_GATING: Final = frozenset({"starting"})
# Room for the envelope `{"acks":[…]}` and the separators.
_ENVELOPE_BYTES: Final = 64
# Answers to the whole request that mean "this body, not these ACKs".
_BODY_REFUSED: Final = frozenset({400, 411, 413, 422})
_UNSUPPORTED: Final = frozenset({404, 405})


@dataclass
class _Group:
    """ACKs one caller hands over together; answered together."""

    items: list[tuple[str, Mapping[str, Any]]]
    size: int
    responses: list[Response] | None = None
    error: TransportError | None = None
    alone: bool = False  # send these as single ACKs (on the caller's thread)
    done: bool = False


def _size(offer_id: str, body: Mapping[str, Any]) -> int:
    return len(json.dumps({"offer_id": offer_id, **body}, ensure_ascii=False).encode()) + 1


class AckSender:
    """The ACKs of one Session, several per request (see the module docstring)."""

    def __init__(
        self,
        transport: Transport,
        *,
        token: str,
        max_items: int = MAX_ITEMS,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_in_flight: int = MAX_IN_FLIGHT,
        linger_s: float = LINGER_S,
        company: Callable[[], bool] | None = None,
        log: Callable[..., None] | None = None,
    ) -> None:
        self.transport = transport
        self.token = token
        self.max_items = max(1, min(max_items, MAX_ITEMS))
        self.max_body_bytes = max_body_bytes
        self.max_in_flight = max(1, max_in_flight)
        self.linger_s = max(0.0, linger_s)
        # Whether some other runner of the Session may hand over an ACK soon
        # (None: assume so); without one, lingering waits for nobody.
        self._company = company
        self._last_sent: float | None = None  # time.monotonic() of the last request
        # When the request the lingering ACKs gather for goes (None: none gathers).
        self._linger_until: float | None = None
        self._log = log
        self._cond = threading.Condition()
        self._queue: deque[_Group] = deque()
        self._in_flight = 0
        # None: not known yet; False: the control plane has no `POST acks`.
        self.supported: bool | None = None
        # Counters (requests sent, ACKs they carried), for logs and tests.
        self.requests = 0
        self.acks = 0

    # ------------------------------------------------------------- callers

    def post(self, offer_id: str, body: Mapping[str, Any]) -> Response:
        """One ACK: the answer the single ACK endpoint would give."""
        return self.post_many([(offer_id, body)])[0]

    def post_many(self, items: Sequence[tuple[str, Mapping[str, Any]]]) -> list[Response]:
        """ACKs sent in one request, in this order; one answer each.

        Raises `TransportError` when the request got no answer (none of them
        is known to be applied: send them again, a repeat is a no-op).
        """
        group = _Group(items=list(items), size=sum(_size(o, b) for o, b in items))
        with self._cond:
            self._queue.append(group)
            # A lingering caller counts what is queued (`_linger`).
            self._cond.notify_all()
            if self._lingers(group):
                self._linger(group)
            while not group.done:
                if self._in_flight >= self.max_in_flight or not self._queue:
                    self._cond.wait()
                    continue
                batch = self._take()
                self._in_flight += 1
                self._last_sent, self._linger_until = time.monotonic(), None
                self._cond.release()
                try:
                    self._send(batch)
                finally:
                    self._cond.acquire()
                    self._in_flight -= 1
                    for sent in batch:
                        sent.done = True
                    self._cond.notify_all()
        if group.alone:
            return self._send_alone(group.items)
        if group.error is not None:
            raise group.error
        assert group.responses is not None
        return group.responses

    def _lingers(self, group: _Group) -> bool:
        """Whether this group waits for company first (module docstring);
        called holding the lock."""
        if self.linger_s <= 0 or self._in_flight or self.supported is False:
            return False
        if any(body.get("phase") in _GATING for _, body in group.items):
            return False
        if self._linger_until is not None:  # a request is gathering: join it
            return True
        if self._last_sent is None or time.monotonic() - self._last_sent >= BUSY_WINDOW_S:
            return False
        return self._company is None or self._company()

    def _linger(self, group: _Group) -> None:
        """Wait, holding the lock between waits, until the gathering request's
        linger is over, it could carry no more, or a caller sent this group or
        began a request (which then carries it or is followed by one that does)."""
        if self._linger_until is None:
            self._linger_until = time.monotonic() + self.linger_s
        while not group.done and not self._in_flight:
            if sum(len(queued.items) for queued in self._queue) >= self.max_items:
                return
            if self._linger_until is None:
                return
            left = self._linger_until - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(left)

    # ------------------------------------------------------------- sending

    def _take(self) -> list[_Group]:
        """The queue's head: as many groups as one request may carry (at least one)."""
        batch = [self._queue.popleft()]
        items, size = len(batch[0].items), _ENVELOPE_BYTES + batch[0].size
        while self._queue:
            head = self._queue[0]
            if items + len(head.items) > self.max_items:
                break
            if size + head.size > self.max_body_bytes:
                break
            batch.append(self._queue.popleft())
            items += len(head.items)
            size += head.size
        return batch

    def _send(self, batch: list[_Group]) -> None:
        """One request for the batch; sets each group's answer (never raises)."""
        items = [item for group in batch for item in group.items]
        if len(items) == 1 or self.supported is False:
            # One ACK (or an older control plane): the single endpoint, from
            # the caller's own thread, exactly as before.
            for group in batch:
                group.alone = True
            return
        body = {"acks": [{"offer_id": offer_id, **ack} for offer_id, ack in items]}
        try:
            response = self.transport.post(ACKS_PATH, body, token=self.token)
        except TransportError as err:
            for group in batch:
                group.error = err
            return
        self.requests += 1
        self.acks += len(items)
        if response.status == 200:
            answers = _answers(response.body, [offer_id for offer_id, _ in items])
            if answers is not None:
                self.supported = True
                start = 0
                for group in batch:
                    group.responses = answers[start : start + len(group.items)]
                    start += len(group.items)
                return
        if response.status in _UNSUPPORTED or response.status == 200:
            if self.supported is None or response.status == 200:
                # Never learned to use it (or the answer is not one per item):
                # every ACK goes alone from now on.
                self.supported = False
                if self._log is not None:
                    self._log("ack_batch_unsupported", status=response.status)
            for group in batch:
                group.alone = True
            return
        if response.status in _BODY_REFUSED:
            # Refused for its body as a whole: each ACK alone, so a body the
            # server will not take costs only its own ACK.
            if self._log is not None:
                self._log("ack_batch_refused", status=response.status, code=response.error_code)
            for group in batch:
                group.alone = True
            return
        # 401, 403, 429, 5xx, ...: the same answer for every ACK.
        for group in batch:
            group.responses = [response] * len(group.items)

    def _send_alone(self, items: list[tuple[str, Mapping[str, Any]]]) -> list[Response]:
        return [self.transport.post(ack_path(o), body, token=self.token) for o, body in items]


def _answers(body: Mapping[str, Any], offer_ids: list[str]) -> list[Response] | None:
    """One `Response` per item, shaped like the single ACK's answer; None
    when the body is not one well-formed result per item, in order."""
    results = body.get("results")
    if not isinstance(results, list) or len(results) != len(offer_ids):
        return None
    answers = []
    for offer_id, result in zip(offer_ids, results, strict=True):
        if not isinstance(result, Mapping) or result.get("offer_id") != offer_id:
            return None
        status = result.get("status")
        if not isinstance(status, int) or isinstance(status, bool):
            return None
        answers.append(Response(status, {k: v for k, v in result.items() if k != "status"}))
    return answers
