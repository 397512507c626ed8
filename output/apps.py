from __future__ import annotations

from django.apps import AppConfig


class OutputConfig(AppConfig):
    name = "output"
    verbose_name = "Live output"
