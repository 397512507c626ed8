"""The writes of one use case as one statement (issue #12; docs/adr/0011).

A claim or an ACK changes up to four rows: the Attempt (a compare-and-set),
its history row, the Run (a compare-and-set) and the lease (a compare-and-set,
or a new row). `Writes` collects them, checks each against the transition
tables of `leases.transitions` before anything is written (`IllegalTransition`),
and applies them:

- on PostgreSQL as **one** data-modifying statement (`WITH a AS (UPDATE …
  RETURNING 1), e AS (INSERT …), … SELECT count(*) …`): one round trip
  instead of four. Every compare-and-set keeps its own `WHERE id = ? AND
  version = ? AND state = ?`; the statement reports how many rows each
  touched, and any count but one raises `LostRace`, which rolls the caller's
  transaction back, exactly like the one-at-a-time functions of
  `leases.transitions`;
- elsewhere (SQLite has no data-modifying `WITH`) the same statements run one
  after another, each checked the same way. SQLite serializes writers
  (`BEGIN IMMEDIATE`), so nothing can come between them.

An optional `Guard` is a one-row `SELECT` of checks that must be read after
the caller's locks (the claim's slot count and pull-id check): on PostgreSQL
it is the statement's first part and every write is conditioned on its
`ok`, so a failed check writes nothing; elsewhere it runs first, as its own
statement. Either way the caller gets the guard's row back.

The callers hold the row locks (`leases.locks`) before calling `apply`, so
the order of the writes inside the statement takes no lock out of the one
lock order.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, Unpack, cast

from django.db import DEFAULT_DB_ALIAS, connection, connections, models
from django.db.models import Model
from django.utils import timezone

from leases.errors import IllegalTransition, LostRace
from leases.locks import claim_count_sql, pull_conflict_sql, session_counts_cte
from leases.models import LeaseState, RunLease
from leases.transitions import (
    ATTEMPT_TRANSITIONS,
    LEASE_TRANSITIONS,
    RUN_TRANSITIONS,
    AttemptChanges,
    RunChanges,
)
from notifications.models import WebhookSubscription
from notifications.services import run_event_emit
from qinglong.prepared import array_text, int8_params, prepared_cursor, state_literal
from runs.models import Attempt, AttemptEvent, AttemptState, Run, RunState

__all__ = ["AckWrites", "ClaimCounts", "ClaimWrites", "Guard", "Writes"]


@dataclass(frozen=True)
class Guard:
    """Checks read after the locks: `SELECT <columns>` with `ok` computed from them.

    `columns` maps an output name to an SQL expression (its parameters in
    `params`, in the order the columns are given); `ok` is an SQL boolean
    expression over those names.
    """

    columns: Mapping[str, str]
    params: Sequence[Any]
    ok: str
    ok_params: Sequence[Any] = ()

    def select(self) -> tuple[str, list[Any]]:
        inner = ", ".join(f"{expr} AS {name}" for name, expr in self.columns.items())
        return (
            f"SELECT g.*, ({self.ok}) AS ok FROM (SELECT {inner}) AS g",  # noqa: S608  (names from model metadata; values are parameters)
            # `ok` comes first in the text, so its parameters do too.
            [*self.ok_params, *self.params],
        )


@dataclass
class _Step:
    sql: str  # an UPDATE … WHERE … or INSERT INTO … (cols) SELECT …, without RETURNING
    params: list[Any]
    returns_id: bool = False
    guarded_where: bool = True  # UPDATE: AND (guard) appended to WHERE; INSERT: WHERE (guard)
    on_applied: list[Any] = field(default_factory=list)  # callbacks(new_id) after success
    # Set-based application (`AckWrites`): steps of one group are one part of
    # one statement (`("cas", label, names)` or `("insert", label)`; empty:
    # not set-based), and the row an UPDATE writes (two steps writing one row
    # never share a statement).
    group: tuple[Any, ...] = ()
    row: tuple[str, int] | None = None


_ATTEMPT: Final = Attempt._meta
_RUN: Final = Run._meta
_LEASE: Final = RunLease._meta
_EVENT: Final = AttemptEvent._meta


_QUOTED: dict[tuple[str, str], str] = {}
_LABELS: dict[Any, str] = {}


def _label(meta: Any) -> str:
    # `Options.label` is a property that formats the string on every read.
    found = _LABELS.get(meta)
    if found is None:
        found = _LABELS[meta] = meta.label
    return found


def _q(name: str, db: Any = None) -> str:
    # Quoting is per database vendor and never changes: done once per name.
    db = db or _db()
    key = (db.vendor, name)
    quoted = _QUOTED.get(key)
    if quoted is None:
        quoted = _QUOTED[key] = db.ops.quote_name(name)
    return quoted


_INSERT_SQL: dict[tuple[str, str], tuple[str, tuple[Any, ...]]] = {}


def _insert_sql(meta: Any, db: Any = None) -> tuple[str, tuple[Any, ...]]:
    """The INSERT text of a model (every concrete column but the key) and those fields."""
    key = ((db or _db()).vendor, _label(meta))
    found = _INSERT_SQL.get(key)
    if found is None:
        fields = tuple(f for f in meta.concrete_fields if not f.primary_key)
        columns = ", ".join(_q(f.column) for f in fields)
        placeholders = ", ".join(["%s"] * len(fields))
        found = _INSERT_SQL[key] = (
            f"INSERT INTO {_q(meta.db_table)} ({columns}) SELECT {placeholders}",
            fields,
        )
    return found


_FIELDS: dict[tuple[str, str], Any] = {}


def _field(meta: Any, name: str) -> Any:
    key = (_label(meta), name)
    found = _FIELDS.get(key)
    if found is None:
        found = _FIELDS[key] = meta.get_field(name)
    return found


def _insert_step(obj: Model) -> _Step:
    """An INSERT of every concrete column of an unsaved instance, as the ORM would."""
    sql, fields = _insert_sql(obj._meta)
    # pre_save applies auto_now_add and the like, exactly as Model.save() does.
    params = [f.get_db_prep_save(f.pre_save(obj, add=True), connection) for f in fields]
    return _Step(sql=sql, params=params)


def _insert_values(meta: Any, db: Any, **values: object) -> _Step:
    """`_insert_step` of an instance with these attribute values, without making
    one (`_saved_value`); `db` the default database's wrapper (`_db`)."""
    sql, fields = _insert_sql(meta, db)
    return _Step(
        sql=sql,
        params=[_saved_value(f, values, db) for f in fields],
        group=("insert", _label(meta)),
    )


