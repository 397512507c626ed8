"""The agent's death guard (workers/agent/executor.py, `_Guard`): it kills the
children with the agent process, not with their thread; it runs in "/"; a
guard that dies is reaped at once and replaced at the next spawn; a full guard
hands the child it could not take, and the next, to a new guard, or, the
last one started, to a full one whose children ended since; a stopped guard
never blocks a spawn for longer than the wait for its answer and turns the
spawner to the parent-death signal, keeping the children it holds; a child
missed for a passing reason (the agent out of fds) leaves the spawner
guarded; a guard slow to start is waited for, its start no silence; a fork
of the agent keeps no guard from seeing the agent's death, and spawns under
a guard of its own. Tests that kill, stop or fill a guard give their spawner
one of its own (`own_guard`), never the process's, which the other tests'
spawners share."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.agent import executor
from workers.agent.executor import LocalProcess, ProcessSpawner
from workers.tests.polling import eventually
from workers.tests.test_agent import a_spec
from workers.tests.test_agent_spawn import _end, _is_running, linux_only

_REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def own_guard() -> Iterator[executor._Guard]:
    guard = executor._Guard()
    yield guard
    guard.stop()  # kills what it still holds, as the agent's exit would


@contextlib.contextmanager
def _stand_in_agent(program: str, *args: str) -> Iterator[tuple[subprocess.Popen[str], list[int]]]:
    """A stand-in agent process (`program`, run from the repository), in a
    process group of its own; the list takes the pids of children it reports.
    Whatever the test did, the agent's group and those children are killed."""
    agent = subprocess.Popen(
        [sys.executable, "-c", program, *args],
        cwd=_REPO,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    children: list[int] = []
    try:
        yield agent, children
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)
        agent.wait(10)
        if agent.stdout is not None:
            agent.stdout.close()
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _pid(guard: executor._Guard) -> int:
    pid = guard.pid
    assert pid is not None
    return pid


# An agent process in miniature: spawns `sleep 60` from a thread that then
# ends (the parent-death signal would fire there), prints the child's pid and
# the guard's, then waits to be killed.
_STAND_IN = """
import sys, threading, time
from pathlib import Path
from workers.agent import executor
spawner = executor.ProcessSpawner(Path(sys.argv[1]))
assert spawner.guarded
spawned = []
thread = threading.Thread(
    target=lambda: spawned.append(spawner({"command": ["sleep", "60"], "env": {}}))
)
thread.start()
thread.join()
print(spawned[0].pid, executor.death_guard_pid(), flush=True)
time.sleep(120)
"""


