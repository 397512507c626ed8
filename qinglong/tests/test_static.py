"""Admin and API-docs assets are served by the app itself, with DEBUG off."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.templatetags.static import static


@pytest.mark.parametrize(
    "path",
    ["admin/css/base.css", "drf_spectacular_sidecar/swagger-ui-dist/swagger-ui.css"],
)
def test_static_assets_are_served_without_debug(client, path):
    assert settings.DEBUG is False
    response = client.get(static(path))
    assert response.status_code == 200
    body = b"".join(response.streaming_content) if response.streaming else response.content
    assert len(body) > 1000


def test_unknown_static_file_is_404(client):
    assert client.get(static("admin/css/nope.css")).status_code == 404