# Field classes whose `get_db_prep_save` of a value of exactly this type is
# the value as the backend adapts that type (Django 5.2: CharField/TextField
# `to_python` returns a str as it is, IntegerField's `int()` an int, and
# DateTimeField's `to_python` an aware datetime, which it then hands to
# `adapt_datetimefield_value`). Exact classes only: a subclass may prepare
# otherwise. Held to `get_db_prep_save` in leases/tests/test_writes.py.
_PLAIN_PREP: Final[Mapping[type, type]] = {
    models.CharField: str,
    models.TextField: str,
    models.IntegerField: int,
    models.SmallIntegerField: int,
    models.BigIntegerField: int,
    models.PositiveIntegerField: int,
    models.PositiveSmallIntegerField: int,
    models.PositiveBigIntegerField: int,
    models.DateTimeField: datetime,
}


def _prepared(field: Any, value: Any, db: Any) -> Any:
    """`field.get_db_prep_save(value, db)`, without its chain of calls for the
    plain cases (`_PLAIN_PREP`: a few microseconds each, some fourteen values
    per ACK, issue #12)."""
    kind = _PLAIN_PREP.get(type(field))
    if kind is not None and type(value) is kind:
        if kind is str:
            return value
        if kind is int:
            return db.ops.adapt_integerfield_value(value, field.get_internal_type())
        if cast(datetime, value).tzinfo is not None:
            return db.ops.adapt_datetimefield_value(value)
    return field.get_db_prep_save(value, db)


def _saved_value(field: Any, values: Mapping[str, object], db: Any) -> Any:
    """What `Model.save()` would write to `field` of a new instance with these
    attribute values: a field not given takes `pre_save` of an `auto_now_add`
    field (its clock reading), else its default."""
    if field.attname in values:
        value = values[field.attname]
    elif getattr(field, "auto_now_add", False) or getattr(field, "auto_now", False):
        value = timezone.now()
    else:
        value = field.get_default()
    return _prepared(field, value, db)


def _db() -> Any:
    # The connection itself: each attribute read through the `connection`
    # proxy is a thread-local lookup, and value preparation reads several.
    # Each lookup (this one too) asks asyncio for a running loop: a `Writes`
    # looks it up once (issue 12: ~25 lookups per ACK, about a tenth of an
    # ACK request's CPU under py-spy).
    return connections[DEFAULT_DB_ALIAS]


_CAS_SQL: dict[tuple[str, str, tuple[str, ...]], str] = {}


def _cas_sql(meta: Any, names: tuple[str, ...], db: Any) -> str:
    """`UPDATE … SET state, version, <names> WHERE id, version, state` (written once per shape)."""
    key = (db.vendor, _label(meta), names)
    found = _CAS_SQL.get(key)
    if found is None:
        sets = [f"{_q('state')} = %s", f"{_q('version')} = %s"]
        sets.extend(f"{_q(_field(meta, name).column)} = %s" for name in names)
        found = _CAS_SQL[key] = (
            f"UPDATE {_q(meta.db_table)} SET {', '.join(sets)} "  # noqa: S608  (names from model metadata; values are parameters)
            f"WHERE {_q('id')} = %s AND {_q('version')} = %s AND {_q('state')} = %s"
        )
    return found


