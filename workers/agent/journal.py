"""The Worker's durable inbox (docs/adr/0008): one SQLite journal in the agent's state directory.

Every offer is recorded by its offer id and spec digest before anything else
happens to it, and each step that matters after a crash is written before the
agent acts on it:

    received ─ starting ACK accepted ─▶ started ─▶ spawning ─▶ running ─▶ finished ─▶ reported
        └───────────────── (refused, not started, stopped) ───────────▶ finished / reported

`spawning` is the crash barrier: no process is ever started without it, so a
journal without `spawning` for an offer proves nothing of it ran. It implies
`started`: an offer that goes on to its spawn right after the starting ACK
is accepted is written `spawning` at once (one commit, not two); `started`
is written alone only for one stopped before its spawn. `running`
holds the pid, its start time (/proc/<pid>/stat field 22) and the process
group, so a restarted agent can tell its own orphan from a process that got the
pid later. `finished` holds the outcome; `reported` means the control plane has
it (terminal ACK accepted, a 409, or a reconcile answer).

The lease token is a secret: it lives only in this file (0600, in a 0700
directory) and is erased once the execution is reported. So is the Session
token (table `sessions`): a restarted agent ACKs the outcomes the previous
process could not deliver under the Session they ran in, while that Session
is still online; it is deleted once nothing of its Session is owed. The
journal is the agent's own; one agent holds it at a time (an exclusive lock on
`agent.lock` in the directory).

SQLite in WAL mode with `synchronous=NORMAL`: a commit is in the WAL file (the
OS's page cache) when `execute` returns, so it survives the agent being killed
(`kill -9`, the OOM killer) — the only crash its children can outlive. An
operating system crash or power loss may drop the last commits, but it takes
every child process with it, and what can then be missing (a `reported` mark,
an offer never started) is settled again by reconciling with the control plane,
which is idempotent. FULL would add an fsync to each of the five commits of an
Attempt for no case it would fix.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "JOURNAL_FILE",
    "LOCK_FILE",
    "Execution",
    "Journal",
    "OfferVerdict",
    "Outcome",
    "Phase",
    "SessionRecord",
    "StateDirError",
    "default_state_dir",
]

JOURNAL_FILE = "journal.sqlite3"
LOCK_FILE = "agent.lock"
# Reported executions are kept this long, so a late re-delivery of an offer id
# is still recognized (a lease lives for seconds to minutes), then deleted.
RETAIN_REPORTED_S = 24 * 3600.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS executions (
    offer_id     TEXT PRIMARY KEY,
    spec_sha256  TEXT NOT NULL,
    lease_token  TEXT NOT NULL,   -- secret: erased once reported
    session_id   TEXT NOT NULL,   -- the Session the offer came on
    phase        TEXT NOT NULL,
    pid          INTEGER,
    start_time   INTEGER,         -- /proc/<pid>/stat field 22 (clock ticks since boot)
    pgid         INTEGER,
    outcome      TEXT,            -- exited | killed | not_started
    exit_code    INTEGER,
    report       TEXT,            -- how the control plane learned the outcome
    received_at  REAL NOT NULL,
    updated_at   REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS executions_open ON executions (phase, session_id);
-- The Sessions offers came on: a restarted agent delivers the outcomes it owes
-- under the Session they ran in, if that Session is still online.
CREATE TABLE IF NOT EXISTS sessions (
    session_id   TEXT PRIMARY KEY,
    token        TEXT NOT NULL,   -- secret: deleted once nothing of the Session is owed
    timeout_s    REAL NOT NULL,   -- the Session timeout the control plane announced
    opened_at    REAL NOT NULL
);
"""
_SCHEMA_VERSION = 2


class StateDirError(Exception):
    """The state directory cannot be used (not ours, or another agent holds it)."""


class Phase(enum.StrEnum):
    RECEIVED = "received"  # journaled; nothing may run before the starting ACK
    STARTED = "started"  # the starting ACK was accepted
    SPAWNING = "spawning"  # crash barrier: a process may exist from here on
    RUNNING = "running"  # pid, start time and process group recorded
    FINISHED = "finished"  # outcome recorded; the control plane may not know it yet
    REPORTED = "reported"  # the control plane has the outcome (or refused it for good)


# Phases whose offer the agent still holds (executing it or owing its report).
OPEN_PHASES = (Phase.RECEIVED, Phase.STARTED, Phase.SPAWNING, Phase.RUNNING, Phase.FINISHED)
# Phases in which a process of the offer may be alive.
LIVE_PHASES = (Phase.SPAWNING, Phase.RUNNING)


class Outcome(enum.StrEnum):
    """The outcome words of the reconcile endpoint."""

    EXITED = "exited"  # the process ended on its own (or was gone when looked for)
    KILLED = "killed"  # the agent ended it
    NOT_STARTED = "not_started"  # no process was ever spawned


class OfferVerdict(enum.Enum):
    NEW = "new"  # recorded now: run it
    DUPLICATE = "duplicate"  # the same offer id and digest again: already handled
    CONFLICT = "conflict"  # the same offer id with another digest: refuse it


