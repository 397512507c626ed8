"""An ACK in one statement on PostgreSQL: lock, check and write in one round trip (issue #12).

`leases.ack.lease_ack` takes four round trips on its portable path: BEGIN,
the lock statement (`leases.locks.lock_lease_for_ack`), the phase's writes
(`leases.writes.Writes`) and COMMIT. Outside a transaction, the common case
of the three phases a Worker sends for every Run (`starting`, `running`,
`succeeded` without output, cancellation or webhook) is instead one
data-modifying statement in autocommit (`WITH lk AS (SELECT … FOR UPDATE),
g AS (SELECT …, <ok>), wa AS (UPDATE …), … SELECT …`): PostgreSQL runs it
atomically, so it writes all of it or none of it.

The statement only ever *applies*. Its `ok` is the conjunction of every
check `leases.ack._ack_in_chain` and the phase's part of `leases.ack._apply`
make before they write, evaluated on the rows as locked; when it is false
(a refusal, a repeat, a cancelled Run, a timeout, anything unusual) nothing
is written and `lease_ack` takes the portable path, which decides again
under its own locks and gives the answer — its errors, its UNCHANGED — so
every refusal still has one home. The states it accepts are read from the
transition tables (`leases.transitions`), the Session states from
`SESSION_CURRENT_STATES`; leases/tests/test_ack_statement_postgres.py runs
both paths over the same cases and asserts the same answers and rows.

Tokens and spec digests are not compared in plain SQL: Python sends
`sha256(digest || salt)` with a salt of its own per request and the
statement compares that with the same hash of the stored value, so the
comparison's timing tells nothing about the stored digest (the portable
path compares with `hmac.compare_digest`).

A concurrent commit between the statement's snapshot and its locks
(a heartbeat's renewal, say) leaves the snapshot's row behind the locked
one, and an UPDATE never sees a row its snapshot's version does not match;
`ok` therefore also requires each row it writes to be, in the snapshot,
the version the lock returned (`fresh`). Otherwise nothing is written and
the portable path, whose statements each take a new snapshot, applies it.
Every write keeps its compare-and-set on id, version and state, and every
write after the Attempt's runs only if the Attempt's did.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from django.db import DataError, connection
from django.utils import timezone

from dispatch.core.offer import token_digest
from leases import policy
from leases.errors import LostRace
from leases.models import LeaseState, RunLease
from leases.timeout import timeout_margin
from leases.transitions import ATTEMPT_TRANSITIONS, RUN_TRANSITIONS
from leases.writes import _hooks_sql
from qinglong.prepared import prepared_cursor, state_literal
from runs.models import Attempt, AttemptEvent, AttemptState, Run, RunState, TaskRevision
from workers.models import SESSION_CURRENT_STATES, WorkerSession

__all__ = ["OneStatementAck", "ack_in_one_statement", "decides_in_one_statement"]


@dataclass(frozen=True)
class OneStatementAck:
    """What an ACK applied in one statement changed (the rows are not loaded)."""

    lease_id: int
    attempt_state: AttemptState
    run_state: RunState
    cancel_requested: bool


@dataclass(frozen=True)
class _Shape:
    """One phase's statement: the Attempt's target, the Run's (None: unchanged)."""

    attempt_to: AttemptState
    run_to: RunState | None
    attempt_sets: tuple[str, ...]  # SQL `column = expr` over `g` and parameters
    lease: str  # "extend" (expires_at) or "release"
    refuse_cancelled: bool
    refuse_overdue: bool
    refuse_hooks: bool


_PHASES: Final[Mapping[str, _Shape]] = {
    "starting": _Shape(
        attempt_to=AttemptState.STARTING,
        run_to=RunState.RUNNING,
        attempt_sets=(
            "started_at = g.now",
            # README "Run policies": past this (and a margin) the control plane stops it.
            "deadline_at = g.now + g.v_timeout * interval '1 second'",
        ),
        lease="extend",
        refuse_cancelled=True,
        refuse_overdue=False,
        refuse_hooks=False,
    ),
    "running": _Shape(
        attempt_to=AttemptState.RUNNING,
        run_to=None,
        attempt_sets=("executor_handle = %s::varchar",),
        lease="extend",
        refuse_cancelled=False,
        refuse_overdue=True,
        refuse_hooks=False,
    ),
    "succeeded": _Shape(
        attempt_to=AttemptState.SUCCEEDED,
        run_to=RunState.SUCCEEDED,
        attempt_sets=(
            "finished_at = g.now",
            "exit_code = %s::integer",
            "error_code = %s::varchar",
            "output_tail = ''",
        ),
        lease="release",
        refuse_cancelled=True,
        refuse_overdue=False,
        refuse_hooks=True,
    ),
}


def decides_in_one_statement(phase: str, *, output_tail: str) -> bool:
    """Whether an ACK of this phase may be tried as one statement (PostgreSQL only).

    A failure goes through the retry policy (`leases.end.attempt_finish`) and
    an output tail is redacted of the revision's env first: both stay on the
    portable path.
    """
    return phase in _PHASES and not output_tail and connection.vendor == "postgresql"