def _cas_step(
    meta: Any,
    db: Any,
    *,
    pk: int,
    version: int,
    state: str,
    to_state: str,
    changes: Mapping[str, object],
) -> _Step:
    params: list[Any] = [to_state, version + 1]
    for name, value in changes.items():
        params.append(_prepared(_field(meta, name), value, db))
    params.extend((pk, version, state))
    names = tuple(changes)
    return _Step(
        sql=_cas_sql(meta, names, db),
        params=params,
        group=("cas", _label(meta), names),
        row=(_label(meta), pk),
    )


def _legal(
    entity: str, table: Mapping[Any, frozenset[Any]], from_state: str, to_state: str
) -> None:
    if to_state not in table.get(from_state, frozenset()):
        raise IllegalTransition(entity, from_state, to_state)


# The Run states `notifications.services.run_event_emit` reports (it writes
# nothing for any other).
_REPORTED: Final = frozenset({RunState.SUCCEEDED, RunState.FAILED})
_HOOKS_SQL: dict[str, str] = {}


def _hooks_sql(db: Any = None) -> str:
    """Whether a Project has an active webhook subscription (`webhooksub_active`)."""
    db = db or _db()
    found = _HOOKS_SQL.get(db.vendor)
    if found is None:
        meta = WebhookSubscription._meta
        found = _HOOKS_SQL[db.vendor] = (
            f"EXISTS (SELECT 1 FROM {_q(meta.db_table)} h "  # noqa: S608  (names from model metadata; values are parameters)
            f"WHERE h.{_q('active')} AND h.{_q('project_id')} = %s)"
        )
    return found


