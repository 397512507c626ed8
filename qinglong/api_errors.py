"""One error envelope for every API failure: ``{"error": {"code", "message"}}``.

README "Worker API": codes are low-cardinality and messages never echo secrets or
request values. DRF's own messages sometimes quote the input (``'"x" is not a
valid choice'``), so a message here is built only from our own fixed text and
from field names we declared — never from an exception's text.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.db import InterfaceError, OperationalError
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.utils.cache import patch_cache_control
from django.views import defaults
from django.views.decorators.csrf import csrf_exempt
from rest_framework import exceptions, status
from rest_framework.response import Response

logger = logging.getLogger("qinglong.api")

API_PREFIX = "/api/"
# Seconds a client should wait before retrying a request the database could not serve.
DATABASE_RETRY_AFTER_S = 5


class ApiError(exceptions.APIException):
    """An API failure with an explicit status, code and fixed (secret-free) message."""

    def __init__(self, *, status_code: int, code: str, message: str) -> None:
        super().__init__(detail=message, code=code)
        self.status_code = status_code
        self.error_code = code
        self.message = message


class LengthRequired(ApiError):
    """A body sent without Content-Length (e.g. `Transfer-Encoding: chunked`).

    Django reads such a body as empty, so without this a chunked heartbeat or
    ACK would be served as `{}` instead of what the client sent.
    """

    def __init__(self) -> None:
        super().__init__(
            status_code=status.HTTP_411_LENGTH_REQUIRED,
            code="length_required",
            message="send the request body with a Content-Length header, not Transfer-Encoding",
        )


class PayloadTooLarge(ApiError):
    def __init__(self) -> None:
        super().__init__(
            status_code=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE,
            code="payload_too_large",
            message="the request body is larger than this endpoint accepts",
        )


class NestingTooDeep(ApiError):
    """A body nesting arrays/objects deeper than the APIs allow.

    Refused before parsing: 40 KB of `[` used to drive the JSON parser into
    RecursionError, a 500.
    """

    def __init__(self, limit: int) -> None:
        super().__init__(
            status_code=status.HTTP_400_BAD_REQUEST,
            code="nesting_too_deep",
            message=f"the request body nests arrays/objects deeper than {limit} levels",
        )


class InvalidContentLength(ApiError):
    def __init__(self) -> None:
        super().__init__(
            status_code=status.HTTP_400_BAD_REQUEST,
            code="invalid_content_length",
            message="Content-Length must be a decimal number of bytes",
        )


def envelope(code: str, message: str) -> dict[str, dict[str, str]]:
    return {"error": {"code": code, "message": message}}


def no_store(response: HttpResponse) -> HttpResponse:
    """`Cache-Control: no-store`: API answers (offers carry specs and lease
    tokens, sessions their token) must never sit in a browser or proxy cache."""
    patch_cache_control(response, no_store=True)
    return response


def _envelope_response(code: str, message: str, status_code: int) -> JsonResponse:
    response = JsonResponse(envelope(code, message), status=status_code)
    no_store(response)
    return response


_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\[\]]{0,63}")


def safe_field_name(name: object) -> str:
    """A field name fit for a message; anything else may be pasted data (a secret)."""
    if isinstance(name, str) and _FIELD_NAME.fullmatch(name):
        return name
    return "body"


def _flatten_codes(codes: Any, prefix: str = "") -> Iterable[tuple[str, str]]:
    """(field path, code) pairs of a DRF `ValidationError.get_codes()` tree."""
    if isinstance(codes, Mapping):
        for key, value in codes.items():
            name = safe_field_name(str(key))
            if key == "non_field_errors":
                name = prefix or "body"
            else:
                name = f"{prefix}.{name}" if prefix else name
            yield from _flatten_codes(value, name)
    elif isinstance(codes, list | tuple):
        for item in codes:
            yield from _flatten_codes(item, prefix)
    else:
        yield (prefix or "body", str(codes))


_CODE_TEXT = re.compile(r"[a-z_]{1,40}")


def _validation_envelope(exc: exceptions.ValidationError) -> tuple[str, str]:
    pairs = list(_flatten_codes(exc.get_codes()))
    if any(code == "unknown_field" for _, code in pairs):
        fields = sorted({field for field, code in pairs if code == "unknown_field"})
        return "unknown_field", "unknown field(s): " + ", ".join(fields[:8])
    # Only DRF's code names (e.g. "required", "max_length") go into the
    # message: they describe the rule, never the value.
    parts = [
        f"{field}: {code if _CODE_TEXT.fullmatch(code) else 'invalid'}" for field, code in pairs
    ]
    return "invalid_request", "invalid request: " + "; ".join(parts[:8])


# Fixed messages for DRF's own exceptions; their texts may quote the request.
_DRF_ERRORS: tuple[tuple[type[exceptions.APIException], str, str], ...] = (
    (exceptions.ParseError, "malformed_json", "the request body is not valid JSON"),
    (
        exceptions.UnsupportedMediaType,
        "unsupported_media_type",
        "the request body must be application/json",
    ),
    (exceptions.NotAuthenticated, "not_authenticated", "authentication credentials are missing"),
    (exceptions.MethodNotAllowed, "method_not_allowed", "this method is not allowed here"),
    (exceptions.NotAcceptable, "not_acceptable", "no acceptable response content type"),
    (exceptions.NotFound, "not_found", "not found"),
    (exceptions.Throttled, "throttled", "too many requests; retry later"),
)

# Codes our authentication/permission classes raise on purpose, with their texts.
_AUTH_MESSAGES: Mapping[str, str] = {
    "invalid_credential": "the worker credential is not valid",
    "invalid_session_token": "the session token is not valid",
    "session_replaced": "this session was replaced by a newer session of the worker",
    "session_offline": "this session is offline; open a new session",
    "credential_rotated": (
        "the worker credential was rotated; open a new session with the new credential"
    ),
    "worker_disabled": "the worker is disabled",
    "authentication_failed": "authentication failed",
    "not_authenticated": "authentication credentials are missing",
}


def _exception_envelope(exc: Exception) -> tuple[int, str, str, dict[str, str]]:
    """(status, code, message, extra headers) for an exception we recognise."""
    if isinstance(exc, OperationalError | InterfaceError):
        # Never a 500 or a hang: the client retries (README "Worker API").
        logger.warning("database unavailable", extra={"event": "database_unavailable"})
        return (
            status.HTTP_503_SERVICE_UNAVAILABLE,
            "database_unavailable",
            "the database is unavailable; retry later",
            {"Retry-After": str(DATABASE_RETRY_AFTER_S)},
        )
    if isinstance(exc, ApiError):
        return exc.status_code, exc.error_code, exc.message, {}
    if isinstance(exc, Http404):
        return status.HTTP_404_NOT_FOUND, "not_found", "not found", {}
    if isinstance(exc, DjangoPermissionDenied):
        return status.HTTP_403_FORBIDDEN, "forbidden", "permission denied", {}
    if isinstance(exc, exceptions.ValidationError):
        code, message = _validation_envelope(exc)
        return status.HTTP_400_BAD_REQUEST, code, message, {}
    if isinstance(exc, exceptions.AuthenticationFailed | exceptions.PermissionDenied):
        raw = exc.get_codes()
        code = raw if isinstance(raw, str) else ""
        if code in _AUTH_MESSAGES:
            return exc.status_code, code, _AUTH_MESSAGES[code], {}
        if isinstance(exc, exceptions.AuthenticationFailed):
            return exc.status_code, "authentication_failed", "authentication failed", {}
        return exc.status_code, "forbidden", "permission denied", {}
    for kind, code, message in _DRF_ERRORS:
        if isinstance(exc, kind):
            headers: dict[str, str] = {}
            wait = getattr(exc, "wait", None)
            if isinstance(exc, exceptions.Throttled) and wait is not None:
                headers["Retry-After"] = str(max(1, math.ceil(wait)))
            return exc.status_code, code, message, headers
    if isinstance(exc, exceptions.APIException):
        return exc.status_code, "error", "the request failed", {}
    raise LookupError  # not ours: let Django's 500 handling take it


def api_exception_handler(exc: Exception, context: Mapping[str, Any]) -> Response | None:
    """REST_FRAMEWORK["EXCEPTION_HANDLER"]: every failure in the one envelope."""
    try:
        status_code, code, message, headers = _exception_envelope(exc)
    except LookupError:
        return None
    response = Response(envelope(code, message), status=status_code)
    no_store(response)
    for name, value in headers.items():
        response[name] = value
    if isinstance(exc, exceptions.APIException):
        auth_header = getattr(exc, "auth_header", None)
        if auth_header:
            response["WWW-Authenticate"] = auth_header
    return response


def _is_api(request: HttpRequest) -> bool:
    return request.path.startswith(API_PREFIX)


# No cookie-authenticated action happens here; without the exemption a POST to
# an unknown /api/ path would get Django's HTML CSRF page instead of the envelope.
@csrf_exempt
def api_not_found(request: HttpRequest, *args: object, **kwargs: object) -> JsonResponse:
    """Catch-all for unknown /api/ paths, so even DEBUG answers in the envelope."""
    return _envelope_response("not_found", "not found", 404)


def handler404(request: HttpRequest, exception: Exception) -> HttpResponse:
    if _is_api(request):
        return _envelope_response("not_found", "not found", 404)
    return defaults.page_not_found(request, exception)


def handler500(request: HttpRequest) -> HttpResponse:
    if _is_api(request):
        return _envelope_response("internal_error", "internal server error", 500)
    return defaults.server_error(request)


def handler403(request: HttpRequest, exception: Exception) -> HttpResponse:
    if _is_api(request):
        return _envelope_response("forbidden", "permission denied", 403)
    return defaults.permission_denied(request, exception)


def handler400(request: HttpRequest, exception: Exception) -> HttpResponse:
    if _is_api(request):
        return _envelope_response("invalid_request", "bad request", 400)
    return defaults.bad_request(request, exception)
