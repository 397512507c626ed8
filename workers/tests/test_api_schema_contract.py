"""The OpenAPI schema states the rules the server enforces (issue 8, item 7).

Loaded from `/api/schema/` as a client would: 411/413 on every operation that
takes a body, the `wait_s` range, and the ACK's cross-field rules as one
`oneOf` branch per phase — checked against the serializer for every phase and
every combination of the phase-dependent fields, so the two cannot drift.
"""

from __future__ import annotations

from itertools import combinations
from typing import Any

import pytest
from django.test import Client
from jsonschema import Draft4Validator  # type: ignore[import-untyped]

from leases.ack import ACK_PHASE_DEPENDENT_FIELDS, ACK_PHASE_FIELDS, AckPhase
from workers.api.serializers import AckItemSerializer, AckRequestSerializer
from workers.api.views import MAX_PULL_WAIT_S

pytestmark = pytest.mark.django_db

ACK_PATH = "/api/v1/worker/leases/{offer_id}/ack"
ACKS_PATH = "/api/v1/worker/acks"
VALUES = {
    "executor_handle": "pid:42",
    "exit_code": 0,
    "error_code": "spawn_failed",
    "output_tail": "done\n",
}


@pytest.fixture
def schema(client: Client) -> dict[str, Any]:
    response = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    return dict(response.json())


def _operations(schema: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (method, path, op)
        for path, ops in schema["paths"].items()
        for method, op in ops.items()
        if method in {"get", "post", "put", "patch", "delete"}
    ]


def test_every_operation_with_a_body_documents_411_and_413(schema: dict[str, Any]) -> None:
    with_body = [(m, p, op) for m, p, op in _operations(schema) if "requestBody" in op]
    assert len(with_body) >= 8
    for method, path, op in with_body:
        for status in ("400", "411", "413"):
            assert status in op["responses"], (method, path, status)
        text = op["responses"]["413"]["description"]
        assert "payload_too_large" in text and "80 KiB" in text
    # 400 names the nesting limit.
    assert "nesting_too_deep" in with_body[0][2]["responses"]["400"]["description"]


def test_wait_s_documents_its_range(schema: dict[str, Any]) -> None:
    [param] = [
        p
        for p in schema["paths"]["/api/v1/worker/pull"]["post"]["parameters"]
        if p["name"] == "wait_s"
    ]
    assert param["in"] == "query"
    assert param["schema"]["type"] == "integer"
    assert param["schema"]["minimum"] == 0
    assert param["schema"]["maximum"] == MAX_PULL_WAIT_S


def test_query_integers_document_their_range(schema: dict[str, Any]) -> None:
    for path in ("/api/v1/runs", "/api/v1/projects"):
        [limit] = [p for p in schema["paths"][path]["get"]["parameters"] if p["name"] == "limit"]
        assert (limit["schema"]["minimum"], limit["schema"]["maximum"]) == (1, 100)


def test_the_ack_body_is_one_branch_per_phase(schema: dict[str, Any]) -> None:
    body = schema["paths"][ACK_PATH]["post"]["requestBody"]["content"]["application/json"]
    ack = schema["components"]["schemas"][body["schema"]["$ref"].rsplit("/", 1)[1]]
    assert ack["discriminator"]["propertyName"] == "phase"
    assert set(ack["discriminator"]["mapping"]) == {p.value for p in AckPhase}
    assert len(ack["oneOf"]) == len(AckPhase)
    for phase, ref in ack["discriminator"]["mapping"].items():
        branch = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
        required, optional = ACK_PHASE_FIELDS[AckPhase(phase)]
        assert branch["properties"]["phase"]["enum"] == [phase]
        assert branch["additionalProperties"] is False
        assert set(branch["required"]) == {"phase", "lease_token", "spec_sha256", *required}
        assert set(branch["properties"]) == {
            "phase",
            "lease_token",
            "spec_sha256",
            *required,
            *optional,
        }


