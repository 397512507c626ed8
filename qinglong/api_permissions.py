"""Operator API authorization: staff AND the Django model permissions of the call.

`is_staff` alone only says "may use the console"; creating a Task, a Run or a
Schedule runs a command on a Worker, so each method names the model
permissions it needs (the same ones the admin enforces), in the style of DRF's
`DjangoModelPermissions`. Superusers hold every permission. Every operator API
(`runs.api`, `schedules.api`) uses this one class.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from qinglong.api_errors import ApiError

__all__ = ["OperatorPermission", "permissions_doc"]


class OperatorPermission(BasePermission):
    """is_staff, plus every permission in `view.required_permissions[method]`.

    Not staff (or not a User at all) → 403 `forbidden`; staff without one of the
    permissions → 403 `permission_denied`. A method with a handler but no
    declared permissions is refused: forgetting to declare fails closed.
    """

    def has_permission(self, request: Request, view: Any) -> bool:
        user = request.user
        if not (user and user.is_authenticated and getattr(user, "is_staff", False)):
            return False
        method = "GET" if request.method == "HEAD" else str(request.method)
        required: Mapping[str, tuple[str, ...]] = getattr(view, "required_permissions", {})
        if method not in required:
            # OPTIONS and methods without a handler (→ 405) change nothing.
            return method == "OPTIONS" or not hasattr(view, method.lower())
        if not user.has_perms(required[method]):
            # Its own code: DRF's bare refusal (not staff) stays `forbidden`.
            raise ApiError(
                status_code=403,
                code="permission_denied",
                message="this operation needs a model permission this user does not have",
            )
        return True


def permissions_doc(*perms: str) -> str:
    """The line each operation's OpenAPI description carries."""
    names = ", ".join(f"`{perm}`" for perm in perms)
    return (
        f"Requires a staff user with the model permission(s) {names} "
        "(superusers hold all); otherwise 403 `permission_denied`."
    )
