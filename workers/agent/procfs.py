"""What the agent knows about its processes from /proc (Linux), and how it ends them.

A pid alone never identifies a process: once it exits, the number can be handed
out again. The agent therefore records the start time of each child
(/proc/<pid>/stat field 22, clock ticks since boot) beside its pid, and every
child carries an environment marker (`QL_OFFER_ID=<offer id>`, inherited by
whatever it starts) so the processes of an execution can be found even when the
agent died before it recorded the pid.

A process group is treated as the execution's only when its leader is still
there (running or a zombie: either way its pid cannot be reused) with the
recorded start time, or when a member carries the execution's marker.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "GROUPS",
    "MARKER_ENV",
    "GroupScans",
    "ProcInfo",
    "end_execution",
    "proc_info",
    "procfs_available",
    "snapshot",
]

MARKER_ENV = "QL_OFFER_ID"
_PROC = Path("/proc")


@functools.cache
def procfs_available() -> bool:
    """Whether /proc can be read (Linux): asked once, it does not change."""
    return (_PROC / "self" / "stat").exists()


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    state: str  # R, S, D, Z, T, ... (field 3)
    pgid: int  # field 5
    start_time: int  # field 22

    @property
    def alive(self) -> bool:
        """A zombie (Z) or dead (X) entry runs nothing: only its exit status is left."""
        return self.state not in ("Z", "X", "x")


def proc_info(pid: int) -> ProcInfo | None:
    raw = _read_stat(str(pid))
    if raw is None:
        return None
    # Field 2 (comm) is in parentheses and may hold spaces and parentheses
    # itself: the fields after it start after the LAST ')'.
    fields = raw[raw.rfind(b")") + 2 :].split()
    try:
        return ProcInfo(
            pid=pid, state=fields[0].decode(), pgid=int(fields[2]), start_time=int(fields[19])
        )
    except (IndexError, ValueError):
        return None


def _pids() -> list[int]:
    try:
        names = [entry.name for entry in _PROC.iterdir()]
    except OSError:
        return []
    return [int(name) for name in names if name.isdigit()]


def _marker(pid: int) -> str | None:
    """The offer id in a process's marker, if it has one (and we may read it)."""
    try:
        environ = (_PROC / str(pid) / "environ").read_bytes()
    except OSError:  # another user's process, or gone
        return None
    prefix = MARKER_ENV.encode() + b"="
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode("ascii", "replace")
    return None


@dataclass(frozen=True)
class Snapshot:
    procs: dict[int, ProcInfo]
    markers: dict[int, str]  # pid -> offer id, for live marked processes


def snapshot(*, with_markers: bool = True) -> Snapshot:
    procs: dict[int, ProcInfo] = {}
    markers: dict[int, str] = {}
    me, my_group = os.getpid(), os.getpgrp()
    for pid in _pids():
        info = proc_info(pid)
        if info is None or pid == me or info.pgid == my_group:
            continue  # never the agent itself nor its own group
        procs[pid] = info
        if with_markers and info.alive:
            offer_id = _marker(pid)
            if offer_id is not None:
                markers[pid] = offer_id
    return Snapshot(procs, markers)


@dataclass(frozen=True)
class Targets:
    groups: frozenset[int]
    pids: frozenset[int]

    def alive(self, view: Snapshot) -> bool:
        return any(
            info.alive and (info.pgid in self.groups or info.pid in self.pids)
            for info in view.procs.values()
        )


def _targets(
    view: Snapshot, *, offer_id: str, pid: int | None, start_time: int | None, pgid: int | None
) -> Targets:
    groups: set[int] = set()
    group = pgid if pgid is not None else pid
    leader = view.procs.get(pid) if pid is not None else None
    if group is not None and leader is not None and leader.start_time == start_time:
        # Running or a zombie, the leader holds its pid: the group is ours.
        groups.add(group)
    marked = {p for p, marked_id in view.markers.items() if marked_id == offer_id}
    if group is not None and any(view.procs[p].pgid == group for p in marked):
        groups.add(group)
    return Targets(frozenset(groups), frozenset(marked))


