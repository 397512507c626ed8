"""Shared builders for the dispatcher core tests (plain functions, no fixtures)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dispatch.core.budget import DispatchBudget
from dispatch.core.cycle import dispatch_once
from dispatch.core.fakes import FakeStore
from dispatch.core.ports import DispatchPorts, DispatchScope, PullCredential
from dispatch.core.result import DispatchCycleResult

SECRET = b"qinglong-test-secret-0123456789ab"
CANARY = "CANARY-b7e1c9d4"


def definition(**overrides: Any) -> dict[str, object]:
    base: dict[str, object] = {
        "executor_type": "process",
        "command": ["echo", "hello"],
        "env": {"GREETING": "hi"},
        "timeout_s": 60,
    }
    base.update(overrides)
    return base


def secret_definition(**overrides: Any) -> dict[str, object]:
    """A task whose command, cwd and env all carry the canary."""
    return definition(
        command=["run-job", f"--password={CANARY}"],
        cwd=f"srv/{CANARY}",
        env={"API_TOKEN": CANARY},
        **overrides,
    )


def enqueue(store: FakeStore, count: int = 1, **task: Any) -> list[tuple[str, str]]:
    """`count` queued Runs of one new Task; returns [(run_id, attempt_id)]."""
    _, task_id, _ = store.add_task(definition=definition(**task))
    return [store.add_run(task_id=task_id) for _ in range(count)]


def run(
    ports: DispatchPorts,
    *,
    scope: DispatchScope | None = None,
    budget: DispatchBudget | Mapping[str, int] | None = None,
    pull: PullCredential | None = None,
    max_offers: int | None = None,
    secret: bytes = SECRET,
) -> DispatchCycleResult:
    if budget is None:
        budget = DispatchBudget()
    elif not isinstance(budget, DispatchBudget):
        budget = DispatchBudget.from_mapping(budget)
    return dispatch_once(
        scope=scope or DispatchScope.global_(),
        budget=budget,
        ports=ports,
        secret=secret,
        pull=pull,
        max_offers=max_offers,
    )
