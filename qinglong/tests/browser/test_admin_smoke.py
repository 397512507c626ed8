"""The operator's console in a real browser: log in, the index, a Run's page."""

from __future__ import annotations

import re
from pathlib import Path

from playwright.sync_api import Page, expect

from leases.models import RunLease
from qinglong.testing import (
    CANARY_COMMAND,
    CANARY_CWD,
    CANARY_ENV,
    canary_definition,
    claim,
    make_project,
    make_worker,
    open_session,
    pending_attempt,
)
from qinglong.tests.browser.pages import log_in, make_viewer
from runs.models import RunState
from runs.services import run_enqueue, task_create


def test_wrong_password_is_refused_by_the_login_form(page: Page, page_problems):
    make_viewer("operator")
    page.goto("/admin/")
    page.fill("#id_username", "operator")
    page.fill("#id_password", "not-the-password")
    page.click("input[type=submit]")

    expect(page.locator(".errornote")).to_contain_text("enter the correct username and password")
    expect(page).to_have_url(re.compile(r"/admin/login/"))
    assert page_problems == []


def test_staff_user_logs_in_and_the_index_lists_the_console(
    page: Page, page_problems, screenshot_dir: Path
):
    make_viewer("operator")
    log_in(page, "operator")

    expect(page.locator("#user-tools")).to_contain_text("operator")
    # The app list names the console's models, each a link to its changelist.
    for row, name, href in [
        ("#runs-run", "Runs", "/admin/runs/run/"),
        ("#runs-attempt", "Attempts", "/admin/runs/attempt/"),
        ("#workers-worker", "Workers", "/admin/workers/worker/"),
        ("#leases-runlease", "Run leases", "/admin/leases/runlease/"),
    ]:
        link = page.locator(row).get_by_role("link", name=name, exact=True)
        expect(link).to_be_visible()
        expect(link).to_have_attribute("href", href)
    # The admin's stylesheet applied (static files are served): the header is
    # laid out as a styled bar, not unstyled text.
    assert page.locator("#header").evaluate("e => getComputedStyle(e).display") == "flex"
    page.screenshot(path=screenshot_dir / "admin-index.png", full_page=True)
    assert page_problems == []


def test_run_page_shows_the_runs_state_and_attempt_without_secrets(
    page: Page, page_problems, screenshot_dir: Path
):
    make_viewer("operator")
    worker, _ = make_worker("browser-worker")
    opened = open_session(worker)
    task = task_create(project=make_project("web"), name="nightly", definition=canary_definition())
    run = run_enqueue(task=task)
    attempt = pending_attempt(run)
    claim(attempt, opened.session)
    run.refresh_from_db()
    assert run.state == RunState.DISPATCHING
    assert RunLease.objects.filter(attempt=attempt).exists()

    log_in(page, "operator")
    page.locator("#runs-run").get_by_role("link", name="Runs", exact=True).click()
    page.get_by_role("link", name=str(run.pk), exact=True).click()

    expect(page).to_have_url(re.compile(rf"/admin/runs/run/{run.pk}/change/$"))
    expect(page.locator(".field-state .readonly")).to_have_text("Dispatching")
    expect(page.locator(".field-task .readonly")).to_contain_text("nightly")
    attempt_row = page.locator("#attempts-group tbody tr.has_original")
    expect(attempt_row).to_have_count(1)
    expect(attempt_row.locator("td.field-state")).to_have_text("Claimed")
    expect(attempt_row.locator("td.field-lease_generation")).to_have_text("1")
    body = page.content()
    for secret in (CANARY_COMMAND, CANARY_ENV, CANARY_CWD):
        assert secret not in body
    page.screenshot(path=screenshot_dir / "run-page.png", full_page=True)
    assert page_problems == []