def test_an_item_of_post_acks_is_one_branch_per_phase_with_its_offer_id(
    schema: dict[str, Any],
) -> None:
    op = schema["paths"][ACKS_PATH]["post"]
    body = schema["components"]["schemas"][
        op["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    ]
    acks = body["properties"]["acks"]
    assert (acks["minItems"], acks["maxItems"]) == (1, 64)
    item = schema["components"]["schemas"][acks["items"]["$ref"].rsplit("/", 1)[1]]
    assert set(item["discriminator"]["mapping"]) == {p.value for p in AckPhase}
    for phase, ref in item["discriminator"]["mapping"].items():
        branch = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
        required, optional = ACK_PHASE_FIELDS[AckPhase(phase)]
        assert branch["additionalProperties"] is False
        common = {"offer_id", "phase", "lease_token", "spec_sha256"}
        assert set(branch["required"]) == common | required
        assert set(branch["properties"]) == common | required | optional
    assert "1 MiB" in op["responses"]["413"]["description"]
    result = schema["components"]["schemas"]["AckBatchResult"]
    assert set(result["required"]) == {"offer_id", "status"}


def test_the_item_schema_accepts_exactly_what_the_item_serializer_accepts(
    schema: dict[str, Any],
) -> None:
    root = {"$ref": "#/components/schemas/AckItemRequest", "components": schema["components"]}
    validator = Draft4Validator(root)
    base = {"offer_id": "a" * 64, "lease_token": "t" * 43, "spec_sha256": "0" * 64}
    for phase in AckPhase:
        for fields in _subsets(ACK_PHASE_DEPENDENT_FIELDS):
            body = {**base, "phase": phase.value, **{name: VALUES[name] for name in fields}}
            assert AckItemSerializer(data=body).is_valid() == validator.is_valid(body)
        missing = {"phase": phase.value, "lease_token": "t" * 43, "spec_sha256": "0" * 64}
        assert not AckItemSerializer(data=missing).is_valid()
        assert not validator.is_valid(missing)


def _subsets(items: tuple[str, ...]) -> list[tuple[str, ...]]:
    return [combo for size in range(len(items) + 1) for combo in combinations(items, size)]


def test_the_schema_accepts_exactly_what_the_serializer_accepts(schema: dict[str, Any]) -> None:
    root = {"$ref": "#/components/schemas/AckRequest", "components": schema["components"]}
    validator = Draft4Validator(root)
    base = {"lease_token": "t" * 43, "spec_sha256": "0" * 64}
    checked = 0
    for phase in AckPhase:
        for fields in _subsets(ACK_PHASE_DEPENDENT_FIELDS):
            body = {**base, "phase": phase.value, **{name: VALUES[name] for name in fields}}
            serializer_ok = AckRequestSerializer(data=body).is_valid()
            schema_ok = validator.is_valid(body)
            assert serializer_ok == schema_ok, (phase, fields, serializer_ok)
            checked += 1
    assert checked == len(AckPhase) * 2 ** len(ACK_PHASE_DEPENDENT_FIELDS)


@pytest.mark.parametrize(
    ("phase", "fields", "ok"),
    [
        ("starting", (), True),
        ("running", ("executor_handle",), True),
        ("running", (), False),
        ("running", ("executor_handle", "exit_code"), False),
        ("succeeded", ("exit_code",), True),
        ("succeeded", ("exit_code", "output_tail", "error_code"), True),
        ("failed", (), False),
        ("start_failed", (), True),
        ("start_failed", ("exit_code", "error_code", "output_tail"), True),
        ("starting", ("output_tail",), False),
    ],
)
def test_the_documented_ack_rules(phase: str, fields: tuple[str, ...], ok: bool) -> None:
    body: dict[str, object] = {"lease_token": "t" * 43, "spec_sha256": "0" * 64, "phase": phase}
    body.update({name: VALUES[name] for name in fields})
    assert AckRequestSerializer(data=body).is_valid() is ok