def _signal(targets: Targets, signum: int) -> None:
    for group in targets.groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signum)
    for pid in targets.pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def end_execution(
    *,
    offer_id: str,
    pid: int | None,
    start_time: int | None,
    pgid: int | None,
    grace_s: float,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """End whatever still runs of one execution: TERM, then KILL after `grace_s`.

    Returns whether anything of it was alive. Off Linux (no /proc) nothing can
    be told apart safely, so nothing is signalled and False comes back.
    """
    if not procfs_available():
        return False
    targets = _targets(snapshot(), offer_id=offer_id, pid=pid, start_time=start_time, pgid=pgid)
    if not targets.alive(snapshot(with_markers=False)):
        return False
    _signal(targets, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        sleep(0.05)
        if not targets.alive(snapshot(with_markers=False)):
            return True
    _signal(targets, signal.SIGKILL)
    for _ in range(100):  # SIGKILL is not refused; wait for it to land
        if not targets.alive(snapshot(with_markers=False)):
            break
        sleep(0.02)
    return True


_NOT_RUNNING = (b"Z", b"X", b"x")  # zombie, dead: runs nothing


def _read_stat(name: str) -> bytes | None:
    """/proc/<name>/stat, read with plain system calls and no path objects."""
    try:
        fd = os.open(f"/proc/{name}/stat", os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)


def _stat_head(name: str) -> list[bytes] | None:
    """[state, ppid, pgrp, rest] of /proc/<name>/stat."""
    raw = _read_stat(name)
    if raw is None:
        return None
    return raw[raw.rfind(b")") + 2 :].split(b" ", 3)


def group_members_alive(pgid: int, *, exclude: Iterable[int] = ()) -> bool:
    """Whether a live process other than `exclude` is in the process group.

    Linux has no "members of a process group" call, so every process is
    asked for its group: one `getpgid` system call each (no file to open and
    parse: this runs over every process after every Attempt); only a member
    of the group has its stat read, for its state. The leader itself
    (unreaped, so its pid and group id are not handed out again) is excluded
    by the caller. The agent asks `GROUPS.members_alive`, which answers the
    same question for several callers with one pass; this one asks alone
    (not in `__all__`: tests call it by name).
    """
    return bool(_scan({pgid: frozenset(str(pid) for pid in exclude)}))


def _scan(groups: dict[int, frozenset[str]]) -> set[int]:
    """The groups of `groups` (process group id: pids left out) that have a
    live member, from one pass over /proc."""
    found: set[int] = set()
    getpgid = os.getpgid
    try:
        names = os.listdir("/proc")  # noqa: PTH208  (names, not Path objects: hot)
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        try:
            group = getpgid(int(name))
        except ProcessLookupError:
            continue  # gone meanwhile
        except OSError:
            group = None  # not ours to ask (a security module): its stat tells
        if group is not None:
            skip = groups.get(group)
            if skip is None or name in skip or group in found:
                continue
        head = _stat_head(name)
        if head is None or len(head) < 3 or head[0] in _NOT_RUNNING:
            continue
        try:
            group = int(head[2])
        except ValueError:
            continue
        skip = groups.get(group)
        if skip is None or name in skip or group in found:
            continue
        found.add(group)
        if len(found) == len(groups):
            break
    return found


class _GroupRequest:
    __slots__ = ("answer", "exclude", "pgid")

    def __init__(self, pgid: int, exclude: frozenset[str]) -> None:
        self.pgid = pgid
        self.exclude = exclude
        self.answer: bool | None = None


class GroupScans:
    """`group_members_alive` for every runner at once, by group commit: a
    caller with no pass over /proc under way makes one for itself and for
    whoever asked meanwhile; a caller that finds one under way waits for the
    next, which starts after its question (so it sees the group as it is
    now). One pass costs about the same for one group as for sixteen (a
    `getpgid` per process on the box), and a busy agent's processes end
    together (issue 12). An idle agent's caller scans at once, as before."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._asked: list[_GroupRequest] = []
        self._scanning = False
        self.passes = 0  # for tests and diagnostics

    def members_alive(self, pgid: int, *, exclude: Iterable[int] = ()) -> bool:
        request = _GroupRequest(pgid, frozenset(str(pid) for pid in exclude))
        with self._cond:
            self._asked.append(request)
            while True:
                if request.answer is not None:
                    return request.answer
                if not self._scanning:
                    self._scanning = True
                    batch, self._asked = self._asked, []
                    self.passes += 1
                    break
                self._cond.wait()
        found: set[int] | None = None
        try:
            groups: dict[int, frozenset[str]] = {}
            for asked in batch:
                # Two callers of one group (never in practice) leave out both's pids.
                groups[asked.pgid] = groups.get(asked.pgid, frozenset()) | asked.exclude
            found = _scan(groups)
        finally:
            with self._cond:
                self._scanning = False
                for asked in batch:
                    if found is not None:
                        asked.answer = asked.pgid in found
                    elif asked is not request:
                        # This pass failed: each other caller asks again.
                        self._asked.append(asked)
                self._cond.notify_all()
        return request.answer if request.answer is not None else False


GROUPS = GroupScans()
