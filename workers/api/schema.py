"""OpenAPI security schemes of the two Worker Bearer secrets."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class WorkerCredentialScheme(OpenApiAuthenticationExtension):
    target_class = "workers.api.authentication.WorkerCredentialAuthentication"
    name = "workerCredential"

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "The Worker credential printed once by `manage.py enroll_worker`; "
            "only for `POST /api/v1/worker/sessions`.",
        }


class SessionTokenScheme(OpenApiAuthenticationExtension):
    target_class = "workers.api.authentication.SessionTokenAuthentication"
    name = "sessionToken"

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "The session token returned once by `POST /api/v1/worker/sessions`.",
        }