def _from_states(table: Mapping[Any, frozenset[Any]], to_state: str) -> str:
    """The states the transition table allows `to_state` from, as SQL literals."""
    found = sorted(str(state) for state, allowed in table.items() if to_state in allowed)
    assert found and to_state not in found  # a repeat is never a move
    return ", ".join(state_literal(state) for state in found)


def _hashed(value: str, salt: str) -> bytes:
    return hashlib.sha256((value + salt).encode("utf-8")).digest()


def _fresh(table: str, alias: str) -> str:
    """The snapshot's version of a locked row is the version the lock returned."""
    return f"(SELECT x.version FROM {table} x WHERE x.id = lk.{alias}_id) = lk.{alias}_version"  # noqa: S608  (names from model metadata; values are parameters)


_SQL: dict[str, str] = {}


def _sql(phase: str) -> str:
    """The statement of one phase (written once; prepared once per connection)."""
    found = _SQL.get(phase)
    if found is not None:
        return found
    shape = _PHASES[phase]
    qn = connection.ops.quote_name
    run, revision, attempt = (qn(m._meta.db_table) for m in (Run, TaskRevision, Attempt))
    session, lease = qn(WorkerSession._meta.db_table), qn(RunLease._meta.db_table)
    event = qn(AttemptEvent._meta.db_table)
    event_columns = tuple(f.column for f in AttemptEvent._meta.concrete_fields if not f.primary_key)
    # A new history column must be written here too: fail loudly, not silently.
    assert event_columns == (
        "attempt_id",
        "run_id",
        "from_state",
        "to_state",
        "reason",
        "actor",
        "at",
    ), event_columns
    target = state_literal(shape.attempt_to)
    current = ", ".join(state_literal(s) for s in SESSION_CURRENT_STATES)
    checks = [
        "sha256(convert_to(lk.l_token || %s::text, 'UTF8')) = %s::bytea",
        f"lk.s_state IN ({current}) AND lk.s_gen = lk.l_sgen",
        "sha256(convert_to(lk.l_spec || %s::text, 'UTF8')) = %s::bytea",
        f"lk.l_state = {state_literal(LeaseState.ACTIVE)}",
        "lk.l_expires > lk.now",  # leases.policy.lease_is_live
        "lk.a_gen = lk.l_gen",  # not stale
        f"lk.a_state IN ({_from_states(ATTEMPT_TRANSITIONS, shape.attempt_to)})",
    ]
    if shape.run_to is not None:
        checks.append(f"lk.r_state IN ({_from_states(RUN_TRANSITIONS, shape.run_to)})")
    # `fresh` (see the module docstring): the snapshot's row is the locked one.
    checks.extend(_fresh(table, alias) for table, alias in ((attempt, "a"), (lease, "l")))
    if shape.run_to is not None:
        checks.append(_fresh(run, "r"))
    if shape.refuse_cancelled:
        checks.append("NOT lk.r_cancel")
    if shape.refuse_overdue:
        # leases.timeout.attempt_overdue
        checks.append("(lk.a_deadline IS NULL OR lk.a_deadline > lk.now - %s::interval)")
    if shape.refuse_hooks:
        # notifications.services.run_event_emit records a delivery: the portable path.
        checks.append("NOT " + _hooks_sql().replace("%s", "lk.r_project"))
    if shape.lease == "extend":
        lease_sets = "expires_at = g.now + %s::interval"
    else:
        lease_sets = (
            f"state = {state_literal(LeaseState.RELEASED)}, ended_at = g.now, "
            f"end_reason = {state_literal('ack_' + phase)}"
        )
    active = state_literal(LeaseState.ACTIVE)
    attempt_sets = ", ".join((f"state = {target}", "version = a.version + 1", *shape.attempt_sets))
    writes = [
        f"""wa AS (
            UPDATE {attempt} a SET {attempt_sets} FROM g
            WHERE a.id = (SELECT g.a_id FROM g) AND g.ok
              AND a.id = g.a_id AND a.version = g.a_version AND a.state = g.a_state
            RETURNING a.id)""",  # noqa: S608  (names from model metadata; values are parameters)
        f"""we AS (
            INSERT INTO {event} ({", ".join(qn(c) for c in event_columns)})
            SELECT g.a_id, g.r_id, g.a_state, {target}, {state_literal("ack_" + phase)},
                   %s::varchar, %s::timestamptz
            FROM g WHERE EXISTS (SELECT 1 FROM wa)
            RETURNING 1)""",  # noqa: S608  (names from model metadata; values are parameters)
        f"""wl AS (
            UPDATE {lease} l SET {lease_sets}, version = l.version + 1 FROM g
            WHERE l.id = (SELECT g.l_id FROM g) AND EXISTS (SELECT 1 FROM wa)
              AND l.id = g.l_id AND l.version = g.l_version AND l.state = {active}
            RETURNING 1)""",  # noqa: S608  (names from model metadata; values are parameters)
    ]
    counts = ["(SELECT count(*) FROM wa)", "(SELECT count(*) FROM we)", "(SELECT count(*) FROM wl)"]
    if shape.run_to is not None:
        run_sets = f"state = {state_literal(shape.run_to)}, version = r.version + 1"
        if shape.run_to == RunState.SUCCEEDED:
            run_sets += ", finished_at = g.now"
        writes.append(
            f"""wr AS (
            UPDATE {run} r SET {run_sets} FROM g
            WHERE r.id = (SELECT g.r_id FROM g) AND EXISTS (SELECT 1 FROM wa)
              AND r.id = g.r_id AND r.version = g.r_version AND r.state = g.r_state
            RETURNING 1)"""  # noqa: S608  (names from model metadata; values are parameters)
        )
        counts.append("(SELECT count(*) FROM wr)")
    found = _SQL[phase] = f"""
        WITH lk AS MATERIALIZED (
            SELECT r.id AS r_id, r.state AS r_state, r.version AS r_version,
                   r.cancel_requested AS r_cancel, r.project_id AS r_project,
                   v.timeout_s AS v_timeout,
                   a.id AS a_id, a.state AS a_state, a.version AS a_version,
                   a.lease_generation AS a_gen, a.deadline_at AS a_deadline,
                   s.state AS s_state, s.generation AS s_gen,
                   l.id AS l_id, l.state AS l_state, l.version AS l_version,
                   l.lease_generation AS l_gen, l.session_generation AS l_sgen,
                   l.expires_at AS l_expires, l.token_digest AS l_token,
                   l.spec_digest AS l_spec,
                   statement_timestamp() AS now
            FROM {run} r, {revision} v, {attempt} a, {session} s, {lease} l
            WHERE l.id = (SELECT x.id FROM {lease} x WHERE x.offer_id = %s::varchar)
              -- `+ 0`: a filter, never an index condition (the Session's
              -- every lease ever), so the lease is read by its key.
              AND l.session_id + 0 = %s::bigint
              AND r.id = l.run_id AND v.id = r.task_revision_id
              AND a.id = l.attempt_id AND s.id = l.session_id
            FOR UPDATE OF r, a FOR NO KEY UPDATE OF s FOR UPDATE OF l
        ),
        g AS MATERIALIZED (
            SELECT lk.*, COALESCE({" AND ".join(checks)}, false) AS ok FROM lk
        ),
        {", ".join(writes)}
        SELECT g.ok, g.l_id, g.r_state, g.r_cancel, {", ".join(counts)},
               -- All of it or none: should a write after the Attempt's touch
               -- no row, the statement fails (a cast no constant folding can
               -- reach) and PostgreSQL undoes every write of it.
               CASE WHEN (SELECT count(*) FROM wa) = 1
                     AND NOT ({" AND ".join(f"{count} = 1" for count in counts[1:])})
                    THEN ({_HALF_WRITTEN!r} || g.l_id)::integer END
        FROM g
    """  # noqa: S608  (names from model metadata; values are parameters)
    return found


