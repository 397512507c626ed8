"""Worker API views (README "Worker API"): thin — validate, call one use case, shape JSON.

Views never log request bodies; every failure leaves through the one error
envelope (`qinglong.api_errors`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any, TypedDict, cast

from django.conf import settings
from django.db import InterfaceError, OperationalError
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers, status
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

import workers.api.schema  # noqa: F401  (registers the OpenAPI security schemes)
from dispatch.core.ports import to_rfc3339
from leases.ack import (
    ACK_PHASE_DEPENDENT_FIELDS,
    ACK_PHASE_FIELDS,
    AckItem,
    AckPhase,
    lease_ack,
    lease_ack_each,
)
from leases.errors import LeaseError
from leases.models import ExecutionOutcome
from leases.reconcile import ExecutionReport, leases_reconcile
from qinglong.api_common import (
    ApiView,
    ErrorEnvelopeSerializer,
    parse_query_int,
    unknown_field_error,
    validated,
)
from qinglong.api_errors import ApiError, envelope, safe_field_name
from qinglong.api_schema import error_responses, retry_after
from workers.api.authentication import (
    HasWorkerSession,
    IsEnabledWorker,
    SessionTokenAuthentication,
    WorkerCredentialAuthentication,
    WorkerPrincipal,
)
from workers.api.pull import PullIdConflict, worker_pull
from workers.api.serializers import (
    ACK_BATCH_MAX_BODY_BYTES,
    LEASE_TOKEN_RE,
    MAX_ACKS_PER_REQUEST,
    MAX_OFFERS_PER_RESPONSE,
    OFFER_ID_RE,
    SPEC_SHA256_RE,
    AckBatchRequestSerializer,
    AckBatchResponseSerializer,
    AckItemSerializer,
    AckRequestSerializer,
    AckResponseSerializer,
    HeartbeatRequestSerializer,
    HeartbeatResponseSerializer,
    PullRequestSerializer,
    PullResponseSerializer,
    ReconcileRequestSerializer,
    ReconcileResponseSerializer,
    SessionOpenRequestSerializer,
    SessionOpenResponseSerializer,
)
from workers.api.throttles import (
    HeartbeatThrottle,
    PullThrottle,
    ReconcileThrottle,
    SessionOpenThrottle,
)
from workers.models import WorkerSession
from workers.services import (
    CredentialRotated,
    SessionRejected,
    WorkerDisabled,
    WorkerInputError,
    session_heartbeat,
    session_open,
)

# README "Worker API": Worker bodies are small; the largest is an ACK with a 64 KiB tail.
WORKER_MAX_BODY_BYTES = 80 * 1024

_TAG = ["worker"]

# One instance of each request serializer for every request and thread (see
# `qinglong.api_common.validated`): building one per request deep-copied its
# declared fields each time (issue #12, bench/request_cost.py).
_SESSION_OPEN = SessionOpenRequestSerializer()
_HEARTBEAT = HeartbeatRequestSerializer()
_RECONCILE = ReconcileRequestSerializer()
_PULL = PullRequestSerializer()
_ACK = AckRequestSerializer()

logger = logging.getLogger("qinglong.workers")


def _rejected(err: SessionRejected) -> ApiError:
    messages = {
        "session_replaced": "this session was replaced by a newer session of the worker",
        "session_offline": "this session is offline; open a new session",
        "credential_rotated": (
            "the worker credential was rotated; open a new session with the new credential"
        ),
    }
    return ApiError(
        status_code=status.HTTP_401_UNAUTHORIZED,
        code=err.code if err.code in messages else "invalid_session_token",
        message=messages.get(err.code, "the session token is not valid"),
    )


class WorkerApiView(ApiView):
    max_body_bytes = WORKER_MAX_BODY_BYTES
    authentication_classes = [SessionTokenAuthentication]
    permission_classes = [HasWorkerSession]
    throttle_classes: list[Any] = []

    def session(self, request: Request) -> WorkerSession:
        return cast(WorkerSession, request.auth)


class SessionOpenView(WorkerApiView):
    """Open a Worker Session with the Worker credential."""

    authentication_classes = [WorkerCredentialAuthentication]
    permission_classes = [IsEnabledWorker]
    throttle_classes = [SessionOpenThrottle]

    @extend_schema(
        operation_id="worker_session_open",
        summary="Open a Session (fences every earlier Session of this Worker)",
        tags=_TAG,
        request=SessionOpenRequestSerializer,
        responses={
            201: SessionOpenResponseSerializer,
            **error_responses(429),
        },
        parameters=[retry_after(429)],
    )
    def post(self, request: Request) -> Response:
        body = validated(_SESSION_OPEN, request.data)
        principal = cast(WorkerPrincipal, request.user)
        try:
            opened = session_open(
                worker=principal.worker,
                executor_types=body["executor_types"],
                labels=body.get("labels", {}),
                slots=body["slots"],
                agent_version=body.get("agent_version", ""),
            )
        except WorkerInputError as err:
            # The service names the field and the rule, never the value.
            raise ApiError(
                status_code=400, code="invalid_request", message=f"{err.field}: {err.message}"
            ) from None
        except WorkerDisabled:
            raise ApiError(
                status_code=403, code="worker_disabled", message="the worker is disabled"
            ) from None
        except CredentialRotated:
            # Rotated while this open was under way: as if it came a moment later.
            raise ApiError(
                status_code=401,
                code="invalid_credential",
                message="the worker credential is not valid",
            ) from None
        session = opened.session
        return Response(
            {
                "session_id": str(session.session_id),
                "generation": session.generation,
                "session_token": opened.token,
                "heartbeat_interval_s": int(settings.QINGLONG_HEARTBEAT_INTERVAL_S),
                "session_timeout_s": int(settings.QINGLONG_SESSION_TIMEOUT_S),
                "lease_ttl_s": int(settings.QINGLONG_DISPATCH["lease_ttl_s"]),
            },
            status=status.HTTP_201_CREATED,
        )


class HeartbeatView(WorkerApiView):
    """Session heartbeat."""

    throttle_classes = [HeartbeatThrottle]

    @extend_schema(
        operation_id="worker_heartbeat",
        summary="Keep the Session online, renew held leases, get cancel and stop verdicts",
        description=(
            "Send one every `heartbeat_interval_s`. A heartbeat sooner than the server's "
            "minimum interval after the last recorded one is answered (state, cancel and "
            "stop verdicts) without being recorded; `draining: true` always takes effect at "
            "once. With `held`, a recorded heartbeat renews only the listed started leases "
            "and ends this Session's started Attempts it does not list (`not_held`); "
            "without it, every started lease of the Session is renewed."
        ),
        tags=_TAG,
        request=HeartbeatRequestSerializer,
        responses={200: HeartbeatResponseSerializer, **error_responses(429)},
        parameters=[retry_after(429)],
    )
    def post(self, request: Request) -> Response:
        body = validated(_HEARTBEAT, request.data)
        try:
            beat = session_heartbeat(
                session=self.session(request),
                draining=body.get("draining", False),
                held=body.get("held"),
            )
        except SessionRejected as err:
            raise _rejected(err) from None
        return Response(
            {
                "session_state": beat.session_state,
                "cancel": list(beat.cancel),
                "stop": list(beat.stop),
                "server_time": to_rfc3339(beat.server_time),
            }
        )


class ReconcileView(WorkerApiView):
    """A restarted Worker's report on its earlier Sessions' executions."""

    throttle_classes = [ReconcileThrottle]

    @extend_schema(
        operation_id="worker_reconcile",
        summary="Report executions of earlier Sessions as gone (lifts the retry's grace)",
        description=(
            "Send with the session token of the Worker's NEW Session, after ending whatever "
            "its journal shows an earlier Session left running. Each item names a lease of "
            "this Worker (any Session generation) by offer id and proves it with the lease "
            "token. It records who confirmed the execution gone, when, how (outcome) and its "
            "exit code on the lease, and a retry of the Run that waits for the lost-execution "
            "grace (`QL_LOST_EXECUTION_GRACE_S`) may then be claimed at once. Idempotent. An "
            "offer id that does not exist, is another Worker's, or comes with a wrong token "
            "is `unknown`, one answer for all."
        ),
        tags=_TAG,
        request=ReconcileRequestSerializer,
        responses={200: ReconcileResponseSerializer, **error_responses(429)},
        parameters=[retry_after(429)],
    )
    def post(self, request: Request) -> Response:
        body = validated(_RECONCILE, request.data)
        results = leases_reconcile(
            session=self.session(request),
            reports=[
                ExecutionReport(
                    offer_id=item["offer_id"],
                    lease_token=item["lease_token"],
                    outcome=ExecutionOutcome(item["outcome"]),
                    exit_code=item.get("exit_code"),
                )
                for item in body["executions"]
            ],
        )
        return Response(
            {
                "results": [
                    {"offer_id": offer_id, "status": str(status)} for offer_id, status in results
                ]
            }
        )


MAX_PULL_WAIT_S = 60


def _wait_s(request: Request) -> int:
    params = request.query_params
    # README "Worker API": unknown request fields are a 400, never silently ignored; the
    # same goes for a query string (and a repeated wait_s is ambiguous).
    unknown = {key for key in params if key != "wait_s"}
    if unknown:
        raise unknown_field_error({safe_field_name(key) for key in unknown})
    if len(params.getlist("wait_s")) > 1:
        raise ApiError(
            status_code=400, code="invalid_request", message="wait_s: given more than once"
        )
    # ASCII digits only: str.isdigit() takes "²", which int() then refused (a 500).
    wait = parse_query_int(params.get("wait_s", "0"))
    if wait is None or wait > MAX_PULL_WAIT_S:
        raise ApiError(
            status_code=400,
            code="invalid_request",
            message=f"wait_s: must be an integer from 0 to {MAX_PULL_WAIT_S}",
        )
    return wait


class PullView(WorkerApiView):
    """Pull this Session's offers."""

    throttle_classes = [PullThrottle]

    @extend_schema(
        operation_id="worker_pull",
        summary="Pull offers: this Session's undelivered leases first, else new claims",
        description=(
            "Send a fresh `pull_id` (UUID) and a fresh high-entropy `lease_token` "
            "(base64url, ≥ 43 chars) per pull. After a lost response, repeat the same "
            "`pull_id` with the same token: the same offers come back with the token "
            "echoed. The same `pull_id` with another token is `409 pull_id_conflict`. "
            "`max_offers` is capped by the Session's free slots and by the response size "
            f"budget ({MAX_OFFERS_PER_RESPONSE} offers per response)."
        ),
        tags=_TAG,
        request=PullRequestSerializer,
        responses={200: PullResponseSerializer, **error_responses(409, 429)},
        parameters=[
            OpenApiParameter(
                "wait_s",
                {"type": "integer", "minimum": 0, "maximum": MAX_PULL_WAIT_S, "default": 0},
                location=OpenApiParameter.QUERY,
                required=False,
                description=(
                    "Long poll: when nothing is deliverable, wait up to this many seconds "
                    f"(0-{MAX_PULL_WAIT_S}, capped by the server's QL_PULL_WAIT_MAX_S; "
                    "0 there means the server never waits) for an offer to be announced. "
                    "One pull per Session waits: a newer waiting pull makes an older one "
                    "answer at once (empty), and so does the Session being fenced."
                ),
            ),
            retry_after(429),
        ],
    )
    def post(self, request: Request) -> Response:
        body = validated(_PULL, request.data)
        try:
            result = worker_pull(
                session=self.session(request),
                pull_id=body["pull_id"],
                lease_token=body["lease_token"],
                # Response size budget: offers times the largest spec fit the agent's cap.
                max_offers=min(body.get("max_offers", 1), MAX_OFFERS_PER_RESPONSE),
                wait_s=_wait_s(request),
            )
        except PullIdConflict:
            raise ApiError(
                status_code=409,
                code="pull_id_conflict",
                message="this pull_id was already used with another lease_token",
            ) from None
        # The only response that carries specs and lease tokens (docs/adr/0002).
        return Response(
            {
                "offers": [offer.to_wire() for offer in result.offers],
                "status": result.status,
                "reason": result.reason,
                "truncated": result.truncated,
            }
        )


