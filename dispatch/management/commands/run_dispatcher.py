"""`manage.py run_dispatcher`: the embedded default's dispatcher (README "Running it").

A plain loop around one bounded step, like healthchecks' `sendalerts`: one
bounded Schedule evaluation step (`schedules.services.schedules_evaluate`, so a
due fire is enqueued and then dispatched in the same iteration), a global
`dispatch_cycle`, and every `--sweep-interval` seconds the sweepers. No Celery,
no Redis: it must keep dispatching with no broker reachable. Running it beside
Celery beat (or twice) is safe — each iteration is just one more cycle.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from types import FrameType
from typing import Any, Final

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection

from dispatch.core.ports import DispatchScope
from dispatch.cycles import NullOfferNotifier, OfferNotifier, cycle_recorder, dispatch_cycle
from dispatch.notify import RedisOfferNotifier
from dispatch.sweeps import run_all_sweeps
from notifications.delivery import WebhookSender
from schedules.services import schedules_evaluate

logger = logging.getLogger("qinglong.dispatch.loop")

MAX_BACKOFF_S: Final = 30.0

Emit = Callable[[str, dict[str, Any]], None]


def _positive_float(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise ValueError(raw)
    return value


class Command(BaseCommand):
    help = (
        "Loop Schedule evaluation, global dispatch cycles and the sweepers (lease expiry, "
        "stale Sessions, "
        "over-delivered leases, DispatchCycle and ended-Session retention) for the "
        "embedded default, "
        "without Celery or Redis. SIGTERM/SIGINT stop it after the current cycle. "
        "A cycle that raises is logged and the loop continues after a back-off. "
        "Prints only redacted summaries. Exit status 0 on a clean stop."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--interval",
            type=_positive_float,
            default=1.0,
            help="Seconds between cycles (default 1.0); a cycle that made offers is "
            "followed at once by the next.",
        )
        parser.add_argument(
            "--sweep-interval",
            type=_positive_float,
            default=5.0,
            help="Seconds between sweeps (default 5.0); the first iteration sweeps.",
        )
        parser.add_argument(
            "--max-cycles",
            type=int,
            default=0,
            help="Stop after this many cycles (0 = run until signalled; for tests).",
        )
        parser.add_argument(
            "--notify",
            choices=("none", "redis"),
            default="none",
            help="Offer notification: none (Workers poll; default) or redis pub/sub.",
        )
        parser.add_argument(
            "--json", action="store_true", help="Print one JSON object per cycle/stop."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        max_cycles: int = options["max_cycles"]
        if max_cycles < 0:
            raise CommandError("--max-cycles must be >= 0")
        notifier: OfferNotifier = NullOfferNotifier()
        if options["notify"] == "redis":
            notifier = RedisOfferNotifier()
        loop = DispatchLoop(
            interval=options["interval"],
            sweep_interval=options["sweep_interval"],
            max_cycles=max_cycles,
            notifier=notifier,
            emit=self._emitter(as_json=options["json"], verbosity=options["verbosity"]),
        )
        with _stop_on_signals(loop.stop):
            totals = loop.run()
        if options["json"]:
            self.stdout.write(json.dumps({"event": "stopped", **totals}, sort_keys=True))
        else:
            self.stdout.write(
                f"dispatcher stopped: {totals['cycles']} cycles, {totals['errors']} errors, "
                f"{totals['offers']} offers, {totals['sweeps']} sweeps"
            )

    def _emitter(self, *, as_json: bool, verbosity: int) -> Emit:
        def emit(event: str, payload: dict[str, Any]) -> None:
            if as_json:
                self.stdout.write(json.dumps({"event": event, **payload}, sort_keys=True))
            elif verbosity >= 2:
                self.stdout.write(f"{event}: {payload}")

        return emit


class _stop_on_signals:
    """Route SIGTERM/SIGINT to `stop` for the loop's lifetime (main thread only)."""

    def __init__(self, stop: threading.Event) -> None:
        self._stop = stop
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only set a flag: the cycle in progress finishes and commits normally.
        self._stop.set()

    def __enter__(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


class DispatchLoop:
    """The loop outside the bounded step; `stop` ends it between cycles."""

    def __init__(
        self,
        *,
        interval: float,
        sweep_interval: float,
        max_cycles: int,
        notifier: OfferNotifier,
        emit: Emit,
    ) -> None:
        self.interval = interval
        self.sweep_interval = sweep_interval
        self.max_cycles = max_cycles
        self.notifier = notifier
        self.emit = emit
        self.stop = threading.Event()
        # Webhook deliveries go out on a thread of their own (README "Webhooks").
        self.webhooks = WebhookSender()
        self.totals: dict[str, Any] = {
            "cycles": 0,
            "errors": 0,
            "offers": 0,
            "sweeps": 0,
            "fires": 0,
            "statuses": Counter(),
        }

    def run(self) -> dict[str, Any]:
        failures = 0
        last_sweep: float | None = None
        while not self.stop.is_set():
            if last_sweep is None or time.monotonic() - last_sweep >= self.sweep_interval:
                last_sweep = time.monotonic()
                self._sweep()
            delay = self.interval
            self._kick_webhooks()
            self._evaluate_schedules()
            try:
                summary = dispatch_cycle(
                    scope=DispatchScope.global_(), notifier=self.notifier
                ).summary()
            except Exception:
                failures += 1
                self.totals["errors"] += 1
                # Back off exponentially so a database outage is not hammered;
                # the loop itself never dies of one bad cycle.
                delay = min(MAX_BACKOFF_S, self.interval * 2**failures)
                logger.exception(
                    "dispatch cycle failed",
                    extra={"event": "dispatch_cycle_failed", "backoff_s": delay},
                )
                _reset_connection()
            else:
                failures = 0
                counts = summary["counts"]
                assert isinstance(counts, dict)
                self.totals["offers"] += int(counts["offers"])
                self.totals["statuses"][summary["status"]] += 1
                self.emit("cycle", summary)
                if summary["status"] == "offered":
                    # More work is likely waiting: throughput comes from more
                    # short cycles (docs/adr/0001), not from bigger ones.
                    delay = 0.0
            self.totals["cycles"] += 1
            if self.max_cycles and self.totals["cycles"] >= self.max_cycles:
                break
            if delay:
                self.stop.wait(delay)
        self._flush_cycle_records()
        self.webhooks.stop()
        totals = dict(self.totals)
        totals["statuses"] = dict(self.totals["statuses"])
        return totals

    def _flush_cycle_records(self) -> None:
        # The repeats summed since the last summary row are written on a clean stop.
        try:
            cycle_recorder.flush()
        except Exception:
            self.totals["errors"] += 1
            logger.exception(
                "cycle summaries not written", extra={"event": "dispatch_cycle_summary_failed"}
            )

    def _evaluate_schedules(self) -> None:
        # Before the cycle, so a fire enqueued now is dispatched in this iteration.
        try:
            result = schedules_evaluate()
        except Exception:
            self.totals["errors"] += 1
            logger.exception(
                "schedule evaluation failed", extra={"event": "schedule_evaluation_failed"}
            )
            _reset_connection()
            return
        self.totals["fires"] += result.fires
        if result.examined:
            self.emit("schedules", result.summary())

    def _kick_webhooks(self) -> None:
        try:
            self.webhooks.kick()
        except Exception:
            self.totals["errors"] += 1
            logger.exception("webhook check failed", extra={"event": "webhook_check_failed"})
            _reset_connection()

    def _sweep(self) -> None:
        try:
            swept = run_all_sweeps()
        except Exception:
            self.totals["errors"] += 1
            logger.exception("sweep failed", extra={"event": "sweep_failed"})
            _reset_connection()
            return
        self.totals["sweeps"] += 1
        self.emit("sweep", swept)


def _reset_connection() -> None:
    # A broken connection must not poison every later cycle; Django reconnects
    # on next use. Never inside an outer transaction (a test wrapping us).
    if not connection.in_atomic_block:
        connection.close()
