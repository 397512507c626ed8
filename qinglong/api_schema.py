"""OpenAPI helpers: the error envelope on every operation, Retry-After headers,
and `additionalProperties: false` on request bodies (unknown fields are a 400)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse

from qinglong.api_common import MAX_JSON_DEPTH, ErrorEnvelopeSerializer

_DESCRIPTIONS = {
    400: "Invalid request (`invalid_request`, `unknown_field`, `malformed_json`, "
    f"`nesting_too_deep` (arrays/objects nested deeper than {MAX_JSON_DEPTH} levels), "
    "`invalid_content_length`, …).",
    401: "Missing or invalid credentials.",
    403: "Authenticated but not allowed (`forbidden`; operator API: `permission_denied` "
    "when a staff user lacks the model permission the operation lists).",
    404: "Not found.",
    405: "Method not allowed.",
    409: "Conflict with the current state.",
    411: "A body without `Content-Length` (e.g. `Transfer-Encoding: chunked`): `length_required`.",
    413: "Request body too large (`payload_too_large`): over 80 KiB on the Worker API, over "
    "`DATA_UPLOAD_MAX_MEMORY_SIZE` (256 KiB by default) on the operator API; refused from "
    "`Content-Length` before the body is read.",
    415: "Request body must be `application/json`.",
    429: "Throttled (`throttled`); see `Retry-After`.",
    503: "Database unavailable (`database_unavailable`); see `Retry-After`.",
}

# Every operation can answer these (auth, body caps, content type, database).
COMMON_ERRORS = (400, 401, 403, 405, 411, 413, 415, 503)


def error_responses(*statuses: int) -> dict[int, OpenApiResponse]:
    return {
        status: OpenApiResponse(ErrorEnvelopeSerializer, description=_DESCRIPTIONS[status])
        for status in sorted({*COMMON_ERRORS, *statuses})
    }


def retry_after(*statuses: int) -> OpenApiParameter:
    return OpenApiParameter(
        "Retry-After",
        OpenApiTypes.INT,
        location=OpenApiParameter.HEADER,
        description="Seconds to wait before retrying.",
        response=sorted({503, *statuses}),
    )


_REF = "#/components/schemas/"
_DOUBLE = "RequestRequest"


def _rename_refs(node: Any, renames: dict[str, str]) -> Any:
    if isinstance(node, dict):
        return {
            key: (
                _REF + renames.get(value[len(_REF) :], value[len(_REF) :])
                if key == "$ref" and isinstance(value, str) and value.startswith(_REF)
                else _rename_refs(value, renames)
            )
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [_rename_refs(item, renames) for item in node]
    return node


def close_request_bodies(result: dict[str, Any], generator: Any, **kwargs: Any) -> dict[str, Any]:
    """POSTPROCESSING_HOOK: request components reject unknown properties, as the API does.

    Also names them `XRequest` instead of the split-request `XRequestRequest`.
    """
    schemas = result.get("components", {}).get("schemas", {})
    renames = {name: name[: -len("Request")] for name in schemas if name.endswith(_DOUBLE)}
    if renames:
        result = _rename_refs(result, renames)
        schemas = result["components"]["schemas"]
        result["components"]["schemas"] = {renames.get(k, k): v for k, v in schemas.items()}
        schemas = result["components"]["schemas"]
    for name, schema in schemas.items():
        if name.endswith("Request") and schema.get("type") == "object":
            schema.setdefault("additionalProperties", False)
    return result


PROTOCOL = """

## Worker protocol

1. An operator runs `manage.py enroll_worker NAME --slots N --executor TYPE` and gives the
   Worker its credential (printed once).
2. `POST /api/v1/worker/sessions` with `Authorization: Bearer <credential>` opens a Session
   and returns a `session_token` (shown once). A new Session fences every earlier one:
   their tokens get `401 session_replaced` and their unstarted leases go back to the queue.
   Rotating the credential fences every Session the same way (`401 credential_rotated`:
   open a new Session with the new credential).
3. Every other Worker call sends `Authorization: Bearer <session_token>`.
   `POST /api/v1/worker/heartbeat` every `heartbeat_interval_s`; stop every offer id it
   lists in `cancel`.
4. `POST /api/v1/worker/pull` with a fresh `pull_id` (UUID) and a fresh `lease_token`
   (32 random bytes, base64url). Each offer carries the ExecutionSpec and `spec_sha256`
   (SHA-256 of the canonical JSON: sorted keys, `(",", ":")` separators, UTF-8, no ASCII
   escaping); verify it. If the response is lost, repeat the same `pull_id` and token.
5. `POST /api/v1/worker/leases/{offer_id}/ack` with the lease token and `spec_sha256`:
   `starting` before spawning anything (a 409 means: do not run it), then `running`
   (`executor_handle`), then `succeeded`/`failed` (`exit_code`) or `start_failed`.
   Any 409 means: stop the Attempt. `cancel_requested: true` means: stop and ACK the end.

Errors are always `{"error": {"code", "message"}}`; 429 and 503 carry `Retry-After`.
Bodies need `Content-Length` (chunked bodies are `411 length_required`). Every response is
`Cache-Control: no-store`.
"""


def describe_protocol(result: dict[str, Any], generator: Any, **kwargs: Any) -> dict[str, Any]:
    """POSTPROCESSING_HOOK: the protocol walk-through a Worker author starts from."""
    info = result.setdefault("info", {})
    info["description"] = str(info.get("description", "")) + PROTOCOL
    return result