class Writes:
    """The writes of one use case, applied together (see the module docstring)."""

    def __init__(self) -> None:
        self._db = _db()  # the default database's wrapper, looked up once
        self._steps: list[_Step] = []
        self._after: list[Any] = []
        # Reads answered by the writing statement itself (PostgreSQL): SQL
        # boolean expressions and their parameters, and their answers once applied.
        self._probes: list[tuple[str, list[Any]]] = []
        self._probed: dict[int, bool] = {}
        # Runs that just ended, reported once written (`run_event_emit`), each
        # with its probe's index (None: no probe, always reported).
        self._emits: list[tuple[int | None, Run]] = []

    # -- what to write ---------------------------------------------------------

    def attempt(
        self,
        attempt: Attempt,
        to_state: AttemptState,
        *,
        reason: str,
        actor: str,
        **changes: Unpack[AttemptChanges],
    ) -> None:
        """`leases.transitions.attempt_transition` (its history row included,
        stamped like every history row: `AttemptEvent.at`, auto_now_add)."""
        from_state = str(attempt.state)
        _legal("attempt", ATTEMPT_TRANSITIONS, from_state, to_state)
        self._steps.append(
            _cas_step(
                _ATTEMPT,
                self._db,
                pk=attempt.pk,
                version=attempt.version,
                state=from_state,
                to_state=str(to_state),
                changes=dict(changes),
            )
        )
        self._steps.append(
            _insert_values(
                _EVENT,
                self._db,
                attempt_id=attempt.pk,
                run_id=attempt.run_id,
                from_state=from_state,
                to_state=str(to_state),
                reason=reason,
                actor=actor[:80],
            )
        )

        def done() -> None:
            attempt.state = to_state
            attempt.version += 1
            for key, value in changes.items():
                setattr(attempt, key, value)

        self._after.append(done)

    def run(self, run: Run, to_state: RunState, **changes: Unpack[RunChanges]) -> None:
        """`leases.transitions.run_transition`."""
        from_state = str(run.state)
        _legal("run", RUN_TRANSITIONS, from_state, to_state)
        self._steps.append(
            _cas_step(
                _RUN,
                self._db,
                pk=run.pk,
                version=run.version,
                state=from_state,
                to_state=str(to_state),
                changes=dict(changes),
            )
        )

        # Webhooks, as run_transition does: a Run that just ended gets its
        # outbox rows in this transaction (nothing for other states). On
        # PostgreSQL the writing statement also tells whether its Project has
        # an active subscription at all; without one there is nothing to
        # record and run_event_emit, which would read that again, is skipped.
        hooks: int | None = None
        if to_state in _REPORTED and self._db.vendor == "postgresql":
            hooks = len(self._probes)
            self._probes.append((_hooks_sql(self._db), [run.project_id]))

        def done() -> None:
            run.state = to_state
            run.version += 1
            for key, value in changes.items():
                setattr(run, key, value)

        self._after.append(done)
        self._emits.append((hooks, run))

    def lease_end(
        self, lease: RunLease, to_state: LeaseState, *, reason: str, now: datetime
    ) -> None:
        """`leases.transitions.lease_transition`."""
        _legal("lease", LEASE_TRANSITIONS, str(lease.state), to_state)
        changes = {"ended_at": now, "end_reason": reason}
        self._steps.append(
            _cas_step(
                _LEASE,
                self._db,
                pk=lease.pk,
                version=lease.version,
                state=LeaseState.ACTIVE,
                to_state=str(to_state),
                changes=changes,
            )
        )

        def done() -> None:
            lease.state = to_state
            lease.version += 1
            lease.ended_at = now
            lease.end_reason = reason

        self._after.append(done)

    def lease_extend(self, lease: RunLease, *, expires_at: datetime) -> None:
        """`leases.transitions.lease_extend`: an active lease's new expiry."""
        self._steps.append(
            _cas_step(
                _LEASE,
                self._db,
                pk=lease.pk,
                version=lease.version,
                state=LeaseState.ACTIVE,
                to_state=LeaseState.ACTIVE,
                changes={"expires_at": expires_at},
            )
        )

        def done() -> None:
            lease.expires_at = expires_at
            lease.version += 1

        self._after.append(done)

    def lease_create(self, lease: RunLease) -> None:
        """A new lease row (the claim); `lease.pk` is set once applied."""
        step = _insert_step(lease)
        step.returns_id = True
        step.on_applied.append(lambda new_id: setattr(lease, "pk", new_id))
        self._steps.append(step)

    # -- applying --------------------------------------------------------------

    def apply(self, *, guard: Guard | None = None) -> dict[str, Any] | None:
        """Write everything, or nothing when the guard's `ok` is false.

        Returns the guard's row (None without a guard). Must run inside the
        caller's transaction, after its locks.
        """
        if self._db.vendor == "postgresql":
            row = self._apply_in_one_statement(guard)
        else:
            row = self._apply_one_by_one(guard)
        if row is None or row["ok"]:
            for done in self._after:
                done()
            self._emit()
        return row

    def _emit(self) -> None:
        """The webhooks of the Runs these writes ended (after every write: the
        report reads the Attempt as written)."""
        for hooks, run in self._emits:
            if hooks is None or self._probed.get(hooks, True):
                run_event_emit(run=run)

    def _apply_in_one_statement(self, guard: Guard | None) -> dict[str, Any] | None:
        ctes: list[str] = []
        params: list[Any] = []
        condition = ""
        if guard is not None:
            guard_sql, guard_params = guard.select()
            ctes.append(f"guard AS ({guard_sql})")
            params.extend(guard_params)
            condition = "(SELECT ok FROM guard)"
        for index, step in enumerate(self._steps):
            sql = step.sql
            if condition:
                sql += f" AND {condition}" if sql.startswith("UPDATE") else f" WHERE {condition}"
            returning = _q("id", self._db) if step.returns_id else "1"
            ctes.append(f"w{index} AS ({sql} RETURNING {returning})")
            params.extend(step.params)
        most = f"max({_q('id', self._db)})"
        written = [
            f"(SELECT {most if step.returns_id else 'count(*)'} FROM w{index})"  # noqa: S608  (names from model metadata; values are parameters)
            f" AS _w{index}"
            for index, step in enumerate(self._steps)
        ]
        probed = [f"{probe} AS _p{index}" for index, (probe, _) in enumerate(self._probes)]
        counts = ", ".join(written + probed)
        for _, probe_params in self._probes:
            params.extend(probe_params)
        tail = f"SELECT guard.*, {counts} FROM guard" if guard else f"SELECT {counts}"  # noqa: S608  (names from model metadata; values are parameters)
        # The text depends only on the use case's shape (which steps, which
        # columns), and its integers go as bigint whatever their values
        # (`int8_params`), so PostgreSQL prepares it once per connection.
        with prepared_cursor() as cursor:
            cursor.execute(f"WITH {', '.join(ctes)} {tail}", int8_params(params))
            names = [column.name for column in cursor.description]
            values = cursor.fetchone()
        assert values is not None
        row = dict(zip(names, values, strict=True))
        self._probed = {index: bool(row[f"_p{index}"]) for index in range(len(self._probes))}
        if guard is not None and not row["ok"]:
            return row
        for index, step in enumerate(self._steps):
            touched = row[f"_w{index}"]
            if step.returns_id:
                if touched is None:
                    raise LostRace("a row was not written")
                for callback in step.on_applied:
                    callback(touched)
            elif touched != 1:
                raise LostRace("a row changed under us")
        return (
            {key: value for key, value in row.items() if not key.startswith("w")} if guard else None
        )

    def _apply_one_by_one(self, guard: Guard | None) -> dict[str, Any] | None:
        with connection.cursor() as cursor:
            row: dict[str, Any] | None = None
            if guard is not None:
                guard_sql, guard_params = guard.select()
                cursor.execute(guard_sql, guard_params)
                names = [column[0] for column in cursor.description]
                values = cursor.fetchone()
                assert values is not None
                row = dict(zip(names, values, strict=True))
                row["ok"] = bool(row["ok"])
                if not row["ok"]:
                    return row
            for step in self._steps:
                cursor.execute(step.sql, step.params)
                if step.returns_id:
                    new_id = connection.ops.last_insert_id(
                        cursor, step.sql.split()[2].strip('"'), "id"
                    )
                    for callback in step.on_applied:
                        callback(new_id)
                elif cursor.rowcount != 1:
                    raise LostRace("a row changed under us")
        return row


# ------------------------------------------------ several ACKs' writes at once


