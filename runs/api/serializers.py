"""Operator API bodies (docs/architecture.md "Worker API and operations").

Task definitions are validated only by `runs.services` (the one shared
validator); `TaskDefinitionRequestSerializer` documents their shape for
OpenAPI and is never used to validate. Run and lease facts are redacted: no
spec, command, env, cwd or token ever appears here.
"""

from __future__ import annotations

from rest_framework import serializers

from dispatch.adapters.waiting import WAIT_REASONS
from dispatch.core.placement import (
    LABEL_KEY_RE,
    LABEL_VALUE_RE,
    MAX_LABEL_VALUE_CHARS,
    MAX_PREFERRED_TERMS,
    MAX_WEIGHT,
)
from dispatch.core.spec import (
    ENV_KEY_RE,
    EXECUTOR_TYPE_RE,
    MAX_ATTEMPTS_LIMIT,
    MAX_COMMAND_ITEM_CHARS,
    MAX_COMMAND_ITEMS,
    MAX_CONCURRENT_RUNS_LIMIT,
    MAX_CPU_MILLIS,
    MAX_CWD_CHARS,
    MAX_ENV_VALUE_CHARS,
    MAX_MEMORY_MB,
    MAX_RETRY_BACKOFF_S,
    MAX_TIMEOUT_S,
    RetryOn,
)
from leases.models import LeaseSource, LeaseState
from qinglong.api_common import (
    BodySerializer,
    FullMatchRegexValidator,
    StrictCharField,
    StrictIntegerField,
    StrictSerializer,
)
from runs.models import AttemptState, RunState

# `^…$` for the OpenAPI schema; checked with fullmatch (no trailing newline).
SLUG_RE = r"^[-a-zA-Z0-9_]+$"
_PG_INT_MAX = 2**31 - 1


class ProjectCreateRequestSerializer(StrictSerializer):
    slug = StrictCharField(max_length=64, validators=[FullMatchRegexValidator(SLUG_RE)])
    name = StrictCharField(max_length=200)
    max_concurrent_runs = StrictIntegerField(
        min_value=0, max_value=_PG_INT_MAX, required=False, help_text="0 = no limit."
    )


class ProjectSerializer(BodySerializer):
    id = serializers.CharField()
    slug = serializers.CharField()
    name = serializers.CharField()
    max_concurrent_runs = serializers.IntegerField()
    created_at = serializers.DateTimeField()


class ProjectPageSerializer(BodySerializer):
    results = ProjectSerializer(many=True)
    next_cursor = serializers.CharField(allow_null=True)


# ------------------------------------------------------------ task (docs only)


class ResourcesRequestSerializer(BodySerializer):
    cpu_millis = serializers.IntegerField(min_value=0, max_value=MAX_CPU_MILLIS, required=False)
    memory_mb = serializers.IntegerField(min_value=0, max_value=MAX_MEMORY_MB, required=False)


_LABELS_HELP = (
    f"Label keys match `{LABEL_KEY_RE}`; values match `{LABEL_VALUE_RE}` (ASCII only, "
    "so a look-alike character cannot make a Run unplaceable)."
)


def _label_values() -> serializers.CharField:
    return serializers.CharField(
        max_length=MAX_LABEL_VALUE_CHARS,
        allow_blank=True,
        validators=[FullMatchRegexValidator(LABEL_VALUE_RE)],
    )


class PreferredTermRequestSerializer(BodySerializer):
    labels = serializers.DictField(child=_label_values(), help_text=_LABELS_HELP)
    weight = serializers.IntegerField(min_value=1, max_value=MAX_WEIGHT)


class PlacementRequestSerializer(BodySerializer):
    executor_type = serializers.CharField(required=False, allow_null=True)
    required_labels = serializers.DictField(
        child=_label_values(), required=False, allow_null=True, help_text=_LABELS_HELP
    )
    # max_length on a many=True serializer is DRF >= 3.15; the stubs lag behind.
    preferred = PreferredTermRequestSerializer(  # type: ignore[call-arg]
        many=True, required=False, allow_null=True, max_length=MAX_PREFERRED_TERMS
    )