class AckView(WorkerApiView):
    """ACK a phase of a leased Attempt."""

    @extend_schema(
        operation_id="worker_lease_ack",
        summary="ACK a lease phase: starting, running, start_failed, succeeded, failed",
        description=(
            "Spawn nothing before the `starting` ACK is accepted. A repeat of the same phase "
            "is idempotent. 403: another Session's lease or a wrong lease token (nothing "
            "changes). 409: the lease expired, was revoked or released, the Run was "
            "cancelled, the phase is not allowed now, or `spec_sha256` differs — stop the "
            "Attempt."
        ),
        tags=_TAG,
        request=AckRequestSerializer,
        responses={200: AckResponseSerializer, **error_responses(404, 409)},
        parameters=[
            OpenApiParameter("offer_id", str, location=OpenApiParameter.PATH, pattern=OFFER_ID_RE),
            retry_after(),
        ],
    )
    def post(self, request: Request, offer_id: str) -> Response:
        body = validated(_ACK, request.data)
        try:
            result = lease_ack(
                session=self.session(request), offer_id=offer_id, **_ack_fields(body)
            )
        except LeaseError as err:
            # LeaseError messages are fixed texts and state names, never secrets.
            raise ApiError(status_code=err.status, code=err.code, message=str(err)) from None
        return Response(
            {
                "offer_id": result.offer_id,
                "attempt_state": result.attempt_state,
                "run_state": result.run_state,
                "cancel_requested": result.cancel_requested,
            }
        )