class AckWrites:
    """The writes of the ACKs of one batch (`leases.ack.lease_ack_each`),
    applied set-based on PostgreSQL (docs/adr/0013).

    Each ACK is decided as before, on its chain's rows in memory, and its
    `Writes` handed here (`add`) instead of applied: its rows in memory take
    their new values at once (the next item of the same offer is decided on
    them), and its writes wait. `flush` applies everything added in as few
    statements as there are *waves*: a wave holds at most one write per row
    (PostgreSQL applies one change per row and statement), so `running` then
    `succeeded` of one offer are two waves; ACKs of different offers share
    a wave. A wave of one ACK is that ACK's own `Writes` statement; any
    other is one statement of the same shape as `Writes`' — one
    part per kind of write (`UPDATE … FROM unnest(<arrays>)`, every row's
    compare-and-set on id, version and state; `INSERT … SELECT * FROM
    unnest(…)` for the history rows) — and its text depends only on which
    kinds it holds, not on how many rows: prepared once per connection.
    Each part must touch exactly as many rows as it was given, else
    `LostRace` (the caller rolls the whole transaction back). The webhooks
    of the Runs that ended are recorded after the last wave, in the order
    the ACKs were added; the wave itself tells which of their Projects have
    an active subscription, as `Writes` does.

    The caller holds every row's lock (`leases.locks.lock_leases_for_acks`)
    and flushes before anything that reads or writes those rows otherwise
    (`leases.end.attempt_finish`) and before it commits.
    """

    def __init__(self) -> None:
        self._waves: list[list[Writes]] = []
        self._rows: list[set[tuple[str, int]]] = []
        self._added: list[Writes] = []

    def add(self, writes: Writes) -> None:
        assert writes._db.vendor == "postgresql", "set-based ACK writes are PostgreSQL's"
        rows = set()
        for step in writes._steps:
            if not step.group or step.returns_id or step.on_applied:
                # `_apply_wave` reports counts only: no new id to hand back.
                raise ValueError(
                    "only compare-and-sets and history rows are set-based, "
                    "never a step that returns an id or has callbacks"
                )
            if step.row is not None:
                rows.add(step.row)
        # After the last wave that writes one of its rows.
        wave = 1 + max((i for i, taken in enumerate(self._rows) if taken & rows), default=-1)
        if wave == len(self._waves):
            self._waves.append([])
            self._rows.append(set())
        self._waves[wave].append(writes)
        self._rows[wave] |= rows
        self._added.append(writes)
        for done in writes._after:
            done()

    def flush(self) -> None:
        """Apply every wave added, then record the webhooks."""
        waves, added = self._waves, self._added
        self._waves, self._rows, self._added = [], [], []
        for wave in waves:
            _apply_wave(wave)
        for writes in added:
            writes._emit()


_METAS: Final = {meta.label: meta for meta in (_ATTEMPT, _RUN, _LEASE, _EVENT)}
_GROUP_SQL: dict[tuple[Any, ...], str] = {}
_SIZED: Final = re.compile(r"\(\d+\)$")


def _arrays(fields: Sequence[Any]) -> str:
    """`unnest` arguments, one array parameter per field. Unsized (`varchar`,
    not `varchar(16)`): an explicit cast to a sized type truncates, an
    assignment to the column refuses an over-long value, as `Writes` does."""
    db = _db()
    return ", ".join(f"%s::{_SIZED.sub('', field.db_type(db))}[]" for field in fields)


def _group_sql(group: tuple[Any, ...]) -> str:
    """One kind of write over arrays of rows (written once per kind)."""
    found = _GROUP_SQL.get(group)
    if found is not None:
        return found
    kind, label, *rest = group
    meta = _METAS[label]
    table = _q(meta.db_table)
    if kind == "cas":
        (names,) = rest
        state, version, pk = (_field(meta, name) for name in ("state", "version", "id"))
        # The order of `_cas_step`'s parameters.
        sets = [state, version, *(_field(meta, name) for name in names)]
        where = [pk, version, state]
        fields = [*sets, *where]
        columns = ", ".join(f"c{index}" for index in range(len(fields)))
        assignments = ", ".join(f"{_q(f.column)} = v.c{i}" for i, f in enumerate(sets))
        matches = " AND ".join(
            f"t.{_q(f.column)} = v.c{len(sets) + i}" for i, f in enumerate(where)
        )
        found = (
            f"UPDATE {table} t SET {assignments} "  # noqa: S608  (names from model metadata; values are parameters)
            f"FROM unnest({_arrays(fields)}) AS v({columns}) WHERE {matches}"
        )
    else:
        assert kind == "insert", group
        _, inserted = _insert_sql(meta)
        found = (
            f"INSERT INTO {table} ({', '.join(_q(f.column) for f in inserted)}) "  # noqa: S608  (names from model metadata; values are parameters)
            f"SELECT * FROM unnest({_arrays(inserted)})"
        )
    _GROUP_SQL[group] = found
    return found


