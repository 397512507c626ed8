"""Static files, user and messages middleware pass the Worker API by, and only it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.core.cache import close_caches
from django.core.signals import request_finished
from django.test import Client, override_settings

from qinglong.apps import _skip_noop_cache_close
from qinglong.testing import open_session
from workers.tests.api_helpers import WORKER_API, bearer, post_json

pytestmark = pytest.mark.django_db


def _browser_state(request: object) -> set[str]:
    """What the message middleware leaves on a request."""
    return {name for name in ("_messages",) if hasattr(request, name)}


def test_a_worker_request_builds_no_message_storage_and_keeps_the_security_headers():
    opened = open_session(slots=2)
    client = Client()
    client.cookies["csrftoken"] = "x" * 32
    client.cookies["sessionid"] = "y" * 32

    response = post_json(client, f"{WORKER_API}/heartbeat", {}, bearer(opened.token))

    assert response.status_code == 200, response.content
    assert _browser_state(response.wsgi_request) == set()
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    assert response.headers["X-Frame-Options"] == "DENY"
    assert response.headers["Referrer-Policy"] == "same-origin"
    assert response.headers["Cache-Control"] == "no-store"


def test_a_worker_path_error_keeps_the_envelope_and_the_headers():
    response = post_json(Client(), f"{WORKER_API}/heartbeat", {}, bearer("not-a-token"))

    assert response.status_code == 401
    assert set(response.json()) == {"error"}
    assert _browser_state(response.wsgi_request) == set()
    assert response.headers["X-Content-Type-Options"] == "nosniff"


def test_every_other_path_still_gets_session_csrf_user_and_messages():
    # (The deploy check's middleware names: qinglong/tests/test_settings.py.)
    client = Client(enforce_csrf_checks=True)
    client.cookies["csrftoken"] = "x" * 32

    page = client.get("/admin/login/")
    assert page.status_code == 200
    assert _browser_state(page.wsgi_request) == {"_messages"}
    assert "CSRF_COOKIE" in page.wsgi_request.META
    assert page.wsgi_request.user.is_authenticated is False

    # Without the CSRF token a browser POST is refused, as before.
    refused = client.post("/admin/login/", {"username": "a", "password": "b"})
    assert refused.status_code == 403


@pytest.fixture
def close_caches_connected() -> Iterator[None]:
    request_finished.connect(close_caches)
    yield
    _skip_noop_cache_close()  # as the app leaves it with the test settings


def test_close_caches_is_dropped_only_while_every_backend_closes_as_a_no_op(
    close_caches_connected: None,
):
    memcached = {"BACKEND": "django.core.cache.backends.memcached.PyMemcacheCache"}
    locmem = {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
    redis = {"BACKEND": "qinglong.cache.RedisCache", "LOCATION": "redis://127.0.0.1:1/0"}

    with override_settings(CACHES={"default": locmem, "other": memcached}):
        _skip_noop_cache_close()
    assert close_caches in request_finished._live_receivers(None)[0]

    with override_settings(CACHES={"default": redis, "other": locmem}):
        _skip_noop_cache_close()
    assert close_caches not in request_finished._live_receivers(None)[0]
