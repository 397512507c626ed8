"""Operator API routes, mounted at /api/v1/ (docs/architecture.md "Worker API and operations")."""

from __future__ import annotations

from django.urls import path, re_path

from runs.api import output, views

app_name = "operator-api"

urlpatterns = [
    path("projects", views.ProjectsView.as_view(), name="projects"),
    path("projects/<slug:slug>/tasks", views.TasksView.as_view(), name="tasks"),
    path("projects/<slug:slug>/tasks/<slug:name>", views.TaskView.as_view(), name="task"),
    path("runs", views.RunsView.as_view(), name="runs"),
    re_path(r"^runs/(?P<run_id>[0-9]{1,18})$", views.RunView.as_view(), name="run"),
    re_path(
        r"^runs/(?P<run_id>[0-9]{1,18})/cancel$", views.RunCancelView.as_view(), name="run-cancel"
    ),
    re_path(
        r"^runs/(?P<run_id>[0-9]{1,18})/output$", output.RunOutputView.as_view(), name="run-output"
    ),
]
