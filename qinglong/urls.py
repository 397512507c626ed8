from __future__ import annotations

from django.contrib import admin
from django.urls import include, path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.permissions import AllowAny

from qinglong.api_errors import api_not_found
from qinglong.console.views import metrics_view
from qinglong.health import healthz

urlpatterns = [
    path("admin/", admin.site.urls),
    path("healthz", healthz, name="healthz"),
    # Prometheus text, for a scraper with the token or from the allow-list (README "Metrics").
    path("metrics", metrics_view, name="metrics"),
    path("api/v1/worker/", include("workers.api.urls")),
    path("api/v1/", include("runs.api.urls")),
    path("api/v1/", include("schedules.api.urls")),
    # Public on purpose: a Worker author writes a client from the schema alone.
    path(
        "api/schema/",
        SpectacularAPIView.as_view(authentication_classes=[], permission_classes=[AllowAny]),
        name="api-schema",
    ),
    path(
        "api/docs/",
        SpectacularSwaggerView.as_view(
            url_name="api-schema", authentication_classes=[], permission_classes=[AllowAny]
        ),
        name="api-docs",
    ),
    # Anything else under /api/ is a 404 in the error envelope, even with DEBUG on.
    re_path(r"^api/", api_not_found),
]

# JSON error envelopes for /api/ paths; HTML pages elsewhere (qinglong.api_errors).
handler400 = "qinglong.api_errors.handler400"
handler403 = "qinglong.api_errors.handler403"
handler404 = "qinglong.api_errors.handler404"
handler500 = "qinglong.api_errors.handler500"
