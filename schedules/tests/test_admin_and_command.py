"""The admin pages of Schedules and the ledger, their actions, `manage.py schedules`,
the Celery task and the `run_dispatcher` hook."""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO
from pathlib import Path

import pytest
from django.contrib.admin.models import LogEntry
from django.core.management import call_command
from django.test import Client
from django.urls import reverse

from qinglong.testing import CANARY_COMMAND, CANARY_ENV, canary_definition, make_task
from runs.models import Run
from runs.services import task_create
from schedules.models import Schedule, ScheduleFire
from schedules.services import schedule_pause, schedules_evaluate
from schedules.tasks import evaluate_schedules_task
from schedules.tests.helpers import at, make_schedule

pytestmark = pytest.mark.django_db


def _secret_schedule() -> Schedule:
    task = task_create(project=make_task().project, name="secret", definition=canary_definition())
    return make_schedule(task, cron="*/5 * * * *", timezone="America/New_York", catchup_window_s=0)


def test_the_schedule_pages_show_next_fires_in_both_zones_and_no_secret(
    admin_client: Client,
) -> None:
    schedule = _secret_schedule()
    schedules_evaluate(now=at(hours=1))
    listing = admin_client.get(reverse("admin:schedules_schedule_changelist")).content.decode()
    assert "2026-06-01T09:05:00-04:00" in listing  # next fire, New York
    assert "2026-06-01 13:05:00 UTC" in listing
    page = admin_client.get(
        reverse("admin:schedules_schedule_change", args=[schedule.pk])
    ).content.decode()
    assert page.count("-04:00 &nbsp;/&nbsp;") == 5  # the next five fires
    response = admin_client.get(
        reverse("admin:schedules_schedulefire_changelist") + "?outcome__exact=missed"
    )
    assert [fire.outcome for fire in response.context["cl"].result_list] == ["missed"]
    ledger = response.content.decode()
    assert "2026-06-01 12:05:00 UTC … 2026-06-01 12:55:00 UTC" in ledger
    fire = ScheduleFire.objects.first()
    assert fire is not None
    detail = admin_client.get(
        reverse("admin:schedules_schedulefire_change", args=[fire.pk])
    ).content.decode()
    for text in (listing, page, ledger, detail):
        assert CANARY_COMMAND not in text and CANARY_ENV not in text


def test_pause_and_resume_actions_carry_the_note(admin_client: Client) -> None:
    schedule = make_schedule()
    url = reverse("admin:schedules_schedule_changelist")
    admin_client.post(
        url,
        {"action": "pause_schedules", "_selected_action": [schedule.pk], "reason": "disk full"},
    )
    schedule.refresh_from_db()
    assert (schedule.paused, schedule.pause_reason) == (True, "disk full")
    assert schedule.paused_by.startswith("admin:")
    # Every console action needs a reason (qinglong.admin.ReasonedActions).
    admin_client.post(url, {"action": "resume_schedules", "_selected_action": [schedule.pk]})
    schedule.refresh_from_db()
    assert schedule.paused
    admin_client.post(
        url, {"action": "resume_schedules", "_selected_action": [schedule.pk], "reason": "fixed"}
    )
    schedule.refresh_from_db()
    assert not schedule.paused
    admin_client.post(
        url, {"action": "run_now", "_selected_action": [schedule.pk], "reason": "backfill"}
    )
    assert Run.objects.filter(schedule=schedule).count() == 1
    assert ScheduleFire.objects.get(schedule=schedule, manual=True).run is not None
    logged = list(LogEntry.objects.values_list("change_message", flat=True))
    assert any("reason: disk full" in message for message in logged)
    assert any("reason: fixed" in message for message in logged)
    assert any("reason: backfill" in message for message in logged)
    # Who: each entry names the admin user who acted.
    assert set(LogEntry.objects.values_list("user__username", flat=True)) == {"admin"}


