"""Worker Registry and Session use cases: enroll, rotate, open, heartbeat, offline.

A new Session of a Worker fences every earlier one (docs/adr/0003): its token
stops working at once, and the lease authority ends the old Session's leases
(`leases.end.leases_end_for_session`: claimed → back to pending, started →
lost) so that nothing it was granted is ever delivered again. The reason a
lost Attempt carries says why (docs/adr/0005): `worker_restarted` (a new
Session of the same Worker), `worker_lost` (offline), `credential_rotated`,
`worker_disabled`.
"""

from __future__ import annotations

import logging
import secrets
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db.models import Q

from dispatch.core.errors import SpecError
from dispatch.core.offer import token_digest
from dispatch.core.placement import validate_labels
from dispatch.core.policy import capacity
from dispatch.core.spec import validate_executor_type
from dispatch.notify import announce_sessions_fenced
from leases.end import leases_end_for_session, leases_end_not_held
from leases.locks import lock_worker
from leases.policy import SWEEP_BATCH, session_is_current
from leases.reasons import EndReason
from leases.renew import leases_renew_for_session
from leases.selectors import cancelled_offer_ids, offers_to_stop
from leases.timeout import timed_out_offer_ids
from notifications.services import worker_offline_emit
from qinglong.clock import db_now
from qinglong.prepared import prepared_cursor
from qinglong.rows import ModelColumns
from workers.models import (
    SESSION_CURRENT_STATES,
    SessionEndReason,
    SessionState,
    Worker,
    WorkerAdminState,
    WorkerSession,
)

logger = logging.getLogger("qinglong.workers")

MAX_SLOTS = 256
MAX_EXECUTOR_TYPES = 16


