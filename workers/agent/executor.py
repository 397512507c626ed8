"""The `process` executor: the spec's argv as a local subprocess.

Each Attempt's process is a `LocalProcess`: it owns the child (its own session
and process group), the child's output file and its identity (pid, start time,
process group) for the journal. The child carries the `QL_OFFER_ID` marker and,
on Linux, dies with the agent — a courtesy: the journal's reconcile at start
is what guarantees no orphan outlives a restart (docs/adr/0008).

On Linux with pidfds the courtesy comes from the agent's death guard (`_Guard`):
a small process started once per agent process (another when one is at its
fd limit) that holds a pidfd of every child the agent spawned (each handed
over and answered before the spawn returns) and SIGKILLs those still
running when the agent process is gone (its end of a socket pair closes:
any death, kill -9 included). The child is the spec's command alone, spawned by `vfork` with no
`preexec_fn` and no exec in between: `setpriv --pdeathsig KILL`'s extra exec
cost about 0.8 ms of CPU per Run, more than the command `true` itself (issue
12). Where there is no guard, util-linux's `setpriv --pdeathsig KILL` sets
the parent-death signal, then execs the command in the same process (also
`vfork`); where setpriv is missing or too old, a `preexec_fn` sets it
(`fork` of the whole agent).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import enum
import errno
import functools
import itertools
import os
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from workers.agent import procfs
from workers.agent.protocol import SpecRefused, clean_output_tail

__all__ = [
    "LocalProcess",
    "ProcessSpawner",
    "death_guard_pid",
    "parent_death_signal",
    "parent_death_wrapper",
    "resolve_cwd",
]

# The child gets the spec's env over a minimal base, never the agent's whole
# environment (which may hold the agent's own secrets).
_BASE_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "TZ", "SYSTEMROOT")
_PR_SET_PDEATHSIG = 1
# Programs whose place a spawner remembers (forgotten all at once beyond).
_PROGRAMS_KEPT = 64


def parent_death_signal() -> Callable[[], None] | None:
    """A preexec function that asks Linux to SIGKILL the child when the thread
    that spawned it dies (with the agent), or None where there is no such thing.

    PR_SET_PDEATHSIG fires on the exit of the spawning THREAD, not the process:
    the runner thread that spawns a child outlives it (it waits for the exit).
    Everything the function uses is bound here, in the parent: between fork and
    exec the child may only make the system calls.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    agent_pid = os.getpid()
    getppid, kill, getpid, sigkill = os.getppid, os.kill, os.getpid, signal.SIGKILL

    def _die_with_the_agent() -> None:
        prctl(_PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
        if getppid() != agent_pid:
            # The agent died between the fork and the prctl: no signal will come.
            kill(getpid(), sigkill)

    return _die_with_the_agent


@functools.cache
def parent_death_wrapper() -> tuple[str, ...] | None:
    """`setpriv --pdeathsig KILL --`: the argv prefix that sets the child's
    parent-death signal and execs the command, or None where util-linux's
    setpriv is missing or has no `--pdeathsig` (before 2.33). Asked once:
    setpriv runs itself (`--version`) under the option, so a setpriv that
    lacks it, or a kernel or sandbox that refuses the prctl, is found out
    before any job depends on it.
    """
    if not sys.platform.startswith("linux"):
        return None
    path = shutil.which("setpriv")
    if path is None:
        return None
    prefix = (path, "--pdeathsig", "KILL", "--")
    try:
        probe = subprocess.run(
            [*prefix, path, "--version"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return prefix if probe.returncode == 0 else None


def _check_program(name: str, *, env: Mapping[str, str], cwd: str, first: str | None = None) -> str:
    """Raise what exec would (FileNotFoundError, PermissionError) when `name`
    names no program the child can run, before any process exists: behind
    setpriv, a missing program would otherwise be setpriv's exit code 127
    instead of a `spawn_failed`. The same search as the exec: a name with a
    slash from the cwd, else each directory of the child's PATH in order.
    Returns the file found; `first`: where it was found last time, looked at
    before the search (whichever the exec then picks, one exists)."""
    if not name:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory")
    # Strings, not Path objects: this runs before every spawn.
    # The PATH is split only when `first` is not the answer (lazily).
    candidates: Iterable[str] = (
        (os.path.join(cwd, name),) if "/" in name else _on_path(name, env=env, cwd=cwd)  # noqa: PTH118
    )
    if first is not None:
        candidates = itertools.chain((first,), candidates)
    denied = False
    for candidate in candidates:
        try:
            mode = os.stat(candidate).st_mode  # noqa: PTH116
        except OSError:
            continue  # not there (or not reachable): the next directory
        if not stat.S_ISDIR(mode) and os.access(candidate, os.X_OK):
            return candidate
        denied = True
    if denied:
        raise PermissionError(errno.EACCES, "Permission denied")
    raise FileNotFoundError(errno.ENOENT, "No such file or directory")


def _on_path(name: str, *, env: Mapping[str, str], cwd: str) -> Iterator[str]:
    for folder in os.get_exec_path(env):
        yield os.path.join(cwd, folder, name)  # noqa: PTH118


def _exit_status(result: os.waitid_result) -> int:
    """Popen's convention: the exit code, or -N for a death by signal N."""
    if result.si_code == os.CLD_EXITED:
        return int(result.si_status)
    return -int(result.si_status)


class _ExitWatcher:
    """Tells of children's exits: a pidfd per child (readable once it exits,
    never reaping it) in one epoll set, watched by one daemon thread for the
    whole agent that only calls the callbacks it was given (the runners'
    wake-ups). A thread per child cost more CPU than the rest of a short
    Attempt's wait (issue 12)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoll: Any = None
        self._callbacks: dict[int, Callable[[], None]] = {}

    def watch(self, pid: int, callback: Callable[[], None]) -> bool:
        """False where pidfds or epoll are missing: the caller watches itself."""
        pidfd_open = getattr(os, "pidfd_open", None)
        epoll = getattr(select, "epoll", None)
        if pidfd_open is None or epoll is None:
            return False
        try:
            fd = pidfd_open(pid)  # close-on-exec: no child inherits it
        except OSError:
            return False  # e.g. a kernel before 5.3
        with self._lock:
            if self._epoll is None:
                self._epoll = epoll()
                threading.Thread(target=self._loop, name="exit-watcher", daemon=True).start()
            self._callbacks[fd] = callback
            try:
                self._epoll.register(fd, select.EPOLLIN)
            except OSError:
                del self._callbacks[fd]
                os.close(fd)
                return False
        return True

    def _loop(self) -> None:
        while True:
            events = self._epoll.poll()
            for fd, _ in events:
                with self._lock:
                    callback = self._callbacks.pop(fd, None)
                    with contextlib.suppress(OSError):
                        self._epoll.unregister(fd)
                    with contextlib.suppress(OSError):  # never the end of this thread
                        os.close(fd)
                if callback is not None:
                    with contextlib.suppress(Exception):
                        callback()

    def _forget_at_fork(self) -> None:
        """In a child forked without exec: the parent's epoll set is not the
        child's (shared across the fork: a pidfd the child added to it would
        wake the parent's thread, which would close the parent's fd of that
        number) and the thread did not come along. The child's copies of the
        set and of the parent's pidfds are closed (the parent's stay
        registered) and its first watch starts a set and a thread of its own.
        No lock is taken: the parent's thread may have held it at the fork."""
        self._lock = threading.Lock()
        for fd in self._callbacks:
            with contextlib.suppress(OSError):
                os.close(fd)
        _FORGOTTEN.extend(self._callbacks.values())
        self._callbacks = {}
        if self._epoll is not None:
            with contextlib.suppress(OSError):
                self._epoll.close()
        self._epoll = None


# What a fork's child forgets of its parent's children (the exit watcher's
# callbacks, the guards' Popen objects), kept referenced: dropped, each Popen
# would be finalized in the child, warn "still running" and wait for a
# process that is not the child's.
_FORGOTTEN: list[object] = []

_EXITS = _ExitWatcher()

# The guard's whole program, run by `python -I -S -c` (nothing of the agent
# imported): argv[1] is its end of the socket pair. Each message carries one
# pidfd (a child to kill with the agent) and a tag; EOF is the agent process
# gone. A child's pidfd is dropped once it exits. SIGINT/SIGTERM/SIGHUP (the
# agent's process group's, e.g. a terminal's or a service manager's) are
# ignored: the guard outlives the agent's shutdown, its end is the agent's. It
# holds one fd per running child, so its soft RLIMIT_NOFILE goes up to the
# hard limit. Every message is answered, with its tag: "held", or "full" for
# a pidfd the kernel could not hand it past that limit (MSG_CTRUNC: the
# message came, its fd was closed), a child it does not hold. Before any
# answer it says "ready", once it listens: the agent waits for that (its
# interpreter's start, slow on a loaded box) apart from the answer of each
# child it hands over (`_Guard.cover`).
_GUARD_PROGRAM = """
import os, resource, select, signal, socket, sys
for name in ("SIGINT", "SIGTERM", "SIGHUP"):
    signal.signal(getattr(signal, name), signal.SIG_IGN)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if soft != hard:
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError):
        pass
agent = socket.socket(fileno=int(sys.argv[1]))
epoll = select.epoll()
epoll.register(agent.fileno(), select.EPOLLIN)
try:
    agent.send(b"ready", socket.MSG_DONTWAIT)
except OSError:
    pass
held = set()
while True:
    for fd, _ in epoll.poll():
        if fd != agent.fileno():
            epoll.unregister(fd)
            os.close(fd)
            held.discard(fd)
            continue
        try:
            message, fds, flags, _ = socket.recv_fds(agent, 64, 16)
        except OSError:  # ECONNRESET: the agent gone with an answer unread
            message, fds, flags = b"", [], 0
        if not message and not fds:
            for pidfd in held:
                try:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                except OSError:
                    pass
            sys.exit(0)
        for pidfd in fds:
            held.add(pidfd)
            epoll.register(pidfd, select.EPOLLIN)
        answer = b"full " if flags & socket.MSG_CTRUNC or not fds else b"held "
        try:
            agent.send(answer + message, socket.MSG_DONTWAIT)
        except OSError:
            pass
"""


class _Cover(enum.Enum):
    """What became of a child handed to the death guard."""

    HELD = "held"  # a guard said it holds its pidfd
    MISSED = "missed"  # this child only (the agent out of fds a moment): the next spawn tries again
    REFUSED = "refused"  # no guard takes children now: the spawner turns to the signal


# How long a cover waits for the guard's answer for its child (it comes in
# well under a millisecond): past it the guard is stopped or starved, and the
# spawner turns to the parent-death signal.
_COVER_ANSWER_S = 0.5
# How long a guard just started has to say it is ready (its interpreter's
# start: some 20 ms on an idle box, seconds on a loaded one), before the
# answer's wait begins; past it the guard is taken for one that did not answer.
_GUARD_START_S = 10.0
# Guards at their fd limit are kept (with the children they hold) and another
# takes the next children; past this many in all, a kept one whose children
# ended since takes them, and where none has room children get the signal.
_MAX_GUARDS = 4


# pidfd_open's errors that pass: the agent (or the box) out of fds or memory
# for a moment, or the child gone already. Any other (ENOSYS, EPERM from a
# sandbox, EINVAL) will not.
_TRANSIENT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ESRCH})