@dataclass(frozen=True, repr=False)
class SessionRecord:
    session_id: str
    token: str
    timeout_s: float

    def __repr__(self) -> str:
        # The token is a secret: never in a repr, a log line or a traceback.
        return f"SessionRecord(session_id={self.session_id!r})"


@dataclass(frozen=True, repr=False)
class Execution:
    offer_id: str
    spec_sha256: str
    lease_token: str
    session_id: str
    phase: Phase
    pid: int | None
    start_time: int | None
    pgid: int | None
    outcome: Outcome | None
    exit_code: int | None
    report: str

    def __repr__(self) -> str:
        # The lease token is a secret: never in a repr, a log line or a traceback.
        return f"Execution(offer_id={self.offer_id!r}, phase={self.phase.value!r})"


def default_state_dir() -> Path:
    """`$XDG_STATE_HOME/qinglong-agent`, else `~/.local/state/qinglong-agent`."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "qinglong-agent"


def _private_dir(path: Path) -> None:
    """Create `path` 0700; an existing one must be ours and is made 0700."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if not stat.S_ISDIR(info.st_mode):
        raise StateDirError(f"{path} is not a directory")
    if info.st_uid != os.getuid():
        raise StateDirError(f"{path} belongs to another user")
    if stat.S_IMODE(info.st_mode) != 0o700:
        path.chmod(0o700)


