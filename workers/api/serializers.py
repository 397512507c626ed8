"""Request and response bodies of the Worker API (README "Worker API").

Request serializers only check shape and types (strictly: unknown fields are a
400); the rules live in the services and `dispatch.core`, so there is never a
second validator. Response serializers document the wire format for OpenAPI;
the views emit the exact dictionaries the services and offers produce.
"""

from __future__ import annotations

from typing import Any

from django.core.validators import ProhibitNullCharactersValidator
from rest_framework import serializers
from rest_framework.validators import ProhibitSurrogateCharactersValidator

from dispatch.core.placement import LABEL_KEY_RE, LABEL_VALUE_RE
from dispatch.core.result import CycleReason, CycleStatus
from dispatch.core.spec import MAX_SPEC_BYTES
from leases.ack import ACK_PHASE_DEPENDENT_FIELDS, ACK_PHASE_FIELDS, AckPhase
from leases.models import ExecutionOutcome
from leases.reconcile import ReconcileStatus
from qinglong.api_common import (
    BodySerializer,
    ErrorSerializer,
    FullMatchRegexValidator,
    StrictBooleanField,
    StrictCharField,
    StrictChoiceField,
    StrictIntegerField,
    StrictSerializer,
    StrictUUIDField,
)
from runs.models import AttemptState, RunState

# Re-exported on purpose (`X as X`): the server's output-tail rule is the
# agent's, the very same objects, and workers/tests hold them to that.
from workers.agent.protocol import MAX_OUTPUT_TAIL_BYTES as MAX_OUTPUT_TAIL_BYTES
from workers.agent.protocol import clean_output_tail as clean_output_tail
from workers.agent.protocol import output_tail_wire_bytes as output_tail_wire_bytes
from workers.models import SessionState
from workers.services import MAX_EXECUTOR_TYPES, MAX_SLOTS

# docs/adr/0003: a fresh high-entropy token chosen by the Worker, base64url
# (32 random bytes encode to 43 characters). `^…$` is for the OpenAPI schema
# (ECMA-262); values are checked with fullmatch (FullMatchRegexValidator), so
# a trailing newline is refused.
LEASE_TOKEN_RE = r"^[A-Za-z0-9_-]{43,128}$"
SPEC_SHA256_RE = r"^[0-9a-f]{64}$"
OFFER_ID_RE = r"^[0-9a-f]{64}$"
MAX_OFFERS_PER_PULL = 16
# docs/adr/0005: a heartbeat lists at most this many held offers (a Session's
# most slots), a reconcile report at most this many executions.
MAX_HELD_OFFERS = 256
MAX_RECONCILE_EXECUTIONS = 64
# A pull response is bounded by construction, never by luck: the reference
# agent reads at most 4 MiB of a response (workers/agent/transport.py). An
# offer is its spec (at most MAX_SPEC_BYTES: the response renders strings
# exactly as canonical JSON does, qinglong.api_renderers) plus fields of fixed
# width (ids, UUIDs, times, a lease token of at most 128 characters, the
# digest), which MAX_OFFER_ENVELOPE_BYTES bounds with room to spare (tested).
MAX_PULL_RESPONSE_BYTES = 4 * 1024 * 1024
MAX_OFFER_ENVELOPE_BYTES = 1024
_PULL_RESPONSE_ENVELOPE_BYTES = 256  # {"offers":[…],"status":…,"reason":…,"truncated":…}
# Offers one response may carry whatever the specs hold (15 with the limits of
# dispatch.core.spec); a larger `max_offers` is capped to it, like free slots.
MAX_OFFERS_PER_RESPONSE = min(
    MAX_OFFERS_PER_PULL,
    (MAX_PULL_RESPONSE_BYTES - _PULL_RESPONSE_ENVELOPE_BYTES)
    // (MAX_SPEC_BYTES + MAX_OFFER_ENVELOPE_BYTES),
)
_INT32 = 2**31


def lease_token_field(**kwargs: Any) -> StrictCharField:
    return StrictCharField(
        min_length=43,
        max_length=128,
        validators=[FullMatchRegexValidator(LEASE_TOKEN_RE)],
        help_text="base64url, 43 to 128 characters.",
        **kwargs,
    )


# ----------------------------------------------------------------- sessions


class SessionOpenRequestSerializer(StrictSerializer):
    executor_types = serializers.ListField(
        child=StrictCharField(max_length=32),
        min_length=1,
        max_length=MAX_EXECUTOR_TYPES,
        help_text="Executor types this Session runs; a subset of the enrolled ones.",
    )
    labels = serializers.DictField(
        child=StrictCharField(max_length=63),
        required=False,
        help_text="Labels advertised by this Session (merged over the enrolled labels). "
        f"ASCII only: keys match `{LABEL_KEY_RE}`, values `{LABEL_VALUE_RE}` "
        "(dispatch.core.placement).",
    )
    slots = StrictIntegerField(
        min_value=1, max_value=MAX_SLOTS, help_text="Capped by the enrolled slot count."
    )
    agent_version = StrictCharField(max_length=64, required=False, allow_blank=True)