class _Guard:
    """The agent's death guard: kills the agent's children when the agent
    process dies, in place of a parent-death signal set in each child.

    One per agent process, started at the first spawner that asks (`start`),
    in the agent's process group (what stops the group stops it too; it
    ignores the group's SIGINT/SIGTERM/SIGHUP and ends when the agent does),
    in "/" (it pins no mount the agent was started in). `cover(pid)` hands it
    a pidfd of a just-spawned child: race-free whatever becomes of the pid.
    Like setpriv's prctl, the cover comes just after the spawn: an agent
    killed in between leaves that child to the restarted agent's orphan
    handling (docs/adr/0008). Each cover waits (`_COVER_ANSWER_S` at most)
    for the guard's answer for that child, so what it returns is what the
    guard did; the first cover of a guard just started also waits for it to
    be ready (`_GUARD_START_S` at most: its interpreter's start, slow on a
    loaded box, is no silence), and meanwhile other covers wait for the
    lock. A guard that died is reaped at once (the exit watcher, by its
    pid alone) and replaced at the next cover; the children it held are no
    longer covered. A guard that answers "full" for a child (its fd limit) is
    retired — kept, with what it holds — and a new guard takes that very
    child and the next ones; with `_MAX_GUARDS` running, the retired ones
    are asked in turn (children of theirs that ended freed their fds), the
    first to answer "held" becoming the current guard, and only a child each
    answered "full" for is refused (the next cover asks them all again). A
    guard that does not answer in time (stopped, starved) is kept and
    covers nothing more until its answer came. A child forked without exec
    closes its copies of the agent's ends of the sockets at once
    (`_forget_at_fork`): the guards see the agent's death whatever the fork
    becomes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._poll: Any = None  # select.poll of the current guard's socket
        self._owner = 0  # the pid of the process that started it (a fork starts its own)
        self._atexit = False
        # Guards that answered "full", kept (each with its socket's poll):
        # their sockets stay open (closing one kills what it holds).
        self._retired: list[tuple[socket.socket, subprocess.Popen[bytes], Any]] = []
        self._tags = itertools.count(1)
        self._unanswered = b""  # the tag whose answer did not come in time
        self._ready = False  # the current guard said "ready"
        self._ready_by = 0.0  # when it must have said so (time.monotonic)
        # The agent's end of a guard being started (until it is `_socket`):
        # a fork meanwhile closes it too.
        self._opening: socket.socket | None = None
        # Guards whose exit came while a cover held the lock (reaped by it).
        self._exited: list[subprocess.Popen[bytes]] = []
        _GUARDS.add(self)

    @property
    def pid(self) -> int | None:
        """The guard's pid while one runs for this process (for measurements)."""
        with self._lock:
            if self._process is None or self._owner != os.getpid():
                return None
            return self._process.pid

    def start(self) -> bool:
        """Whether a guard runs (started now if need be); False where Linux,
        Python or the sandbox lack pidfds or passing them over a socket."""
        with self._lock:
            return self._start_locked()

    def _start_locked(self) -> bool:
        if self._socket is not None and self._owner == os.getpid():
            return True
        if self._owner != os.getpid():
            self._retired = []  # a fork's parent's guards are not this process's
        if not sys.platform.startswith("linux") or not all(
            (
                hasattr(os, "pidfd_open"),
                hasattr(signal, "pidfd_send_signal"),
                hasattr(socket, "send_fds"),
                hasattr(select, "epoll"),
            )
        ):
            return False
        try:
            os.close(os.pidfd_open(os.getpid()))  # a kernel before 5.3 refuses
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self._opening = ours
            # Non-blocking: a full queue is an error at once (`cover`); with
            # a blocking socket, MSG_DONTWAIT alone still waited here.
            ours.setblocking(False)
        except OSError:
            if self._opening is not None:
                self._opening.close()
                self._opening = None
            return False
        try:
            with theirs:
                process = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _GUARD_PROGRAM, str(theirs.fileno())],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    cwd="/",
                    env={},  # nothing of the agent's environment (its secrets)
                    pass_fds=(theirs.fileno(),),
                )
        except OSError:
            self._opening = None
            ours.close()
            return False
        self._socket, self._process, self._owner = ours, process, os.getpid()
        self._opening = None
        self._poll = select.poll()
        self._poll.register(ours, select.POLLIN)
        self._unanswered = b""
        self._ready = False
        self._ready_by = time.monotonic() + _GUARD_START_S
        # Reaped as soon as it dies, not at the next spawn: by its own pid
        # (Popen.poll), never a wait for any child that could take a Run's.
        _EXITS.watch(process.pid, functools.partial(self._reap, process))
        if not self._atexit:
            self._atexit = True
            atexit.register(self.stop)
        return True

    def _reap(self, process: subprocess.Popen[bytes]) -> None:
        """A guard exited (the exit watcher's thread). Never waits for a
        cover, which may hold the lock for a guard's start: the watcher
        thread tells every runner of its child's exit. Left to the cover
        then, which reaps it as it lets go of the lock."""
        if not self._lock.acquire(timeout=0.05):
            self._exited.append(process)
            # The cover may have let go of the lock (and looked) just now.
            if self._lock.acquire(blocking=False):
                self._lock.release()
                self._reap_exited()
            return
        try:
            self._reap_locked(process)
        finally:
            self._lock.release()
        with contextlib.suppress(OSError):
            process.poll()

    def _reap_locked(self, process: subprocess.Popen[bytes]) -> None:
        if process is self._process and self._owner == os.getpid():
            self._drop_locked()  # the next cover starts another
            return
        for index, (ours, retired, _) in enumerate(self._retired):
            if retired is process:
                ours.close()
                del self._retired[index]
                break

    def _reap_exited(self) -> None:
        """The guards whose exit came while a cover held the lock."""
        while self._exited:
            process = self._exited.pop()
            with self._lock:
                self._reap_locked(process)
            with contextlib.suppress(OSError):
                process.poll()

    def stop(self) -> None:
        """At the interpreter's exit (after its non-daemon threads, the
        runners, ended): the guard told the agent's end, as a death would,
        and reaped."""
        with self._lock:
            ours = self._owner == os.getpid()
            processes = [process for _, process, _ in self._retired] if ours else []
            if self._process is not None and ours:
                processes.append(self._process)
            for retired, _, _ in self._retired:
                retired.close()
            if self._socket is not None:
                self._socket.close()
            self._socket = self._process = self._poll = None
            self._retired = []
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=2)

    def cover(self, pid: int) -> _Cover:
        """Hand the guard a pidfd of child `pid`."""
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as err:
            # Out of fds for a moment: this child runs uncovered, the guard
            # stays for the next. A kernel or sandbox that refuses pidfds
            # refuses them for good.
            return _Cover.MISSED if err.errno in _TRANSIENT else _Cover.REFUSED
        try:
            with self._lock:
                full: set[int] = set()  # the guards that said "full" for this child
                # Each guard asked once at most, and two that died replaced.
                for _ in range(_MAX_GUARDS + 2):
                    if not self._start_locked():
                        return _Cover.REFUSED
                    assert self._socket is not None
                    if self._unanswered and self._answer_locked(self._unanswered, 0) is None:
                        return _Cover.REFUSED  # still silent: nothing more to it yet
                    self._unanswered = b""
                    tag = b"%d" % next(self._tags)
                    try:
                        socket.send_fds(self._socket, [tag], [pidfd], socket.MSG_NOSIGNAL)
                    except (BrokenPipeError, ConnectionResetError):
                        self._drop_locked()  # the guard is gone: replaced
                        continue
                    except OSError:
                        # The guard lives but takes nothing now (stopped, its
                        # queue full): never drop it (its end of the socket
                        # closing, it would kill the children it holds).
                        return _Cover.REFUSED
                    answer = self._answer_locked(tag, _COVER_ANSWER_S)
                    if answer == b"held":
                        return _Cover.HELD
                    if answer is None:
                        # Stopped or starved: the lock is not held longer
                        # (every spawn would wait), the pidfd stays queued
                        # for it, and it covers nothing until it answered.
                        self._unanswered = tag
                        return _Cover.REFUSED
                    if answer == b"":
                        self._drop_locked()  # it died with the pidfd unread: replaced
                        continue
                    # "full": this child is not held. The guard is retired,
                    # kept with what it holds; a new one takes this child and
                    # the next ones, or, `_MAX_GUARDS` running, a retired one
                    # not asked yet for this child (its children may have
                    # ended since) is asked. Only when each said "full" is
                    # the child refused.
                    assert self._process is not None
                    full.add(self._process.pid)
                    self._retired.append((self._socket, self._process, self._poll))
                    self._socket = self._process = self._poll = None
                    if len(self._retired) < _MAX_GUARDS:
                        continue  # a new guard is started
                    asked = [i for i, (_, p, _) in enumerate(self._retired) if p.pid not in full]
                    # It answered all it was handed (retired at an answer):
                    # ready, nothing unanswered. All full: the one that said
                    # so longest ago is the current guard again, asked first
                    # by the next cover.
                    index = asked[0] if asked else 0
                    # Current before it leaves the list: a fork in between
                    # still finds its socket (`_forget_at_fork`).
                    self._socket, self._process, self._poll = self._retired[index]
                    del self._retired[index]
                    self._ready, self._unanswered = True, b""
                    if not asked:
                        return _Cover.REFUSED
                return _Cover.REFUSED
        finally:
            os.close(pidfd)
            if self._exited:
                self._reap_exited()

    def _answer_locked(self, tag: bytes, wait_s: float) -> bytes | None:
        """The guard's answer for `tag` ("held", "full"; b"" if it ended),
        None if it did not come within `wait_s` of the guard being ready. A
        guard not yet known ready (just started) is waited for until
        `_GUARD_START_S` after its start, then `wait_s` from its "ready": its
        interpreter's start never counts as a silence. Late answers of
        earlier tags are passed over."""
        assert self._socket is not None and self._poll is not None
        # A ready guard: no more than the recv and the poll of the answer.
        deadline = time.monotonic() + wait_s if self._ready else self._ready_by
        while True:
            try:
                answer = self._socket.recv(64, socket.MSG_DONTWAIT)
            except BlockingIOError:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._poll.poll(remaining * 1000):
                    return None
                continue
            except OSError:
                return b""
            if not answer:
                return b""
            if answer == b"ready":
                self._ready = True
                deadline = time.monotonic() + wait_s
                continue
            verdict, _, answered = answer.partition(b" ")
            if answered == tag:
                return verdict

    def _drop_locked(self) -> None:
        if self._socket is not None:
            self._socket.close()
        if self._process is not None and self._owner == os.getpid():
            with contextlib.suppress(OSError):
                self._process.poll()  # reaped if it died
        self._socket = self._process = self._poll = None

    def _forget_at_fork(self) -> None:
        """In a child forked without exec (multiprocessing's "fork", a
        program embedding the agent): the child's copies of the agent's ends
        of every guard's socket are closed, so a fork that lives on never
        keeps a guard from seeing the agent's death; the parent's ends, and
        its guards, are untouched. The child starts a guard of its own if it
        spawns. No lock is taken: another thread of the parent's may have held
        it at the fork, and the child has this thread alone."""
        self._lock = threading.Lock()
        ends = [ours for ours, _, _ in self._retired]
        _FORGOTTEN.extend(process for _, process, _ in self._retired)
        _FORGOTTEN.extend((self._process, *self._exited))
        for end in (self._socket, self._opening):
            if end is not None:
                ends.append(end)
        for ours in ends:
            with contextlib.suppress(OSError):
                ours.close()
        self._socket = self._process = self._poll = self._opening = None
        self._retired = []
        self._exited = []
        self._unanswered = b""
        self._ready = False


