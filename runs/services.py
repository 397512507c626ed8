"""Use cases for Projects, Tasks, Runs and Attempts, and every Run/Attempt transition.

Each transition is one function here guarded by a compare-and-set: an
``UPDATE … WHERE id=? AND version=? AND state=?`` that must touch exactly one
row (DESIGN §2). An illegal transition raises `IllegalTransition`; a writer that
lost the race gets `LostRace` (inside a transaction, so the whole use case rolls
back) which the outermost service turns into `Outcome.LOST_RACE`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Max

from dispatch.core.errors import SpecError
from dispatch.core.spec import TaskDefinition, build_spec, validate_task_definition
from qinglong.clock import db_now
from runs.models import (
    ATTEMPT_ACTIVE_STATES,
    Attempt,
    AttemptEvent,
    AttemptState,
    Project,
    Run,
    RunState,
    Task,
    TaskRevision,
)


class TransitionError(Exception):
    """Base class of transition failures."""


class IllegalTransition(TransitionError):
    """The state machine does not allow this transition from the current state."""

    def __init__(self, entity: str, from_state: str, to_state: str) -> None:
        super().__init__(f"{entity}: {from_state} → {to_state} is not a legal transition")
        self.entity = entity
        self.from_state = from_state
        self.to_state = to_state


class LostRace(TransitionError):
    """Another writer changed the row first (the compare-and-set touched 0 rows)."""


class Outcome(enum.StrEnum):
    APPLIED = "applied"  # this call made the transition
    LOST_RACE = "lost_race"  # another writer got there first; nothing changed here
    UNCHANGED = "unchanged"  # an idempotent repeat: already in the requested state


A = AttemptState
ATTEMPT_TRANSITIONS: Mapping[str, frozenset[str]] = {
    A.PENDING: frozenset({A.CLAIMED, A.CANCELLED}),
    A.CLAIMED: frozenset({A.PENDING, A.STARTING, A.START_FAILED, A.CANCELLED}),
    A.STARTING: frozenset({A.RUNNING, A.START_FAILED, A.LOST, A.CANCELLED}),
    A.RUNNING: frozenset({A.SUCCEEDED, A.FAILED, A.LOST, A.CANCELLED}),
}
R = RunState
RUN_TRANSITIONS: Mapping[str, frozenset[str]] = {
    R.QUEUED: frozenset({R.DISPATCHING, R.CANCELLED}),
    R.DISPATCHING: frozenset({R.QUEUED, R.RUNNING, R.FAILED, R.CANCELLED}),
    R.RUNNING: frozenset({R.QUEUED, R.SUCCEEDED, R.FAILED, R.CANCELLED}),
}


# --------------------------------------------------------------------------- CAS


def attempt_transition(
    attempt: Attempt,
    to_state: str,
    *,
    reason: str,
    actor: str = "",
    **changes: Any,
) -> None:
    """Move one Attempt by compare-and-set; update the instance; append history.

    Must run inside a transaction: `LostRace` is raised so the caller's
    transaction rolls back every other write of the use case with it.
    """
    if to_state not in ATTEMPT_TRANSITIONS.get(attempt.state, frozenset()):
        raise IllegalTransition("attempt", attempt.state, to_state)
    updated = Attempt.objects.filter(
        pk=attempt.pk, version=attempt.version, state=attempt.state
    ).update(state=to_state, version=attempt.version + 1, **changes)
    if updated != 1:
        raise LostRace(f"attempt {attempt.pk} changed under us")
    from_state = attempt.state
    attempt.state = to_state
    attempt.version += 1
    for key, value in changes.items():
        setattr(attempt, key, value)
    AttemptEvent.objects.create(
        attempt=attempt,
        run_id=attempt.run_id,
        from_state=from_state,
        to_state=to_state,
        reason=reason,
        actor=actor[:80],
    )


def run_transition(run: Run, to_state: str, **changes: Any) -> None:
    """Move one Run by compare-and-set; update the instance."""
    if to_state not in RUN_TRANSITIONS.get(run.state, frozenset()):
        raise IllegalTransition("run", run.state, to_state)
    updated = Run.objects.filter(pk=run.pk, version=run.version, state=run.state).update(
        state=to_state, version=run.version + 1, **changes
    )
    if updated != 1:
        raise LostRace(f"run {run.pk} changed under us")
    run.state = to_state
    run.version += 1
    for key, value in changes.items():
        setattr(run, key, value)


# ------------------------------------------------------------- projects & tasks


class DefinitionError(ValueError):
    """A Task definition failed validation; nothing was saved."""

    def __init__(self, error: SpecError) -> None:
        super().__init__(str(error))
        self.field = error.field
        self.message = error.message


def _validated(definition: Mapping[str, object]) -> TaskDefinition:
    try:
        return validate_task_definition(definition)
    except SpecError as err:
        raise DefinitionError(err) from None


@transaction.atomic
def project_create(*, slug: str, name: str, max_concurrent_runs: int = 0) -> Project:
    project = Project(slug=slug, name=name, max_concurrent_runs=max_concurrent_runs)
    project.full_clean()
    project.save()
    return project


def _revision_create(*, task: Task, number: int, definition: TaskDefinition) -> TaskRevision:
    return TaskRevision.objects.create(
        task=task,
        revision=number,
        executor_type=definition.executor_type,
        command=list(definition.command),
        cwd=definition.cwd,
        env=dict(definition.env),
        timeout_s=definition.timeout_s,
        resources=dict(definition.resources),
        placement=definition.placement.to_wire(),
        max_attempts=definition.max_attempts,
    )


@transaction.atomic
def task_create(*, project: Project, name: str, definition: Mapping[str, object]) -> Task:
    """Create a Task with revision 1. Validation happens before any write."""
    validated = _validated(definition)
    task = Task(project=project, name=name)
    task.full_clean(exclude=["current_revision"])
    task.save()
    revision = _revision_create(task=task, number=1, definition=validated)
    task.current_revision = revision
    task.save(update_fields=["current_revision", "updated_at"])
    return task


@transaction.atomic
def task_update(*, task: Task, definition: Mapping[str, object]) -> TaskRevision:
    """Edit a Task: a new immutable revision n+1 becomes current; Runs keep theirs."""
    validated = _validated(definition)
    # Lock the Task so two concurrent edits cannot both take revision n+1.
    locked = Task.objects.select_for_update().get(pk=task.pk)
    last = locked.revisions.aggregate(n=Max("revision"))["n"] or 0
    revision = _revision_create(task=locked, number=last + 1, definition=validated)
    locked.current_revision = revision
    locked.save(update_fields=["current_revision", "updated_at"])
    task.current_revision = revision
    return revision


def revision_definition(revision: TaskRevision) -> TaskDefinition:
    """Re-validate a stored revision with the one shared validator."""
    return validate_task_definition(
        {
            "executor_type": revision.executor_type,
            "command": revision.command,
            "cwd": revision.cwd,
            "env": revision.env,
            "timeout_s": revision.timeout_s,
            "resources": revision.resources,
            "placement": revision.placement,
            "max_attempts": revision.max_attempts,
        }
    )


def attempt_spec(*, attempt: Attempt, run: Run, revision: TaskRevision) -> dict[str, object]:
    """The ExecutionSpec of an Attempt, materialized from its Run's pinned revision."""
    return build_spec(
        run_id=str(run.pk),
        attempt_id=str(attempt.pk),
        project_id=str(run.project_id),
        task_id=str(run.task_id),
        task_revision=revision.revision,
        definition=revision_definition(revision),
    )


