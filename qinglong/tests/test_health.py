"""`GET /healthz`: 200 while the database answers; the broker is informational."""

from __future__ import annotations

from unittest import mock

import pytest
from django.test import override_settings

pytestmark = pytest.mark.django_db


@override_settings(CELERY_BROKER_URL="redis://127.0.0.1:1/0")
def test_healthy_database_with_unreachable_broker_is_200(client):
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "database": "ok", "broker": "error"}


@override_settings(CELERY_BROKER_URL="")
def test_no_broker_configured_is_reported_as_such(client):
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json()["broker"] == "not_configured"


@override_settings(CELERY_BROKER_URL="redis://127.0.0.1:6379/15")
def test_reachable_redis_broker_is_ok(client):
    assert client.get("/healthz").json()["broker"] == "ok"


@override_settings(CELERY_BROKER_URL="")
def test_database_down_is_503(client):
    with mock.patch("qinglong.health.connection") as conn:
        conn.cursor.side_effect = RuntimeError("connection refused")
        response = client.get("/healthz")
    assert response.status_code == 503
    assert response.json() == {"status": "error", "database": "error", "broker": "not_configured"}


def test_healthz_only_answers_get(client):
    assert client.post("/healthz").status_code == 405