class _DefinitionFields(BodySerializer):
    executor_type = serializers.CharField(
        max_length=32, validators=[FullMatchRegexValidator(EXECUTOR_TYPE_RE)]
    )
    command = serializers.ListField(
        child=serializers.CharField(max_length=MAX_COMMAND_ITEM_CHARS, allow_blank=True),
        min_length=1,
        max_length=MAX_COMMAND_ITEMS,
        help_text="argv; never shown by the runs endpoints.",
    )
    cwd = serializers.CharField(
        max_length=MAX_CWD_CHARS,
        required=False,
        allow_null=True,
        help_text="Relative to the Worker's work directory, '/'-separated; an absolute "
        "path, a drive letter, a backslash or a '..' segment is a 400. Stored normalized "
        "('./a//b/' is 'a/b'). Never shown by the runs endpoints.",
    )
    env = serializers.DictField(
        child=serializers.CharField(allow_blank=True, max_length=MAX_ENV_VALUE_CHARS),
        required=False,
        help_text=f"Variable names match {ENV_KEY_RE}; never shown by the runs endpoints.",
    )
    timeout_s = serializers.IntegerField(min_value=1, max_value=MAX_TIMEOUT_S, required=False)
    resources = ResourcesRequestSerializer(required=False, allow_null=True)
    placement = PlacementRequestSerializer(required=False, allow_null=True)
    max_attempts = serializers.IntegerField(
        min_value=1, max_value=MAX_ATTEMPTS_LIMIT, required=False
    )
    # Run policies (README "Run policies"): pinned in the revision, never sent to a Worker.
    max_concurrent_runs = serializers.IntegerField(
        min_value=0,
        max_value=MAX_CONCURRENT_RUNS_LIMIT,
        required=False,
        help_text="Runs of this Task holding a live lease at once, besides the Project's "
        "limit; 0 (default) = unlimited.",
    )
    retry_on = serializers.ChoiceField(
        choices=[member.value for member in RetryOn],
        required=False,
        help_text="Which failures get another Attempt while attempts < max_attempts: "
        "`exit_code` (failed, start_failed, timed_out), `worker_lost` (lost), `both` "
        "(default).",
    )
    retry_backoff_s = serializers.IntegerField(
        min_value=0,
        max_value=MAX_RETRY_BACKOFF_S,
        required=False,
        help_text="Seconds before the first retry may be claimed; each next retry waits "
        "twice as long (default 0: at once).",
    )
    retry_backoff_max_s = serializers.IntegerField(
        min_value=0,
        max_value=MAX_RETRY_BACKOFF_S,
        required=False,
        help_text="The cap of that doubling (default 3600); at least `retry_backoff_s`.",
    )


class TaskCreateRequestSerializer(_DefinitionFields):
    name = serializers.SlugField(max_length=100)


class TaskDefinitionRequestSerializer(_DefinitionFields):
    """PUT body: the full new definition (a new revision)."""


class TaskSerializer(BodySerializer):
    id = serializers.CharField()
    project = serializers.CharField(help_text="Project slug.")
    name = serializers.CharField()
    revision = serializers.IntegerField(help_text="The current revision number.")
    executor_type = serializers.CharField()


# ----------------------------------------------------------------------- runs


class RunCreateRequestSerializer(StrictSerializer):
    project = StrictCharField(max_length=64, help_text="Project slug.")
    task = StrictCharField(max_length=100, help_text="Task name.")
    priority = StrictIntegerField(min_value=-1000, max_value=1000, required=False, default=0)


class LeaseFactsSerializer(BodySerializer):
    lease_id = serializers.CharField()
    state = serializers.ChoiceField(choices=LeaseState.choices)
    generation = serializers.IntegerField()
    source = serializers.ChoiceField(choices=[s.value for s in LeaseSource])  # type: ignore[assignment]  # a field named like Field.source
    worker_id = serializers.CharField()
    session_generation = serializers.IntegerField()
    claimed_at = serializers.DateTimeField()
    expires_at = serializers.DateTimeField()
    ended_at = serializers.DateTimeField(allow_null=True)
    end_reason = serializers.CharField(allow_blank=True)
    delivery_count = serializers.IntegerField()
    token_digest_prefix = serializers.CharField(
        help_text="First 8 hex characters of SHA-256(token): enough to tell leases apart."
    )
    execution_confirmed_at = serializers.DateTimeField(
        allow_null=True,
        help_text="When a restarted Worker reported this lease's execution gone (reconcile).",
    )
    execution_outcome = serializers.CharField(
        allow_blank=True,
        help_text="What it reported: killed, exited or not_started (empty: no report).",
    )
    execution_exit_code = serializers.IntegerField(allow_null=True)
    execution_confirmed_by = serializers.CharField(
        allow_blank=True, help_text='Who reported it, e.g. "worker:3 session:7".'
    )