# The text of the error that undoes a half-written ACK (no secret: a lease id follows).
_HALF_WRITTEN: Final = "qinglong: ack half written, lease "


def ack_in_one_statement(
    *,
    session: WorkerSession,
    offer_id: str,
    phase: str,
    lease_token: str,
    spec_sha256: str,
    executor_handle: str = "",
    exit_code: int | None = None,
    error_code: str = "",
) -> OneStatementAck | None:
    """Apply one ACK in one statement, or write nothing and return None.

    None: the lease was not found for this Session, or a check failed, or a
    row changed between the statement's snapshot and its locks — the caller
    takes the portable path, which decides and answers. Outside a
    transaction only (the statement is its own); `decides_in_one_statement`
    says which ACKs may come here. Raises `LostRace`, having written
    nothing, only should a write after the Attempt's touch no row, which the
    locks and `fresh` exclude.
    """
    shape = _PHASES[phase]
    salt = secrets.token_hex(16)
    digest = token_digest(lease_token)
    params: list[Any] = [
        offer_id,
        session.pk,
        salt,
        _hashed(digest, salt),
        salt,
        _hashed(spec_sha256, salt),
    ]
    if shape.refuse_overdue:
        params.append(timeout_margin())
    if phase == "running":
        params.append(executor_handle[:200])
    elif phase == "succeeded":
        params.extend((exit_code, error_code[:64]))
    # The history row's actor and clock, as `Writes.attempt` stamps them.
    params.extend((f"worker:{session.worker_id}"[:80], timezone.now()))
    if shape.lease == "extend":
        params.append(policy.lease_ttl())
    try:
        with prepared_cursor() as cursor:
            cursor.execute(_sql(phase), params)
            row = cursor.fetchone()
    except DataError as exc:
        if _HALF_WRITTEN not in str(exc):
            raise
        # The statement failed whole: nothing of it was written.
        raise LostRace("an ACK in one statement would have been half written") from None
    if row is None or not row[0]:
        return None
    _, lease_id, run_state, cancel_requested, *written, _half = row
    if written[0] != 1:
        return None  # nothing written (the Attempt's compare-and-set gates the rest)
    return OneStatementAck(
        lease_id=lease_id,
        attempt_state=shape.attempt_to,
        run_state=RunState(shape.run_to or run_state),
        cancel_requested=bool(cancel_requested),
    )
