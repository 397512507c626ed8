"""Worker authentication: the Worker credential and the Session token.

Both are `Authorization: Bearer …` secrets, deliberately distinct from the
operator's `Token …` scheme: a Worker credential can never call an operator
endpoint and an operator token can never call a Worker endpoint (README "Worker API").
Only SHA-256 digests are stored; lookups go through `workers.services`.
"""

from __future__ import annotations

from dataclasses import dataclass

from rest_framework import HTTP_HEADER_ENCODING, exceptions
from rest_framework.authentication import BaseAuthentication
from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from workers.models import Worker, WorkerAdminState, WorkerSession
from workers.services import SessionRejected, session_authenticate, worker_authenticate

_REALM = 'Bearer realm="qinglong-worker"'
# Longest secret we will even hash: ours are ~47 characters.
_MAX_SECRET_CHARS = 256


@dataclass(frozen=True)
class WorkerPrincipal:
    """`request.user` on Worker endpoints: a Worker (and its Session), never a User."""

    worker: Worker
    session: WorkerSession | None = None
    is_authenticated: bool = True
    # Operator permissions (IsAdminUser) read this; a Worker is never staff.
    is_staff: bool = False


def _bearer(request: Request) -> str | None:
    """The Bearer secret, None when another scheme (or none) is used."""
    # DRF's `get_authorization_header` reads `request.headers`, which builds a
    # mapping of every header of the request first (issue #12): the same
    # value, read from the one WSGI key it comes from.
    raw: bytes | str = request.META.get("HTTP_AUTHORIZATION", b"")
    if isinstance(raw, str):
        raw = raw.encode(HTTP_HEADER_ENCODING)
    parts = raw.split()
    if not parts or parts[0].lower() != b"bearer":
        return None
    if len(parts) != 2 or len(parts[1]) > _MAX_SECRET_CHARS:
        raise exceptions.AuthenticationFailed(code="authentication_failed")
    try:
        return parts[1].decode("ascii")
    except UnicodeDecodeError:
        raise exceptions.AuthenticationFailed(code="authentication_failed") from None


class WorkerCredentialAuthentication(BaseAuthentication):
    """The long-lived Worker credential: only for opening a Session."""

    def authenticate(self, request: Request) -> tuple[WorkerPrincipal, None] | None:
        secret = _bearer(request)
        if secret is None:
            return None
        worker = worker_authenticate(secret)
        if worker is None:
            raise exceptions.AuthenticationFailed(code="invalid_credential")
        return WorkerPrincipal(worker=worker), None

    def authenticate_header(self, request: Request) -> str:
        return _REALM


class SessionTokenAuthentication(BaseAuthentication):
    """The Session token: heartbeat, pull and ACK."""

    def authenticate(self, request: Request) -> tuple[WorkerPrincipal, WorkerSession] | None:
        secret = _bearer(request)
        if secret is None:
            return None
        try:
            session = session_authenticate(secret)
        except SessionRejected as err:
            if err.code == "worker_disabled":
                raise exceptions.PermissionDenied(code="worker_disabled") from None
            raise exceptions.AuthenticationFailed(code=err.code) from None
        return WorkerPrincipal(worker=session.worker, session=session), session

    def authenticate_header(self, request: Request) -> str:
        return _REALM


class IsEnabledWorker(BasePermission):
    """A Worker principal whose admin state is not `disabled` (else 403)."""

    def has_permission(self, request: Request, view: object) -> bool:
        principal = request.user
        if not isinstance(principal, WorkerPrincipal):
            return False
        if principal.worker.admin_state == WorkerAdminState.DISABLED:
            raise exceptions.PermissionDenied(code="worker_disabled")
        return True


class HasWorkerSession(IsEnabledWorker):
    def has_permission(self, request: Request, view: object) -> bool:
        return super().has_permission(request, view) and isinstance(request.auth, WorkerSession)
