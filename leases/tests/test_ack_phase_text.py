"""A phase passed as its text is the phase (phases are compared by identity)."""

from __future__ import annotations

from typing import Any

import pytest

from leases.ack import AckItem, AckPhase, lease_ack
from leases.models import RunLease
from qinglong import testing
from runs.models import Attempt, AttemptState, Run, RunState

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_lifecycle_acked_with_phase_texts_runs_as_with_the_members() -> None:
    session = testing.open_session(testing.make_worker(slots=1)[0]).session
    attempt = testing.pending_attempt(testing.make_run(testing.make_task()))
    _, offer_id, token = testing.claim(attempt, session)
    lease = RunLease.objects.get(offer_id=offer_id)
    common: dict[str, Any] = {
        "session": session,
        "offer_id": offer_id,
        "lease_token": token,
        "spec_sha256": lease.spec_digest,
    }
    text: Any = "starting"  # as a caller without the enum would send it
    lease_ack(**common, phase=text)
    assert Attempt.objects.get(pk=attempt.pk).state == AttemptState.STARTING
    lease_ack(**common, phase="running", executor_handle="pid:1")  # type: ignore[arg-type]
    assert Attempt.objects.get(pk=attempt.pk).state == AttemptState.RUNNING
    lease_ack(**common, phase="succeeded", exit_code=0)  # type: ignore[arg-type]
    assert Attempt.objects.get(pk=attempt.pk).state == AttemptState.SUCCEEDED
    assert Run.objects.get(pk=attempt.run_id).state == RunState.SUCCEEDED


def test_an_item_of_a_text_holds_the_member_and_no_phase_is_refused() -> None:
    fields: dict[str, Any] = {"offer_id": "o", "lease_token": "t", "spec_sha256": "s"}
    assert AckItem(**{**fields, "phase": "running"}).phase is AckPhase.RUNNING
    assert AckItem(**fields, phase=AckPhase.FAILED).phase is AckPhase.FAILED
    with pytest.raises(ValueError, match="not a valid AckPhase"):
        AckItem(**{**fields, "phase": "done"})
