"""Live output: a running Attempt's output, sent in bounded chunks on its own thread.

`OutputSender` reads what the process wrote since the last send (through a
`read(offset, limit)` callable: the executor's output file) and POSTs it to
`/api/v1/worker/leases/{offer_id}/output` as `{"lease_token", "seq", "chunk",
"skipped_bytes"}`, at most one request per `interval_s`. It runs beside the
Attempt's runner and never blocks heartbeats or ACKs: the runner only starts
it after the `running` ACK and closes it (a last, time-bounded flush) before
the terminal ACK, whose output tail stays the complete record of the end.

- Chunks are at most `MAX_OUTPUT_CHUNK_BYTES` counted as sent (the UTF-8
  bytes of the JSON string escaping, like the ACK tail), cut at a newline
  when one is near, never inside a UTF-8 sequence.
- Sequence numbers start at 1 and are never reused: a chunk whose request got
  no answer (transport error, 5xx, 429) is sent again with the same number,
  and the control plane stores it once.
- When the process writes faster than the chunks can go out, the sender
  skips ahead to the newest output and says how many bytes it skipped
  (`skipped_bytes`); the pages show that gap. A 409 or 404 (the lease ended),
  403 or 401 (not ours any more) stops the sender for good; a 400 drops that
  one chunk.
- The answer's `cancel_requested` cancels the Attempt at once (no need to
  wait for the next heartbeat).

Standard library only (the agent contract).
"""

from __future__ import annotations

import codecs
import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable
from typing import Final

from workers.agent.protocol import (
    CANCELLED,
    AttemptRunner,
    Process,
    Response,
    Transport,
    TransportError,
    output_tail_wire_bytes,
)

__all__ = [
    "MAX_OUTPUT_CHUNK_BYTES",
    "OUTPUT_INTERVAL_S",
    "OutputSender",
    "output_watcher",
    "split_chunk",
]

# One chunk as sent: 16 KiB of JSON-escaped UTF-8 (the control plane imports this).
MAX_OUTPUT_CHUNK_BYTES: Final = 16 * 1024
OUTPUT_INTERVAL_S: Final = 1.0
# Read from the output file at most this much per step.
_READ_BYTES: Final = 64 * 1024
# Unsent output beyond this (in the file) is skipped: only the newest is sent.
MAX_BACKLOG_BYTES: Final = 256 * 1024
# A newline this close to the end of a chunk is where it is cut.
_NEWLINE_WINDOW: Final = 4 * 1024
_FINAL_FLUSH_S: Final = 5.0
# Senders' threads are started on this tick (see `_Starter`).
_STARTER_TICK_S: Final = 0.25

Reader = Callable[[int, int], bytes]
SizeOf = Callable[[], int]


def split_chunk(text: str, limit: int = MAX_OUTPUT_CHUNK_BYTES) -> tuple[str, str]:
    """(head, rest): the longest head within `limit` as sent, cut after a newline if
    one is within the last `_NEWLINE_WINDOW` characters of it."""
    if output_tail_wire_bytes(text) <= limit:
        return text, ""
    # Every character takes at least one byte: `limit` characters is an upper bound.
    low, high = 0, min(len(text), limit)
    while low < high:  # the longest prefix that fits
        middle = (low + high + 1) // 2
        if output_tail_wire_bytes(text[:middle]) <= limit:
            low = middle
        else:
            high = middle - 1
    cut = low
    newline = text.rfind("\n", max(0, cut - _NEWLINE_WINDOW), cut)
    if newline >= 0:
        cut = newline + 1
    return text[:cut], text[cut:]


