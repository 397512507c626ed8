"""Operator API: a Run's live output (README "Live output", docs/adr/0006).

`GET /api/v1/runs/{id}/output?after=<seq>[&attempt=<number>][&limit=<n>]`:
the chunks of one Attempt (default: the Run's newest) with a sequence number
above `after`, oldest first, at most `limit` (≤ 64) per page, keyset by
sequence number. Read on with `after=next_after` while `more` is true; poll
again later while `live` is true (the Attempt has not ended). `truncated`
says how much older output was dropped to keep the per-Attempt bound, a
chunk's `skipped_bytes` how much the Worker skipped right before it. The
text is stored redacted of the Task's env values.

The admin's Run and Attempt pages follow the output through this endpoint
(with the admin session), so they need the same permission: `runs.view_run`.
"""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from output.services import MAX_OUTPUT_PAGE, output_page
from qinglong.api_common import BodySerializer, QueryIntegerField, StrictSerializer
from qinglong.api_errors import ApiError
from qinglong.api_schema import error_responses, retry_after
from runs.api.permissions import permissions_doc
from runs.api.views import RUN_ID_RE, VIEW_RUN, OperatorApiView, _query
from runs.models import AttemptState

__all__ = ["RunOutputView"]

_INT32 = 2**31


class RunOutputQuerySerializer(StrictSerializer):
    after = QueryIntegerField(
        required=False,
        min_value=0,
        max_value=_INT32 - 1,
        default=0,
        help_text="`next_after` of the previous page (0: from the oldest stored chunk).",
    )
    attempt = QueryIntegerField(
        required=False,
        min_value=1,
        max_value=_INT32 - 1,
        help_text="The Attempt's number (default: the Run's newest Attempt).",
    )
    limit = QueryIntegerField(
        required=False, min_value=1, max_value=MAX_OUTPUT_PAGE, default=MAX_OUTPUT_PAGE
    )


class OutputAttemptSerializer(BodySerializer):
    id = serializers.CharField()
    number = serializers.IntegerField()
    state = serializers.ChoiceField(choices=AttemptState.choices)


class OutputChunkSerializer(BodySerializer):
    seq = serializers.IntegerField()
    text = serializers.CharField(allow_blank=True, help_text="Redacted of the Task's env values.")
    skipped_bytes = serializers.IntegerField(
        help_text="Output the Worker skipped right before this chunk (0: contiguous)."
    )
    received_at = serializers.DateTimeField()


class OutputTruncationSerializer(BodySerializer):
    dropped_through_seq = serializers.IntegerField(
        help_text="Chunks up to this sequence number were dropped (the per-Attempt bound)."
    )
    dropped_bytes = serializers.IntegerField()


class RunOutputSerializer(BodySerializer):
    run_id = serializers.CharField()
    attempt = OutputAttemptSerializer(allow_null=True)
    latest_attempt = serializers.IntegerField(
        allow_null=True,
        help_text="The number of the Run's newest Attempt: when it is above `attempt.number` "
        "and `live` is false, a retry is under way; read it with `attempt=<number>&after=0`.",
    )
    chunks = OutputChunkSerializer(many=True)
    next_after = serializers.IntegerField()
    more = serializers.BooleanField(help_text="More chunks are stored: read on at once.")
    live = serializers.BooleanField(
        help_text="The Attempt has not ended: more output may come; poll again later."
    )
    truncated = OutputTruncationSerializer(allow_null=True)
    skipped_bytes = serializers.IntegerField(help_text="Total the Worker skipped.")


class RunOutputView(OperatorApiView):
    """A Run's live output (one Attempt's chunks)."""

    required_permissions = {"GET": VIEW_RUN}

    @extend_schema(
        operation_id="runs_output",
        summary="A Run's output: one Attempt's chunks after a sequence number",
        description="Keyset by sequence number, at most "
        f"{MAX_OUTPUT_PAGE} chunks per page. " + permissions_doc(*VIEW_RUN),
        tags=["operator"],
        parameters=[
            OpenApiParameter(
                "run_id", OpenApiTypes.STR, location=OpenApiParameter.PATH, pattern=RUN_ID_RE
            ),
            RunOutputQuerySerializer,
            retry_after(),
        ],
        responses={200: RunOutputSerializer, **error_responses(404)},
    )
    def get(self, request: Request, run_id: str) -> Response:
        query = _query(RunOutputQuerySerializer, request)
        page = output_page(
            run_id=int(run_id),
            attempt_number=query.get("attempt"),
            after=query["after"],
            limit=query["limit"],
        )
        if page is None:
            raise ApiError(status_code=404, code="not_found", message="not found")
        return Response({"run_id": run_id, **page.as_json()})
