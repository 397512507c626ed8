"""Schedules API routes, mounted at /api/v1/ (README "Schedules")."""

from __future__ import annotations

from django.urls import path, re_path

from schedules.api import views

app_name = "schedules-api"

_ID = r"(?P<schedule_id>[0-9]{1,18})"

urlpatterns = [
    path("schedules", views.SchedulesView.as_view(), name="schedules"),
    re_path(rf"^schedules/{_ID}$", views.ScheduleView.as_view(), name="schedule"),
    re_path(rf"^schedules/{_ID}/pause$", views.SchedulePauseView.as_view(), name="pause"),
    re_path(rf"^schedules/{_ID}/resume$", views.ScheduleResumeView.as_view(), name="resume"),
    re_path(rf"^schedules/{_ID}/run$", views.ScheduleRunNowView.as_view(), name="run-now"),
    re_path(rf"^schedules/{_ID}/fires$", views.ScheduleFiresView.as_view(), name="fires"),
]
