"""Worker API routes, mounted at /api/v1/worker/ (README "Worker API")."""

from __future__ import annotations

from django.urls import path, re_path

from workers.api import output, views

app_name = "worker-api"

urlpatterns = [
    path("sessions", views.SessionOpenView.as_view(), name="sessions"),
    path("heartbeat", views.HeartbeatView.as_view(), name="heartbeat"),
    path("pull", views.PullView.as_view(), name="pull"),
    path("reconcile", views.ReconcileView.as_view(), name="reconcile"),
    path("acks", views.AckBatchView.as_view(), name="lease-acks"),
    re_path(r"^leases/(?P<offer_id>[0-9a-f]{64})/ack$", views.AckView.as_view(), name="lease-ack"),
    re_path(
        r"^leases/(?P<offer_id>[0-9a-f]{64})/output$",
        output.OutputView.as_view(),
        name="lease-output",
    ),
]