def _private_file(path: Path) -> None:
    """Create `path` 0600 (before SQLite does, with the process umask)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != 0o600:
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


class Journal:
    """Thread-safe: one connection, one lock; every method is one transaction."""

    def __init__(self, connection: sqlite3.Connection, *, lock_fd: int | None = None) -> None:
        self._db = connection
        self._lock = threading.Lock()
        self._lock_fd = lock_fd
        self._db.executescript(_SCHEMA)
        self._db.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")

    # ------------------------------------------------------------ opening

    @classmethod
    def open(cls, state_dir: Path) -> Journal:
        """Lock the state directory (0700) and open its journal (0600).

        Raises StateDirError when another agent holds the directory: two
        agents on one journal would end each other's processes.
        """
        _private_dir(state_dir)
        lock_path = state_dir / LOCK_FILE
        _private_file(lock_path)
        # O_CLOEXEC: no child inherits the lock (an orphan would hold it).
        lock_fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            raise StateDirError(f"another agent is using {state_dir}") from None
        try:
            path = state_dir / JOURNAL_FILE
            _private_file(path)
            # SQLite creates the -wal and -shm files with the database's mode.
            connection = sqlite3.connect(
                path, isolation_level=None, check_same_thread=False, timeout=30
            )
            connection.execute("PRAGMA journal_mode = WAL")
            connection.execute("PRAGMA synchronous = NORMAL")
            # Deleted rows (and their erased tokens) are overwritten, not left in free pages.
            connection.execute("PRAGMA secure_delete = ON")
            return cls(connection, lock_fd=lock_fd)
        except BaseException:
            os.close(lock_fd)
            raise

    @classmethod
    def memory(cls) -> Journal:
        """A journal that lives as long as the object (tests, embedding)."""
        return cls(sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False))

    def close(self) -> None:
        with self._lock:
            self._db.close()
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = None

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # ------------------------------------------------------------ writing

    def record_offer(
        self, *, offer_id: str, spec_sha256: str, lease_token: str, session_id: str
    ) -> OfferVerdict:
        """First thing done with an offer: record it, or say it is known."""
        now = time.time()
        with self._lock:
            # One statement, committed when it returns (autocommit): a new
            # offer is recorded in a single write; a known one writes nothing.
            cursor = self._db.execute(
                "INSERT INTO executions (offer_id, spec_sha256, lease_token, session_id, phase,"
                " received_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (offer_id) DO NOTHING",
                (offer_id, spec_sha256, lease_token, session_id, Phase.RECEIVED, now, now),
            )
            if cursor.rowcount == 1:
                return OfferVerdict.NEW
            row = self._db.execute(
                "SELECT spec_sha256 FROM executions WHERE offer_id = ?", (offer_id,)
            ).fetchone()
        return OfferVerdict.DUPLICATE if row[0] == spec_sha256 else OfferVerdict.CONFLICT

    def _update(self, offer_id: str, assignments: str, *values: object) -> None:
        # One statement is its own transaction (autocommit): committed, in the
        # WAL, when `execute` returns; no BEGIN/COMMIT round of its own.
        with self._lock:
            self._db.execute(
                f"UPDATE executions SET {assignments}, updated_at = ? WHERE offer_id = ?",  # noqa: S608
                (*values, time.time(), offer_id),
            )

    def set_lease_token(self, offer_id: str, lease_token: str) -> None:
        """A re-delivered pull claim's token turned out to be another recent one."""
        self._update(offer_id, "lease_token = ?", lease_token)

    def mark_started(self, offer_id: str) -> None:
        self._update(offer_id, "phase = ?", Phase.STARTED)

    def mark_spawning(self, offer_id: str) -> None:
        """The crash barrier: written (committed) before the spawn. Implies
        `started` (the runner writes it straight after the starting ACK)."""
        self._update(offer_id, "phase = ?", Phase.SPAWNING)

    def mark_running(
        self, offer_id: str, *, pid: int, start_time: int | None, pgid: int | None
    ) -> None:
        self._update(
            offer_id, "phase = ?, pid = ?, start_time = ?, pgid = ?", Phase.RUNNING, pid,
            start_time, pgid,
        )  # fmt: skip

    def mark_finished(self, offer_id: str, *, outcome: Outcome, exit_code: int | None) -> None:
        self._update(
            offer_id, "phase = ?, outcome = ?, exit_code = ?", Phase.FINISHED, outcome, exit_code
        )

    def mark_reported(self, offer_id: str, *, report: str) -> None:
        """Settled: the token is erased (nothing will be sent under it again)."""
        self._update(offer_id, "phase = ?, report = ?, lease_token = ''", Phase.REPORTED, report)

    def record_session(self, *, session_id: str, token: str, timeout_s: float) -> None:
        """A Session was opened: written before any offer of it is recorded."""
        with self._transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO sessions (session_id, token, timeout_s, opened_at)"
                " VALUES (?, ?, ?, ?)",
                (session_id, token, timeout_s, time.time()),
            )

    def forget_sessions(self, *, keep: str) -> int:
        """Delete every Session but `keep` of which nothing is owed any more
        (its token will never be needed again)."""
        marks = ", ".join("?" for _ in OPEN_PHASES)
        with self._transaction() as db:
            cursor = db.execute(
                "DELETE FROM sessions WHERE session_id != ? AND NOT EXISTS (SELECT 1 FROM"  # noqa: S608
                f" executions e WHERE e.session_id = sessions.session_id AND e.phase IN ({marks}))",
                (keep, *OPEN_PHASES),
            )
            return cursor.rowcount

    def purge(self, *, older_than_s: float = RETAIN_REPORTED_S) -> int:
        with self._transaction() as db:
            cursor = db.execute(
                "DELETE FROM executions WHERE phase = ? AND updated_at < ?",
                (Phase.REPORTED, time.time() - older_than_s),
            )
            return cursor.rowcount

    # ------------------------------------------------------------ reading

    _COLUMNS = (
        "offer_id, spec_sha256, lease_token, session_id, phase, pid, start_time, pgid,"
        " outcome, exit_code, report"
    )

    @staticmethod
    def _execution(row: tuple[object, ...]) -> Execution:
        offer_id, digest, token, session_id, phase, pid, start, pgid, outcome, code, report = row
        return Execution(
            offer_id=str(offer_id),
            spec_sha256=str(digest),
            lease_token=str(token),
            session_id=str(session_id),
            phase=Phase(str(phase)),
            pid=int(pid) if isinstance(pid, int) else None,
            start_time=int(start) if isinstance(start, int) else None,
            pgid=int(pgid) if isinstance(pgid, int) else None,
            outcome=Outcome(str(outcome)) if outcome is not None else None,
            exit_code=int(code) if isinstance(code, int) else None,
            report=str(report or ""),
        )

    def get(self, offer_id: str) -> Execution | None:
        with self._lock:
            row = self._db.execute(
                f"SELECT {self._COLUMNS} FROM executions WHERE offer_id = ?",  # noqa: S608
                (offer_id,),
            ).fetchone()
        return self._execution(row) if row is not None else None

    def session(self, session_id: str) -> SessionRecord | None:
        with self._lock:
            row = self._db.execute(
                "SELECT session_id, token, timeout_s FROM sessions WHERE session_id = ?",
                (session_id,),
            ).fetchone()
        if row is None:
            return None
        return SessionRecord(str(row[0]), str(row[1]), float(row[2]))

    def count_open(self, *, session_id: str) -> int:
        """How many executions of one Session are not yet reported."""
        marks = ", ".join("?" for _ in OPEN_PHASES)
        with self._lock:
            row = self._db.execute(
                f"SELECT count(*) FROM executions WHERE phase IN ({marks})"  # noqa: S608
                " AND session_id = ?",
                (*OPEN_PHASES, session_id),
            ).fetchone()
        return int(row[0])

    def open_executions(self, *, session_id: str | None = None) -> list[Execution]:
        """Executions not yet reported (of one Session, or of every Session)."""
        marks = ", ".join("?" for _ in OPEN_PHASES)
        sql = f"SELECT {self._COLUMNS} FROM executions WHERE phase IN ({marks})"  # noqa: S608
        args: tuple[object, ...] = tuple(OPEN_PHASES)
        if session_id is not None:
            sql += " AND session_id = ?"
            args += (session_id,)
        with self._lock:
            rows = self._db.execute(sql + " ORDER BY received_at, offer_id", args).fetchall()
        return [self._execution(row) for row in rows]