# Every guard of this process (the agent's, a test's own): forgotten by a
# child forked without exec (`_Guard._forget_at_fork`), as the exit watcher
# is. A subprocess's child runs no such handler (vfork, or fork then exec:
# the fds are close-on-exec), but for a preexec_fn's, where it closes them
# just earlier.
_GUARDS: weakref.WeakSet[_Guard] = weakref.WeakSet()


def _forget_at_fork() -> None:
    for guard in list(_GUARDS):
        guard._forget_at_fork()
    _EXITS._forget_at_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_at_fork)


_GUARD = _Guard()


def death_guard_pid() -> int | None:
    """The pid of this process's death guard, if one runs (tests, benches)."""
    return _GUARD.pid


class LocalProcess:
    """One Attempt's child process, its process group and its output file."""

    def __init__(
        self, popen: subprocess.Popen[bytes], output: IO[bytes], *, offer_id: str = ""
    ) -> None:
        self._popen = popen
        self._output = output
        self.offer_id = offer_id
        self.pid = popen.pid
        self.pgid = popen.pid  # start_new_session: the child leads its own group
        # Read before anything reaps the child, so the pid still names it.
        info = procfs.proc_info(popen.pid)
        self.start_time = info.start_time if info is not None else None
        self._exit_code: int | None = None

    @property
    def output_file(self) -> IO[bytes]:
        """The output file (stdout and stderr), for whoever streams it."""
        return self._output

    def read_output(self, offset: int, limit: int) -> bytes:
        """Up to `limit` bytes of output from `offset`, safe beside the writer
        and other readers (pread moves no file position); b"" once closed."""
        try:
            return os.pread(self._output.fileno(), limit, offset)
        except (OSError, ValueError):  # ValueError: the file is closed
            return b""

    def output_size(self) -> int:
        try:
            return os.fstat(self._output.fileno()).st_size
        except (OSError, ValueError):
            return 0

    def poll(self) -> int | None:
        """The exit code once the main process exited — without reaping it.

        Unreaped, its pid (and so its process group id) cannot be handed out
        again, so signalling the group stays safe until `release`.
        """
        if self._exit_code is None:
            if hasattr(os, "waitid"):
                try:
                    found = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                except ChildProcessError:
                    found = None
                    self._exit_code = self._popen.poll()
                if found is not None:
                    self._exit_code = _exit_status(found)
            else:
                self._exit_code = self._popen.poll()
        return self._exit_code

    def on_exit(self, callback: Callable[[], None]) -> bool:
        """Call `callback` once the main process has exited, without reaping
        it: the runner learns of the exit at once instead of at its next poll.
        Through the agent-wide exit watcher (a pidfd per child, one thread for
        all of them) where Linux has pidfds, else from a thread of its own,
        blocked in waitid meanwhile. True: the callback will come (the runner
        need not poll); False: it will not (no waitid), poll."""
        if not hasattr(os, "waitid"):
            return False
        if _EXITS.watch(self.pid, callback):
            return True

        def watch() -> None:
            with contextlib.suppress(OSError):  # ChildProcessError: reaped already
                os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
            callback()

        threading.Thread(target=watch, name=f"exit-{self.pid}", daemon=True).start()
        return True

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            code = self.poll()
            if code is not None:
                return code
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self._popen.args, timeout or 0.0)
            time.sleep(0.01)

    def _signal_group(self, signum: int) -> None:
        # The child leads its own process group: stop what it spawned too. Safe
        # while the leader is unreaped (its pid, the group id, is not reused).
        if self._popen.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signum)

    def terminate(self) -> None:
        self._signal_group(signal.SIGTERM)

    def kill(self) -> None:
        self._signal_group(signal.SIGKILL)

    def release(self, grace_s: float) -> int:
        """After the main process exited: end what it left in its process
        group (TERM, then KILL after `grace_s`), then reap it.

        A job's leftovers would otherwise run on after its outcome is reported
        (and beside a retry of its Run) with no lease behind them.
        """
        code = self.wait()
        if procfs.procfs_available() and self._leftovers():
            self._signal_group(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and self._leftovers():
                time.sleep(0.05)
            if self._leftovers():
                self._signal_group(signal.SIGKILL)
                # SIGKILL cannot be refused, but lands asynchronously.
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline and self._leftovers():
                    time.sleep(0.01)
        self._popen.wait()
        return code

    def _leftovers(self) -> bool:
        return procfs.GROUPS.members_alive(self.pgid, exclude=(self.pid,))

    def close(self) -> None:
        """Done with it: the output file goes (idempotent)."""
        self._output.close()

    def output_tail(self, limit: int) -> str:
        """The newest stdout+stderr that fits `limit` (its escaped size on the
        wire, see `clean_output_tail`), decoded leniently."""
        self._output.flush()
        size = self._output.seek(0, os.SEEK_END)
        # Every character takes at least its UTF-8 bytes on the wire, so the
        # last `limit` bytes of the file hold all that can fit.
        self._output.seek(max(0, size - limit))
        data = self._output.read(limit)
        # Invalid UTF-8 and NUL bytes become U+FFFD (the control plane stores
        # text, and PostgreSQL text refuses NUL); quotes, backslashes and
        # control characters count as their JSON escapes, so the text is
        # trimmed again until the ACK body it goes into fits the server's cap.
        return clean_output_tail(data.decode("utf-8", "replace"), limit)


def resolve_cwd(workdir: Path, cwd: object) -> Path:
    """The directory a spec runs in: `cwd` relative to the work directory.

    The control plane refuses an absolute cwd or a '..' segment already; this
    is the agent's own check, on the real filesystem: symlinks are resolved,
    and whatever lands outside the work directory is refused
    (`cwd_outside_workdir`), never run.
    """
    return _resolve_in(workdir.resolve(), cwd)


def _resolve_in(base: Path, cwd: object) -> Path:
    """`resolve_cwd` under a work directory resolved already."""
    if cwd is None:
        return base
    if not isinstance(cwd, str) or not cwd or "\x00" in cwd:
        raise SpecRefused("invalid_cwd")
    relative = Path(cwd)
    # An absolute cwd would replace the base in `base / cwd`: refuse it outright.
    if relative.is_absolute():
        raise SpecRefused("cwd_outside_workdir")
    target = (base / relative).resolve()  # realpath: symlinks followed, '..' applied
    if not target.is_relative_to(base):
        raise SpecRefused("cwd_outside_workdir")
    return target


class ProcessSpawner:
    """Spawns a spec's command as a `LocalProcess`.

    The work directory is resolved once, here: a spec without a cwd runs in
    it without a path lookup per spawn (a spec's own cwd is still resolved
    and checked at each spawn, symlinks and all). The child's death with the
    agent: the agent's death guard where Linux has one (`guard=False`: not
    asked, the fallbacks' tests; `death_guard`: another than the agent
    process's own, the guard's tests), else `setpriv --pdeathsig`, else a
    `preexec_fn` (`setpriv=False`: the preexec_fn even where setpriv has it).
    A guard at its fd limit hands over to a new guard (the cover waits for
    the guard's answer, so the very child it could not take goes to the new
    one); a guard that takes no more children (stopped, or `_MAX_GUARDS`
    ones all full) turns the spawner to the signal for good, known at that
    child's cover; a child missed for a passing reason (the agent out of fds
    a moment) runs uncovered alone, and the next spawn is guarded again.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        guard: bool = True,
        setpriv: bool = True,
        death_guard: _Guard | None = None,
    ) -> None:
        self.workdir = workdir
        self._base = workdir.resolve()
        self._wrapper: Sequence[str] = ()
        # Where each program was found last (its name, PATH, cwd): looked at
        # first by the next spawn's check, one stat instead of a PATH walk.
        self._programs: dict[tuple[str, str, str], str] = {}
        self._preexec: Callable[[], None] | None = None
        self._setpriv = setpriv
        # Guarded or not, with which wrapper or preexec_fn: read together by
        # each spawn and changed together (runner threads spawn at once).
        self._mode_lock = threading.Lock()
        # The agent process's guard; a test may give a spawner one of its own.
        self._death_guard = _GUARD if death_guard is None else death_guard
        self._guarded = guard and self._death_guard.start()
        if not self._guarded:
            self._fall_back()

    def _fall_back(self) -> None:
        """The parent-death signal set in each child instead of the guard."""
        wrapper = parent_death_wrapper() if self._setpriv else None
        with self._mode_lock:
            if wrapper is not None:
                self._wrapper = wrapper
            else:
                self._preexec = parent_death_signal()
            self._guarded = False

    @property
    def guarded(self) -> bool:
        """Whether the agent's death guard kills the children with the agent."""
        return self._guarded

    @property
    def uses_vfork(self) -> bool:
        """Whether children are spawned without a `preexec_fn` (so by vfork)."""
        return self._preexec is None

    def __call__(self, spec: Mapping[str, Any], *, offer_id: str = "") -> LocalProcess:
        command = [str(part) for part in spec["command"]]
        cwd = _resolve_in(self._base, spec.get("cwd"))
        env = {key: os.environ[key] for key in _BASE_ENV if key in os.environ}
        env.update({str(k): str(v) for k, v in dict(spec.get("env") or {}).items()})
        if offer_id:
            # Last, over the spec's env: how a restarted agent finds this
            # execution's processes (procfs), whatever became of their pids.
            env[procfs.MARKER_ENV] = offer_id
        if not command:
            raise ValueError("empty command")
        with self._mode_lock:
            guarded, wrapper, preexec = self._guarded, self._wrapper, self._preexec
        if wrapper:
            # setpriv execs the command itself: what it could not find or
            # run would be its exit code, not a refused spawn.
            key = (command[0], env.get("PATH", ""), str(cwd))
            found = _check_program(command[0], env=env, cwd=str(cwd), first=self._programs.get(key))
            if len(self._programs) >= _PROGRAMS_KEPT:
                self._programs.clear()
            self._programs[key] = found
            command = [*wrapper, *command]
        output = tempfile.TemporaryFile()  # noqa: SIM115  (closed by LocalProcess.close)
        try:
            # No preexec_fn with the guard or setpriv: vfork.
            popen = subprocess.Popen(
                command,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=preexec,
            )
        except (OSError, ValueError):
            # ValueError: what exec refuses before trying (a NUL in argv or env).
            output.close()
            raise
        except subprocess.SubprocessError as err:
            # The preexec function failed in the child: nothing was executed.
            output.close()
            raise OSError(str(err)) from None
        if guarded and self._death_guard.cover(popen.pid) is _Cover.REFUSED:
            # No guard took it (its answer said so, or never came): this
            # child runs uncovered (like one whose agent died before
            # setpriv's prctl; a stopped guard takes it if it goes on); the
            # next ones get the parent-death signal. A child MISSED (the
            # agent out of fds a moment) runs uncovered alone: the next
            # spawn is guarded.
            self._fall_back()
        return LocalProcess(popen, output, offer_id=offer_id)
