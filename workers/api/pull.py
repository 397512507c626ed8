"""The pull use case of the Worker API: guard the pull id, cap, run one cycle.

docs/adr/0003: the Worker sends a `pull_id` and a fresh lease token.
Repeating the same pair rebuilds the same response from the durable lease
(session-scope recovery echoes the token); the same `pull_id` with another
token is a 409 and runs no cycle at all.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from django.conf import settings
from django.db import connection

from dispatch.core.offer import ClaimedExecutionOffer, token_digest, tokens_equal
from dispatch.core.policy import free_slots
from dispatch.core.ports import DispatchScope, PullCredential, SessionRef
from dispatch.core.result import CycleReason, CycleStatus, DispatchCycleResult
from dispatch.cycles import dispatch_cycle
from dispatch.notify import Wake, offer_subscription
from leases.models import LeaseState, RunLease
from leases.policy import session_capacity
from qinglong.prepared import prepared_cursor, state_literal
from runs.models import Attempt, AttemptState
from workers.models import WorkerSession


class PullIdConflict(Exception):
    """This Session already used the pull id with another lease token."""


@dataclass(frozen=True, repr=False)
class PullResult:
    offers: tuple[ClaimedExecutionOffer, ...]
    status: str
    reason: str
    truncated: bool

    def __repr__(self) -> str:
        # Offers hold specs and tokens: only counts may be shown.
        return f"PullResult(status={self.status!r}, offers={len(self.offers)})"


class _WaiterSlots:
    """At most QL_PULL_WAIT_MAX_WAITERS pulls wait at once in this process.

    A waiting pull holds a server thread (never a database connection); past
    the bound a pull answers at once, so heartbeats and ACKs keep a thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.waiting = 0

    @contextmanager
    def slot(self) -> Iterator[bool]:
        with self._lock:
            granted = self.waiting < int(settings.QINGLONG_PULL_WAIT_MAX_WAITERS)
            if granted:
                self.waiting += 1
        try:
            yield granted
        finally:
            if granted:
                with self._lock:
                    self.waiting -= 1


waiter_slots = _WaiterSlots()


def _release_database_connection() -> None:
    """Give the connection back before waiting: a waiting pull holds none.

    Django opens a new one on the next query (the cycle after the wake-up).
    Inside an outer transaction (a test wrapping us) there is nothing to give.
    """
    if not connection.in_atomic_block:
        connection.close()


_GUARD_SQL: dict[str, str] = {}


def _guard_sql() -> str:
    found = _GUARD_SQL.get(connection.vendor)
    if found is None:
        qn = connection.ops.quote_name
        lease, attempt = qn(RunLease._meta.db_table), qn(Attempt._meta.db_table)
        started = ", ".join(state_literal(s) for s in (AttemptState.STARTING, AttemptState.RUNNING))
        found = _GUARD_SQL[connection.vendor] = (
            f"SELECT 0, l.{qn('token_digest')}, 0 FROM {lease} l "  # noqa: S608  (names from model metadata, states are constants; values are parameters)
            f"WHERE l.{qn('session_id')} = %s AND l.{qn('pull_id')} = %s "
            f"UNION ALL SELECT 1, NULL, COUNT(*) FROM {lease} l "
            f"JOIN {attempt} a ON a.{qn('id')} = l.{qn('attempt_id')} "
            f"WHERE l.{qn('session_id')} = %s "
            f"AND l.{qn('state')} = {state_literal(LeaseState.ACTIVE)} "
            f"AND a.{qn('state')} IN ({started})"
        )
    return found


def _pull_guard(*, session: WorkerSession, pull_id: uuid.UUID) -> tuple[list[str], int]:
    """The token digests this Session's leases of `pull_id` hold, and its free slots.

    One statement written once (issue #12; it replaced two ORM queries):
    docs/adr/0003's one pull id, one token, and the slots not taken by
    started work — claimed-but-not-started leases are not subtracted, the
    pull re-delivers them and they must fit in the response.
    """
    pull_param = RunLease._meta.get_field("pull_id").get_db_prep_value(pull_id, connection)
    # Every pull asks it: PostgreSQL plans it once per connection (qinglong.prepared).
    with prepared_cursor() as cursor:
        cursor.execute(_guard_sql(), [session.pk, pull_param, session.pk])
        rows = cursor.fetchall()
    digests = [str(digest) for kind, digest, _ in rows if kind == 0]
    started = next(int(count) for kind, _, count in rows if kind == 1)
    return digests, free_slots(session_capacity(session), started)


def worker_pull(
    *,
    session: WorkerSession,
    pull_id: uuid.UUID,
    lease_token: str,
    max_offers: int,
    wait_s: int = 0,
) -> PullResult:
    """One session-scope cycle; with `wait_s`, a long poll (cluster, docs/adr/0001).

    A long poll subscribes to the Session's channels before its first cycle
    (so no announcement falls between the two), and when that cycle finds
    nothing it takes over as the Session's one waiting pull (an older one
    answers at once), closes its database connection, and waits up to
    min(wait_s, QL_PULL_WAIT_MAX_S) for the global cycle to announce an offer,
    then runs one more cycle, which re-materializes it. Without Redis, with
    waiting off, or with QL_PULL_WAIT_MAX_WAITERS pulls already waiting in this
    process, it is a plain pull.
    """
    digests, free = _pull_guard(session=session, pull_id=pull_id)
    presented = token_digest(lease_token)
    # Constant time per comparison: response timing must not leak a digest.
    if any(not tokens_equal(presented, stored) for stored in digests):
        raise PullIdConflict
    cap = min(max_offers, free)
    if cap < 1:
        return PullResult(
            offers=(),
            status=str(CycleStatus.NO_MATCH),
            reason=str(CycleReason.NO_FREE_SLOTS),
            truncated=False,
        )

    def cycle() -> DispatchCycleResult:
        return dispatch_cycle(
            scope=DispatchScope.for_session(
                SessionRef(
                    worker_id=str(session.worker_id),
                    session_id=str(session.session_id),
                    session_generation=session.generation,
                )
            ),
            pull=PullCredential(pull_id=str(pull_id), token=lease_token),
            max_offers=cap,
            session_pk=session.pk,
        )

    wait = min(max(0, wait_s), int(settings.QINGLONG_PULL_WAIT_MAX_S))
    if wait <= 0:
        result = cycle()
    else:
        with waiter_slots.slot() as may_wait:
            if not may_wait:
                result = cycle()
            else:
                with offer_subscription(str(session.session_id)) as subscription:
                    result = cycle()
                    if not result.offers and subscription is not None and subscription.take_over():
                        _release_database_connection()
                        if subscription.wait(wait) is Wake.OFFER:
                            result = cycle()
    return PullResult(
        offers=result.offers,
        status=str(result.status),
        reason=str(result.reason),
        truncated=result.truncated,
    )
