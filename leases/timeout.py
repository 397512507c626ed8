"""Timeouts enforced by the control plane (README "Run policies").

The agent enforces a spec's `timeout_s` itself; this is what happens when it
does not (a hung agent, a lost one, an old one). The starting ACK pins the
Attempt's `deadline_at` (started_at + the revision's `timeout_s`). Once a
started Attempt is past it by more than `QL_TIMEOUT_MARGIN_S` (the margin lets
the agent's own timeout report first):

- every heartbeat answer of its Session lists its offer in `stop`
  (`timed_out_offer_ids`), and so does the answer of one listing it as held
  after its lease ended; a `running` ACK is refused with 409 `timed_out`
  (any 409 means stop), and once the lease is ended every ACK is a 409;
- the timeout sweep (`attempts_overdue` + `attempt_time_out`, bounded like
  every sweep) revokes its lease and ends it with reason and error code
  `timed_out`, whether or not any agent is still there: a running Attempt
  `failed`, a starting one `lost` (nothing said it ever ran). The Run's retry
  policy treats a timeout like a failed exit code (`retry_on`); the retry
  waits the lost-execution grace like any execution the control plane gave
  up on (docs/adr/0005), unless the Worker confirmed the process gone.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Final

from django.conf import settings
from django.db import transaction

from leases.end import attempt_finish
from leases.errors import LostRace, Outcome
from leases.locks import lock_active_lease, lock_attempt, lock_run
from leases.models import LeaseState, RunLease
from leases.policy import SWEEP_BATCH, lost_execution_grace
from leases.reasons import EndReason, WaitReason
from leases.transitions import lease_transition
from qinglong.clock import db_now
from runs.models import Attempt, AttemptState

__all__ = [
    "TIMED_OUT",
    "attempt_overdue",
    "attempt_time_out",
    "attempts_overdue",
    "timed_out_offer_ids",
    "timeout_margin",
]

logger = logging.getLogger("qinglong.dispatch")

# The end reason and error code (docs/adr/0005's vocabulary of endings).
TIMED_OUT: Final = EndReason.TIMED_OUT
_STARTED: Final = (AttemptState.STARTING, AttemptState.RUNNING)
# A heartbeat answer names at most this many (a Session holds at most its slots).
_STOP_LIST_CAP: Final = 256


def timeout_margin() -> timedelta:
    return timedelta(seconds=int(settings.QINGLONG_TIMEOUT_MARGIN_S))


def _overdue_before(now: datetime) -> datetime:
    """Deadlines at or before this have passed by the margin at `now`."""
    return now - timeout_margin()


def attempt_overdue(attempt: Attempt, *, now: datetime) -> bool:
    """Is this started Attempt past its deadline by the margin (the stop verdict)?"""
    return attempt.deadline_at is not None and attempt.deadline_at <= _overdue_before(now)


def timed_out_offer_ids(session_pk: int, *, now: datetime) -> list[str]:
    """Offers of this Session whose started Attempt is past its deadline: stop them."""
    return list(
        RunLease.objects.filter(
            session_id=session_pk,
            state=LeaseState.ACTIVE,
            attempt__state__in=_STARTED,
            attempt__deadline_at__lte=_overdue_before(now),
        )
        .order_by("id")
        .values_list("offer_id", flat=True)[:_STOP_LIST_CAP]
    )


def attempts_overdue(*, now: datetime, limit: int = SWEEP_BATCH) -> list[int]:
    """Started Attempts past their deadline, oldest deadline first (index
    attempt_started_deadline): at most `limit` ids."""
    return list(
        Attempt.objects.filter(state__in=_STARTED, deadline_at__lte=_overdue_before(now))
        .order_by("deadline_at", "id")
        .values_list("id", flat=True)[:limit]
    )


def attempt_time_out(attempt_id: int) -> Outcome:
    """End one overdue Attempt `timed_out`; re-checked under the row locks.

    Run → Attempt → RunLease, as every path locks them (leases.locks): a
    terminal ACK that committed first leaves nothing to do.
    """
    run_id = Attempt.objects.filter(pk=attempt_id).values_list("run_id", flat=True).first()
    if run_id is None:
        return Outcome.UNCHANGED
    try:
        with transaction.atomic(durable=True):
            run = lock_run(run_id)
            attempt = lock_attempt(attempt_id, run_id=run_id)
            assert run is not None and attempt is not None  # never deleted (PROTECT)
            now = db_now()
            if attempt.state not in _STARTED or not attempt_overdue(attempt, now=now):
                return Outcome.UNCHANGED
            lease = lock_active_lease(attempt)
            if lease is not None:
                lease_transition(lease, LeaseState.REVOKED, reason=TIMED_OUT, now=now)
            # Running: its process ran too long, a failure of the script.
            # Starting: nothing ever said it ran (no executor handle).
            to_state = (
                AttemptState.FAILED if attempt.state == AttemptState.RUNNING else AttemptState.LOST
            )
            # A timed-out process may still run where the control plane cannot
            # see it (a hung agent, a lost one): its retry waits the
            # lost-execution grace unless the Worker confirmed it gone
            # (docs/adr/0005; a reconcile report lifts the wait).
            grace = lost_execution_grace()
            hold = grace > timedelta(0) and (lease is None or lease.execution_confirmed_at is None)
            attempt_finish(
                attempt,
                run,
                to_state,
                reason=TIMED_OUT,
                actor="control-plane",
                now=now,
                retry_not_before=now + grace if hold else None,
                retry_wait_reason=WaitReason.LOST_EXECUTION_GRACE,
                error_code=TIMED_OUT,
            )
    except LostRace:
        return Outcome.LOST_RACE
    logger.info(
        "attempt timed out",
        extra={"event": "attempt_timed_out", "attempt_id": attempt_id, "run_id": run_id},
    )
    return Outcome.APPLIED
