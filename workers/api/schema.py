"""OpenAPI security schemes of the two Worker Bearer secrets."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension

from leases.ack import ACK_PHASE_FIELDS


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


_REF = "#/components/schemas/"
_ACK_COMMON = ("phase", "lease_token", "spec_sha256")


def _phase_component(phase: str, prefix: str = "Ack") -> str:
    return prefix + "".join(part.title() for part in phase.split("_")) + "Request"


def _per_phase(
    schemas: dict[str, Any], base_name: str, *, prefix: str, common: tuple[str, ...], what: str
) -> None:
    """Replace component `base_name` by one `oneOf` branch per phase."""
    base = schemas.get(base_name)
    if not base or "properties" not in base:
        return
    properties: dict[str, Any] = base["properties"]
    branches: dict[str, str] = {}
    for phase, (required, optional) in ACK_PHASE_FIELDS.items():
        name = _phase_component(str(phase), prefix)
        fields = [*common, *sorted(required | optional)]
        extras = ", ".join(f"`{f}`" for f in sorted(required)) or "nothing else"
        allowed = ", ".join(f"`{f}`" for f in sorted(optional)) or "nothing else"
        schemas[name] = {
            "type": "object",
            "description": f"{what} `{phase}`: requires {extras}; may carry {allowed}. "
            "Any other field is a 400 (`not_allowed_for_phase` or `unknown_field`).",
            "properties": {
                "phase": {"type": "string", "enum": [str(phase)]},
                **{f: properties[f] for f in fields if f != "phase"},
            },
            "required": sorted({*common, *required}),
            "additionalProperties": False,
        }
        branches[str(phase)] = _REF + name
    schemas[base_name] = {
        "description": f"{what}: one shape per `phase` (the cross-field rules the server "
        "enforces): `running` requires `executor_handle`; `succeeded` and `failed` require "
        "`exit_code`; `start_failed` may carry it; `error_code` and `output_tail` only "
        "on `succeeded`, `failed` and `start_failed`; `starting` carries nothing else.",
        "oneOf": [{"$ref": ref} for ref in branches.values()],
        "discriminator": {"propertyName": "phase", "mapping": branches},
    }


def ack_request_per_phase(result: dict[str, Any], generator: Any, **kwargs: Any) -> dict[str, Any]:
    """POSTPROCESSING_HOOK: the ACK body as one `oneOf` branch per phase.

    Built from `leases.ack.ACK_PHASE_FIELDS`, the table `AckRequestSerializer.validate`
    enforces: each branch lists exactly the fields its phase requires and may
    carry, so a client generated from the schema cannot send `exit_code` with
    `running` or forget `executor_handle`. The items of `POST acks` get the
    same branches with their `offer_id`.
    """
    schemas = result.get("components", {}).get("schemas", {})
    _per_phase(schemas, "AckRequest", prefix="Ack", common=_ACK_COMMON, what="ACK")
    _per_phase(
        schemas,
        "AckItemRequest",
        prefix="AckItem",
        common=("offer_id", *_ACK_COMMON),
        what="An item of `POST acks`",
    )
    return result
