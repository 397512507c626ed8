"""Which Chromium the browser tests launch, and how.

Playwright's own browser download is not available here, so the tests launch
the system binary: `QL_CHROMIUM`, default /usr/bin/chromium (Debian package
`chromium`). A missing binary fails the tests; it never skips them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CHROMIUM_DEFAULT = "/usr/bin/chromium"

# As root there is no sandbox; the closed network refuses Chromium's background
# connections (updates, sync, QUIC probes), which otherwise stall or spam the
# log. Playwright's launch() adds a fresh temporary --user-data-dir itself.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# The same wording as scripts/_chromium.sh, so either place names the fix.
MISSING_CHROMIUM = (
    "The browser tests need Chromium, not found at {path}: install Debian's package "
    "(apt-get install chromium) or set QL_CHROMIUM to a Chromium binary."
)


def require_chromium() -> str:
    """The Chromium binary to launch; a missing one fails the test (never a skip)."""
    path = os.environ.get("QL_CHROMIUM") or CHROMIUM_DEFAULT
    if not (Path(path).is_file() and os.access(path, os.X_OK)):
        pytest.fail(MISSING_CHROMIUM.format(path=path), pytrace=False)
    return path
