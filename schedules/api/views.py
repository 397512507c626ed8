"""Operator API of Schedules: define, pause, resume, run now, delete, read the ledger.

Thin over `schedules.services`; the same auth, error envelope and permission
model as `runs.api` (`qinglong.api_permissions.OperatorPermission`: staff AND
the model permissions each method declares). Creating or changing a Schedule
also needs `runs.add_run`: a Schedule enqueues Runs, so a user who may not
enqueue one may not schedule one either.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar

from django.db import IntegrityError
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.authentication import SessionAuthentication
from rest_framework.exceptions import ErrorDetail, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from qinglong.api_auth import OperatorTokenAuthentication
from qinglong.api_common import (
    ApiView,
    BodySerializer,
    FullMatchRegexValidator,
    QueryIntegerField,
    StrictCharField,
    StrictSerializer,
    validated,
)
from qinglong.api_errors import ApiError, safe_field_name
from qinglong.api_permissions import OperatorPermission, permissions_doc
from qinglong.api_schema import error_responses, retry_after
from runs.models import Task
from schedules.api.serializers import (
    FirePageSerializer,
    FireSerializer,
    ScheduleCreateRequestSerializer,
    SchedulePageSerializer,
    SchedulePauseRequestSerializer,
    ScheduleResumeRequestSerializer,
    ScheduleSerializer,
    ScheduleUpdateRequestSerializer,
)
from schedules.cron import ScheduleError
from schedules.models import FireOutcome, Schedule
from schedules.selectors import (
    FIRE_CURSOR_RE,
    MAX_PAGE,
    fire_json,
    fire_page,
    schedule_detail,
    schedule_page,
)
from schedules.services import (
    schedule_create,
    schedule_delete,
    schedule_pause,
    schedule_resume,
    schedule_run_now,
    schedule_update,
)

VIEW = ("schedules.view_schedule",)
ADD = ("schedules.add_schedule", "runs.add_run")
CHANGE = ("schedules.change_schedule", "runs.add_run")
DELETE = ("schedules.delete_schedule",)
PAUSE = ("schedules.pause_schedule",)
RUN_NOW = ("runs.add_run",)
VIEW_FIRES = ("schedules.view_schedulefire",)
ID_RE = r"^[0-9]{1,18}$"

_ID = OpenApiParameter(
    "schedule_id", OpenApiTypes.STR, location=OpenApiParameter.PATH, pattern=ID_RE
)


def _not_found() -> ApiError:
    return ApiError(status_code=404, code="not_found", message="not found")


@contextmanager
def _schedule_errors() -> Iterator[None]:
    """The one translation of schedule use-case errors into the error envelope."""
    try:
        yield
    except ScheduleError as err:
        raise ApiError(
            status_code=400,
            code="invalid_schedule",
            message=f"{safe_field_name(err.field)}: {err.message}",
        ) from None
    except Schedule.DoesNotExist:
        raise _not_found() from None
    except IntegrityError:
        raise ApiError(
            status_code=409, code="already_exists", message="it already exists"
        ) from None


def _object_body(data: Any) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ValidationError({"body": [ErrorDetail("must be a JSON object", code="not_object")]})
    return dict(data)


def _query(serializer_class: type[BodySerializer], request: Request) -> dict[str, Any]:
    params = request.query_params
    if any(len(params.getlist(key)) > 1 for key in params):
        raise ValidationError({"query": [ErrorDetail("repeated parameter", code="repeated")]})
    return validated(serializer_class, {key: params.get(key) for key in params})


def _schedule(schedule_id: str) -> Schedule:
    schedule = Schedule.objects.filter(pk=int(schedule_id)).first()
    if schedule is None:
        raise _not_found()
    return schedule


class ScheduleApiView(ApiView):
    authentication_classes = [OperatorTokenAuthentication, SessionAuthentication]
    permission_classes = [OperatorPermission]
    required_permissions: ClassVar[dict[str, tuple[str, ...]]] = {}

    @staticmethod
    def actor(request: Request) -> str:
        return f"operator:{getattr(request.user, 'username', '')}"


class ScheduleListQuerySerializer(StrictSerializer):
    cursor = StrictCharField(
        required=False,
        validators=[FullMatchRegexValidator(ID_RE)],
        help_text="`next_cursor` of the previous page.",
    )
    limit = QueryIntegerField(required=False, min_value=1, max_value=MAX_PAGE, default=50)


class SchedulesView(ScheduleApiView):
    """Schedules: list them, or create one."""

    required_permissions = {"GET": VIEW, "POST": ADD}

    @extend_schema(
        operation_id="schedules_list",
        summary="Schedules with their next fire time (keyset-paginated by id)",
        description=permissions_doc(*VIEW),
        tags=["schedules"],
        parameters=[ScheduleListQuerySerializer, retry_after()],
        responses={200: SchedulePageSerializer, **error_responses()},
    )
    def get(self, request: Request) -> Response:
        query = _query(ScheduleListQuerySerializer, request)
        cursor = query.get("cursor")
        results, next_cursor = schedule_page(
            cursor=None if cursor is None else int(cursor), limit=query["limit"]
        )
        return Response({"results": results, "next_cursor": next_cursor})

    @extend_schema(
        operation_id="schedules_create",
        summary="Create a Schedule of a Task",
        description="The settings are validated by the one schedule validator; an invalid "
        "cron expression, an unknown time zone or a catch-up window over the cap is a 400 "
        "`invalid_schedule` naming the field, and nothing is saved. " + permissions_doc(*ADD),
        tags=["schedules"],
        request=ScheduleCreateRequestSerializer,
        responses={201: ScheduleSerializer, **error_responses(404, 409)},
        parameters=[retry_after()],
    )
    def post(self, request: Request) -> Response:
        body = _object_body(request.data)
        project, task_name = body.pop("project", None), body.pop("task", None)
        name = body.pop("name", None)
        for field, value in (("project", project), ("task", task_name), ("name", name)):
            if not isinstance(value, str):
                raise ApiError(
                    status_code=400,
                    code="invalid_schedule",
                    message=f"{field}: is required and must be a string",
                )
        task = (
            Task.objects.filter(project__slug=project, name=task_name)
            .select_related("project", "current_revision")
            .first()
        )
        if task is None:
            raise _not_found()
        with _schedule_errors():
            schedule = schedule_create(
                task=task, name=name, definition=body, actor=self.actor(request)
            )
        return Response(schedule_detail(schedule.pk), status=status.HTTP_201_CREATED)


class ScheduleView(ScheduleApiView):
    """One Schedule."""

    required_permissions = {"GET": VIEW, "PATCH": CHANGE, "DELETE": DELETE}

    @extend_schema(
        operation_id="schedules_retrieve",
        summary="A Schedule with its next fire time (UTC and its time zone)",
        description=permissions_doc(*VIEW),
        tags=["schedules"],
        parameters=[_ID, retry_after()],
        responses={200: ScheduleSerializer, **error_responses(404)},
    )
    def get(self, request: Request, schedule_id: str) -> Response:
        detail = schedule_detail(int(schedule_id))
        if detail is None:
            raise _not_found()
        return Response(detail)

    @extend_schema(
        operation_id="schedules_update",
        summary="Change some settings of a Schedule",
        description="A new cron expression, time zone or jitter starts from now (fires "
        "already recorded stay as they are; the old timetable's fires due but not yet "
        "evaluated become one `missed` row, `paused` while paused). Bad input is a 400 "
        "`invalid_schedule` that changes nothing. " + permissions_doc(*CHANGE),
        tags=["schedules"],
        request=ScheduleUpdateRequestSerializer,
        parameters=[_ID, retry_after()],
        responses={200: ScheduleSerializer, **error_responses(404)},
    )
    def patch(self, request: Request, schedule_id: str) -> Response:
        body = _object_body(request.data)
        with _schedule_errors():
            schedule = schedule_update(schedule_id=_schedule(schedule_id).pk, changes=body)
        return Response(schedule_detail(schedule.pk))

    @extend_schema(
        operation_id="schedules_delete",
        summary="Delete a Schedule and its ledger (its Runs stay)",
        description=permissions_doc(*DELETE),
        tags=["schedules"],
        parameters=[_ID, retry_after()],
        responses={204: None, **error_responses(404)},
    )
    def delete(self, request: Request, schedule_id: str) -> Response:
        if not schedule_delete(schedule_id=_schedule(schedule_id).pk):
            raise _not_found()
        return Response(status=status.HTTP_204_NO_CONTENT)


class SchedulePauseView(ScheduleApiView):
    """Pause a Schedule."""

    required_permissions = {"POST": PAUSE}

    @extend_schema(
        operation_id="schedules_pause",
        summary="Pause a Schedule (who, why, optional resume-at)",
        description="Fires while paused are recorded `paused` (one ledger row for the "
        "stretch, written when it resumes). " + permissions_doc(*PAUSE),
        tags=["schedules"],
        request=SchedulePauseRequestSerializer,
        parameters=[_ID, retry_after()],
        responses={200: ScheduleSerializer, **error_responses(404)},
    )
    def post(self, request: Request, schedule_id: str) -> Response:
        body = validated(SchedulePauseRequestSerializer, request.data)
        with _schedule_errors():
            schedule = schedule_pause(
                schedule_id=_schedule(schedule_id).pk,
                actor=self.actor(request),
                reason=body["reason"],
                resume_at=body["resume_at"],
            )
        return Response(schedule_detail(schedule.pk))


class ScheduleResumeView(ScheduleApiView):
    """Resume a Schedule."""

    required_permissions = {"POST": PAUSE}

    @extend_schema(
        operation_id="schedules_resume",
        summary="Resume a paused Schedule (idempotent); its next fire is the first from now",
        description=permissions_doc(*PAUSE),
        tags=["schedules"],
        request=ScheduleResumeRequestSerializer,
        parameters=[_ID, retry_after()],
        responses={200: ScheduleSerializer, **error_responses(404)},
    )
    def post(self, request: Request, schedule_id: str) -> Response:
        validated(ScheduleResumeRequestSerializer, request.data)
        with _schedule_errors():
            schedule = schedule_resume(
                schedule_id=_schedule(schedule_id).pk, actor=self.actor(request)
            )
        return Response(schedule_detail(schedule.pk))


class ScheduleRunNowView(ScheduleApiView):
    """Run now."""

    required_permissions = {"POST": RUN_NOW}

    @extend_schema(
        operation_id="schedules_run_now",
        summary="Enqueue a Run from this Schedule now (a manual fire in its ledger)",
        description="The overlap policy does not apply: an operator asked for this Run. "
        + permissions_doc(*RUN_NOW),
        tags=["schedules"],
        request=ScheduleResumeRequestSerializer,
        parameters=[_ID, retry_after()],
        responses={201: FireSerializer, **error_responses(404)},
    )
    def post(self, request: Request, schedule_id: str) -> Response:
        validated(ScheduleResumeRequestSerializer, request.data)
        schedule = _schedule(schedule_id)
        with _schedule_errors():
            fire = schedule_run_now(schedule_id=schedule.pk, actor=self.actor(request))
        return Response(fire_json(fire, schedule.timezone), status=status.HTTP_201_CREATED)


class FireListQuerySerializer(StrictSerializer):
    outcome = serializers.ChoiceField(choices=FireOutcome.choices, required=False)
    at = serializers.DateTimeField(
        required=False,
        help_text="Only the row that accounts for this instant: a fire at it, or the "
        'missed/paused stretch that covers it ("why didn\'t it run at 03:00?").',
    )
    cursor = StrictCharField(
        required=False,
        validators=[FullMatchRegexValidator(FIRE_CURSOR_RE)],
        help_text="`next_cursor` of the previous page.",
    )
    limit = QueryIntegerField(required=False, min_value=1, max_value=MAX_PAGE, default=50)


class ScheduleFiresView(ScheduleApiView):
    """The ledger of one Schedule."""

    required_permissions = {"GET": VIEW_FIRES}

    @extend_schema(
        operation_id="schedules_fires",
        summary="The Schedule's ledger, newest fire first: what became of each fire",
        description="Outcomes: `enqueued` (with its Run), `skipped_overlap`, `missed`, "
        "`paused`, `blocked` (a concurrency limit), `buffered`. " + permissions_doc(*VIEW_FIRES),
        tags=["schedules"],
        parameters=[_ID, FireListQuerySerializer, retry_after()],
        responses={200: FirePageSerializer, **error_responses(404)},
    )
    def get(self, request: Request, schedule_id: str) -> Response:
        schedule = _schedule(schedule_id)
        query = _query(FireListQuerySerializer, request)
        outcome = query.get("outcome")
        results, next_cursor = fire_page(
            schedule=schedule,
            outcome=None if outcome is None else FireOutcome(outcome),
            at=query.get("at"),
            cursor=query.get("cursor"),
            limit=query["limit"],
        )
        return Response({"results": results, "next_cursor": next_cursor})