# One item validator for every request: a serializer instance only reads its
# declared fields while validating, so threads can share it (DRF's ListField
# shares its child the same way), and no request pays for copying its fields.
_ACK_ITEM = AckItemSerializer()
_ACK_ITEM_FIELDS = frozenset(_ACK_ITEM.fields)
_OUTPUT_TAIL = _ACK_ITEM.fields["output_tail"]
_PHASES = {str(phase): phase for phase in AckPhase}
_OFFER_ID = re.compile(OFFER_ID_RE)
_SPEC_SHA256 = re.compile(SPEC_SHA256_RE)
_LEASE_TOKEN = re.compile(LEASE_TOKEN_RE)
_NUL_OR_SURROGATE = re.compile("[\x00\ud800-\udfff]")
_INT32 = 2**31


def _plain_text(value: object, *, min_length: int, max_length: int) -> bool:
    return (
        type(value) is str
        and min_length <= len(value) <= max_length
        and _NUL_OR_SURROGATE.search(value) is None
    )


def _plain_ack_item(item: Mapping[str, Any]) -> AckItem | None:
    """The item as `AckItemSerializer` would read it, when it plainly passes
    every one of its checks; None for anything else, which the serializer then
    decides (and names what is wrong).

    The agent's items are all plain: reading them here costs a few regex
    matches instead of the serializer's field-by-field run (about a tenth of
    an 8-item `POST acks`, issue #12, bench/request_cost.py). Held to the
    serializer item by item in workers/tests/test_api_ack_batch.py: never an
    item it refuses, never another reading of one it accepts.
    """
    if not _ACK_ITEM_FIELDS.issuperset(item):
        return None
    raw_phase, offer_id = item.get("phase"), item.get("offer_id")
    token, digest = item.get("lease_token"), item.get("spec_sha256")
    phase = _PHASES.get(raw_phase) if type(raw_phase) is str else None
    if (
        phase is None
        or type(offer_id) is not str
        or type(token) is not str
        or type(digest) is not str
        or _OFFER_ID.fullmatch(offer_id) is None
        or _SPEC_SHA256.fullmatch(digest) is None
        or _LEASE_TOKEN.fullmatch(token) is None
    ):
        return None
    required, optional = ACK_PHASE_FIELDS[phase]
    for name in ACK_PHASE_DEPENDENT_FIELDS:
        if (name in required and name not in item) or (
            name in item and name not in required | optional
        ):
            return None
    handle, exit_code = item.get("executor_handle", ""), item.get("exit_code")
    error_code, tail = item.get("error_code", ""), item.get("output_tail", "")
    if "executor_handle" in item and not _plain_text(handle, min_length=1, max_length=200):
        return None
    if "exit_code" in item and (type(exit_code) is not int or not -_INT32 <= exit_code < _INT32):
        return None
    if "error_code" in item and not _plain_text(error_code, min_length=0, max_length=64):
        return None
    if "output_tail" in item:
        try:
            # The field itself: its size rule and its cleaning (NUL, surrogates).
            tail = _OUTPUT_TAIL.run_validation(tail)
        except ValidationError:
            return None
    return AckItem(
        offer_id=offer_id,
        phase=phase,
        lease_token=token,
        spec_sha256=digest,
        executor_handle=handle,
        exit_code=exit_code,
        error_code=error_code,
        output_tail=tail,
    )


