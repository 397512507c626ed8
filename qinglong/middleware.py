"""Browser middleware passed by for the Worker API (issue #12).

A Worker request (`/api/v1/worker/…`) is authenticated by a Bearer token and
answered in JSON: it has no Django user and no flash messages to carry, and it
asks for no static file. Each class here is WhiteNoise's or Django's own (so
the admin's checks still find them) and does exactly what it did for every
other path; for a Worker path it hands the request straight to the next
middleware — no static-file lookup, lazy user or message storage (a cookie
and a session storage object per request) is built, and none of their
response hooks run.

Security, Session, Common (host validation, trailing-slash redirect), CSRF
and X-Frame-Options middleware are Django's, listed by name, and run on every
request as before: a Worker answer keeps `X-Content-Type-Options: nosniff`,
the HSTS and Referrer-Policy headers and `X-Frame-Options`, and
`check --deploy` still finds the session and CSRF middleware it looks for by
name.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.middleware import AuthenticationMiddleware
from django.contrib.messages.middleware import MessageMiddleware
from django.http import HttpRequest
from whitenoise.middleware import WhiteNoiseMiddleware  # type: ignore[import-untyped]

# Where workers.api.urls is mounted (qinglong/urls.py).
WORKER_API_PREFIX = "/api/v1/worker/"


class WorkerApiPassBy:
    """A middleware that lets Worker API requests by untouched."""

    get_response: Any  # set by the middleware class it is mixed into

    def __call__(self, request: HttpRequest) -> Any:
        if request.path_info.startswith(WORKER_API_PREFIX):
            return self.get_response(request)
        return super().__call__(request)  # type: ignore[misc]


class StaticFilesMiddleware(WorkerApiPassBy, WhiteNoiseMiddleware):  # type: ignore[misc]
    """WhiteNoise: static files (admin, API docs), never under the Worker API."""


class BrowserAuthenticationMiddleware(WorkerApiPassBy, AuthenticationMiddleware):
    """`request.user` from the cookie session (Worker views have their own principal)."""


class BrowserMessageMiddleware(WorkerApiPassBy, MessageMiddleware):
    """The admin's flash messages."""
