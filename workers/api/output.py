"""Worker API: live output of a started Attempt (README "Live output", docs/adr/0006).

`POST /api/v1/worker/leases/{offer_id}/output` with the Session token and the
lease token, like an ACK. Its own module beside the ACK view: the use case is
`output.services.output_append`; this file only shapes the request and the
answer, and throttles per lease (one lease = one Attempt).
"""

from __future__ import annotations

from typing import Any

from django.core.validators import ProhibitNullCharactersValidator
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.validators import ProhibitSurrogateCharactersValidator

from leases.errors import LeaseError
from output.services import output_append
from qinglong.api_common import (
    BodySerializer,
    StrictCharField,
    StrictIntegerField,
    StrictSerializer,
    validated,
)
from qinglong.api_errors import ApiError
from qinglong.api_schema import error_responses, retry_after
from workers.agent.output import MAX_OUTPUT_CHUNK_BYTES
from workers.agent.protocol import output_tail_wire_bytes
from workers.api.authentication import WorkerPrincipal
from workers.api.serializers import OFFER_ID_RE, lease_token_field
from workers.api.throttles import _PrincipalThrottle
from workers.api.views import WorkerApiView

__all__ = ["OutputThrottle", "OutputView"]

_INT32 = 2**31
_MAX_SKIPPED = 2**62


class OutputThrottle(_PrincipalThrottle):
    """Output requests per lease, i.e. per Attempt (QL_THROTTLE_WORKER_OUTPUT)."""

    scope = "worker_output"

    def get_cache_key(self, request: Request, view: object) -> str | None:
        principal = request.user
        offer_id = getattr(view, "kwargs", {}).get("offer_id")
        if not isinstance(principal, WorkerPrincipal) or not offer_id:
            return None
        return self.cache_format % {"scope": self.scope, "ident": f"lease-{offer_id}"}


class OutputChunkField(StrictCharField):
    """Process output as sent: at most MAX_OUTPUT_CHUNK_BYTES of JSON-escaped UTF-8.

    Output holds whatever the program wrote: NUL and lone surrogates are
    accepted here and stored as U+FFFD by the use case, never a 400.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.validators = [
            v
            for v in self.validators
            if not isinstance(
                v, ProhibitNullCharactersValidator | ProhibitSurrogateCharactersValidator
            )
        ]

    def to_internal_value(self, data: Any) -> str:
        value = super().to_internal_value(data)
        if output_tail_wire_bytes(value) > MAX_OUTPUT_CHUNK_BYTES:
            self.fail("max_length", max_length=MAX_OUTPUT_CHUNK_BYTES)
        return value


class OutputRequestSerializer(StrictSerializer):
    lease_token = lease_token_field()
    seq = StrictIntegerField(
        min_value=1,
        max_value=_INT32 - 1,
        help_text="1 for the first chunk of this lease, then +1 per chunk. Send the same "
        "number again after an unanswered request: it is stored once.",
    )
    chunk = OutputChunkField(
        min_length=1,
        max_length=MAX_OUTPUT_CHUNK_BYTES,
        help_text=f"The next piece of output: at most {MAX_OUTPUT_CHUNK_BYTES} bytes counted as "
        "sent (UTF-8 of the JSON-escaped string, as for the ACK's output_tail).",
    )
    skipped_bytes = StrictIntegerField(
        min_value=0,
        max_value=_MAX_SKIPPED,
        required=False,
        default=0,
        help_text="Output bytes the Worker skipped right before this chunk (it fell behind).",
    )


class OutputResponseSerializer(BodySerializer):
    seq = serializers.IntegerField()
    stored = serializers.BooleanField(
        help_text="false: this sequence number was already accepted (nothing stored twice)."
    )
    cancel_requested = serializers.BooleanField(
        help_text="true: the Run was cancelled; stop the Attempt and ACK its end."
    )


class OutputView(WorkerApiView):
    """Append a chunk of a started Attempt's output."""

    throttle_classes = [OutputThrottle]

    @extend_schema(
        operation_id="worker_lease_output",
        summary="Send a chunk of a running Attempt's output",
        description=(
            "Only for a lease of this Session whose Attempt was ACKed `starting` or "
            "`running`, with its lease token. Stored redacted of the Task's env values; "
            "per Attempt only the newest output is kept (the oldest chunks are dropped and "
            "counted). 403: another Session's lease or a wrong token; 409: the lease ended or "
            "the Attempt is not started — stop sending; 429: slow down and send the same `seq` "
            "again."
        ),
        tags=["worker"],
        request=OutputRequestSerializer,
        responses={200: OutputResponseSerializer, **error_responses(404, 409, 429)},
        parameters=[
            OpenApiParameter("offer_id", str, location=OpenApiParameter.PATH, pattern=OFFER_ID_RE),
            retry_after(429),
        ],
    )
    def post(self, request: Request, offer_id: str) -> Response:
        body = validated(OutputRequestSerializer, request.data)
        try:
            result = output_append(
                session=self.session(request),
                offer_id=offer_id,
                lease_token=body["lease_token"],
                seq=body["seq"],
                chunk=body["chunk"],
                skipped_bytes=body.get("skipped_bytes", 0),
            )
        except LeaseError as err:
            # LeaseError messages are fixed texts and state names, never secrets.
            raise ApiError(status_code=err.status, code=err.code, message=str(err)) from None
        return Response(
            {
                "seq": result.seq,
                "stored": result.stored,
                "cancel_requested": result.cancel_requested,
            }
        )
