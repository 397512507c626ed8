"""Test helpers shared by every app's tests: small builders over the services.

Builders go through the same services production uses, so a test never builds
a state that the services could not reach.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from django.conf import settings

from dispatch.core.offer import derive_lease_token, offer_id_for, token_digest
from dispatch.core.ports import ClaimOutcome, ClaimRequest, ClaimStatus
from dispatch.core.spec import spec_sha256
from leases.claim import lease_claim
from notifications.models import WebhookSubscription
from runs.models import Attempt, Project, Run, Task
from runs.services import attempt_spec, project_create, run_enqueue, task_create
from workers.models import Worker, WorkerSession
from workers.services import OpenedSession, session_open, worker_enroll

_seq = itertools.count(1)

CANARY_COMMAND = "CANARY-CMD-7f3a9"
CANARY_ENV = "CANARY-ENV-5b21c"
CANARY_CWD = "srv/CANARY-CWD-0d4e8"  # relative: a cwd lives in the Worker's work directory


def definition(**overrides: Any) -> dict[str, object]:
    base: dict[str, object] = {
        "executor_type": "process",
        "command": ["echo", "hello"],
        "env": {"A": "1"},
        "timeout_s": 60,
        "max_attempts": 1,
    }
    base.update(overrides)
    return base


def canary_definition(**overrides: Any) -> dict[str, object]:
    return definition(
        command=["sh", "-c", f"echo {CANARY_COMMAND}"],
        env={"SECRET_TOKEN": CANARY_ENV},
        cwd=CANARY_CWD,
        **overrides,
    )


def make_project(slug: str | None = None) -> Project:
    return project_create(slug=slug or f"p{next(_seq)}", name="Test project")


def make_task(project: Project | None = None, name: str | None = None, **overrides: Any) -> Task:
    return task_create(
        project=project or make_project(),
        name=name or f"t{next(_seq)}",
        definition=definition(**overrides),
    )


def make_run(task: Task | None = None, priority: int = 0, **overrides: Any) -> Run:
    return run_enqueue(task=task or make_task(**overrides), priority=priority)


def subscribe_to_success(run: Run) -> WebhookSubscription:
    """A webhook subscription of the Run's Project to `run.succeeded`: its
    success then also writes an outbox row."""
    return WebhookSubscription.objects.create(
        project_id=run.project_id,
        name="ops",
        url="https://hooks.example.com/q",
        events=["run.succeeded"],
    )


def pending_attempt(run: Run) -> Attempt:
    return run.attempts.get(state="pending")


def make_worker(
    name: str | None = None,
    *,
    slots: int = 2,
    executor_types: tuple[str, ...] = ("process",),
    labels: Mapping[str, str] | None = None,
) -> tuple[Worker, str]:
    return worker_enroll(
        name=name or f"w{next(_seq)}",
        slots=slots,
        executor_types=list(executor_types),
        labels=dict(labels or {}),
    )


def open_session(
    worker: Worker | None = None, *, slots: int | None = None, **kwargs: Any
) -> OpenedSession:
    if worker is None:
        worker, _ = make_worker(**kwargs)
    return session_open(
        worker=worker,
        executor_types=list(worker.executor_types),
        labels=dict(worker.labels),
        slots=slots or worker.slots,
        agent_version="test",
    )


def lease_secret() -> bytes:
    return str(settings.QINGLONG_LEASE_SECRET).encode()


def claim_request(
    attempt: Attempt,
    session: WorkerSession,
    *,
    expected_version: int | None = None,
    lease_generation: int | None = None,
    skip_locked: bool = False,
    token: str | None = None,
    pull_id: str | None = None,
) -> tuple[ClaimRequest, str]:
    """A ClaimRequest as dispatch_once would build it; returns it and the token."""
    run = attempt.run
    generation = attempt.lease_generation + 1 if lease_generation is None else lease_generation
    offer_id = offer_id_for(
        attempt_id=str(attempt.pk),
        lease_generation=generation,
        worker_id=str(session.worker_id),
        session_id=str(session.session_id),
        session_generation=session.generation,
    )
    lease_token = token or derive_lease_token(lease_secret(), offer_id)
    spec = attempt_spec(attempt=attempt, run=run, revision=run.task_revision)
    request = ClaimRequest(
        attempt_id=str(attempt.pk),
        run_id=str(run.pk),
        expected_version=attempt.version if expected_version is None else expected_version,
        lease_generation=generation,
        worker_id=str(session.worker_id),
        session_id=str(session.session_id),
        session_generation=session.generation,
        offer_id=offer_id,
        token_digest=token_digest(lease_token),
        spec_sha256=spec_sha256(spec),
        placement_score=0,
        source="pull_claim" if pull_id else "new_claim",
        pull_id=pull_id,
        lease_ttl_s=int(settings.QINGLONG_DISPATCH["lease_ttl_s"]),
        skip_locked=skip_locked,
    )
    return request, lease_token


def claim(attempt: Attempt, session: WorkerSession, **kwargs: Any) -> tuple[ClaimOutcome, str, str]:
    """Claim and return (outcome, offer_id, token)."""
    request, token = claim_request(attempt, session, **kwargs)
    outcome = lease_claim(request)
    return outcome, request.offer_id, token


__all__ = ["ClaimStatus", "claim", "claim_request"]
