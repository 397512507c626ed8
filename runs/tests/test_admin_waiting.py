"""The Run page says why a queued Run waits and whether it can be placed (issue 11).

The admin's enqueue actions (a Task's "Enqueue a run", "Retry failed runs")
warn about a Run no enrolled Worker can take; it is queued all the same.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.urls import reverse

from qinglong.testing import (
    CANARY_COMMAND,
    CANARY_CWD,
    CANARY_ENV,
    canary_definition,
    make_project,
    make_run,
    make_task,
    make_worker,
    open_session,
)
from runs.models import Run
from runs.services import task_create

pytestmark = pytest.mark.django_db

GPU = {"required_labels": {"gpu": "a100"}}


def act(client: Any, model: str, action: str, ids: list[int]) -> Any:
    url = reverse(f"admin:{model}_changelist")
    data = {"action": action, "_selected_action": ids, "reason": "admin test"}
    return client.post(url, data, follow=True)


def messages_of(response: Any) -> list[str]:
    return [str(m) for m in response.context["messages"]]


def run_page(client: Any, run: Run) -> str:
    response = client.get(reverse("admin:runs_run_change", args=[run.pk]))
    assert response.status_code == 200
    return str(response.content.decode())


def test_the_run_page_says_why_it_waits_and_that_nobody_can_place_it(admin_client: Any) -> None:
    task = task_create(
        project=make_project(), name="canary", definition=canary_definition(placement=GPU)
    )
    run = make_run(task)
    body = run_page(admin_client, run)
    assert "Why it waits" in body
    assert (
        "no_matching_worker: No online Worker has executor type process or label gpu=a100." in body
    )
    assert "Unplaceable now" in body
    assert "yes: No enrolled Worker has executor type process or label gpu=a100." in body
    for secret in (CANARY_COMMAND, CANARY_ENV, CANARY_CWD):
        assert secret not in body

    open_session(labels={"gpu": "a100"})
    body = run_page(admin_client, run)
    assert "eligible: Eligible now" in body
    assert '<div class="readonly">no</div>' in body


def test_a_run_that_is_not_queued_does_not_wait(admin_client: Any) -> None:
    run = make_run()
    Run.objects.filter(pk=run.pk).update(state="succeeded")
    body = run_page(admin_client, run)
    assert "Eligible now" not in body and "no_matching_worker" not in body


def test_enqueue_actions_warn_about_an_unplaceable_run(admin_client: Any) -> None:
    gpu = make_task(placement=GPU)
    plain = make_task()
    make_worker()  # enrolled, without the label
    response = act(admin_client, "runs_task", "enqueue_run", [gpu.pk, plain.pk])
    notes = messages_of(response)
    assert "Enqueued 2 run(s)." in notes
    (warning,) = [n for n in notes if "unplaceable" in n]
    queued = Run.objects.get(task=gpu)
    assert warning == (
        f"Run {queued.pk} is unplaceable now: No enrolled Worker has label gpu=a100. "
        "It is queued all the same."
    )

    Run.objects.filter(pk=queued.pk).update(state="failed")
    response = act(admin_client, "runs_run", "retry_failed_runs", [queued.pk])
    assert any("unplaceable now" in n for n in messages_of(response))