class SessionOpenResponseSerializer(BodySerializer):
    session_id = serializers.UUIDField()
    generation = serializers.IntegerField()
    session_token = serializers.CharField(help_text="Shown once; send as `Bearer` on every call.")
    heartbeat_interval_s = serializers.IntegerField()
    session_timeout_s = serializers.IntegerField(
        help_text="A Session with no recorded heartbeat for this long goes offline and its "
        "started Attempts end `worker_lost`. An agent that has had no heartbeat accepted for "
        "this long should stop what the Session runs (the reference agent does: "
        "docs/adr/0008)."
    )
    lease_ttl_s = serializers.IntegerField()


# ---------------------------------------------------------------- heartbeat


def offer_id_field(**kwargs: Any) -> StrictCharField:
    return StrictCharField(validators=[FullMatchRegexValidator(OFFER_ID_RE)], **kwargs)


class HeartbeatRequestSerializer(StrictSerializer):
    draining = StrictBooleanField(
        required=False, help_text="true: keep my leases, send me no new claims."
    )
    held = serializers.ListField(
        child=offer_id_field(),
        required=False,
        max_length=MAX_HELD_OFFERS,
        help_text=(
            "Offer ids this agent holds: every offer it recorded and has not finished "
            "reporting (claimed, starting, running, or a final ACK not yet accepted). With "
            "it, only the listed started leases are renewed, and a started Attempt of this "
            "Session that is not listed ends at once (`not_held`, its slot freed; one "
            "started within the last heartbeat interval is left for the next heartbeat). "
            "Claimed-but-not-started leases are not affected. Absent: every started lease "
            f"of the Session is renewed. At most {MAX_HELD_OFFERS} ids."
        ),
    )


class HeartbeatResponseSerializer(BodySerializer):
    session_state = serializers.ChoiceField(
        choices=[SessionState.ONLINE.value, SessionState.DRAINING.value]
    )
    cancel = serializers.ListField(
        child=serializers.CharField(),
        help_text="Offer ids of this Session's leases whose Run was cancelled: stop them.",
    )
    stop = serializers.ListField(
        child=serializers.CharField(),
        help_text=(
            "Offers to stop now. Ids from `held` that are not a live lease of this Session "
            "whose Attempt is still claimed or started under it (ended, released, revoked, "
            "expired, unknown, or another Worker's: one answer for all); and, listed or not, "
            "this Session's started offers past their Task's timeout (README \"Run "
            'policies"). Without `held`, only the latter.'
        ),
    )
    server_time = serializers.DateTimeField()


# ---------------------------------------------------------------- reconcile


class ExecutionReportSerializer(StrictSerializer):
    offer_id = offer_id_field()
    lease_token = lease_token_field()
    outcome = StrictChoiceField(
        choices=[o.value for o in ExecutionOutcome],
        help_text=(
            "killed: it still ran and the agent ended it; exited: it had exited on its "
            "own; not_started: no process was ever spawned."
        ),
    )
    exit_code = StrictIntegerField(
        min_value=-_INT32, max_value=_INT32 - 1, required=False, allow_null=True, default=None
    )


class ReconcileRequestSerializer(StrictSerializer):
    executions = serializers.ListField(
        child=ExecutionReportSerializer(),
        min_length=1,
        max_length=MAX_RECONCILE_EXECUTIONS,
        help_text=(
            "Executions of this Worker's earlier Sessions (any generation) that the agent "
            "found in its journal after a restart and made sure are gone."
        ),
    )


class ReconcileResultSerializer(BodySerializer):
    offer_id = serializers.CharField()
    status = serializers.ChoiceField(choices=[s.value for s in ReconcileStatus])


class ReconcileResponseSerializer(BodySerializer):
    results = ReconcileResultSerializer(
        many=True,
        help_text=(
            "One per execution, in order. confirmed: recorded now, and the Run's retry that "
            "waited for the lost-execution grace may be claimed at once; already_confirmed: "
            "recorded before (nothing changed); unknown: no lease of this Worker with that "
            "offer id and token."
        ),
    )


# --------------------------------------------------------------------- pull


