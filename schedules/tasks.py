"""Celery task of the cluster deployment: one bounded evaluation step (README "Schedules").

Beat sends it every second beside the dispatch cycle. Duplicate beats are safe:
each call is one more bounded step, and every fire is owned by its unique
ledger row (docs/adr/0010). It takes no arguments and returns only counts.
"""

from __future__ import annotations

from celery import shared_task

from schedules.services import schedules_evaluate

__all__ = ["evaluate_schedules_task"]


@shared_task(name="schedules.tasks.evaluate_schedules_task")
def evaluate_schedules_task() -> dict[str, object]:
    return schedules_evaluate().summary()
