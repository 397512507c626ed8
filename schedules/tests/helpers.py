"""Builders for the schedule tests (through the services, like qinglong.testing)."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from typing import Any

from leases.ack import AckPhase, lease_ack
from qinglong.testing import claim, make_task, open_session, pending_attempt
from runs.models import Run, Task
from schedules.models import Schedule, ScheduleFire
from schedules.services import schedule_create

T0 = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
_seq = itertools.count(1)


def at(**delta: float) -> datetime:
    return T0 + timedelta(**delta)


def make_schedule(
    task: Task | None = None, *, now: datetime = T0, name: str | None = None, **fields: Any
) -> Schedule:
    definition = {"cron": "* * * * *", **fields}
    return schedule_create(
        task=task or make_task(),
        name=name or f"s{next(_seq)}",
        definition=definition,
        actor="test",
        now=now,
    )


def ledger(schedule: Schedule) -> list[tuple[str, datetime]]:
    """(outcome, fire_at) oldest first."""
    return [
        (fire.outcome, fire.fire_at)
        for fire in ScheduleFire.objects.filter(schedule=schedule).order_by("fire_at", "id")
    ]


def start(run: Run) -> tuple[Any, str, str]:
    """Claim the Run's Attempt for a fresh Session and ACK `starting`."""
    session = open_session().session
    outcome, offer_id, token = claim(pending_attempt(run), session)
    assert outcome.status == "won", outcome
    lease_ack(
        session=session,
        offer_id=offer_id,
        phase=AckPhase.STARTING,
        lease_token=token,
        spec_sha256=_spec_digest(run),
    )
    return session, offer_id, token


def _spec_digest(run: Run) -> str:
    from leases.models import RunLease

    return RunLease.objects.filter(run=run).order_by("-id").values_list("spec_digest", flat=True)[0]
