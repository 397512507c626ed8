"""The project's AdminSite: Django's, plus the overview page (README "The operator's console").

Installed as the default site (`qinglong.apps.QinglongAdminConfig`), so every
`admin.site.register` and `@admin.register` lands here unchanged.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from django.contrib import admin
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import URLPattern, URLResolver, path
from django.views.decorators.cache import never_cache

from qinglong.console.views import OVERVIEW_PERMISSIONS, overview_view

__all__ = ["QinglongAdminSite"]


class QinglongAdminSite(admin.AdminSite):
    site_header = "Qinglong console"
    site_title = "Qinglong"
    index_title = "Console"
    index_template = "admin/qinglong/index.html"

    def get_urls(self) -> list[URLPattern | URLResolver]:
        # admin_view: staff only, login redirect, CSRF, never cached.
        overview = self.admin_view(never_cache(partial(overview_view, site=self)))
        return [path("overview/", overview, name="overview"), *super().get_urls()]

    def index(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> TemplateResponse:
        # The index links the overview for whoever may open it.
        context = {"may_see_overview": request.user.has_perms(OVERVIEW_PERMISSIONS)}
        return super().index(request, {**context, **(extra_context or {})})
