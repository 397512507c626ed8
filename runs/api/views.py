"""Operator API views: Projects, Tasks, Runs; thin over runs.services and leases.end.

Auth: DRF Token (automation) or the admin's session; staff AND the model
permissions each method declares (`runs.api.permissions`): a staff user without
`runs.add_task` cannot define what a Worker runs. Worker credentials are Bearer
secrets and are never accepted here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import IntegrityError
from django.db.models import Q
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, PolymorphicProxySerializer, extend_schema
from rest_framework import serializers, status
from rest_framework.authentication import SessionAuthentication
from rest_framework.exceptions import ErrorDetail, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from leases.end import run_cancel
from leases.errors import Outcome
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
from qinglong.api_schema import error_responses, retry_after
from runs.api.permissions import OperatorPermission, permissions_doc
from runs.api.selectors import (
    MAX_PAGE,
    enqueued_detail,
    enqueued_summaries,
    project_json,
    project_page,
    run_detail,
    run_page,
    task_by_name,
)
from runs.api.serializers import (
    SLUG_RE,
    ProjectCreateRequestSerializer,
    ProjectPageSerializer,
    ProjectSerializer,
    RunBulkCreatedSerializer,
    RunCreateRequestSerializer,
    RunDetailSerializer,
    RunEnqueuedSerializer,
    RunPageSerializer,
    TaskCreateRequestSerializer,
    TaskDefinitionRequestSerializer,
    TaskSerializer,
)
from runs.models import Project, Run, RunState, Task
from runs.services import (
    MAX_BULK_RUNS,
    BulkItemError,
    DefinitionError,
    project_create,
    run_enqueue_bulk_rows,
    run_enqueue_one,
    task_create,
    task_update,
)

_CANCEL_RETRIES = 3

VIEW_PROJECT = ("runs.view_project",)
ADD_PROJECT = ("runs.add_project",)
ADD_TASK = ("runs.add_task", "runs.add_taskrevision")
CHANGE_TASK = ("runs.change_task", "runs.add_taskrevision")
VIEW_RUN = ("runs.view_run",)
ADD_RUN = ("runs.add_run",)
CHANGE_RUN = ("runs.change_run",)


def _not_found() -> ApiError:
    return ApiError(status_code=404, code="not_found", message="not found")


def _definition_error(field: str, message: str) -> ApiError:
    return ApiError(
        status_code=400,
        code="invalid_definition",
        message=f"{safe_field_name(field)}: {message}",
    )


def _model_error(err: DjangoValidationError) -> ApiError:
    """A model's full_clean() failure: name the fields, never the values."""
    by_field = err.error_dict if hasattr(err, "error_dict") else {"body": err.error_list}
    codes = {(field, e.code or "invalid") for field, errs in by_field.items() for e in errs}
    if any(code in ("unique", "unique_together") for _, code in codes):
        return ApiError(status_code=409, code="already_exists", message="it already exists")
    fields = sorted({safe_field_name(f if f != "__all__" else "body") for f, _ in codes})
    return ApiError(
        status_code=400, code="invalid_request", message="invalid: " + ", ".join(fields)
    )


@contextmanager
def _service_errors() -> Iterator[None]:
    """The one translation of operator use-case errors into the error envelope."""
    try:
        yield
    except DefinitionError as err:
        raise _definition_error(err.field, err.message) from None
    except DjangoValidationError as err:
        raise _model_error(err) from None
    except IntegrityError:
        # A concurrent create of the same slug/name won the unique index.
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


def _project(slug: str) -> Project:
    project = Project.objects.filter(slug=slug).first()
    if project is None:
        raise _not_found()
    return project


def _task_json(task: Task) -> dict[str, Any]:
    revision = task.current_revision
    assert revision is not None
    return {
        "id": str(task.pk),
        "project": task.project.slug,
        "name": task.name,
        "revision": revision.revision,
        "executor_type": revision.executor_type,
    }


class OperatorApiView(ApiView):
    authentication_classes = [OperatorTokenAuthentication, SessionAuthentication]
    permission_classes = [OperatorPermission]
    # Method → Django model permissions it needs (OperatorPermission).
    required_permissions: ClassVar[dict[str, tuple[str, ...]]] = {}

    @staticmethod
    def actor(request: Request) -> str:
        return f"operator:{getattr(request.user, 'username', '')}"