def test_the_ledger_search_finds_the_row_that_accounts_for_a_time(admin_client: Client) -> None:
    """ "Why didn't it run at 12:30?" from the Schedule's page: its ledger link, then
    the time typed into the search box (in the Schedule's zone, or with an offset)."""
    schedule = make_schedule(cron="*/5 * * * *", timezone="America/New_York", catchup_window_s=0)
    other = make_schedule(cron="*/5 * * * *", catchup_window_s=0)
    schedules_evaluate(now=at(hours=1))  # both down for an hour: 12:05-12:55 UTC missed
    page = admin_client.get(
        reverse("admin:schedules_schedule_change", args=[schedule.pk])
    ).content.decode()
    ledger_url = reverse("admin:schedules_schedulefire_changelist")
    link = f"{ledger_url}?schedule__id__exact={schedule.pk}"
    assert f'href="{link}"' in page and "America/New_York" in page

    def found(query: str) -> list[tuple[int, str]]:
        response = admin_client.get(ledger_url, {"q": query, **dict_of(query_of(link))})
        assert response.status_code == 200
        return [(fire.schedule_id, fire.outcome) for fire in response.context["cl"].result_list]

    def found_everywhere(query: str) -> list[tuple[int, str]]:
        response = admin_client.get(ledger_url, {"q": query})
        assert response.status_code == 200
        return sorted(
            (fire.schedule_id, fire.outcome) for fire in response.context["cl"].result_list
        )

    # 08:30 in New York is 12:30 UTC: inside the missed stretch.
    assert found("2026-06-01 08:30") == [(schedule.pk, "missed")]
    assert found("2026-06-01T12:30:00Z") == [(schedule.pk, "missed")]
    assert found("2026-06-01T09:00:00-04:00") == [(schedule.pk, "enqueued")]
    assert found("2026-06-01 07:00") == []  # before its first fire
    # Without a Schedule chosen, a time without an offset is UTC.
    assert found_everywhere("2026-06-01 12:30") == sorted(
        [(schedule.pk, "missed"), (other.pk, "missed")]
    )
    # Anything else is an ordinary search by Schedule name.
    assert found_everywhere(other.name) == [(other.pk, "enqueued"), (other.pk, "missed")]
    assert found_everywhere("2026-99-99 nonsense") == []


def query_of(url: str) -> str:
    return url.split("?", 1)[1]


def dict_of(query: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in query.split("&"))


def test_the_command_lists_schedules_next_fires_and_recent_outcomes() -> None:
    schedule = _secret_schedule()
    paused = make_schedule(name="held")
    schedule_pause(
        schedule_id=paused.pk, actor="ops", reason="waiting for vendor", now=at(seconds=1)
    )
    schedules_evaluate(now=at(hours=1))
    out = StringIO()
    call_command("schedules", "--json", stdout=out)
    rows = {row["name"]: row for row in json.loads(out.getvalue())["schedules"]}
    assert rows[schedule.name]["next_fire_local"] == "2026-06-01T09:05:00-04:00"
    assert [f["outcome"] for f in rows[schedule.name]["recent"]] == ["enqueued", "missed"]
    assert rows["held"]["paused"] and rows["held"]["pause_reason"] == "waiting for vendor"
    text = StringIO()
    call_command("schedules", stdout=text)
    shown = text.getvalue()
    assert "next: 2026-06-01T09:05:00-04:00" in shown
    assert "paused by ops: waiting for vendor" in shown
    assert "missed" in shown and "enqueued run" in shown
    for output in (out.getvalue(), shown):
        assert CANARY_COMMAND not in output and CANARY_ENV not in output


def test_the_celery_task_is_one_step_returning_counts_only() -> None:
    make_schedule(cron="* * * * * *", overlap_policy="allow")
    summary = evaluate_schedules_task.apply().get()
    assert set(summary) == {
        "examined",
        "fires",
        "busy",
        "lost_race",
        "failed",
        "cancelled",
        "truncated",
        "reason",
    }
    json.dumps(summary)  # a JSON-only broker can carry it


def test_run_dispatcher_evaluates_schedules_before_its_cycles() -> None:
    schedule = make_schedule(cron="* * * * * *", overlap_policy="allow", catchup_window_s=0)
    out = StringIO()
    call_command("run_dispatcher", "--max-cycles", "1", "--json", stdout=out)
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    assert events[-1]["event"] == "stopped" and events[-1]["fires"] >= 1
    assert any(e["event"] == "schedules" for e in events)
    assert ScheduleFire.objects.filter(schedule=schedule).exists()


def test_seed_demo_creates_a_schedule_every_ten_seconds_once(settings) -> None:
    settings.DEBUG = True
    call_command("seed_demo", "--runs", "0", stdout=StringIO())
    call_command("seed_demo", "--runs", "0", stdout=StringIO())
    demo = Schedule.objects.get(name="every-10s")
    assert (demo.cron, demo.timezone, demo.task.name) == ("*/10 * * * * *", "UTC", "hello")
    assert demo.next_fire_at is not None and demo.next_fire_at.second % 10 == 0
    # It really fires: the loop ./scripts/dev starts (run_dispatcher) evaluates it
    # before each cycle; here one step at its next two fire times.
    first = demo.next_fire_at
    schedules_evaluate(now=first)
    schedules_evaluate(now=first + timedelta(seconds=10))
    fires = list(ScheduleFire.objects.filter(schedule=demo).order_by("fire_at"))
    assert [(f.fire_at, f.outcome) for f in fires] == [
        (first, "enqueued"),
        (first + timedelta(seconds=10), "skipped_overlap"),  # its first Run is still queued
    ]
    assert fires[0].run is not None and fires[0].run.task == demo.task
    script = (Path(__file__).resolve().parents[2] / "scripts" / "dev").read_text()
    assert "manage.py seed_demo" in script and "manage.py run_dispatcher" in script
