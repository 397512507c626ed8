from __future__ import annotations

from django.apps import AppConfig


class QinglongConfig(AppConfig):
    name = "qinglong"
    verbose_name = "Qinglong"

    def ready(self) -> None:
        from qinglong import checks  # noqa: F401  (registers the system checks)
