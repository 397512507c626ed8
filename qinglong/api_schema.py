"""OpenAPI helpers: the error envelope on every operation, Retry-After headers,
and `additionalProperties: false` on request bodies (unknown fields are a 400)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse

from qinglong.api_common import ErrorEnvelopeSerializer

_DESCRIPTIONS = {
    400: "Invalid request (`invalid_request`, `unknown_field`, `malformed_json`, …).",
    401: "Missing or invalid credentials.",
    403: "Authenticated but not allowed.",
    404: "Not found.",
    405: "Method not allowed.",
    409: "Conflict with the current state.",
    413: "Request body too large (`payload_too_large`).",
    415: "Request body must be `application/json`.",
    429: "Throttled (`throttled`); see `Retry-After`.",
    503: "Database unavailable (`database_unavailable`); see `Retry-After`.",
}

# Every operation can answer these (auth, body caps, content type, database).
COMMON_ERRORS = (400, 401, 403, 405, 413, 415, 503)


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
