from __future__ import annotations

from django.apps import AppConfig
from django.contrib.admin.apps import AdminConfig


class QinglongConfig(AppConfig):
    name = "qinglong"
    verbose_name = "Qinglong"

    def ready(self) -> None:
        from qinglong import checks  # noqa: F401  (registers the system checks)

        _skip_noop_cache_close()


def _skip_noop_cache_close() -> None:
    """Drop Django's per-request `close_caches` when closing is a no-op (issue #12).

    Django closes every cache in use after each request. Our backends (the
    pooled Redis client of `qinglong.cache`, or the local-memory cache) keep
    Django's `BaseCache.close`, which does nothing, yet the walk over the
    caches cost every Worker request about 0.7 % of the web process's CPU. The
    receiver stays connected as soon as any configured backend closes for
    real (e.g. memcached).
    """
    from django.conf import settings
    from django.core.cache import close_caches
    from django.core.cache.backends.base import BaseCache
    from django.core.signals import request_finished
    from django.utils.module_loading import import_string

    backends = [import_string(conf["BACKEND"]) for conf in settings.CACHES.values()]
    if all(backend.close is BaseCache.close for backend in backends):
        request_finished.disconnect(close_caches)


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