class OutputSender:
    def __init__(
        self,
        *,
        transport: Transport,
        session_token: str,
        offer_id: str,
        lease_token: str,
        read: Reader,
        size: SizeOf,
        on_cancel: Callable[[], None],
        interval_s: float = OUTPUT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.transport = transport
        self.session_token = session_token
        self.offer_id = offer_id
        self.lease_token = lease_token
        self._read = read
        self._size = size
        self._on_cancel = on_cancel
        self.interval_s = interval_s
        self._clock = clock
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.offset = 0  # bytes of the output file read so far
        self.pending = ""  # decoded, not yet accepted
        self.seq = 1  # the number of the next (or re-sent) chunk
        self.skipped = 0  # bytes skipped, reported with the next chunk
        self.sent_chunks = 0
        self.stopped = False  # the control plane refused: send nothing more
        self._closing = threading.Event()
        self._start_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- thread

    def start(self) -> None:
        """Send on a thread of its own from one interval on. Nothing is sent
        before the first interval ends, so the thread is only started then,
        if the sender is still open (`_Starter`): an Attempt that ends sooner
        (most of them) costs no thread; `close` sends its output."""
        _STARTER.start_at(self._clock() + self.interval_s, self)

    def _start_thread(self) -> None:
        with self._start_lock:
            if self._closing.is_set() or self._thread is not None:
                return
            self._thread = threading.Thread(
                target=self._loop, name=f"output-{self.offer_id[:8]}", daemon=True
            )
            self._thread.start()

    def _loop(self) -> None:
        # Started one interval after `start`: send now, then every interval.
        self._guarded_step()
        while not self._closing.wait(self.interval_s):
            self._guarded_step()

    def _guarded_step(self) -> bool:
        try:
            return self.step()
        except TransportError:
            return False  # same chunk, same number, next time
        except OSError:
            self.stopped = True  # the output file is gone: nothing more to send
            return False

    def close(self, *, flush_s: float = _FINAL_FLUSH_S) -> None:
        """Stop the thread, then send what is left for at most `flush_s` seconds."""
        with self._start_lock:
            self._closing.set()  # a thread not started yet never will be
        if self._thread is not None:
            self._thread.join()
        deadline = self._clock() + flush_s
        while not self.stopped and self._clock() < deadline:
            if not self._guarded_step():
                break

    # ------------------------------------------------------------------ step

    def _fill(self) -> None:
        if len(self.pending) >= MAX_OUTPUT_CHUNK_BYTES:
            return
        size = self._size()
        if size - self.offset > MAX_BACKLOG_BYTES:
            # Too far behind: skip to the newest output, and say so.
            target = size - MAX_BACKLOG_BYTES // 2
            self.skipped += target - self.offset + len(self.pending.encode("utf-8", "replace"))
            self.offset = target
            self.pending = ""
            self._decoder.reset()
        data = self._read(self.offset, _READ_BYTES)
        self.offset += len(data)
        self.pending += self._decoder.decode(data)

    def step(self) -> bool:
        """Send at most one chunk; True if one was accepted (more may be waiting)."""
        if self.stopped:
            return False
        self._fill()
        if not self.pending:
            return False
        chunk, rest = split_chunk(self.pending)
        response = self._post(chunk)
        if response.status == 200:
            self.pending = rest
            self.seq += 1
            self.skipped = 0
            self.sent_chunks += 1
            if response.body.get("cancel_requested"):
                self._on_cancel()
            return True
        if response.status == 400:
            # The control plane refuses this body; dropping it keeps the rest flowing.
            self.pending = rest
            self.seq += 1
            return True
        if response.status in (401, 403, 404, 409):
            self.stopped = True  # the lease is over or not ours: nobody will take more
        return False  # 429, 5xx: the same chunk, with the same number, next time

    def _post(self, chunk: str) -> Response:
        body = {
            "lease_token": self.lease_token,
            "seq": self.seq,
            "chunk": chunk,
            "skipped_bytes": self.skipped,
        }
        return self.transport.post(
            f"/api/v1/worker/leases/{self.offer_id}/output", body, token=self.session_token
        )


class _Starter:
    """Starts each sender's thread when its first interval ends, unless it was
    closed meanwhile. One daemon thread for the agent; it only starts threads
    (never a request), so no Attempt's output waits for another's. It wakes
    on a coarse tick (`_STARTER_TICK_S`), taking every sender due by then at
    once: a few wakes a second however many Attempts start, a sender's first
    chunk going out up to one tick past its interval."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: list[tuple[float, int, OutputSender]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def start_at(self, when: float, sender: OutputSender) -> None:
        when = math.ceil(when / _STARTER_TICK_S) * _STARTER_TICK_S
        with self._cond:
            heapq.heappush(self._due, (when, next(self._order), sender))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="output-starter", daemon=True
                )
                self._thread.start()
            if self._due[0][2] is sender:
                self._cond.notify()  # a new earliest: wake sooner than planned

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._due:
                    self._cond.wait()
                delay = self._due[0][0] - self._due[0][2]._clock()
                if delay > 0:
                    self._cond.wait(delay)
                    continue
                due: list[OutputSender] = []
                while self._due and self._due[0][0] <= self._due[0][2]._clock():
                    due.append(heapq.heappop(self._due)[2])
            for sender in due:
                if not sender._closing.is_set():
                    sender._start_thread()


_STARTER = _Starter()


def output_watcher(runner: AttemptRunner, process: Process) -> Callable[[], None] | None:
    """The runner's hook (`AttemptRunner(watch_output=...)`): start a sender for
    this process's output; returns its `close`. None for a process that offers
    no output file to read (`read_output`/`output_size`)."""
    read = getattr(process, "read_output", None)
    size = getattr(process, "output_size", None)
    if read is None or size is None:
        return None
    sender = OutputSender(
        transport=runner.transport,
        session_token=runner.session_token,
        offer_id=runner.offer_id,
        lease_token=runner.lease_token,
        read=read,
        size=size,
        on_cancel=lambda: runner.cancel(CANCELLED),
    )
    sender.start()
    return sender.close
