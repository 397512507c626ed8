from __future__ import annotations

from django.apps import AppConfig
from django.contrib.admin.apps import AdminConfig


class QinglongConfig(AppConfig):
    name = "qinglong"
    verbose_name = "Qinglong"

    def ready(self) -> None:
        from qinglong import checks  # noqa: F401  (registers the system checks)


class QinglongAdminConfig(AdminConfig):
    """Django's admin with the console's site as the default `admin.site`."""

    default_site = "qinglong.console.site.QinglongAdminSite"

    def ready(self) -> None:
        super().ready()  # autodiscovery: every app's admin module is loaded now
        # Models can only be imported once the apps are ready. DRF stores API
        # keys unhashed and its TokenProxy admin would list them: no page may.
        from django.contrib import admin
        from rest_framework.authtoken.models import TokenProxy

        if admin.site.is_registered(TokenProxy):
            admin.site.unregister(TokenProxy)

        # Users and groups are changed in the console too: their actions (delete
        # selected) and delete pages need a reason and log it, like every other.
        from django.contrib.auth.models import Group, User

        from qinglong.admin import ReasonedActions

        for model in (User, Group):
            if admin.site.is_registered(model):
                stock = type(admin.site.get_model_admin(model))
                if not issubclass(stock, ReasonedActions):
                    admin.site.unregister(model)
                    admin.site.register(
                        model, type(f"Reasoned{stock.__name__}", (ReasonedActions, stock), {})
                    )
