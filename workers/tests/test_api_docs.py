"""The API docs work on a box with no CDN: Swagger UI comes from this installation."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.django_db


def test_swagger_ui_assets_are_served_locally(client):
    response = client.get("/api/docs/")
    assert response.status_code == 200
    page = response.content.decode()
    assert "swagger-ui" in page
    assert "cdn.jsdelivr.net" not in page and "unpkg.com" not in page
    assert "/static/drf_spectacular_sidecar/" in page
