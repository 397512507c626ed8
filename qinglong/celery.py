"""The Celery app of the cluster deployment (README "Running it").

Beat triggers one bounded global `dispatch_cycle` every second plus the
sweepers; every task is single-shot and takes no arguments. Overlapping runs
— two beats, a redelivered message, the `run_dispatcher` loop beside Celery —
are safe by construction: each is just one more cycle or sweep, and every
claim and transition underneath is a row-locked compare-and-set. Nothing here
is a lock made by asking the broker what is running (STYLE.md "Avoid").
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "qinglong.settings")

app = Celery("qinglong")
# Every CELERY_* Django setting configures the app (CELERY_BROKER_URL, …).
app.config_from_object("django.conf:settings", namespace="CELERY")

# Seconds a beat message may wait in the queue before a worker drops it: a
# backlog of stale cycles after an outage is useless work, the next beat
# brings a fresh one.
_CYCLE_EXPIRES_S = 5
_SWEEP_EXPIRES_S = 30

app.conf.update(
    # JSON only, whatever the settings say: no pickle ever crosses the broker
    # (a pickled offer would carry the spec; DispatchCycleResult refuses it anyway).
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    event_serializer="json",
    # task_acks_late stays False (ack on receipt), deliberately. Each task is a
    # short, idempotent, argument-free step that beat re-fires within seconds,
    # so redelivering one after a crash buys nothing; with Redis, late acks
    # would redeliver it only after the visibility timeout (an hour), as a
    # stale extra cycle. Correctness never depends on either choice: a
    # redelivered or duplicated cycle is just another cycle, and claims are CAS.
    task_acks_late=False,
    task_reject_on_worker_lost=False,
    # One message at a time per worker process: a prefetched backlog of
    # 1-second cycles would run late and in bursts.
    worker_prefetch_multiplier=1,
    # Keep Django's LOGGING (JSON + the one redaction filter) in the worker:
    # Celery would otherwise replace the root handlers with its own.
    worker_hijack_root_logger=False,
    # Bounded tasks: a cycle or sweep that hangs (a stuck DB socket) is killed.
    task_soft_time_limit=20,
    task_time_limit=30,
    beat_schedule={
        "dispatch-cycle": {
            "task": "dispatch.tasks.dispatch_cycle_task",
            "schedule": 1.0,
            "options": {"expires": _CYCLE_EXPIRES_S},
        },
        "evaluate-schedules": {
            # One bounded step over the Schedules due now (README "Schedules");
            # a duplicate beat is one more step: every fire has one ledger row.
            "task": "schedules.tasks.evaluate_schedules_task",
            "schedule": 1.0,
            "options": {"expires": _CYCLE_EXPIRES_S},
        },
        "deliver-webhooks": {
            # One bounded step of due webhook deliveries (README "Webhooks"); a
            # duplicate beat finds them claimed: each try is sent once.
            "task": "notifications.tasks.deliver_webhooks_task",
            "schedule": 2.0,
            "options": {"expires": _CYCLE_EXPIRES_S},
        },
        "prune-webhook-deliveries": {
            "task": "notifications.tasks.prune_webhook_deliveries_task",
            "schedule": 300.0,
            "options": {"expires": _SWEEP_EXPIRES_S},
        },
        "sweep-expired-leases": {
            "task": "dispatch.tasks.sweep_expired_leases_task",
            "schedule": 5.0,
            "options": {"expires": _SWEEP_EXPIRES_S},
        },
        "sweep-stale-sessions": {
            "task": "dispatch.tasks.sweep_stale_sessions_task",
            "schedule": 10.0,
            "options": {"expires": _SWEEP_EXPIRES_S},
        },
        "sweep-over-delivered-leases": {
            "task": "dispatch.tasks.sweep_over_delivered_leases_task",
            "schedule": 5.0,
            "options": {"expires": _SWEEP_EXPIRES_S},
        },
        "sweep-timed-out-attempts": {
            "task": "dispatch.tasks.sweep_timed_out_attempts_task",
            "schedule": 5.0,
            "options": {"expires": _SWEEP_EXPIRES_S},
        },
        "prune-dispatch-cycles": {
            "task": "dispatch.tasks.prune_dispatch_cycles_task",
            # Every pull records a cycle (a Worker polling each second adds
            # 86,400 rows a day); one bounded prune (<= 5,000 rows) a minute
            # keeps up with ~80 such Workers.
            "schedule": 60.0,
            "options": {"expires": 30},
        },
        "prune-live-output": {
            # The output of Attempts ended over QL_OUTPUT_RETENTION_DAYS ago;
            # one bounded prune (<= 50 Attempts) every five minutes.
            "task": "dispatch.tasks.prune_live_output_task",
            "schedule": 300.0,
            "options": {"expires": _SWEEP_EXPIRES_S},
        },
        "prune-ended-sessions": {
            "task": "dispatch.tasks.prune_ended_sessions_task",
            # Session churn is far slower than pulls: one bounded prune
            # (<= 1,000 Sessions) every five minutes keeps up with it.
            "schedule": 300.0,
            "options": {"expires": _SWEEP_EXPIRES_S},
        },
    },
)
app.autodiscover_tasks()
