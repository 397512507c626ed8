"""Steps the browser tests share; each goes through the real pages, as an operator would."""

from __future__ import annotations

import re

from django.contrib.auth.models import Permission, User
from playwright.sync_api import Page, expect

OPERATOR_PASSWORD = "browser-test-password"


def make_viewer(username: str = "operator") -> User:
    """A staff user who may view every model (an operator's read-only role)."""
    user = User.objects.create_user(username, password=OPERATOR_PASSWORD, is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename__startswith="view_"))
    return user


def log_in(page: Page, username: str, password: str = OPERATOR_PASSWORD) -> None:
    """Log in through the admin's login form and land on the admin index."""
    page.goto("/admin/")
    expect(page).to_have_url(re.compile(r"/admin/login/\?next=/admin/$"))
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("input[type=submit]")
    expect(page).to_have_url(re.compile(r"/admin/$"))
