"""Leases to ACK and the ACK items for them, shared by the ACK batch tests."""

from __future__ import annotations

from leases.ack import AckItem, AckPhase
from leases.models import RunLease
from qinglong import testing
from workers.models import WorkerSession


def leased(session: WorkerSession, count: int) -> list[tuple[RunLease, str]]:
    """`count` claimed leases of `session`, oldest Run first, with their tokens."""
    task = testing.make_task()
    out = []
    for _ in range(count):
        attempt = testing.pending_attempt(testing.make_run(task))
        _, offer_id, token = testing.claim(attempt, session)
        out.append((RunLease.objects.get(offer_id=offer_id), token))
    return out


def items(pairs: list[tuple[RunLease, str]], *phases: AckPhase) -> list[AckItem]:
    """An ACK of each phase for each lease, lease by lease."""
    return [
        AckItem(
            offer_id=lease.offer_id,
            phase=phase,
            lease_token=token,
            spec_sha256=lease.spec_digest,
            executor_handle="pid:1",
            exit_code=0,
        )
        for lease, token in pairs
        for phase in phases
    ]
