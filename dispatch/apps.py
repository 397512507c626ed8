from __future__ import annotations

from django.apps import AppConfig


class DispatchConfig(AppConfig):
    name = "dispatch"