def _hooked_sql() -> str:
    """The Projects among an array of ids with an active webhook subscription."""
    meta = WebhookSubscription._meta
    return (
        f"(SELECT array_agg(h.{_q('project_id')}) FROM {_q(meta.db_table)} h "  # noqa: S608  (names from model metadata; values are parameters)
        f"WHERE h.{_q('active')} AND h.{_q('project_id')} = ANY(%s::bigint[]))"
    )


def _array_text(values: Sequence[Any]) -> Any:
    """A column of a wave as its array's text form (`qinglong.prepared.array_text`),
    which the statement casts to the column's array type. A column holding any
    other type goes as a list, dumped by psycopg."""
    text = array_text(values)
    return list(values) if text is None else text


def _apply_wave(wave: Sequence[Writes]) -> None:
    if len(wave) == 1:
        # One ACK's writes: its own statement (`Writes`' text, without arrays
        # to dump and unnest), exactly as it is applied alone.
        wave[0]._apply_in_one_statement(None)
        return
    groups: dict[tuple[Any, ...], list[_Step]] = {}
    for writes in wave:
        for step in writes._steps:
            groups.setdefault(step.group, []).append(step)
    kinds = sorted(groups)  # one text per set of kinds, whatever the order added
    ctes: list[str] = []
    params: list[Any] = []
    for index, kind in enumerate(kinds):
        steps = groups[kind]
        ctes.append(f"w{index} AS ({_group_sql(kind)} RETURNING 1)")
        params.extend(
            _array_text(column) for column in zip(*(step.params for step in steps), strict=True)
        )
    counts = [f"(SELECT count(*) FROM w{index})" for index in range(len(kinds))]  # noqa: S608  (no values)
    # Every probe of `Writes` is `_hooks_sql()` of one Project.
    projects = sorted({probe[1][0] for writes in wave for probe in writes._probes})
    if projects:
        counts.append(_hooked_sql())
        params.append(projects)
    with prepared_cursor() as cursor:
        # Arrays of integers as bigint[] (each cast to its column's type in
        # the text): one prepared statement per text whatever the ids' widths.
        cursor.execute(f"WITH {', '.join(ctes)} SELECT {', '.join(counts)}", int8_params(params))
        row = cursor.fetchone()
    assert row is not None
    for index, kind in enumerate(kinds):
        if row[index] != len(groups[kind]):
            raise LostRace("a row changed under us")
    if projects:
        hooked = set(row[-1] or ())
        for writes in wave:
            writes._probed = {
                index: probe[1][0] in hooked for index, probe in enumerate(writes._probes)
            }


# ------------------------------------------------ a page of claims at once


@dataclass(frozen=True)
class ClaimCounts:
    """The counts a page of claims was decided on (`leases.claim`), to check again.

    Read under the locks but in a snapshot taken before the locks were
    granted, each may have missed a lease committed meanwhile; under the
    locks none can grow any more. `ClaimWrites.apply` writes only if every
    count is still at most what was assumed and no pull id gained another
    token; otherwise it writes nothing and the claim decides again.
    """

    sessions: Sequence[tuple[int, int]] = ()  # (WorkerSession pk, active leases)
    projects: Sequence[tuple[int, int]] = ()  # (Project pk, live leases at `now`)
    tasks: Sequence[tuple[int, int]] = ()  # (Task pk, live leases at `now`)
    pulls: Sequence[tuple[int, uuid.UUID, str]] = ()  # (Session pk, pull id, token digest)
    now: datetime | None = None


@dataclass
class _Claimed:
    attempt: Attempt
    run: Run
    lease: RunLease
    actor: str  # the history row's `actor`


# A page's lease columns that differ from claim to claim: what `_new_lease`
# (leases.claim) sets. Every other column is the model's default, the same for
# every lease of every page (`_lease_defaults`).
_LEASE_VARYING: Final = (
    "attempt_id",
    "run_id",
    "worker_id",
    "session_id",
    "session_generation",
    "lease_generation",
    "offer_id",
    "token_digest",
    "spec_digest",
    "placement_score",
    "source",
    "pull_id",
    "claimed_at",
    "expires_at",
    "delivery_count",
    "last_delivered_at",
)
_CLAIM_BATCH_SQL: dict[str, str] = {}


_LEASE_FIELDS: list[tuple[list[Any], list[Any]]] = []


def _lease_fields() -> tuple[list[Any], list[Any]]:
    """RunLease's concrete columns but the key: those `_LEASE_VARYING` names, the rest."""
    if not _LEASE_FIELDS:
        fields = [f for f in _LEASE.concrete_fields if not f.primary_key]
        _LEASE_FIELDS.append(
            (
                [f for f in fields if f.attname in _LEASE_VARYING],
                [f for f in fields if f.attname not in _LEASE_VARYING],
            )
        )
    return _LEASE_FIELDS[0]


def _lease_column(field: Any, leases: Sequence[RunLease]) -> list[Any]:
    """One varying column of the page's leases, as `save()` writes it on PostgreSQL:
    the attribute's value (`leases.claim._new_lease` sets each in the column's
    type), a pull id given as text made a UUID."""
    values = [getattr(lease, field.attname) for lease in leases]
    if field.attname == "pull_id":
        return [v if v is None or isinstance(v, uuid.UUID) else uuid.UUID(str(v)) for v in values]
    return values