def _state(pid: int) -> str | None:
    """The process's state letter ("Z": a zombie), None once it is reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z")


def _dead(pid: int) -> bool:
    return not _alive(pid)


def _held_by(guard: int) -> set[int]:
    """The pids whose pidfds the guard holds (its fds' fdinfo "Pid:" lines)."""
    pids = set()
    for info in Path(f"/proc/{guard}/fdinfo").iterdir():
        with contextlib.suppress(OSError):
            for line in info.read_text().splitlines():
                if line.startswith("Pid:"):
                    pids.add(int(line.split()[1]))
    return pids


_READ_SIGNAL = (
    "import ctypes; v = ctypes.c_int();"
    "ctypes.CDLL(None).prctl(2, ctypes.byref(v), 0, 0, 0); print(v.value)"
)


def _signal_of_child(spawner: ProcessSpawner) -> str:
    """The parent-death signal a child of `spawner` reads back ("0": none)."""
    process = spawner(a_spec(command=[sys.executable, "-c", _READ_SIGNAL]))
    assert process.wait(timeout=30) == 0
    process.release(grace_s=0)
    tail = process.output_tail(100).strip()
    process.close()
    return tail


@linux_only
def test_the_guard_kills_the_child_with_the_agent_process_not_with_its_thread(
    tmp_path: Path,
) -> None:
    with _stand_in_agent(_STAND_IN, str(tmp_path)) as (agent, _):
        assert agent.stdout is not None
        child, guard = (int(part) for part in agent.stdout.readline().split())
        eventually(_is_running(child, ["sleep", "60"]), 10, "sleep exec'd")
        # The thread that spawned it ended: the child runs on (no signal of its own).
        time.sleep(0.2)
        assert _alive(child)
        eventually(lambda: child in _held_by(guard), 10, "the guard holds the child")
        # The guard is in the agent's process group and outlives a TERM to it.
        assert os.getpgid(guard) == agent.pid
        os.kill(guard, signal.SIGTERM)
        time.sleep(0.2)
        assert _alive(guard)
        agent.kill()  # kill -9 of the agent process alone
        agent.wait(10)
        eventually(lambda: not _alive(child), 10, "the guard killed the child")
        eventually(lambda: not _alive(guard), 10, "the guard ended with the agent")


@linux_only
def test_the_guard_runs_in_the_root_directory(tmp_path: Path, own_guard) -> None:
    # Started from a directory of its own, it pins no mount (tmp_path here).
    os.chdir(tmp_path)
    try:
        assert ProcessSpawner(tmp_path, death_guard=own_guard).guarded
    finally:
        os.chdir(_REPO)
    assert Path(f"/proc/{_pid(own_guard)}/cwd").readlink() == Path("/")


@linux_only
def test_a_killed_guard_is_reaped_at_once_and_replaced_at_the_next_spawn(
    tmp_path: Path, own_guard
) -> None:
    spawner = ProcessSpawner(tmp_path, death_guard=own_guard)
    assert spawner.guarded
    # A Run's child that has exited and is not waited for yet: a zombie that
    # only its runner may reap (its exit status is the Attempt's).
    ended = spawner(a_spec(command=["sh", "-c", "exit 7"]))
    eventually(lambda: _state(ended.pid) == "Z", 10, "the child exited")
    old = _pid(own_guard)
    os.kill(old, signal.SIGKILL)
    # No spawn in between: the agent reaps its guard by itself, and no other child.
    eventually(lambda: _state(old) is None, 10, "the dead guard reaped")
    assert own_guard.pid is None
    assert _state(ended.pid) == "Z"
    assert ended.wait(timeout=10) == 7
    ended.release(grace_s=0)
    ended.close()
    process = spawner(a_spec(command=["sleep", "60"]))
    try:
        new = _pid(own_guard)
        assert spawner.guarded
        assert new != old
        eventually(lambda: process.pid in _held_by(new), 10, "the new guard holds the child")
    finally:
        _end(process)
    # Its exit drops its pidfd.
    eventually(lambda: process.pid not in _held_by(new), 10, "the guard let go of the child")


@linux_only
def test_a_stopped_guard_never_blocks_a_spawn_and_keeps_its_children(
    tmp_path: Path, own_guard
) -> None:
    """A guard that takes nothing (SIGSTOP) does not answer: the spawn waits
    for its answer no longer than `_COVER_ANSWER_S`, its child goes on
    uncovered (queued for the guard), the next ones with the parent-death
    signal; the guard is kept, and when it goes on it still holds (and has
    not killed) its child."""
    spawner = ProcessSpawner(tmp_path, death_guard=own_guard)
    assert spawner.guarded
    guard = _pid(own_guard)
    held = spawner(a_spec(command=["sleep", "60"]))
    spawned = 0
    # A small send buffer: the queue fills within a few spawns whatever the
    # machine's default (wmem_default; 212 KiB here: 278 spawns).
    ours = own_guard._socket
    assert ours is not None
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    try:
        eventually(lambda: held.pid in _held_by(guard), 10, "the guard holds the child")
        os.kill(guard, signal.SIGSTOP)

        def spawn_until_uncovered() -> None:
            nonlocal spawned
            while spawner.guarded and spawned < 5000:
                process = spawner(a_spec(command=["true"]))
                process.wait(timeout=30)
                process.release(grace_s=0)
                process.close()
                spawned += 1

        worker = threading.Thread(target=spawn_until_uncovered, daemon=True)
        started = time.monotonic()
        worker.start()
        worker.join(60)
        assert not worker.is_alive(), f"a spawn waited on the stopped guard after {spawned}"
        assert not spawner.guarded
        assert spawned == 1  # the first spawn's cover knew
        assert time.monotonic() - started < executor._COVER_ANSWER_S + 5
        assert _signal_of_child(spawner) == str(int(signal.SIGKILL))
    finally:
        os.kill(guard, signal.SIGCONT)
    try:
        assert own_guard.pid == guard
        time.sleep(0.2)
        assert _alive(held.pid)
        assert held.pid in _held_by(guard)
    finally:
        _end(held)


def _first_free_fd(pid: int) -> int:
    used = {int(path.name) for path in Path(f"/proc/{pid}/fd").iterdir()}
    return next(fd for fd in range(len(used) + 1) if fd not in used)


def _fill(guard: int) -> None:
    """No room left in the guard's fd table: the next pidfd sent to it is
    closed by the kernel on the way (MSG_CTRUNC)."""
    limit = _first_free_fd(guard)
    resource.prlimit(guard, resource.RLIMIT_NOFILE, (limit, limit))


@linux_only
def test_a_child_a_full_guard_could_not_take_goes_to_a_new_guard_at_once(
    tmp_path: Path, own_guard
) -> None:
    """Past its RLIMIT_NOFILE the kernel cannot hand the guard a pidfd (the
    message comes, MSG_CTRUNC, the fd closed): that child is not held. The
    cover waits for the guard's answer (reviewer R8), so that very child is
    handed to a new guard before the spawn returns, and the spawner stays
    guarded; the full guard is kept, with (and without killing) what it holds,
    and both kill their children when the agent's end closes."""
    spawner = ProcessSpawner(tmp_path, death_guard=own_guard)
    assert spawner.guarded
    guard = _pid(own_guard)
    first = spawner(a_spec(command=["sleep", "60"]))
    spawned: list[LocalProcess] = [first]
    try:
        eventually(lambda: first.pid in _held_by(guard), 10, "the guard holds the first child")
        _fill(guard)
        second = spawner(a_spec(command=["sleep", "60"]))
        spawned.append(second)
        # At once, no later spawn needed: the guard's answers came with the covers.
        new = _pid(own_guard)
        assert new != guard
        assert second.pid in _held_by(new)
        assert _held_by(guard) == {first.pid}
        assert spawner.guarded
        assert _signal_of_child(spawner) == "0"
        third = spawner(a_spec(command=["sleep", "60"]))
        spawned.append(third)
        assert third.pid in _held_by(new)
        assert _alive(guard)
        assert _alive(first.pid)
        # The agent gone with an answer of the guard's unread (its recv is
        # then reset, not ended): the guard still kills what it holds.
        ours = own_guard._socket
        assert ours is not None
        pidfd = os.pidfd_open(first.pid)
        try:
            socket.send_fds(ours, [b"x"], [pidfd])
        finally:
            os.close(pidfd)
        assert select.select([ours], [], [], 10)[0], "the guard answered"
        own_guard.stop()
        for pid in [process.pid for process in spawned]:
            eventually(functools.partial(_dead, pid), 10, "a guard killed the child")
        eventually(lambda: not _alive(guard), 10, "the full guard ended with the agent")
    finally:
        for process in spawned:
            _end(process)


# The stand-in again, whose guard fills up after one child: prints the pids
# of the two children, of the first guard and of a fork of itself (with
# "fork": a child forked without exec, that sleeps; else 0), then waits to be
# killed.
_STAND_IN_FULL = """
import os, resource, sys, time, warnings
from pathlib import Path
from workers.agent import executor
spawner = executor.ProcessSpawner(Path(sys.argv[1]))
first = spawner({"command": ["sleep", "60"], "env": {}})
guard = executor.death_guard_pid()
def held():
    pids = set()
    for info in Path(f"/proc/{guard}/fdinfo").iterdir():
        pids.update(int(line.split()[1]) for line in info.read_text().splitlines()
                    if line.startswith("Pid:"))
    return pids
deadline = time.monotonic() + 10
while first.pid not in held() and time.monotonic() < deadline:
    time.sleep(0.01)
used = {int(path.name) for path in Path(f"/proc/{guard}/fd").iterdir()}
limit = next(fd for fd in range(len(used) + 1) if fd not in used)
resource.prlimit(guard, resource.RLIMIT_NOFILE, (limit, limit))
second = spawner({"command": ["sleep", "60"], "env": {}})
forked = 0
if sys.argv[2:] == ["fork"]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # a fork beside threads
        forked = os.fork()
    if forked == 0:
        time.sleep(120)
        os._exit(0)
print(first.pid, second.pid, guard, forked, flush=True)
time.sleep(120)
"""


@linux_only
def test_a_kill_9_of_the_agent_kills_the_child_its_full_guard_could_not_take(
    tmp_path: Path,
) -> None:
    """No orphan, even of the child that hit the guard's fd limit: it was
    handed to a new guard at its spawn, and the agent's kill -9 takes it too."""
    with _stand_in_agent(_STAND_IN_FULL, str(tmp_path)) as (agent, children):
        assert agent.stdout is not None
        first, second, guard, _ = (int(part) for part in agent.stdout.readline().split())
        children += [first, second]
        eventually(_is_running(second, ["sleep", "60"]), 10, "sleep exec'd")
        assert _held_by(guard) == {first}
        agent.kill()
        agent.wait(10)
        eventually(lambda: not _alive(first), 10, "the full guard killed the first child")
        eventually(lambda: not _alive(second), 10, "the new guard killed the second child")
        eventually(lambda: not _alive(guard), 10, "the full guard ended with the agent")


@linux_only
def test_a_fork_of_the_agent_keeps_no_guard_from_killing_the_children(tmp_path: Path) -> None:
    """A child the agent process forked without exec (multiprocessing's
    "fork" start method, in a program embedding the agent) closes its copies
    of the agent's ends of the guards' sockets, the current guard's and a
    full one's: while it lives on, the agent's kill -9 still ends every
    child (reviewer S8: the fork held the sockets open, no guard saw its end)."""
    with _stand_in_agent(_STAND_IN_FULL, str(tmp_path), "fork") as (agent, children):
        assert agent.stdout is not None
        first, second, guard, forked = (int(part) for part in agent.stdout.readline().split())
        children += [first, second, forked]
        eventually(_is_running(second, ["sleep", "60"]), 10, "sleep exec'd")
        assert _held_by(guard) == {first}
        agent.kill()  # the agent process alone: its fork lives on
        agent.wait(10)
        eventually(lambda: not _alive(first), 10, "the full guard killed the first child")
        eventually(lambda: not _alive(second), 10, "the new guard killed the second child")
        eventually(lambda: not _alive(guard), 10, "the full guard ended with the agent")
        assert _alive(forked)


@linux_only
def test_past_the_last_guard_the_child_it_could_not_take_is_known_at_once(
    tmp_path: Path, own_guard, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No new guard to hand it to (`_MAX_GUARDS`): the cover of the child the
    full guard could not take says so (reviewer R8: it said HELD, and the
    spawner knew only at a later spawn), the spawner turns to the signal
    from the next spawn on, and the guard keeps what it holds."""
    monkeypatch.setattr(executor, "_MAX_GUARDS", 1, raising=False)
    spawner = ProcessSpawner(tmp_path, death_guard=own_guard)
    assert spawner.guarded
    guard = _pid(own_guard)
    first = spawner(a_spec(command=["sleep", "60"]))
    spawned: list[LocalProcess] = [first]
    try:
        eventually(lambda: first.pid in _held_by(guard), 10, "the guard holds the first child")
        _fill(guard)
        spawned.append(spawner(a_spec(command=["sleep", "60"])))
        assert not spawner.guarded, "the guard dropped a child and nobody knew"
        assert _held_by(guard) == {first.pid}
        assert own_guard.pid == guard
        assert _signal_of_child(spawner) == str(int(signal.SIGKILL))
        assert _alive(first.pid)
    finally:
        for process in spawned:
            _end(process)


@linux_only
@pytest.mark.parametrize(
    ("error", "guarded"),
    [(errno.EMFILE, True), (errno.ENFILE, True), (errno.ENOSYS, False), (errno.EPERM, False)],
    ids=["EMFILE", "ENFILE", "ENOSYS", "EPERM"],
)
def test_a_passing_pidfd_failure_misses_that_child_alone(
    tmp_path: Path,
    own_guard,
    monkeypatch: pytest.MonkeyPatch,
    error: int,
    guarded: bool,
) -> None:
    """The agent out of fds a moment when it opens a child's pidfd: that child
    runs uncovered, the next is guarded again. A kernel or sandbox refusing
    pidfds turns the spawner to the parent-death signal for good."""
    spawner = ProcessSpawner(tmp_path, death_guard=own_guard)
    assert spawner.guarded
    pidfd_open = os.pidfd_open
    failed: list[int] = []

    def failing_once(pid: int, flags: int = 0) -> int:
        if not failed and pid != os.getpid():
            failed.append(pid)
            raise OSError(error, os.strerror(error))
        return pidfd_open(pid, flags)

    monkeypatch.setattr(os, "pidfd_open", failing_once)
    missed = spawner(a_spec(command=["sleep", "60"]))
    monkeypatch.setattr(os, "pidfd_open", pidfd_open)
    try:
        assert failed == [missed.pid]
        assert spawner.guarded is guarded
        if guarded:
            assert _signal_of_child(spawner) == "0"
            process = spawner(a_spec(command=["sleep", "60"]))
            try:
                eventually(
                    lambda: process.pid in _held_by(_pid(own_guard)), 10, "the next one is held"
                )
            finally:
                _end(process)
        else:
            assert _signal_of_child(spawner) == str(int(signal.SIGKILL))
    finally:
        _end(missed)


@linux_only
def test_with_the_guard_the_child_has_no_signal_of_its_own(tmp_path: Path, own_guard) -> None:
    spawner = ProcessSpawner(tmp_path, death_guard=own_guard)
    assert spawner.guarded
    assert spawner.uses_vfork
    assert _signal_of_child(spawner) == "0"


@linux_only
def test_no_guard_falls_back_to_the_parent_death_signal(
    tmp_path: Path, own_guard, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(own_guard, "start", lambda: False)
    spawner = ProcessSpawner(tmp_path, death_guard=own_guard)
    assert not spawner.guarded
    assert spawner.uses_vfork  # setpriv
    assert _signal_of_child(spawner) == str(int(signal.SIGKILL))


@linux_only
def test_a_child_the_guard_could_not_take_turns_the_spawner_to_the_signal(
    tmp_path: Path, own_guard, monkeypatch: pytest.MonkeyPatch
) -> None:
    spawner = ProcessSpawner(tmp_path, death_guard=own_guard)
    assert spawner.guarded
    monkeypatch.setattr(own_guard, "cover", lambda pid: executor._Cover.REFUSED)
    assert _signal_of_child(spawner) == "0"  # spawned before the cover failed
    assert not spawner.guarded
    assert _signal_of_child(spawner) == str(int(signal.SIGKILL))


def _slow_start(monkeypatch: pytest.MonkeyPatch, delay_s: float) -> None:
    """Each guard started from now on sleeps `delay_s` before its program
    runs: the interpreter's start on a loaded box."""
    program = f"import time; time.sleep({delay_s})\n" + executor._GUARD_PROGRAM
    monkeypatch.setattr(executor, "_GUARD_PROGRAM", program)


@linux_only
def test_a_guard_slow_to_start_holds_its_first_child(
    tmp_path: Path, own_guard, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A guard just started (the first, or one that takes over from a full
    guard) takes longer than `_COVER_ANSWER_S` to start its interpreter on a
    loaded box: the cover waits for it to be ready (reviewer S7: its first
    answer timed out and the spawner turned to the signal for good)."""
    delay_s = 2 * executor._COVER_ANSWER_S
    _slow_start(monkeypatch, delay_s)
    started = time.monotonic()
    spawner = ProcessSpawner(tmp_path, death_guard=own_guard)
    assert spawner.guarded
    spawned: list[LocalProcess] = []
    try:
        spawned.append(spawner(a_spec(command=["sleep", "60"])))
        assert spawner.guarded, "the guard's start was taken for no answer"
        assert time.monotonic() - started >= delay_s  # the guard was slow indeed
        guard = _pid(own_guard)
        assert _held_by(guard) == {spawned[0].pid}
        # A full guard hands over to a new guard, as slow to start.
        _fill(guard)
        spawned.append(spawner(a_spec(command=["sleep", "60"])))
        assert spawner.guarded
        new = _pid(own_guard)
        assert new != guard
        assert _held_by(new) == {spawned[1].pid}
        assert _signal_of_child(spawner) == "0"
    finally:
        for process in spawned:
            _end(process)


@linux_only
def test_a_guard_that_never_gets_ready_turns_the_spawner_to_the_signal(
    tmp_path: Path, own_guard, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A guard not ready within `_GUARD_START_S` is one that did not answer:
    the cover returns then, the spawner turns to the signal, and the child
    stays queued for the guard, which takes it once it runs."""
    monkeypatch.setattr(executor, "_GUARD_START_S", 0.2, raising=False)
    _slow_start(monkeypatch, 1.5)
    spawner = ProcessSpawner(tmp_path, death_guard=own_guard)
    assert spawner.guarded
    started = time.monotonic()
    process = spawner(a_spec(command=["sleep", "60"]))
    try:
        assert time.monotonic() - started < 1.5
        assert not spawner.guarded
        guard = _pid(own_guard)
        eventually(lambda: process.pid in _held_by(guard), 10, "the guard took the queued child")
        assert _signal_of_child(spawner) == str(int(signal.SIGKILL))
    finally:
        _end(process)


def _a_full_guard_and_its_successor(
    spawner: ProcessSpawner, guard: executor._Guard, spawned: list[LocalProcess]
) -> tuple[LocalProcess, int, LocalProcess, int]:
    """A first child held by a guard then filled to its fd limit, and a
    second child the next guard took: (first, its guard, second, its guard).
    Every child spawned goes into `spawned` (for the caller to end)."""
    first = spawner(a_spec(command=["sleep", "60"]))
    spawned.append(first)
    retired = _pid(guard)
    eventually(lambda: first.pid in _held_by(retired), 10, "the guard holds the first child")
    _fill(retired)
    second = spawner(a_spec(command=["sleep", "60"]))
    spawned.append(second)
    return first, retired, second, _pid(guard)


@linux_only
def test_past_the_last_guard_a_retired_guard_with_room_takes_the_child(
    tmp_path: Path, own_guard, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last guard full, a guard retired full earlier whose children ended
    since has room again: it takes the child (reviewer S8: retired guards were
    never asked again, the child was refused), and the spawner stays guarded."""
    monkeypatch.setattr(executor, "_MAX_GUARDS", 2, raising=False)
    spawner = ProcessSpawner(tmp_path, death_guard=own_guard)
    spawned: list[LocalProcess] = []
    try:
        first, retired, second, last = _a_full_guard_and_its_successor(spawner, own_guard, spawned)
        assert last != retired
        assert _held_by(last) == {second.pid}
        _end(first)
        eventually(lambda: not _held_by(retired), 10, "the retired guard let go of its child")
        _fill(last)
        third = spawner(a_spec(command=["sleep", "60"]))
        spawned.append(third)
        assert spawner.guarded, "a retired guard with room was not asked"
        assert _held_by(retired) == {third.pid}
        assert _held_by(last) == {second.pid}
        assert _signal_of_child(spawner) == "0"
    finally:
        for process in spawned:
            _end(process)


@linux_only
def test_once_every_guard_was_full_a_later_child_goes_to_one_with_room(
    tmp_path: Path, own_guard, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every guard full: that child is refused and the guards keep what they
    hold. Not for good (reviewer S8: every later child was refused): once a
    guard's children ended, another spawner's child goes to it."""
    monkeypatch.setattr(executor, "_MAX_GUARDS", 2, raising=False)
    spawner = ProcessSpawner(tmp_path, death_guard=own_guard)
    spawned: list[LocalProcess] = []
    try:
        first, retired, second, last = _a_full_guard_and_its_successor(spawner, own_guard, spawned)
        assert _held_by(last) == {second.pid}
        _fill(last)
        spawned.append(spawner(a_spec(command=["sleep", "60"])))
        assert not spawner.guarded
        assert _held_by(retired) == {first.pid}
        assert _held_by(last) == {second.pid}
        assert _alive(first.pid) and _alive(second.pid)
        _end(second)
        eventually(lambda: not _held_by(last), 10, "the last guard let go of its child")
        another = ProcessSpawner(tmp_path, death_guard=own_guard)
        assert another.guarded
        fourth = another(a_spec(command=["sleep", "60"]))
        spawned.append(fourth)
        assert another.guarded, "every guard was taken for full for good"
        assert _held_by(last) == {fourth.pid}
        assert _held_by(retired) == {first.pid}
    finally:
        for process in spawned:
            _end(process)


# A program embedding the agent that forks after a spawn: the fork spawns a
# child of its own and prints whether it is guarded, by a guard of its own,
# and whether it learns of its child's exit (`LocalProcess.on_exit`).
_FORK_SPAWNS = """
import os, sys, threading, warnings
from pathlib import Path
from workers.agent import executor
spawner = executor.ProcessSpawner(Path(sys.argv[1]))
first = spawner({"command": ["true"], "env": {}})
exited = threading.Event()
assert first.on_exit(exited.set) and exited.wait(10)  # the exit watcher runs
first.release(grace_s=0)
parent_guard = executor.death_guard_pid()
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # a fork beside threads
    forked = os.fork()
if forked == 0:
    process = spawner({"command": ["true"], "env": {}})
    guard = executor.death_guard_pid()
    exited = threading.Event()
    told = process.on_exit(exited.set) and exited.wait(10)
    print(spawner.guarded, guard not in (None, parent_guard), told, flush=True)
    process.release(grace_s=0)
    os._exit(0)
os.waitpid(forked, 0)
"""


@linux_only
def test_a_fork_of_the_agent_spawns_under_a_guard_of_its_own_and_learns_of_exits(
    tmp_path: Path,
) -> None:
    """The fork's first spawn starts a guard of its own, and the exit watcher
    is its own too: the parent's epoll set, shared across the fork, and its
    thread, which the fork has not, are left to the parent."""
    with _stand_in_agent(_FORK_SPAWNS, str(tmp_path)) as (agent, _):
        out, _ = agent.communicate(timeout=60)
        assert agent.returncode == 0
        guarded, own_guard, told = out.split()
        assert guarded == "True"
        assert own_guard == "True"
        assert told == "True", "the fork never learnt of its child's exit"


# A stand-in agent whose guard's start is forked over: the fork comes right
# after the guard's Popen, before its socket is the guard's own (reviewer of
# S8: the agent's end of a guard being started was out of the fork's reach).
_STAND_IN_FORK_AT_START = """
import os, subprocess, sys, time, warnings
from pathlib import Path
from workers.agent import executor
real_popen = subprocess.Popen
forked = []
class ForkingPopen(real_popen):
    def __init__(self, args, *rest, **kwargs):
        super().__init__(args, *rest, **kwargs)
        if executor._GUARD_PROGRAM in args and not forked:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # a fork beside threads
                pid = os.fork()
            if pid == 0:
                time.sleep(120)
                os._exit(0)
            forked.append(pid)
executor.subprocess.Popen = ForkingPopen
spawner = executor.ProcessSpawner(Path(sys.argv[1]))
assert spawner.guarded
child = spawner({"command": ["sleep", "60"], "env": {}})
print(child.pid, executor.death_guard_pid(), forked[0], flush=True)
time.sleep(120)
"""


@linux_only
def test_a_fork_while_a_guard_starts_keeps_it_from_seeing_the_agent_die(tmp_path: Path) -> None:
    """A fork between a guard's start and its socket becoming the guard's
    closes that end too: the agent's kill -9 still kills the guarded child
    while the fork lives on (it kept both alive before)."""
    with _stand_in_agent(_STAND_IN_FORK_AT_START, str(tmp_path)) as (agent, children):
        assert agent.stdout is not None
        child, guard, forked = (int(part) for part in agent.stdout.readline().split())
        children += [child, forked]
        eventually(_is_running(child, ["sleep", "60"]), 10, "sleep exec'd")
        assert _held_by(guard) == {child}
        agent.kill()  # the agent process alone: its fork lives on
        agent.wait(10)
        eventually(lambda: not _alive(child), 10, "the guard killed the child")
        eventually(lambda: not _alive(guard), 10, "the guard ended with the agent")
        assert _alive(forked)


@linux_only
def test_a_guard_exit_during_a_long_cover_keeps_other_exits_on_time(
    tmp_path: Path, own_guard: executor._Guard
) -> None:
    """The exit watcher's one thread tells every runner of its child's exit;
    a guard that exits while a cover holds the guard's lock (a new guard's
    start may take seconds) must not hold that thread: another child's exit
    still comes at once, and the dead guard is reaped when the cover lets go
    (before, the watcher waited for the lock and every exit with it)."""
    spawner = ProcessSpawner(tmp_path, death_guard=own_guard)
    assert spawner.guarded
    guard = _pid(own_guard)
    exited = threading.Event()
    with own_guard._lock:  # a cover at work
        os.kill(guard, signal.SIGKILL)
        eventually(lambda: _state(guard) in (None, "Z"), 10, "the guard died")
        time.sleep(0.2)  # the watcher has its exit by now
        other = subprocess.Popen(["sleep", "0.2"])
        assert executor._EXITS.watch(other.pid, exited.set)
        assert exited.wait(5), "another child's exit waited for the cover"
    other.wait(5)
    process = spawner(a_spec(command=["sleep", "60"]))
    try:
        assert spawner.guarded
        assert own_guard.pid not in (None, guard)
        eventually(lambda: _state(guard) is None, 10, "the dead guard was reaped")
    finally:
        _end(process)