class AttemptSerializer(BodySerializer):
    id = serializers.CharField()
    number = serializers.IntegerField()
    state = serializers.ChoiceField(choices=AttemptState.choices)
    lease_generation = serializers.IntegerField()
    executor_handle = serializers.CharField(allow_blank=True)
    exit_code = serializers.IntegerField(allow_null=True)
    error_code = serializers.CharField(
        allow_blank=True,
        help_text="Why it ended, when the control plane ended it: worker_lost, "
        "worker_restarted, credential_rotated, worker_disabled, not_held, lease_expired, "
        "undeliverable; or the Worker's start_failed code.",
    )
    not_before = serializers.DateTimeField(
        allow_null=True, help_text="A pending Attempt is not claimed before this instant."
    )
    not_before_reason = serializers.CharField(
        allow_blank=True,
        help_text="Why it waits: lost_execution_grace (the previous execution may still "
        "run) or redelivery_backoff (its offer was over-delivered).",
    )
    created_at = serializers.DateTimeField()
    started_at = serializers.DateTimeField(allow_null=True)
    finished_at = serializers.DateTimeField(allow_null=True)
    leases = LeaseFactsSerializer(many=True)


class RunSummarySerializer(BodySerializer):
    id = serializers.CharField()
    project = serializers.CharField(help_text="Project slug.")
    task = serializers.CharField(help_text="Task name.")
    task_revision = serializers.IntegerField()
    state = serializers.ChoiceField(choices=RunState.choices)
    priority = serializers.IntegerField()
    cancel_requested = serializers.BooleanField()
    queued_at = serializers.DateTimeField()
    created_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField(allow_null=True)


class WaitingSerializer(BodySerializer):
    """Why a queued Run is not running yet (docs/adr/0012), the first that holds."""

    reason = serializers.ChoiceField(
        choices=list(WAIT_REASONS),
        help_text="dispatch_paused (the kill switch); backoff (not before `until`); "
        "project_limit / task_limit (`active` of `limit` Runs running); no_matching_worker "
        "(no online Worker has its executor type and labels: `missing_executor_type`, "
        "`missing_labels` name what none has); workers_full (every matching Worker's slots "
        "are taken); eligible (it is claimed in its turn).",
    )
    message = serializers.CharField(help_text="The same in operator words.")
    until = serializers.DateTimeField(allow_null=True)
    backoff = serializers.CharField(
        allow_null=True,
        help_text="lost_execution_grace, redelivery_backoff or retry_backoff (reason backoff).",
    )
    active = serializers.IntegerField(allow_null=True)
    limit = serializers.IntegerField(allow_null=True)
    missing_executor_type = serializers.CharField(allow_null=True)
    missing_labels = serializers.DictField(child=serializers.CharField(), allow_null=True)
    matching_workers = serializers.IntegerField(
        allow_null=True, help_text="Online Workers that match (counted up to 1000)."
    )


class UnplaceableSerializer(BodySerializer):
    """Why no enrolled Worker could take the Run when it was enqueued."""

    reason = serializers.ChoiceField(choices=["no_enrolled_worker", "invalid_placement"])
    message = serializers.CharField()
    missing_executor_type = serializers.CharField(allow_null=True)
    missing_labels = serializers.DictField(child=serializers.CharField())


class RunDetailSerializer(RunSummarySerializer):
    attempts = AttemptSerializer(many=True)
    waiting = WaitingSerializer(
        allow_null=True,
        help_text="Why it is still queued, computed now for this Run (null unless queued).",
    )


class _Unplaceable(BodySerializer):
    unplaceable_now = serializers.BooleanField(
        help_text="No enrolled Worker (active or draining) has the Task's executor type and "
        "required labels right now. The Run is queued anyway: Workers come and go."
    )
    unplaceable_reason = UnplaceableSerializer(allow_null=True)


class RunEnqueuedSerializer(RunDetailSerializer, _Unplaceable):
    """A Run just enqueued: its detail, and whether any enrolled Worker could take it."""


class RunEnqueuedSummarySerializer(RunSummarySerializer, _Unplaceable):
    """One Run of a bulk enqueue."""


class RunBulkCreatedSerializer(BodySerializer):
    results = RunEnqueuedSummarySerializer(
        many=True, help_text="The Runs enqueued, in the order given."
    )


class RunPageSerializer(BodySerializer):
    results = RunSummarySerializer(many=True)
    next_cursor = serializers.CharField(allow_null=True)