def _claim_array(values: Sequence[Any]) -> Any:
    """A column of a page of claims as its array's text form (`_array_text`),
    a UUID as its text."""
    return _array_text([str(v) if isinstance(v, uuid.UUID) else v for v in values])


_DEFAULTS: dict[str, list[Any]] = {}


def _lease_defaults() -> list[Any]:
    """What `save()` writes to each column a claim leaves at its default (once per vendor)."""
    found = _DEFAULTS.get(connection.vendor)
    if found is None:
        db = _db()
        found = _DEFAULTS[connection.vendor] = [
            f.get_db_prep_save(f.get_default(), db) for f in _lease_fields()[1]
        ]
    return found


def _claim_batch_sql() -> str:
    """The statement of `ClaimWrites.apply` (written once per vendor).

    Under 4,096 characters and 50 parameters, so psycopg keeps its parsed form
    too (it parses longer statements again on every execution): the values
    that differ per claim are arrays (`q`), the states and the history row's
    fixed words are literals, the columns a claim leaves at their defaults
    one parameter each for the whole page.
    """
    found = _CLAIM_BATCH_SQL.get(connection.vendor)
    if found is not None:
        return found

    def counted(kind: str) -> str:
        if kind == "session":
            # The page's Sessions counted in one pass (`sc`, below), never one
            # scan per Session (leases.locks.session_counts_cte).
            return (
                "COALESCE((SELECT bool_and(COALESCE(sc.n, 0) <= g.n) "
                "FROM unnest(%s::bigint[], %s::integer[]) AS g(k, n) "
                "LEFT JOIN sc ON sc.session_id = g.k), true)"
            )
        check = claim_count_sql(kind, "g.k", "%s")
        return (
            f"COALESCE((SELECT bool_and({check} <= g.n) "  # noqa: S608  (names from model metadata; values are parameters)
            "FROM unnest(%s::bigint[], %s::integer[]) AS g(k, n)), true)"
        )

    varying, defaults = _lease_fields()
    q_columns = [
        "a_version",
        "r_version",
        "actor",
        *(f.column for f in varying),
    ]
    q_types = ["integer", "integer", "varchar(80)", *(f.db_type(connection) for f in varying)]
    arrays = ", ".join(f"%s::{kind}[]" for kind in q_types)
    lease_columns = ", ".join(_q(f.column) for f in (*varying, *defaults))
    lease_values = ", ".join(
        [
            *(f"q.{_q(f.column)}" for f in varying),
            *(f"%s::{f.db_type(connection)}" for f in defaults),
        ]
    )
    attempt, run, lease, event = (_q(m.db_table) for m in (_ATTEMPT, _RUN, _LEASE, _EVENT))
    state, version, pk = _q("state"), _q("version"), _q("id")
    aid, rid, gen = _q("attempt_id"), _q("run_id"), _q("lease_generation")
    pending, claimed = state_literal(AttemptState.PENDING), state_literal(AttemptState.CLAIMED)
    queued, dispatching = state_literal(RunState.QUEUED), state_literal(RunState.DISPATCHING)
    sql = f"""
        WITH {session_counts_cte("sc", "%s::bigint[]")},
        guard AS (SELECT ({counted("session")} AND {counted("project")}
            AND {counted("task")} AND NOT EXISTS (
                SELECT 1 FROM unnest(%s::bigint[], %s::uuid[], %s::varchar(64)[]) AS g(k, pull, tok)
                WHERE {pull_conflict_sql("g.k", "g.pull", "g.tok")})) AS ok),
        q AS MATERIALIZED (SELECT * FROM unnest({arrays}) AS q({", ".join(q_columns)})),
        wa AS (
            UPDATE {attempt} a SET {state} = {claimed}, {version} = a.{version} + 1, {gen} = q.{gen}
            FROM q, {run} r
            WHERE a.{pk} = q.{aid} AND a.{version} = q.a_version AND a.{state} = {pending}
              AND a.{gen} + 1 = q.{gen} AND a.{rid} = q.{rid}
              AND r.{pk} = q.{rid} AND r.{version} = q.r_version AND r.{state} = {queued}
              AND (SELECT ok FROM guard)
            RETURNING a.{pk} AS id
        ),
        wr AS (
            UPDATE {run} r SET {state} = {dispatching}, {version} = r.{version} + 1 FROM q
            WHERE r.{pk} = q.{rid} AND r.{version} = q.r_version AND r.{state} = {queued}
              AND q.{aid} IN (SELECT id FROM wa)
            RETURNING 1
        ),
        we AS (
            INSERT INTO {event} ({aid}, {rid}, {_q("from_state")}, {_q("to_state")}, {_q("reason")},
                {_q("actor")}, {_q("at")})
            SELECT q.{aid}, q.{rid}, {pending}, {claimed}, 'claim', q.actor, %s::timestamptz
            FROM q WHERE q.{aid} IN (SELECT id FROM wa) RETURNING 1
        ),
        wl AS (
            INSERT INTO {lease} ({lease_columns}) SELECT {lease_values}
            FROM q WHERE q.{aid} IN (SELECT id FROM wa) RETURNING {pk}, {aid}
        )
        SELECT (SELECT ok FROM guard), (SELECT array_agg(id) FROM wa),
               (SELECT count(*) FROM wr), (SELECT count(*) FROM we),
               (SELECT json_agg(json_build_array(wl.{aid}, wl.{pk})) FROM wl)
    """  # noqa: S608  (names from model metadata; the states are the models' constants, state_literal; values are parameters)
    # Its layout is for reading; what is sent has no run of blanks (no value
    # is in the text), which keeps it under psycopg's limit.
    found = _CLAIM_BATCH_SQL[connection.vendor] = " ".join(sql.split())
    return found


