"""The live console in Chromium: output that grows while it runs, a cancel that stops the
process, a webhook test delivery in the log (issue 14, items 2 and 3).

The Worker is the real reference agent (a subprocess) against the live server.
While it runs, the test thread reads nothing from the database: with the
in-memory SQLite test database the live server shares this thread's connection,
so the test watches the pages instead, and reads rows only once the agent is gone.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from playwright.sync_api import Page, expect

from notifications.models import DeliveryState, WebhookDelivery, WebhookSubscription
from notifications.tests.receiver import serve
from qinglong.testing import make_project, make_worker
from qinglong.tests.browser.pages import OPERATOR_PASSWORD, log_in
from runs.models import AttemptState, RunState
from runs.services import run_enqueue, task_create
from workers.tests.test_agent_e2e import agent

SECRET = "browser-env-secret-9c1d"


def make_operator(username: str, *extra: str) -> User:
    """Staff who may view everything, plus `extra` permissions ("app.codename")."""
    user = User.objects.create_user(username, password=OPERATOR_PASSWORD, is_staff=True)
    perms = list(Permission.objects.filter(codename__startswith="view_"))
    for dotted in extra:
        app_label, codename = dotted.split(".")
        perms.append(Permission.objects.get(content_type__app_label=app_label, codename=codename))
    user.user_permissions.set(perms)
    return user


@pytest.fixture
def ticker(tmp_path, settings):
    """A Run whose process prints a line every 0.3 s until stopped, and a Worker for it."""
    settings.QINGLONG_HEARTBEAT_INTERVAL_S = 2
    pid_file = tmp_path / "ticker.pid"
    task = task_create(
        project=make_project("web"),
        name="ticker",
        definition={
            "executor_type": "process",
            "command": [
                "sh",
                "-c",
                # A long sleeper in the background too: only stopping the
                # job's whole process group ends it.
                f"sleep 300 & echo $$ > {pid_file}; i=0; while true; do i=$((i+1)); "
                'echo "tick $i $TOKEN"; sleep 0.3; done',
            ],
            "env": {"TOKEN": SECRET},
            "timeout_s": 120,
        },
    )
    run = run_enqueue(task=task)
    _, credential = make_worker("browser-agent", slots=1)
    credential_file = tmp_path / "worker.credential"
    credential_file.write_text(credential)
    credential_file.chmod(0o600)
    return run, credential_file, pid_file


def _output_text(page: Page) -> str:
    return page.locator(".ql-output-text").inner_text()


def test_output_appears_and_grows_on_the_run_page_and_cancel_stops_the_process(
    page: Page, page_problems, screenshot_dir: Path, live_server, ticker
):
    run, credential_file, pid_file = ticker
    make_operator("operator", "runs.change_run")
    _watch_and_cancel(
        page, page_problems, screenshot_dir, live_server, run, credential_file, pid_file
    )
    run.refresh_from_db()
    attempt = run.attempts.get()
    assert run.state == RunState.CANCELLED
    assert (attempt.state, attempt.error_code) == (AttemptState.FAILED, "cancelled")
    # Who and why: the cancel left an admin LogEntry with the operator and the reason.
    [(who, why)] = LogEntry.objects.filter(object_id=str(run.pk)).values_list(
        "user__username", "change_message"
    )
    assert (who, why) == ("operator", "Action: Cancel selected runs (reason: stuck in a loop)")
    page.reload()
    expect(page.locator(".field-state .readonly")).to_have_text("Cancelled")
    expect(page.locator(".ql-cancel-button")).to_have_count(0)  # nothing left to cancel
    assert SECRET not in page.content()
    assert page_problems == []


def _process_group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _watch_and_cancel(
    page, page_problems, screenshot_dir, live_server, run, credential_file, pid_file
):
    """The agent runs the ticker; the operator watches it grow and cancels it.

    The agent keeps running after the cancel (no --once), so the process it
    ran can only have ended because the cancel stopped it, not because its
    agent exited (the agent's children die with it).
    """
    proc = agent(live_server, credential_file)
    try:
        log_in(page, "operator")
        page.goto(f"/admin/runs/run/{run.pk}/change/")
        text = page.locator(".ql-output-text")
        # Rendered before or while the Attempt starts; the page follows it by itself.
        try:
            expect(text).to_contain_text("tick 2", timeout=30_000)
        except AssertionError:
            # Say what the page showed instead (kept short: no output, no secrets).
            where = f"{page.url} {page.title()!r}"
            raise AssertionError(f"no output at {where}; problems: {page_problems}") from None
        first = _output_text(page)
        seen = max(int(n) for n in re.findall(r"tick (\d+)", first))
        # It grows on the same page (no reload): later lines are appended.
        expect(text).to_contain_text(f"tick {seen + 3} ", timeout=15_000)
        later = _output_text(page)
        assert later.startswith(first.rstrip())
        assert SECRET not in later and "[redacted]" in later
        expect(page.locator(".ql-output-state")).to_have_text("running")
        page.screenshot(path=screenshot_dir / "run-page-live-output.png", full_page=True)
        pgid = int(pid_file.read_text())  # the job leads its own process group
        assert _process_group_alive(pgid)

        # The Attempt's own page shows the tail and follows it too.
        attempt_link = page.locator('#attempts-group a[href*="/admin/runs/attempt/"]').first
        attempt_link.click()
        expect(page).to_have_url(re.compile(r"/admin/runs/attempt/\d+/change/$"))
        on_attempt = _output_text(page)
        shown = max(int(n) for n in re.findall(r"tick (\d+)", on_attempt))
        expect(text).to_contain_text(f"tick {shown + 3} ", timeout=15_000)
        assert _output_text(page).startswith(on_attempt.rstrip())
        assert SECRET not in _output_text(page)

        # Cancel from the Run page: a reason, one click, back on the same page.
        page.goto(f"/admin/runs/run/{run.pk}/change/")
        page.fill(".ql-cancel-reason", "stuck in a loop")
        page.click(".ql-cancel-button")
        expect(page).to_have_url(re.compile(rf"/admin/runs/run/{run.pk}/change/$"))
        expect(page.locator(".messagelist")).to_contain_text("Cancelled 1 run(s)")
        # The Worker stops the process; the page sees the Attempt end.
        expect(page.locator(".ql-output-status")).to_contain_text("ended", timeout=30_000)
        # The job and everything in its group (the background sleeper too) are
        # gone while their agent lives on. The terminal ACK follows the job's own
        # exit; the rest of its group gets the signal with it and is let die.
        deadline = time.monotonic() + 10
        while _process_group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _process_group_alive(pgid), "the cancelled job's processes live on"
        assert proc.poll() is None, "the agent exited: it, not the cancel, may have ended them"
        proc.send_signal(signal.SIGTERM)  # nothing left to drain: it exits
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err


def test_a_webhook_test_delivery_shows_in_the_delivery_log(
    page: Page, page_problems, screenshot_dir: Path, settings, live_server
):
    settings.QINGLONG_WEBHOOK_ALLOW_PRIVATE = True
    project = make_project("web")
    make_operator(
        "operator",
        "notifications.add_webhooksubscription",
        "notifications.send_test_webhook",
    )
    receiver_context = serve()
    receiver = next(receiver_context)
    try:
        _add_and_send_test(page, project, receiver, screenshot_dir)
    finally:
        next(receiver_context, None)
    assert len(receiver.received) == 1
    assert receiver.received[0].signature_ok  # signed with the secret shown once
    assert receiver.received[0].json["event"] == "webhook.test"
    delivery = WebhookDelivery.objects.get()
    assert (delivery.state, delivery.subscription) == (
        DeliveryState.SUCCEEDED,
        WebhookSubscription.objects.get(name="on-call"),
    )
    assert page_problems == []


def _add_and_send_test(page: Page, project, receiver, screenshot_dir: Path) -> None:
    """Add a subscription through the form, then run "send test" on it."""
    log_in(page, "operator")
    page.goto("/admin/notifications/webhooksubscription/add/")
    page.select_option("#id_project", str(project.pk))
    page.fill("#id_name", "on-call")
    page.fill("#id_url", receiver.url)
    page.check("input[name=events][value='run.failed']")
    page.click("input[name=_save]")
    message = page.locator(".messagelist").inner_text()
    secret = re.search(r"whsec_[A-Za-z0-9_-]{43}", message)
    assert secret is not None, message
    receiver.secret = secret.group(0)

    page.locator("input[name=_selected_action]").first.check()
    page.select_option("select[name=action]", "send_test")
    page.fill("input[name=reason]", "checking the pager")
    page.click("button[name=index]")
    expect(page.locator(".messagelist")).to_contain_text("answered 200")

    page.goto("/admin/notifications/webhookdelivery/")
    row = page.locator("#result_list tbody tr").first
    expect(row.locator(".field-event")).to_have_text("webhook.test")
    expect(row.locator(".field-state")).to_have_text("Succeeded")
    expect(row.locator(".field-answer")).to_have_text("200")
    page.screenshot(path=screenshot_dir / "webhook-delivery-log.png", full_page=True)
    assert receiver.secret not in page.content()