# ------------------------------------------------------------------- projects


# Query numbers are ASCII digits only (QueryIntegerField) and patterns must
# match the whole value (FullMatchRegexValidator): "5\n", "²" or "٣" are 400s.
RUN_ID_RE = r"^[0-9]{1,18}$"


class ProjectListQuerySerializer(StrictSerializer):
    cursor = StrictCharField(
        required=False,
        max_length=64,
        validators=[FullMatchRegexValidator(SLUG_RE)],
        help_text="`next_cursor` of the previous page.",
    )
    limit = QueryIntegerField(required=False, min_value=1, max_value=MAX_PAGE, default=50)


class ProjectsView(OperatorApiView):
    """Projects: namespaces that own Tasks (list keyset-paginated by slug)."""

    required_permissions = {"GET": VIEW_PROJECT, "POST": ADD_PROJECT}

    @extend_schema(
        operation_id="projects_list",
        description=permissions_doc(*VIEW_PROJECT),
        tags=["operator"],
        parameters=[ProjectListQuerySerializer, retry_after()],
        responses={200: ProjectPageSerializer, **error_responses()},
    )
    def get(self, request: Request) -> Response:
        query = _query(ProjectListQuerySerializer, request)
        results, next_cursor = project_page(cursor=query.get("cursor"), limit=query["limit"])
        return Response({"results": results, "next_cursor": next_cursor})

    @extend_schema(
        operation_id="projects_create",
        description=permissions_doc(*ADD_PROJECT),
        tags=["operator"],
        request=ProjectCreateRequestSerializer,
        responses={201: ProjectSerializer, **error_responses(409)},
        parameters=[retry_after()],
    )
    def post(self, request: Request) -> Response:
        body = validated(ProjectCreateRequestSerializer, request.data)
        with _service_errors():
            project = project_create(
                slug=body["slug"],
                name=body["name"],
                max_concurrent_runs=body.get("max_concurrent_runs", 0),
            )
        return Response(project_json(project), status=status.HTTP_201_CREATED)


# ---------------------------------------------------------------------- tasks


class TasksView(OperatorApiView):
    """A Project's Tasks."""

    required_permissions = {"POST": ADD_TASK}

    @extend_schema(
        operation_id="tasks_create",
        summary="Create a Task (revision 1)",
        description="The definition is validated by the one shared validator; an error "
        "names the field (`invalid_definition`), never the value. " + permissions_doc(*ADD_TASK),
        tags=["operator"],
        request=TaskCreateRequestSerializer,
        responses={201: TaskSerializer, **error_responses(404, 409)},
        parameters=[retry_after()],
    )
    def post(self, request: Request, slug: str) -> Response:
        project = _project(slug)
        definition = _object_body(request.data)
        name = definition.pop("name", None)
        if not isinstance(name, str):
            raise _definition_error("name", "is required and must be a string")
        with _service_errors():
            task = task_create(project=project, name=name, definition=definition)
        return Response(_task_json(task), status=status.HTTP_201_CREATED)


class TaskView(OperatorApiView):
    """One Task; each edit is a new immutable revision."""

    required_permissions = {"PUT": CHANGE_TASK}

    @extend_schema(
        operation_id="tasks_update",
        summary="Edit a Task: the body becomes a new immutable revision",
        description="Runs already enqueued keep the revision they were pinned to. "
        + permissions_doc(*CHANGE_TASK),
        tags=["operator"],
        request=TaskDefinitionRequestSerializer,
        responses={200: TaskSerializer, **error_responses(404)},
        parameters=[retry_after()],
    )
    def put(self, request: Request, slug: str, name: str) -> Response:
        task = Task.objects.select_related("project").filter(project__slug=slug, name=name).first()
        if task is None:
            raise _not_found()
        definition = _object_body(request.data)
        with _service_errors():
            task_update(task=task, definition=definition)
        return Response(_task_json(task))


# ----------------------------------------------------------------------- runs


class RunListQuerySerializer(StrictSerializer):
    state = serializers.ChoiceField(choices=RunState.choices, required=False)
    cursor = StrictCharField(
        required=False,
        validators=[FullMatchRegexValidator(RUN_ID_RE)],
        help_text="`next_cursor` of the previous page.",
    )
    limit = QueryIntegerField(required=False, min_value=1, max_value=MAX_PAGE, default=50)