def _ack_items(data: Any) -> list[AckItem]:
    """The items of `POST acks`, each validated as a single ACK's body; the
    first bad one is a 400 naming it by index and field, and nothing is applied."""
    if not isinstance(data, Mapping):
        raise ValidationError({"body": [serializers.ErrorDetail("not_object", code="not_object")]})
    unknown = {str(key) for key in data} - {"acks"}
    if unknown:
        raise unknown_field_error({safe_field_name(key) for key in unknown})
    raw = data.get("acks")
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_ACKS_PER_REQUEST:
        raise ApiError(
            status_code=400,
            code="invalid_request",
            message=f"invalid request: acks: a list of 1 to {MAX_ACKS_PER_REQUEST} ACKs",
        )
    items = []
    for index, item in enumerate(raw):
        if not isinstance(item, Mapping):
            raise ValidationError(
                {f"acks[{index}]": [serializers.ErrorDetail("not_object", code="not_object")]}
            )
        plain = _plain_ack_item(item)
        if plain is not None:
            items.append(plain)
            continue
        try:
            items.append(_serialized_ack_item(item))
        except ValidationError as err:
            # The single ACK's envelope, each field prefixed by its item.
            raise ValidationError({f"acks[{index}]": err.detail}) from None
    return items


def _serialized_ack_item(item: Mapping[str, Any]) -> AckItem:
    """The item as `AckItemSerializer` reads it (ValidationError: what is wrong)."""
    body = _ACK_ITEM.run_validation(item)
    return AckItem(offer_id=body["offer_id"], **_ack_fields(body))