class WorkerInputError(ValueError):
    """Bad enrollment or session input; `field` names what is wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _new_secret(prefix: str) -> str:
    # 256 bits of entropy; the prefix tells an operator what kind of secret it is.
    return f"{prefix}_{secrets.token_urlsafe(32)}"


def _validate_capabilities(
    *, executor_types: object, labels: object, slots: object
) -> tuple[list[str], dict[str, str], int]:
    if not isinstance(executor_types, list | tuple) or not executor_types:
        raise WorkerInputError("executor_types", "must be a non-empty list")
    if len(executor_types) > MAX_EXECUTOR_TYPES:
        raise WorkerInputError("executor_types", f"at most {MAX_EXECUTOR_TYPES} items")
    try:
        types = sorted({validate_executor_type(t, field="executor_types") for t in executor_types})
        label_map = validate_labels(labels if labels is not None else {}, field="labels")
    except SpecError as err:
        raise WorkerInputError(err.field, err.message) from None
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
        raise WorkerInputError("slots", f"must be an integer from 1 to {MAX_SLOTS}")
    return types, label_map, slots


@transaction.atomic
def worker_enroll(
    *, name: str, slots: int, executor_types: Sequence[str], labels: Mapping[str, str]
) -> tuple[Worker, str]:
    """Register a Worker; returns it and its credential, which is never stored."""
    types, label_map, slot_count = _validate_capabilities(
        executor_types=list(executor_types), labels=dict(labels), slots=slots
    )
    credential = _new_secret("qlw")
    worker = Worker(
        name=name,
        credential_digest=token_digest(credential),
        credential_prefix=credential[:8],
        executor_types=types,
        labels=label_map,
        slots=slot_count,
    )
    worker.full_clean()
    worker.save()
    return worker, credential


def _fence_sessions(worker: Worker, *, reason: SessionEndReason, now: datetime) -> list[int]:
    """End every current Session of a locked Worker (inside the caller's transaction).

    The caller ends their leases after commit (`_end_fenced_leases`): a racing
    claim either committed first (its lease is ended then) or waits on the
    Session row and then sees it fenced.
    """
    fenced = list(
        WorkerSession.objects.filter(worker=worker, state__in=SESSION_CURRENT_STATES).values_list(
            "pk", flat=True
        )
    )
    WorkerSession.objects.filter(pk__in=fenced).update(
        state=SessionState.REPLACED, ended_at=now, end_reason=reason
    )
    return fenced


def _end_fenced_leases(session_pks: Sequence[int], *, reason: str) -> None:
    """After the fence commits: end the fenced Sessions' leases, wake their waiting pulls."""
    for pk in session_pks:
        leases_end_for_session(pk, reason=reason)
    if session_pks and int(settings.QINGLONG_PULL_WAIT_MAX_S) > 0:
        # Best effort: a fenced Session's long poll would otherwise hold its
        # thread until its timeout.
        announce_sessions_fenced(
            [
                str(uuid_)
                for uuid_ in WorkerSession.objects.filter(pk__in=session_pks).values_list(
                    "session_id", flat=True
                )
            ]
        )


def worker_rotate_credential(*, worker: Worker) -> str:
    """Issue a new credential; the old one and every Session opened with it stop at once.

    The Sessions are fenced exactly like a replacement (README "rotation"):
    their tokens get `401 credential_rotated`, their claimed Attempts go back
    to pending and their started ones are lost (the retry policy decides).
    """
    credential = _new_secret("qlw")
    with transaction.atomic(durable=True):
        # The lock a Session open takes: an open authenticated with the old
        # credential either committed first (and is fenced here) or waits and
        # then sees the new digest (`CredentialRotated`).
        locked = lock_worker(worker.pk)
        now = db_now()
        # Fence first: this waits for a claim holding one of the Sessions, and
        # holds back any later claim. Only then change the digest, a key column
        # (unique) whose UPDATE needs a full row lock, which would deadlock
        # with the foreign-key check (KEY SHARE) of that claim's lease insert.
        fenced = _fence_sessions(locked, reason=SessionEndReason.CREDENTIAL_ROTATED, now=now)
        Worker.objects.filter(pk=locked.pk).update(
            credential_digest=token_digest(credential),
            credential_prefix=credential[:8],
            credential_rotated_at=now,
        )
    _end_fenced_leases(fenced, reason=EndReason.CREDENTIAL_ROTATED)
    worker.refresh_from_db()
    logger.info(
        "credential rotated",
        extra={"event": "credential_rotated", "worker_id": worker.pk, "fenced": len(fenced)},
    )
    return credential


def worker_set_admin_state(*, worker: Worker, admin_state: WorkerAdminState) -> None:
    Worker.objects.filter(pk=worker.pk).update(admin_state=admin_state)
    worker.admin_state = admin_state
    if admin_state == WorkerAdminState.DISABLED:
        for session in WorkerSession.objects.filter(
            worker=worker, state__in=SESSION_CURRENT_STATES
        ):
            session_end(
                session_pk=session.pk,
                to_state=SessionState.OFFLINE,
                reason=SessionEndReason.WORKER_DISABLED,
            )


def worker_authenticate(credential: str) -> Worker | None:
    if not credential:
        return None
    return Worker.objects.filter(credential_digest=token_digest(credential)).first()


@dataclass(frozen=True)
class OpenedSession:
    session: WorkerSession
    token: str  # shown once, never stored
    replaced: tuple[int, ...]


class WorkerDisabled(Exception):
    """A disabled Worker may not open Sessions."""


class CredentialRotated(Exception):
    """The credential this request authenticated with was rotated before the open committed."""


def session_open(
    *,
    worker: Worker,
    executor_types: object,
    labels: object,
    slots: object,
    agent_version: str = "",
) -> OpenedSession:
    """Open the Worker's next Session generation and fence every earlier one."""
    types, label_map, slot_count = _validate_capabilities(
        executor_types=executor_types, labels=labels, slots=slots
    )
    unknown = set(types) - set(worker.executor_types)
    if unknown:
        raise WorkerInputError("executor_types", "not enrolled for this worker")
    # Labels decide placement, and placement decides who sees a spec: a Worker
    # may only advertise what the operator enrolled it with, never claim more.
    if any(worker.labels.get(key) != value for key, value in label_map.items()):
        raise WorkerInputError("labels", "not enrolled for this worker")
    token = _new_secret("qls")
    with transaction.atomic(durable=True):
        # Lock the Worker: generations are handed out one at a time.
        # No-key lock: it serializes generations without blocking the foreign-key
        # checks of lease inserts (a claim holding this Worker's Session row).
        locked = lock_worker(worker.pk)
        if locked.admin_state == WorkerAdminState.DISABLED:
            raise WorkerDisabled(locked.name)
        if locked.credential_digest != worker.credential_digest:
            # Authenticated with a credential rotated meanwhile: it "stops
            # working at once", including for an open already under way.
            raise CredentialRotated(locked.name)
        now = db_now()
        replaced = _fence_sessions(locked, reason=SessionEndReason.SESSION_REPLACED, now=now)
        generation = locked.last_generation + 1
        Worker.objects.filter(pk=locked.pk).update(last_generation=generation)
        session = WorkerSession.objects.create(
            worker=locked,
            session_id=uuid.uuid4(),
            generation=generation,
            state=(
                SessionState.DRAINING
                if locked.admin_state == WorkerAdminState.DRAINING
                else SessionState.ONLINE
            ),
            token_digest=token_digest(token),
            executor_types=types,
            labels=dict(locked.labels),
            # Never more than the Worker was enrolled with (dispatch.core.policy).
            slots=capacity(slot_count, locked.slots),
            agent_version=str(agent_version)[:64],
            heartbeat_at=now,
        )
    # After the fence commits, so a racing claim either committed first (and
    # its lease is ended here) or sees the Session replaced.
    # The Worker restarted (or another agent took its credential): a started
    # Attempt of the old Session is lost, `worker_restarted` (docs/adr/0005).
    _end_fenced_leases(replaced, reason=EndReason.WORKER_RESTARTED)
    logger.info(
        "session opened",
        extra={
            "event": "session_opened",
            "worker_id": worker.pk,
            "generation": generation,
            "replaced": len(replaced),
        },
    )
    return OpenedSession(session=session, token=token, replaced=tuple(replaced))


class SessionRejected(Exception):
    """The presented session token is not (or no longer) usable."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


_AUTH_SESSION = ModelColumns(WorkerSession, "s")
_AUTH_WORKER = ModelColumns(Worker, "w")
# The statement above, written once per database vendor.
_AUTH_SQL: dict[str, str] = {}


def _session_by_token_digest(digest: str) -> WorkerSession | None:
    """The Session holding this token digest, its Worker read in: one indexed lookup.

    Every Worker API request but a Session open starts here, so the SQL is
    written once instead of compiled per request (`qinglong.rows`); the
    instances are the ones `select_related("worker")` would build.
    """
    db = connections[DEFAULT_DB_ALIAS]
    sql = _AUTH_SQL.get(db.vendor)
    if sql is None:
        qn = db.ops.quote_name
        sql = _AUTH_SQL[db.vendor] = (
            f"SELECT {_AUTH_SESSION.select()}, {_AUTH_WORKER.select()} "  # noqa: S608  (names from model metadata; values are parameters)
            f"FROM {qn(WorkerSession._meta.db_table)} s "
            f"JOIN {qn(Worker._meta.db_table)} w ON w.{qn('id')} = s.{qn('worker_id')} "
            f"WHERE s.{qn('token_digest')} = %s"
        )
    # Every Worker request asks it: planned once per connection (qinglong.prepared).
    with prepared_cursor() as cursor:
        cursor.execute(sql, [digest])
        row = cursor.fetchone()
    if row is None:
        return None
    session = _AUTH_SESSION.load(row[: len(_AUTH_SESSION)])
    session.worker = _AUTH_WORKER.load(row[len(_AUTH_SESSION) :])
    return session


def session_authenticate(token: str) -> WorkerSession:
    """The Session of a token, or `SessionRejected` with a precise code."""
    session = _session_by_token_digest(token_digest(token)) if token else None
    if session is None:
        raise SessionRejected("invalid_session_token")
    if not session_is_current(session):
        raise SessionRejected(_fenced_code(session))
    if session.worker.admin_state == WorkerAdminState.DISABLED:
        raise SessionRejected("worker_disabled")
    return session


def _fenced_code(session: WorkerSession) -> str:
    """The 401 code of an ended Session: what the Worker should do next."""
    if session.end_reason == SessionEndReason.CREDENTIAL_ROTATED:
        return "credential_rotated"  # reopening needs the new credential
    return "session_replaced" if session.state == SessionState.REPLACED else "session_offline"


@dataclass(frozen=True)
class Heartbeat:
    session_state: SessionState
    cancel: list[str]
    stop: list[str]  # of the offers the agent listed as held: stop these now
    server_time: datetime
    renewed: int
    recorded: bool  # False: inside the minimum interval, answered without a write
    not_held: int = 0  # started Attempts ended because the agent did not list them


def _heartbeat_gap() -> timedelta:
    return timedelta(seconds=int(settings.QINGLONG_HEARTBEAT_MIN_INTERVAL_S))


def _heartbeat_due(*, wants: str, now: datetime) -> Q:
    """Which heartbeats write (README "Heartbeats"), as a WHERE condition.

    A heartbeat records (heartbeat_at, state, lease renewals) at most once per
    QL_HEARTBEAT_MIN_INTERVAL_S per Session. Entering `draining` is the one
    exception: it takes effect at once, and since leaving it again waits for
    the interval, a Session still writes at most twice per interval.
    """
    due = Q(heartbeat_at__lte=now - _heartbeat_gap())
    if wants == SessionState.DRAINING:
        due |= Q(state=SessionState.ONLINE)
    return due


def _heartbeat_looks_due(session: WorkerSession, *, wants: str, now: datetime) -> bool:
    """`_heartbeat_due` on the row as read at authentication (the no-write fast path)."""
    if session.heartbeat_at <= now - _heartbeat_gap():
        return True
    return wants == SessionState.DRAINING and session.state == SessionState.ONLINE


def session_heartbeat(
    *, session: WorkerSession, draining: bool, held: Collection[str] | None = None
) -> Heartbeat:
    """Keep a Session online, renew its started leases, return cancel and stop verdicts.

    `held` is what the agent holds (docs/adr/0005): every offer it has
    recorded and not finished reporting. With it, a recorded heartbeat renews
    only the listed started leases and, once committed, ends this Session's
    started Attempts it does not list (`not_held`; their slots free at once);
    claimed leases are offers in hand and are not touched. Without it (older
    agents) every started lease of the Session is renewed. Either way the
    answer's `stop` names the listed ids the agent must stop now.
    """
    wants = (
        SessionState.DRAINING
        if draining or session.worker.admin_state == WorkerAdminState.DRAINING
        else SessionState.ONLINE
    )
    now = db_now()
    if not _heartbeat_looks_due(session, wants=wants, now=now):
        # Inside the interval: answered from the current state with no
        # transaction at all (on SQLite a write transaction takes the one
        # database write lock).
        return _heartbeat_answer(session, now=now, held=held, renewed=0, recorded=False)
    with transaction.atomic(durable=True):
        now = db_now()
        # Compare-and-set on the current states: a heartbeat racing the offline
        # sweeper or a replacement never resurrects the Session; the interval
        # is in the same WHERE, so racing heartbeats of one Session write once.
        updated = (
            WorkerSession.objects.filter(pk=session.pk, state__in=SESSION_CURRENT_STATES)
            .filter(_heartbeat_due(wants=wants, now=now))
            .update(heartbeat_at=now, state=wants)
        )
        if updated != 1:
            session.refresh_from_db()
            if session.state not in SESSION_CURRENT_STATES:
                raise SessionRejected(_fenced_code(session))
            # A concurrent heartbeat of this Session wrote first.
            return _heartbeat_answer(session, now=now, held=held, renewed=0, recorded=False)
        session.heartbeat_at = now
        session.state = wants
        renewed = leases_renew_for_session(session, now=now, held=held)
    not_held = 0
    if held is not None:
        # After the commit, one transaction per lease in the lock order (Run →
        # Attempt → RunLease): never under this heartbeat's Session row.
        not_held = leases_end_not_held(session_pk=session.pk, held=held, now=now)
    return _heartbeat_answer(
        session, now=now, held=held, renewed=renewed, recorded=True, not_held=not_held
    )


def _stop_verdicts(
    session: WorkerSession, *, held: Collection[str] | None, now: datetime
) -> list[str]:
    """Offers to stop now: listed as held but no longer this Session's to run
    (docs/adr/0005), and started ones past their timeout (leases.timeout),
    listed or not."""
    stop = [] if held is None else offers_to_stop(session, held, now=now)
    listed = set(stop)
    return stop + [
        offer for offer in timed_out_offer_ids(session.pk, now=now) if offer not in listed
    ]


def _heartbeat_answer(
    session: WorkerSession,
    *,
    now: datetime,
    held: Collection[str] | None,
    renewed: int,
    recorded: bool,
    not_held: int = 0,
) -> Heartbeat:
    return Heartbeat(
        session_state=SessionState(session.state),
        cancel=cancelled_offer_ids(session),
        stop=_stop_verdicts(session, held=held, now=now),
        server_time=now,
        renewed=renewed,
        recorded=recorded,
        not_held=not_held,
    )


def session_end(*, session_pk: int, to_state: SessionState, reason: str) -> bool:
    """Mark a current Session offline/replaced and end its leases."""
    updated = WorkerSession.objects.filter(pk=session_pk, state__in=SESSION_CURRENT_STATES).update(
        state=to_state, ended_at=db_now(), end_reason=reason
    )
    leases_end_for_session(session_pk, reason=reason)
    return updated == 1


def sessions_stale(*, now: datetime, limit: int = SWEEP_BATCH) -> list[int]:
    """Current Sessions whose last heartbeat is older than the session timeout."""
    cutoff = now - timedelta(seconds=settings.QINGLONG_SESSION_TIMEOUT_S)
    return list(
        WorkerSession.objects.filter(state__in=SESSION_CURRENT_STATES, heartbeat_at__lt=cutoff)
        .order_by("heartbeat_at", "id")
        .values_list("pk", flat=True)[:limit]
    )


def session_mark_offline_if_stale(*, session_pk: int) -> bool:
    """Offline sweeper step: a CAS that re-checks staleness at write time."""
    now = db_now()
    cutoff = now - timedelta(seconds=settings.QINGLONG_SESSION_TIMEOUT_S)
    with transaction.atomic(durable=True):
        updated = WorkerSession.objects.filter(
            pk=session_pk, state__in=SESSION_CURRENT_STATES, heartbeat_at__lt=cutoff
        ).update(
            state=SessionState.OFFLINE, ended_at=now, end_reason=SessionEndReason.SESSION_OFFLINE
        )
        if updated == 1:
            # Webhooks: `worker.offline`, recorded with the state change it reports.
            worker_offline_emit(session_pk=session_pk)
    if updated != 1:
        return False
    leases_end_for_session(session_pk, reason=EndReason.WORKER_LOST)
    return True