# ------------------------------------------------------------------------ runs


@transaction.atomic
def run_enqueue(*, task: Task, priority: int = 0, queued_at: datetime | None = None) -> Run:
    """Enqueue a Run pinned to the Task's current revision, with Attempt #1 pending."""
    if task.current_revision_id is None:
        raise DefinitionError(SpecError("task", "has no revision"))
    if isinstance(priority, bool) or not isinstance(priority, int) or not -1000 <= priority <= 1000:
        raise DefinitionError(SpecError("priority", "must be an integer from -1000 to 1000"))
    now = queued_at or db_now()
    run = Run.objects.create(
        project_id=task.project_id,
        task=task,
        task_revision_id=task.current_revision_id,
        priority=priority,
        queued_at=now,
    )
    Attempt.objects.create(run=run, number=1, priority=priority, queued_at=now)
    return run


def _active_attempt(run: Run) -> Attempt | None:
    return run.attempts.filter(state__in=ATTEMPT_ACTIVE_STATES).order_by("-number").first()


def attempt_finish(
    attempt: Attempt,
    run: Run,
    to_state: str,
    *,
    reason: str,
    actor: str = "",
    now: datetime,
    **changes: Any,
) -> None:
    """Move an Attempt to a terminal state and apply the retry policy to its Run.

    `start_failed`/`failed`/`lost` create the next Attempt while attempts <
    max_attempts (the Run goes back to `queued`), else the Run fails. A Run
    whose cancellation was requested ends `cancelled`, whatever the outcome.
    """
    attempt_transition(attempt, to_state, reason=reason, actor=actor, finished_at=now, **changes)
    if run.cancel_requested:
        run_transition(run, RunState.CANCELLED, finished_at=now)
        return
    if to_state == AttemptState.SUCCEEDED:
        run_transition(run, RunState.SUCCEEDED, finished_at=now)
        return
    if to_state == AttemptState.CANCELLED:
        run_transition(run, RunState.CANCELLED, finished_at=now)
        return
    max_attempts = run.task_revision.max_attempts
    if attempt.number < max_attempts:
        run_transition(run, RunState.QUEUED)
        try:
            with transaction.atomic():
                Attempt.objects.create(
                    run=run,
                    number=attempt.number + 1,
                    priority=run.priority,
                    # Keep the Run's place in the queue: a retry is not new work.
                    queued_at=run.queued_at,
                )
        except IntegrityError:
            raise LostRace(f"run {run.pk} already has a next attempt") from None
        return
    run_transition(run, RunState.FAILED, finished_at=now)


