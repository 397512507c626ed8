"""Task run policies (README "Run policies"): validated by the one task-definition
validator, pinned in each revision, a clear 400 that changes nothing when bad."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from dispatch.core.errors import SpecError
from dispatch.core.spec import (
    MAX_RETRY_BACKOFF_S,
    RetryOn,
    RunPolicy,
    spec_sha256,
    validate_run_policy,
    validate_task_definition,
)
from qinglong.testing import definition, make_project, make_run, make_task
from runs.models import TaskRevision
from runs.services import attempt_spec, revision_definition, task_update


def test_defaults_keep_the_old_behaviour() -> None:
    policy = validate_task_definition(definition()).policy
    assert policy == RunPolicy()
    assert policy.max_concurrent_runs == 0
    assert policy.retries(lost=True) and policy.retries(lost=False)
    assert policy.backoff_s(retry_number=1) == 0


@pytest.mark.parametrize(
    ("retry_on", "lost", "expected"),
    [
        ("exit_code", False, True),
        ("exit_code", True, False),
        ("worker_lost", True, True),
        ("worker_lost", False, False),
        ("both", True, True),
        ("both", False, True),
    ],
)
def test_retry_on_chooses_which_failures_retry(retry_on: str, lost: bool, expected: bool) -> None:
    assert validate_run_policy({"retry_on": retry_on}).retries(lost=lost) is expected


def test_backoff_doubles_up_to_the_cap() -> None:
    policy = validate_run_policy({"retry_backoff_s": 5, "retry_backoff_max_s": 30})
    assert [policy.backoff_s(retry_number=n) for n in range(1, 7)] == [5, 10, 20, 30, 30, 30]
    # Far retries never overflow or exceed the cap.
    assert policy.backoff_s(retry_number=10_000) == 30
    big = validate_run_policy(
        {"retry_backoff_s": MAX_RETRY_BACKOFF_S, "retry_backoff_max_s": MAX_RETRY_BACKOFF_S}
    )
    assert big.backoff_s(retry_number=99) == MAX_RETRY_BACKOFF_S


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"retry_on": "sometimes"}, "retry_on"),
        ({"retry_on": 1}, "retry_on"),
        ({"max_concurrent_runs": -1}, "max_concurrent_runs"),
        ({"max_concurrent_runs": True}, "max_concurrent_runs"),
        ({"retry_backoff_s": MAX_RETRY_BACKOFF_S + 1}, "retry_backoff_s"),
        ({"retry_backoff_s": 60, "retry_backoff_max_s": 30}, "retry_backoff_max_s"),
        ({"retry_backoff_max_s": "10"}, "retry_backoff_max_s"),
    ],
)
def test_bad_policies_name_the_field(raw: dict[str, object], field: str) -> None:
    with pytest.raises(SpecError) as err:
        validate_task_definition(definition(**raw))
    assert err.value.field == field


@pytest.mark.django_db
def test_each_revision_pins_its_policies_and_the_spec_digest_is_unchanged() -> None:
    task = make_task()
    run = make_run(task)
    before = spec_sha256(
        attempt_spec(attempt=run.attempts.get(), run=run, revision=run.task_revision)
    )
    task_update(
        task=task,
        definition=definition(
            max_concurrent_runs=2, retry_on="worker_lost", retry_backoff_s=3, retry_backoff_max_s=9
        ),
    )
    first, second = TaskRevision.objects.filter(task=task).order_by("revision")
    assert (first.max_concurrent_runs, first.retry_on) == (0, RetryOn.BOTH)
    assert (second.max_concurrent_runs, second.retry_on, second.retry_backoff_s) == (
        2,
        "worker_lost",
        3,
    )
    assert revision_definition(second).policy == RunPolicy(2, RetryOn.WORKER_LOST, 3, 9)
    # Policies are not part of the ExecutionSpec: the Worker never sees them.
    run.refresh_from_db()
    assert spec_sha256(attempt_spec(attempt=run.attempts.get(), run=run, revision=first)) == before


@pytest.mark.django_db
def test_the_api_refuses_a_bad_policy_with_a_400_that_changes_nothing(admin_user) -> None:
    project = make_project()
    client = APIClient()
    client.force_authenticate(admin_user)
    response = client.post(
        f"/api/v1/projects/{project.slug}/tasks",
        {"name": "t", **definition(retry_on="never")},
        format="json",
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_definition"
    assert "retry_on" in response.json()["error"]["message"]
    assert not project.tasks.exists()
    ok = client.post(
        f"/api/v1/projects/{project.slug}/tasks",
        {"name": "t", **definition(max_concurrent_runs=1, retry_backoff_s=2)},
        format="json",
    )
    assert ok.status_code == 201, ok.content
    assert TaskRevision.objects.get(task__project=project).max_concurrent_runs == 1