# The list form of the create body, for the schema (the stub types the
# serializers argument without ListSerializer).
_RUN_CREATE_LIST: Any = serializers.ListSerializer(
    child=RunCreateRequestSerializer(), min_length=1, max_length=MAX_BULK_RUNS
)


class RunsView(OperatorApiView):
    """Runs: enqueue one, or list them newest first."""

    required_permissions = {"GET": VIEW_RUN, "POST": ADD_RUN}

    @extend_schema(
        operation_id="runs_list",
        summary="Runs, newest first (keyset-paginated)",
        description=permissions_doc(*VIEW_RUN),
        tags=["operator"],
        parameters=[RunListQuerySerializer, retry_after()],
        responses={200: RunPageSerializer, **error_responses()},
    )
    def get(self, request: Request) -> Response:
        query = _query(RunListQuerySerializer, request)
        cursor = query.get("cursor")
        state = query.get("state")
        results, next_cursor = run_page(
            state=None if state is None else RunState(state),
            cursor=None if cursor is None else int(cursor),
            limit=query["limit"],
        )
        return Response({"results": results, "next_cursor": next_cursor})

    @extend_schema(
        operation_id="runs_create",
        summary="Enqueue a Run (an object) or up to 1,000 Runs at once (a list)",
        description=(
            "An object enqueues one Run pinned to the Task's current revision and answers "
            "it with its Attempts (`404` for an unknown project/task). A list of 1 to "
            f"{MAX_BULK_RUNS} such objects enqueues them all in one transaction, or none: "
            "the first bad item is a `400` whose message names it by index and field "
            "(`items[3].priority: max_value`, `items[0].task: not_found`); the answer is "
            '`{"results": [...]}`, the Runs in the order given. Each Run answered says '
            "`unplaceable_now` (with `unplaceable_reason`) when no enrolled Worker has its "
            "Task's executor type and required labels: it is queued anyway. "
        )
        + permissions_doc(*ADD_RUN),
        tags=["operator"],
        request=PolymorphicProxySerializer(
            component_name="RunCreateOneOrMany",
            serializers=[
                RunCreateRequestSerializer,
                _RUN_CREATE_LIST,
            ],
            resource_type_field_name=None,
            many=False,
        ),
        responses={
            201: PolymorphicProxySerializer(
                component_name="RunCreated",
                serializers=[RunEnqueuedSerializer, RunBulkCreatedSerializer],
                resource_type_field_name=None,
            ),
            **error_responses(404),
        },
        parameters=[retry_after()],
    )
    def post(self, request: Request) -> Response:
        if isinstance(request.data, list):
            return self._post_many(request.data)
        body = _plain_run_body(request.data) or validated(RunCreateRequestSerializer, request.data)
        task = task_by_name(body["project"], body["task"])
        if task is None:
            raise _not_found()
        with _service_errors():
            run, attempt = run_enqueue_one(task=task, priority=body.get("priority", 0))
        # The answer is built from the rows just written (issue #12): its
        # Project, Task and pinned revision are the Task's just read.
        run.project = task.project
        assert task.current_revision is not None
        run.task_revision = task.current_revision
        return Response(enqueued_detail(run, attempt), status=status.HTTP_201_CREATED)

    def _post_many(self, items: list[Any]) -> Response:
        """A list: every Run or none; the first bad item is named by its index."""
        if not 1 <= len(items) <= MAX_BULK_RUNS:
            raise ApiError(
                status_code=400,
                code="invalid_request",
                message=f"invalid request: body: a list of 1 to {MAX_BULK_RUNS} Runs",
            )
        bodies = [_bulk_item(index, item) for index, item in enumerate(items)]
        pairs = {(body["project"], body["task"]) for body in bodies}
        lookup = Q()
        for project, name in pairs:
            lookup |= Q(project__slug=project, name=name)
        tasks = {
            (task.project.slug, task.name): task
            for task in Task.objects.filter(lookup).select_related("project", "current_revision")
        }
        chosen: list[tuple[Task, int]] = []
        for index, body in enumerate(bodies):
            task = tasks.get((body["project"], body["task"]))
            if task is None:
                raise _bulk_error(index, "task", "not_found")
            chosen.append((task, body.get("priority", 0)))
        try:
            runs = run_enqueue_bulk_rows(items=chosen)
        except BulkItemError as err:
            raise _bulk_error(err.index, err.field, err.code) from None
        by_id = {task.pk: task for task in tasks.values()}
        return Response(
            {"results": enqueued_summaries(runs, by_id)}, status=status.HTTP_201_CREATED
        )