class _AckFields(TypedDict):
    phase: AckPhase
    lease_token: str
    spec_sha256: str
    executor_handle: str
    exit_code: int | None
    error_code: str
    output_tail: str


def _ack_fields(body: Mapping[str, Any]) -> _AckFields:
    """A validated ACK body (single or batch item) as `lease_ack` and `AckItem`
    take it, the fields a phase leaves out at their defaults."""
    return _AckFields(
        phase=AckPhase(body["phase"]),
        lease_token=body["lease_token"],
        spec_sha256=body["spec_sha256"],
        executor_handle=body.get("executor_handle", ""),
        exit_code=body.get("exit_code"),
        error_code=body.get("error_code", ""),
        output_tail=body.get("output_tail", ""),
    )


class AckBatchView(WorkerApiView):
    """ACK phases of several of this Session's leases in one request."""

    max_body_bytes = ACK_BATCH_MAX_BODY_BYTES

    @extend_schema(
        operation_id="worker_lease_acks",
        summary="ACK phases of several leases at once, each applied and answered on its own",
        description=(
            f"1 to {MAX_ACKS_PER_REQUEST} items (at most "
            f"{ACK_BATCH_MAX_BODY_BYTES // 1024} KiB), each the body of "
            "`POST leases/{offer_id}/ack` plus its `offer_id`. A malformed item is a 400 "
            "for the whole request (named by index and field, nothing applied). Otherwise "
            "each item is applied in the order given, in its own transaction, exactly as the "
            "single ACK would be — authorized by its own lease token, a compare-and-set with "
            "its history row, a repeat of the same phase a no-op — and `results[i]` is its "
            "answer: the status the single ACK would have had and its body (200: "
            "`attempt_state`, `run_state`, `cancel_requested`; 403/404/409: `error`). A 409 "
            "means: stop that Attempt. 503 on an item: it was not applied (the database was "
            "unavailable), send it again; the items before it were applied."
        ),
        tags=_TAG,
        request=AckBatchRequestSerializer,
        responses={
            200: AckBatchResponseSerializer,
            **error_responses(),
            413: OpenApiResponse(
                ErrorEnvelopeSerializer,
                description="Request body too large (`payload_too_large`): over "
                f"{ACK_BATCH_MAX_BODY_BYTES // 1024 // 1024} MiB here (80 KiB on the other "
                "Worker API operations); refused from `Content-Length` before the body is read.",
            ),
        },
        parameters=[retry_after()],
    )
    def post(self, request: Request) -> Response:
        items = _ack_items(request.data)
        results: list[dict[str, Any]] = []
        try:
            for item, outcome in zip(
                items, lease_ack_each(session=self.session(request), items=items), strict=False
            ):
                if isinstance(outcome, LeaseError):
                    # LeaseError messages are fixed texts and state names, never secrets.
                    results.append(
                        {
                            "offer_id": item.offer_id,
                            "status": outcome.status,
                            **envelope(outcome.code, str(outcome)),
                        }
                    )
                    continue
                results.append(
                    {
                        "offer_id": outcome.offer_id,
                        "status": 200,
                        "attempt_state": outcome.attempt_state,
                        "run_state": outcome.run_state,
                        "cancel_requested": outcome.cancel_requested,
                    }
                )
        except (OperationalError, InterfaceError):
            # Those before were committed; this one and the rest were not applied.
            logger.warning("database unavailable", extra={"event": "database_unavailable"})
            unavailable = envelope(
                "database_unavailable", "the database is unavailable; retry later"
            )
            results.extend(
                {"offer_id": item.offer_id, "status": 503, **unavailable}
                for item in items[len(results) :]
            )
        return Response({"results": results})
