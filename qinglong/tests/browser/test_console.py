"""The console in a real browser: the overview and its charts, every changelist fits 1400 px."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

from django.contrib import admin
from django.contrib.auth.models import User
from django.urls import reverse
from django.utils import timezone
from playwright.sync_api import Page, expect

from dispatch.models import DispatchControl
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
from qinglong.tests.browser.pages import OPERATOR_PASSWORD, log_in, make_viewer
from runs.models import Run, RunState
from runs.services import run_enqueue, task_create
from runs.tests.test_admin_permissions import build_world

# The operator's window (conftest.VIEWPORT): no changelist may scroll sideways.
WINDOW_PX = 1400


def _history(task, *, succeeded: int, failed: int) -> None:
    """Runs that finished in the last hour (and so in the last day too)."""
    now = timezone.now()
    for i in range(succeeded + failed):
        run = run_enqueue(task=task)
        state = RunState.SUCCEEDED if i < succeeded else RunState.FAILED
        Run.objects.filter(pk=run.pk).update(
            state=state, finished_at=now - timedelta(minutes=1 + i * 7)
        )
        run.attempts.update(state="succeeded" if i < succeeded else "failed")


def test_the_overview_shows_its_charts_and_numbers(page: Page, page_problems, screenshot_dir: Path):
    make_viewer("operator")
    worker, _ = make_worker("builder-01", slots=4, labels={"zone": "eu-west-1a"})
    session = open_session(worker).session
    task = task_create(project=make_project("web"), name="nightly", definition=canary_definition())
    claim(pending_attempt(run_enqueue(task=task)), session)
    for _ in range(2):
        run_enqueue(task=task)
    _history(task, succeeded=5, failed=2)

    log_in(page, "operator")
    page.locator("#ql-overview-link").get_by_role("link", name="Overview").click()
    expect(page).to_have_url(re.compile(r"/admin/overview/$"))
    expect(page.locator("h1")).to_have_text("Overview")

    # Both charts are inline SVG whose bars carry their counts.
    for chart_id in ("#chart-hour", "#chart-day"):
        svg = page.locator(f"{chart_id} svg")
        expect(svg).to_be_visible()
        bars = svg.locator("rect.bar")
        assert bars.count() > 0, chart_id
        counts = bars.evaluate_all("els => els.map(e => Number(e.dataset.count))")
        series = set(bars.evaluate_all("els => els.map(e => e.dataset.series)"))
        assert sum(counts) == 7, chart_id
        assert series == {"succeeded", "failed"}, chart_id
        assert svg.get_attribute("data-total") == "7"
        # Drawn, not just present: the bars have a size on screen.
        box = bars.first.bounding_box()
        assert box is not None and box["width"] > 0 and box["height"] > 0
    expect(page.locator('#tile-runs dd[data-state="queued"]')).to_have_text("2")
    expect(page.locator('#tile-runs dd[data-state="dispatching"]')).to_have_text("1")
    expect(page.locator('#tile-queue dd[data-queue="depth"]')).to_have_text("2")
    expect(page.locator('#tile-slots dd[data-slots="free"]')).to_have_text("3")
    expect(page.locator('#ql-workers tr[data-worker="builder-01"]')).to_contain_text("1 / 4")
    expect(page.locator('#tile-dispatch [data-dispatch="running"]')).to_be_visible()
    # A viewer sees the switch's state but is offered no button.
    expect(page.get_by_role("button", name="Pause dispatch")).to_have_count(0)
    # No script runs the page: the charts are there without JavaScript.
    assert page.locator("#content-main script").count() == 0
    assert page.evaluate("document.documentElement.scrollWidth") <= WINDOW_PX
    body = page.content()
    for secret in (CANARY_COMMAND, CANARY_ENV, CANARY_CWD):
        assert secret not in body
    page.screenshot(path=screenshot_dir / "overview.png", full_page=True)
    assert page_problems == []


def test_an_operator_pauses_dispatch_from_the_overview_with_a_reason(page: Page, page_problems):
    User.objects.create_superuser("chief", password=OPERATOR_PASSWORD)
    log_in(page, "chief")
    page.goto("/admin/overview/")
    page.locator("#ql-switch").get_by_label("Reason:").fill("database upgrade")
    page.get_by_role("button", name="Pause dispatch").click()
    expect(page.locator(".messagelist")).to_contain_text("Dispatch paused.")
    expect(page.locator('#tile-dispatch [data-dispatch="paused"]')).to_contain_text(
        "PAUSED: database upgrade"
    )
    control = DispatchControl.objects.get(pk=1)
    assert (control.paused, control.updated_by) == (True, "admin:chief")
    expect(page.get_by_role("button", name="Resume dispatch")).to_be_visible()
    assert page_problems == []


def test_every_changelist_fits_a_1400_px_window(page: Page, page_problems, screenshot_dir: Path):
    User.objects.create_superuser("chief", password=OPERATOR_PASSWORD)
    build_world()
    # Long but ordinary values, as operators name things.
    worker, _ = make_worker(
        "gpu-builder-eu-west-1a-0042",
        slots=16,
        executor_types=("process", "container"),
        labels={"zone": "eu-west-1a", "gpu": "nvidia-a100-80gb", "pool": "nightly-builds"},
    )
    session = open_session(worker).session
    task = task_create(
        project=make_project("payments-reconciliation"),
        name="nightly-ledger-reconciliation",
        definition=canary_definition(),
    )
    claim(pending_attempt(run_enqueue(task=task)), session)
    log_in(page, "chief")
    too_wide = {}
    for model in admin.site._registry:
        url = reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")
        page.goto(url)
        expect(page.locator("#changelist")).to_be_visible()
        assert page.locator("#result_list tbody tr").count() > 0, f"{url} lists no row"
        # The page must not scroll sideways, and neither may the results box
        # (Django's CSS lets a too-wide table scroll inside it instead).
        widths = page.evaluate(
            """() => {
                const results = document.querySelector('#changelist .results');
                return {
                    page: document.documentElement.scrollWidth,
                    table: results ? results.scrollWidth : 0,
                    box: results ? results.clientWidth : 0,
                };
            }"""
        )
        if widths["page"] > WINDOW_PX or widths["table"] > widths["box"]:
            too_wide[url] = widths
            page.screenshot(path=screenshot_dir / f"too-wide-{model._meta.model_name}.png")
    print("WIDTHS", too_wide)
    assert too_wide == {}
    assert page_problems == []