class PullRequestSerializer(StrictSerializer):
    pull_id = StrictUUIDField(
        help_text="Idempotency key: repeat it with the same lease_token after a lost response."
    )
    lease_token = lease_token_field()
    max_offers = StrictIntegerField(
        min_value=1,
        max_value=MAX_OFFERS_PER_PULL,
        required=False,
        default=1,
        help_text="Capped by the Session's free slots and by the response size budget: at "
        f"most {MAX_OFFERS_PER_RESPONSE} offers per response (a response stays under "
        f"{MAX_PULL_RESPONSE_BYTES // (1024 * 1024)} MiB whatever the specs hold).",
    )


class ResourcesSerializer(BodySerializer):
    cpu_millis = serializers.IntegerField()
    memory_mb = serializers.IntegerField()


class ExecutionSpecSerializer(BodySerializer):
    spec_version = serializers.IntegerField()
    run_id = serializers.CharField()
    attempt_id = serializers.CharField()
    project_id = serializers.CharField()
    task_id = serializers.CharField()
    task_revision = serializers.IntegerField()
    executor_type = serializers.CharField()
    command = serializers.ListField(child=serializers.CharField(allow_blank=True))
    cwd = serializers.CharField(allow_null=True)
    env = serializers.DictField(child=serializers.CharField(allow_blank=True))
    timeout_s = serializers.IntegerField()
    resources = ResourcesSerializer()


class LeaseGrantSerializer(BodySerializer):
    lease_id = serializers.CharField()
    generation = serializers.IntegerField()
    token = serializers.CharField(
        allow_null=True,
        help_text=(
            "The lease token: the one this pull presented (new claim or same pull_id "
            "replayed), a server-derived one for global claims, or null for a re-delivery "
            "of a lease claimed by another pull of yours (use the token you generated)."
        ),
    )
    expires_at = serializers.DateTimeField()


class OfferSerializer(BodySerializer):
    offer_id = serializers.CharField()
    source = serializers.ChoiceField(choices=["new_claim", "lease_recovery"])  # type: ignore[assignment]  # a field named like Field.source
    run_id = serializers.CharField()
    attempt_id = serializers.CharField()
    project_id = serializers.CharField()
    task_id = serializers.CharField()
    task_revision = serializers.IntegerField()
    priority = serializers.IntegerField()
    queued_at = serializers.DateTimeField()
    worker_id = serializers.CharField()
    session_id = serializers.CharField()
    session_generation = serializers.IntegerField()
    lease = LeaseGrantSerializer()
    spec = ExecutionSpecSerializer()
    spec_sha256 = serializers.CharField(
        help_text='sha256 hex of json.dumps(spec, sort_keys=True, separators=(",", ":"), '
        'ensure_ascii=False).encode("utf-8")'
    )
    placement_score = serializers.IntegerField(allow_null=True)


class PullResponseSerializer(BodySerializer):
    offers = OfferSerializer(many=True)
    status = serializers.ChoiceField(choices=[s.value for s in CycleStatus])
    reason = serializers.ChoiceField(choices=[r.value for r in CycleReason])
    truncated = serializers.BooleanField()


# ---------------------------------------------------------------------- ack


