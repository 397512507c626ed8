"""Canary specs never leave through the operations surface (docs/adr/0003).

Celery task results and the messages beat sends, DispatchCycle rows, logs at
DEBUG, and the output of dispatch_once / audit_leases / run_dispatcher.
"""

from __future__ import annotations

import io
import json
import logging

import pytest
from django.core.management import call_command
from django.test import override_settings

from dispatch import tasks
from dispatch.models import DispatchCycle
from leases.models import RunLease
from qinglong.celery import app
from qinglong.testing import (
    CANARY_COMMAND,
    CANARY_CWD,
    CANARY_ENV,
    canary_definition,
    make_project,
    make_worker,
    open_session,
)
from runs.services import run_enqueue, task_create
from schedules import tasks as schedule_tasks

pytestmark = pytest.mark.django_db(transaction=True)

CANARIES = (CANARY_COMMAND, CANARY_ENV, CANARY_CWD)


@pytest.fixture
def debug_logs(caplog):
    # The project loggers do not propagate to the root (settings.LOGGING), so
    # attach pytest's capturing handler to them directly.
    logger = logging.getLogger("qinglong")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="qinglong")
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)


@pytest.fixture
def canary_runs():
    opened = open_session(make_worker(slots=4)[0])
    task = task_create(project=make_project(), name="canary", definition=canary_definition())
    return opened, [run_enqueue(task=task) for _ in range(3)]


def assert_clean(text: str, *secrets: str) -> None:
    for secret in (*CANARIES, *secrets):
        assert secret not in text


def rendered_logs(caplog) -> str:
    formatter = logging.Formatter("%(message)s %(args)s")
    return "\n".join(
        formatter.format(r) + " " + json.dumps(vars(r), default=str) for r in caplog.records
    )


@override_settings(CELERY_BROKER_URL="redis://127.0.0.1:1/0")
def test_celery_dispatch_task_result_and_messages_carry_no_spec_or_token(canary_runs, debug_logs):
    opened, _ = canary_runs
    result = tasks.dispatch_cycle_task.apply()
    summary = result.get()
    assert summary["status"] == "offered"
    assert summary["counts"]["offers"] == 3
    assert_clean(json.dumps(summary), opened.token)
    # What beat sends: no arguments at all, so nothing can ride along.
    for entry in app.conf.beat_schedule.values():
        assert not entry.get("args") and not entry.get("kwargs")
    assert schedule_tasks.evaluate_schedules_task.name in app.tasks  # registered
    sent = {
        name: app.tasks[name].apply().get()
        for name in (
            "dispatch.tasks.sweep_expired_leases_task",
            "dispatch.tasks.sweep_stale_sessions_task",
            "dispatch.tasks.sweep_over_delivered_leases_task",
            "dispatch.tasks.prune_dispatch_cycles_task",
            "dispatch.tasks.prune_ended_sessions_task",
            "dispatch.tasks.sweep_timed_out_attempts_task",
            "schedules.tasks.evaluate_schedules_task",
        )
    }
    assert_clean(json.dumps(sent))
    assert app.conf.task_serializer == "json"
    assert app.conf.accept_content == ["json"]
    cycles = json.dumps(list(DispatchCycle.objects.values()), default=str)
    assert_clean(cycles, opened.token)
    assert_clean(rendered_logs(debug_logs), opened.token)


def test_redis_notifier_publishes_offer_ids_only(canary_runs) -> None:
    from dispatch.core.ports import DispatchScope
    from dispatch.cycles import dispatch_cycle
    from dispatch.notify import RedisOfferNotifier, offer_channel

    opened, _ = canary_runs

    class RecordingPipe:
        published: list[tuple[str, str]] = []

        def publish(self, channel: str, message: str) -> None:
            self.published.append((channel, message))

        def execute(self) -> None:
            return None

    class RecordingRedis:
        def pipeline(self, transaction: bool = False) -> RecordingPipe:
            return RecordingPipe()

    dispatch_cycle(
        scope=DispatchScope.global_(), notifier=RedisOfferNotifier(client=RecordingRedis())
    )
    offers = set(RunLease.objects.values_list("offer_id", flat=True))
    assert {m for _, m in RecordingPipe.published} == offers
    assert {c for c, _ in RecordingPipe.published} == {
        offer_channel(str(opened.session.session_id))
    }


def test_notifier_failure_is_logged_and_swallowed(canary_runs, debug_logs):
    from dispatch.core.ports import DispatchScope
    from dispatch.cycles import dispatch_cycle
    from dispatch.notify import RedisOfferNotifier

    result = dispatch_cycle(
        scope=DispatchScope.global_(), notifier=RedisOfferNotifier(url="redis://127.0.0.1:1/0")
    )
    assert result.summary()["counts"]["claims_won"] == 3  # the leases are the authority
    assert any(r.getMessage() == "offer notification failed" for r in debug_logs.records)


def test_command_output_carries_no_spec_or_token(canary_runs, debug_logs):
    opened, _ = canary_runs
    outputs = []
    for args in (
        ("dispatch_once", "--json"),
        ("run_dispatcher", "--max-cycles", "2", "--interval", "0.01", "--json"),
    ):
        out = io.StringIO()
        call_command(*args, stdout=out)
        outputs.append(out.getvalue())
    out = io.StringIO()
    call_command("audit_leases", "--json", stdout=out)  # healthy: exit 0, no SystemExit
    outputs.append(out.getvalue())
    assert json.loads(outputs[2])["counts"]["awaiting_start"] == 3  # delivered, not started
    for text in outputs:
        assert_clean(text, opened.token)
    digests = list(RunLease.objects.values_list("token_digest", flat=True))
    assert_clean("\n".join(outputs), *digests)
    assert_clean(rendered_logs(debug_logs), opened.token)


def test_celery_keeps_the_redacting_log_handlers():
    from qinglong.celery import app

    # Celery would otherwise swap the root handlers (and their redaction filter).
    assert app.conf.worker_hijack_root_logger is False