_RUN_BODY_KEYS = frozenset(RunCreateRequestSerializer().fields)
_SURROGATE = re.compile("[\ud800-\udfff]")


def _plain_text(value: Any, max_length: int) -> bool:
    return (
        type(value) is str
        and 0 < len(value) <= max_length
        and "\x00" not in value
        and _SURROGATE.search(value) is None
    )


def _plain_run_body(data: Any) -> dict[str, Any] | None:
    """An enqueue body `RunCreateRequestSerializer` would accept unchanged, as it
    would answer it, checked without building a serializer (about a third of a
    list item's cost; issue #12). None: anything else — the serializer then
    judges it and words the error, so the rules and errors stay the serializer's
    (test_plain_bodies_are_what_the_serializer_accepts)."""
    if type(data) is not dict or not data.keys() <= _RUN_BODY_KEYS:
        return None
    priority = data.get("priority", 0)
    if not (
        _plain_text(data.get("project"), 64)
        and _plain_text(data.get("task"), 100)
        and type(priority) is int
        and -1000 <= priority <= 1000
    ):
        return None
    return {"project": data["project"], "task": data["task"], "priority": priority}


def _bulk_error(index: int, field: str, code: str) -> ApiError:
    return ApiError(
        status_code=400,
        code="invalid_request",
        message=f"invalid request: items[{index}].{safe_field_name(field)}: {code}",
    )


def _bulk_item(index: int, item: Any) -> dict[str, Any]:
    """One item of a bulk enqueue, validated as the single form's body is."""
    plain = _plain_run_body(item)
    if plain is not None:
        return plain
    if not isinstance(item, Mapping):
        raise _bulk_error(index, "body", "not_object")
    serializer = RunCreateRequestSerializer(data=item)
    if not serializer.is_valid():
        # The same envelope as the single form, each field prefixed by the item.
        raise ValidationError({f"items[{index}]": serializer.errors})
    return dict(serializer.validated_data)


_RUN_ID = OpenApiParameter(
    "run_id", OpenApiTypes.STR, location=OpenApiParameter.PATH, pattern=RUN_ID_RE
)


class RunView(OperatorApiView):
    """One Run with its Attempts and redacted lease facts."""

    required_permissions = {"GET": VIEW_RUN}

    @extend_schema(
        operation_id="runs_retrieve",
        summary="A Run with its Attempts and redacted lease facts (never the spec)",
        description=permissions_doc(*VIEW_RUN),
        tags=["operator"],
        parameters=[_RUN_ID, retry_after()],
        responses={200: RunDetailSerializer, **error_responses(404)},
    )
    def get(self, request: Request, run_id: str) -> Response:
        detail = run_detail(int(run_id))
        if detail is None:
            raise _not_found()
        return Response(detail)


class EmptyRequestSerializer(StrictSerializer):
    """An empty object (or no body at all)."""


class RunCancelView(OperatorApiView):
    """Cancel a Run (idempotent)."""

    required_permissions = {"POST": CHANGE_RUN}

    @extend_schema(
        operation_id="runs_cancel",
        summary="Cancel a Run (idempotent)",
        description="Not yet started: cancelled at once. Started: `cancel_requested` rides "
        "on the Worker's heartbeat and ACK responses; its terminal ACK ends the Run "
        "`cancelled`. " + permissions_doc(*CHANGE_RUN),
        tags=["operator"],
        request=EmptyRequestSerializer,
        parameters=[_RUN_ID, retry_after()],
        responses={200: RunDetailSerializer, **error_responses(404, 409)},
    )
    def post(self, request: Request, run_id: str) -> Response:
        validated(EmptyRequestSerializer, request.data)
        run = Run.objects.filter(pk=int(run_id)).first()
        if run is None:
            raise _not_found()
        for _ in range(_CANCEL_RETRIES):
            # A lost race means another writer moved the Run first: look again.
            if run_cancel(run=run, actor=self.actor(request)) is not Outcome.LOST_RACE:
                break
        else:
            raise ApiError(
                status_code=409, code="conflict", message="the run changed concurrently; retry"
            )
        return Response(run_detail(run.pk))