class OutputTailField(StrictCharField):
    """A process's output tail, limited by its size as sent, made storable.

    The limit (`MAX_OUTPUT_TAIL_BYTES`, shared with the reference agent) is on
    the tail's JSON string escaping in UTF-8 (`output_tail_wire_bytes`): a
    client that sends UTF-8 JSON (no \\u escapes for non-ASCII) and keeps the
    tail within it always fits the 80 KiB body cap, whatever the output holds.
    Process output holds whatever the program wrote, NUL bytes included;
    refusing it would 400 the terminal ACK, so NUL and lone surrogates are
    stored as U+FFFD (which never makes the tail bigger); only a tail over the
    limit is a 400.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # CharField always adds the NUL/surrogate validators; cleaning makes them moot.
        self.validators = [
            v
            for v in self.validators
            if not isinstance(
                v, ProhibitNullCharactersValidator | ProhibitSurrogateCharactersValidator
            )
        ]

    def to_internal_value(self, data: Any) -> str:
        value = super().to_internal_value(data)
        if output_tail_wire_bytes(value) > MAX_OUTPUT_TAIL_BYTES:
            self.fail("max_length", max_length=MAX_OUTPUT_TAIL_BYTES)
        # Cleaning keeps the limit (U+FFFD counts 3 bytes, a NUL 6), so this
        # trims nothing: what was accepted is stored whole.
        return clean_output_tail(value)


# The ACK's cross-field rules (phase -> fields it requires, fields it may carry)
# are the use case's table, `leases.ack.ACK_PHASE_FIELDS`: `validate` enforces
# it and the OpenAPI schema is built from it (`workers.api.schema.
# ack_request_per_phase`), so neither can drift from what the lease accepts.
class AckRequestSerializer(StrictSerializer):
    phase = StrictChoiceField(choices=[p.value for p in AckPhase])
    lease_token = lease_token_field()
    spec_sha256 = StrictCharField(validators=[FullMatchRegexValidator(SPEC_SHA256_RE)])
    executor_handle = StrictCharField(
        min_length=1, max_length=200, required=False, help_text="Required for `running`."
    )
    exit_code = StrictIntegerField(
        min_value=-_INT32,
        max_value=_INT32 - 1,
        required=False,
        help_text="Required for `succeeded` and `failed`.",
    )
    error_code = StrictCharField(max_length=64, required=False, allow_blank=True)
    output_tail = OutputTailField(
        max_length=MAX_OUTPUT_TAIL_BYTES,
        required=False,
        allow_blank=True,
        help_text=(
            "The newest process output. Limit: 64 KiB (65536 bytes) counted on what is "
            "sent, i.e. the UTF-8 bytes of the JSON-escaped string without its quotes "
            '(Python: len(json.dumps(tail, ensure_ascii=False).encode()) - 2; a `"`, `\\` '
            "or control character counts as its escape). Send the body as UTF-8 JSON "
            "without \\u escapes for non-ASCII (ensure_ascii=False): a tail within the "
            "limit then always fits the 80 KiB request cap. Over the limit: 400. NUL and "
            "lone surrogates are stored as U+FFFD (never a 400). Optional on every "
            "terminal phase: an ACK without it is complete."
        ),
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        phase = AckPhase(attrs["phase"])
        errors: dict[str, list[serializers.ErrorDetail]] = {}

        def fail(name: str, code: str) -> None:
            errors[name] = [serializers.ErrorDetail(code, code=code)]

        required, optional = ACK_PHASE_FIELDS[phase]
        for name in ACK_PHASE_DEPENDENT_FIELDS:
            if name in required and name not in attrs:
                fail(name, "required")
            elif name in attrs and name not in required | optional:
                fail(name, "not_allowed_for_phase")
        if errors:
            raise serializers.ValidationError(errors)
        return attrs


class AckResponseSerializer(BodySerializer):
    offer_id = serializers.CharField()
    attempt_state = serializers.ChoiceField(choices=AttemptState.choices)
    run_state = serializers.ChoiceField(choices=RunState.choices)
    cancel_requested = serializers.BooleanField(
        help_text="true: the Run was cancelled; stop the Attempt and ACK its end."
    )


# ---------------------------------------------------------- ack, several


# README "Worker API": one request may carry the ACKs of several leases of the
# Session (docs/adr/0013). Each item is exactly a single ACK's body plus the
# offer id its path would name; the request is bounded in items and bytes.
MAX_ACKS_PER_REQUEST = 64
ACK_BATCH_MAX_BODY_BYTES = 1024 * 1024


class AckItemSerializer(AckRequestSerializer):
    """One item of `POST acks`: a single ACK's body and the offer id of its path."""

    offer_id = offer_id_field(help_text="The lease's offer id (the single ACK's path).")


class AckBatchRequestSerializer(StrictSerializer):
    acks = serializers.ListField(
        child=AckItemSerializer(),
        min_length=1,
        max_length=MAX_ACKS_PER_REQUEST,
        help_text=(
            f"1 to {MAX_ACKS_PER_REQUEST} ACKs of this Session's leases, applied one after "
            "the other in this order, each on its own (its own transaction and answer): "
            "one refused never undoes or blocks another. Several items may name the same "
            "offer (e.g. `running` then `succeeded` of a process that already exited)."
        ),
    )


class AckBatchResultSerializer(BodySerializer):
    offer_id = serializers.CharField()
    status = serializers.ChoiceField(
        choices=[200, 403, 404, 409, 503],
        help_text=(
            "What the single ACK would have answered: 200 applied (or a repeat, a no-op); "
            "403 another Session's lease or a wrong lease token; 404 no such lease; 409 stop "
            "the Attempt; 503 not applied (the database was unavailable): send it again."
        ),
    )
    attempt_state = serializers.ChoiceField(
        choices=AttemptState.choices, required=False, help_text="With status 200."
    )
    run_state = serializers.ChoiceField(
        choices=RunState.choices, required=False, help_text="With status 200."
    )
    cancel_requested = serializers.BooleanField(
        required=False,
        help_text="With status 200. true: the Run was cancelled; stop the Attempt and ACK its end.",
    )
    error = ErrorSerializer(
        required=False, help_text="With any other status: the single ACK's error body."
    )


class AckBatchResponseSerializer(BodySerializer):
    results = AckBatchResultSerializer(
        many=True, help_text="One per item, in the order given (offer ids may repeat)."
    )