class ClaimWrites:
    """The writes of a page of claims as one statement (PostgreSQL; docs/adr/0011).

    Per claim: the Attempt `pending → claimed` (a compare-and-set on id,
    version, state and lease generation, which also checks its Run's id,
    version and state), the Run `queued → dispatching` (a compare-and-set),
    the history row and the lease — the last three only for an Attempt the
    first one wrote. An Attempt whose compare-and-set touches no row writes
    nothing: a lost race for that claim only. Under the caller's locks that
    cannot happen, and a Run, history row or lease missing for a written
    Attempt raises `LostRace` (the caller's transaction rolls back).
    """

    def __init__(self) -> None:
        self._claims: list[_Claimed] = []

    def __len__(self) -> int:
        return len(self._claims)

    def claim(self, attempt: Attempt, run: Run, lease: RunLease, *, actor: str) -> None:
        """`Writes.attempt(claimed)`, `Writes.run(dispatching)` and `Writes.lease_create`."""
        _legal("attempt", ATTEMPT_TRANSITIONS, str(attempt.state), AttemptState.CLAIMED)
        _legal("run", RUN_TRANSITIONS, str(run.state), RunState.DISPATCHING)
        self._claims.append(_Claimed(attempt=attempt, run=run, lease=lease, actor=actor[:80]))

    def apply(self, counts: ClaimCounts) -> dict[int, RunLease] | None:
        """Write every claim whose compare-and-sets hold, or nothing when a count grew.

        Returns the leases written by Attempt id (their `pk` set); None when
        `counts` no longer hold. Must run inside the caller's transaction,
        after its locks.
        """
        if not self._claims:
            return {}
        claims = self._claims
        leases = [c.lease for c in claims]
        sessions = _claim_array([k for k, _ in counts.sessions])
        # Each array as its text form (`_array_text`): no dumper per element.
        params: list[Any] = [
            sessions,  # the Sessions counted (`sc`), then each with its count
            sessions,
            _claim_array([n for _, n in counts.sessions]),
            # A quota count's `now` stands before its arrays in the text.
            counts.now,
            _claim_array([k for k, _ in counts.projects]),
            _claim_array([n for _, n in counts.projects]),
            counts.now,
            _claim_array([k for k, _ in counts.tasks]),
            _claim_array([n for _, n in counts.tasks]),
            _claim_array([k for k, _, _ in counts.pulls]),
            _claim_array([p for _, p, _ in counts.pulls]),
            _claim_array([t for _, _, t in counts.pulls]),
            _claim_array([c.attempt.version for c in claims]),
            _claim_array([c.run.version for c in claims]),
            _claim_array([c.actor for c in claims]),
            # What `save()` writes for each (leases.claim._new_lease): every
            # value here is already the column's type, a pull id a UUID.
            *(_claim_array(_lease_column(field, leases)) for field in _lease_fields()[0]),
            # The history rows' clock: `auto_now_add`, read once for the page.
            timezone.now(),
            *_lease_defaults(),
        ]
        sql = _claim_batch_sql()
        # One text whatever the page (its values are arrays): prepared once per connection.
        with prepared_cursor() as cursor:
            cursor.execute(sql, int8_params(params))
            row = cursor.fetchone()
        assert row is not None
        ok, written, runs, events, inserted = row
        if not ok:
            return None
        written = set(written or ())
        lease_ids = {int(attempt_id): int(pk) for attempt_id, pk in inserted or ()}
        if runs != len(written) or events != len(written) or set(lease_ids) != written:
            raise LostRace("a claim was half written")
        out: dict[int, RunLease] = {}
        for claimed in claims:
            attempt = claimed.attempt
            if attempt.pk not in written:
                continue
            attempt.state, attempt.version = AttemptState.CLAIMED, attempt.version + 1
            attempt.lease_generation = claimed.lease.lease_generation
            claimed.run.state, claimed.run.version = RunState.DISPATCHING, claimed.run.version + 1
            claimed.lease.pk = lease_ids[attempt.pk]
            out[attempt.pk] = claimed.lease
        return out
