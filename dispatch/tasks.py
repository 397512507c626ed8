"""Celery tasks of the cluster deployment (README "Running it"): one bounded step each.

Tasks take no arguments and return only redacted summaries: the cycle's
`summary()` or a dict of counts. They never see an offer's spec or token — the
cycle keeps offers in memory and hands them, content-free, to the notifier.
"""

from __future__ import annotations

from typing import Any

from celery import shared_task
from celery.signals import worker_process_shutdown, worker_shutdown

from dispatch.core.ports import DispatchScope
from dispatch.cycles import cycle_recorder, dispatch_cycle
from dispatch.notify import RedisOfferNotifier
from dispatch.sweeps import (
    prune_dispatch_cycles,
    prune_ended_sessions,
    prune_live_output,
    sweep_expired_leases,
    sweep_over_delivered_leases,
    sweep_stale_sessions,
    sweep_timed_out_attempts,
)

__all__ = [
    "dispatch_cycle_task",
    "prune_dispatch_cycles_task",
    "prune_ended_sessions_task",
    "prune_live_output_task",
    "sweep_expired_leases_task",
    "sweep_over_delivered_leases_task",
    "sweep_stale_sessions_task",
    "sweep_timed_out_attempts_task",
]

_notifier: RedisOfferNotifier | None = None


def _offer_notifier() -> RedisOfferNotifier:
    # One Redis client per worker process, created on first use.
    global _notifier
    if _notifier is None:
        _notifier = RedisOfferNotifier()
    return _notifier


@shared_task(name="dispatch.tasks.dispatch_cycle_task")
def dispatch_cycle_task() -> dict[str, object]:
    """One global dispatch cycle (honours the kill switch; records itself)."""
    result = dispatch_cycle(scope=DispatchScope.global_(), notifier=_offer_notifier())
    return result.summary()


@worker_shutdown.connect
@worker_process_shutdown.connect
def _flush_cycle_summaries(**kwargs: Any) -> None:
    """A worker (or pool) process that stops writes the cycle summaries it still holds."""
    cycle_recorder.flush()


@shared_task(name="dispatch.tasks.sweep_expired_leases_task")
def sweep_expired_leases_task() -> dict[str, int | bool]:
    return sweep_expired_leases().as_dict()


@shared_task(name="dispatch.tasks.sweep_stale_sessions_task")
def sweep_stale_sessions_task() -> dict[str, int | bool]:
    return sweep_stale_sessions().as_dict()


@shared_task(name="dispatch.tasks.sweep_over_delivered_leases_task")
def sweep_over_delivered_leases_task() -> dict[str, int | bool]:
    return sweep_over_delivered_leases().as_dict()


@shared_task(name="dispatch.tasks.sweep_timed_out_attempts_task")
def sweep_timed_out_attempts_task() -> dict[str, int | bool]:
    return sweep_timed_out_attempts().as_dict()


@shared_task(name="dispatch.tasks.prune_dispatch_cycles_task")
def prune_dispatch_cycles_task() -> dict[str, int | bool]:
    return prune_dispatch_cycles().as_dict()


@shared_task(name="dispatch.tasks.prune_ended_sessions_task")
def prune_ended_sessions_task() -> dict[str, int | bool]:
    return prune_ended_sessions().as_dict()


@shared_task(name="dispatch.tasks.prune_live_output_task")
def prune_live_output_task() -> dict[str, int | bool]:
    return prune_live_output().as_dict()
