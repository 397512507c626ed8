"""Browser tests: Playwright drives Debian's Chromium against Django's live server.

The binary and its flags: chromium.py. A test that uses the `browser` fixture
(directly or through `page`) is marked `browser` and runs in the SQLite pass
only (see the root conftest). Screenshots go to var/screenshots/ (git-ignored).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import settings
from playwright.sync_api import (
    Browser,
    ConsoleMessage,
    Page,
    Response,
    ViewportSize,
    sync_playwright,
)
from pytest_django.live_server_helper import LiveServer

from qinglong.tests.browser.chromium import CHROMIUM_FLAGS, require_chromium

SCREENSHOT_DIR = Path(settings.BASE_DIR) / "var" / "screenshots"

VIEWPORT: ViewportSize = {"width": 1400, "height": 900}


@pytest.fixture(scope="package")
def browser() -> Iterator[Browser]:
    path = require_chromium()
    with pytest.MonkeyPatch.context() as patch:
        # Playwright's sync API keeps its asyncio loop marked as running in this
        # thread, so Django refuses every ORM call here (SynchronousOnlyOperation),
        # including pytest-django's own flush after each test. The calls really
        # are synchronous (the loop idles in another greenlet), so allow them for
        # exactly as long as Playwright runs: this package's scope, no longer.
        patch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        with sync_playwright() as playwright:
            launched = playwright.chromium.launch(
                executable_path=path, headless=True, args=CHROMIUM_FLAGS
            )
            yield launched
            launched.close()


@pytest.fixture
def page_problems() -> list[str]:
    """What went wrong while the page ran: JS errors, console errors, 4xx/5xx responses."""
    return []


@pytest.fixture
def page(
    browser: Browser, live_server: LiveServer, transactional_db: None, page_problems: list[str]
) -> Iterator[Page]:
    """A fresh browser context (no cookies) on the live server; relative URLs work.

    The live server runs in another thread, so the test's rows must be committed
    for it to see them: `transactional_db`, not `db`.
    """
    context = browser.new_context(base_url=live_server.url, viewport=VIEWPORT)
    context.set_default_timeout(10_000)
    page = context.new_page()

    def on_response(response: Response) -> None:
        if response.status >= 400:
            page_problems.append(f"HTTP {response.status} {response.url}")

    def on_console(message: ConsoleMessage) -> None:
        # The app serves no favicon; Chromium asks for one anyway and Playwright
        # reports that miss only here. Other failed loads also arrive as responses.
        if message.type == "error" and not message.location["url"].endswith("/favicon.ico"):
            page_problems.append(f"console error: {message.text} at {message.location['url']}")

    page.on("pageerror", lambda error: page_problems.append(f"page error: {error}"))
    page.on("console", on_console)
    page.on("response", on_response)
    yield page
    context.close()


@pytest.fixture
def screenshot_dir() -> Path:
    """var/screenshots/ (git-ignored): artifacts the browser tests leave behind."""
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    return SCREENSHOT_DIR