def run_cancel(*, run: Run, actor: str = "") -> Outcome:
    """Cancel a Run (idempotent).

    A Run not yet started is cancelled at once (its claimed lease is revoked);
    a started one gets `cancel_requested`, which heartbeats and ACKs carry to the
    Worker, and its terminal ACK (or lease loss) ends the Run `cancelled`.
    """
    from dispatch.services import lease_end_for_attempt

    try:
        with transaction.atomic(durable=True):
            # Row lock: the Run, its active Attempt and lease change together.
            locked = Run.objects.select_for_update().select_related("task_revision").get(pk=run.pk)
            if locked.state in (RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED):
                return Outcome.UNCHANGED
            if locked.cancel_requested and locked.state == RunState.RUNNING:
                return Outcome.UNCHANGED
            now = db_now()
            # Bump the version too: a claim racing this cancel loses its CAS.
            Run.objects.filter(pk=locked.pk).update(
                cancel_requested=True, version=locked.version + 1
            )
            locked.cancel_requested = True
            locked.version += 1
            attempt = _active_attempt(locked)
            if attempt is not None and attempt.state in (
                AttemptState.PENDING,
                AttemptState.CLAIMED,
            ):
                if attempt.state == AttemptState.CLAIMED:
                    lease_end_for_attempt(attempt, reason="run_cancelled", now=now)
                attempt_transition(
                    attempt,
                    AttemptState.CANCELLED,
                    reason="run_cancelled",
                    actor=actor,
                    finished_at=now,
                )
                run_transition(locked, RunState.CANCELLED, finished_at=now)
            elif attempt is None:
                run_transition(locked, RunState.CANCELLED, finished_at=now)
            run.refresh_from_db()
            return Outcome.APPLIED
    except LostRace:
        return Outcome.LOST_RACE


def run_attempts(run: Run) -> Iterable[Attempt]:
    return run.attempts.order_by("number")
