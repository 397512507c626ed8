"""How the agent spawns a child (issue 12): by vfork, the command exec'd
directly, the agent's death guard killing it with the agent process; where
there is no guard, by vfork with the parent-death signal set by util-linux's
`setpriv --pdeathsig KILL` in the child itself, which then execs the spec's
command in the same process; a `preexec_fn` (fork) where setpriv cannot.
Every way the child dies with the agent (with the thread that spawned it,
for the signal), the job sees its own argv, the recorded pid and start time
are the job's, and a program that cannot be run is a refused spawn, not an
exit code."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from workers.agent import executor, procfs
from workers.agent.executor import LocalProcess, ProcessSpawner, parent_death_wrapper
from workers.agent.protocol import AttemptRunner
from workers.tests.markers import offer_id
from workers.tests.polling import eventually
from workers.tests.test_agent import TOKEN, FakeTransport, a_spec, an_offer

linux_only = pytest.mark.skipif(not procfs.procfs_available(), reason="needs Linux /proc")

Way = dict[str, bool]  # ProcessSpawner's keyword arguments

# Every way the child dies with the agent: the guard (vfork), the parent-death
# signal set by setpriv (vfork) or by a preexec_fn (fork).
all_ways = pytest.mark.parametrize(
    "way",
    [{}, {"guard": False}, {"guard": False, "setpriv": False}],
    ids=["guard", "setpriv", "preexec"],
)
# The two ways of setting the parent-death signal itself.
signal_ways = pytest.mark.parametrize(
    "way", [{"guard": False}, {"guard": False, "setpriv": False}], ids=["setpriv", "preexec"]
)


def _cmdline(pid: int) -> list[str]:
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return [part.decode() for part in raw.split(b"\0")[:-1]]


def _is_running(pid: int, argv: list[str]) -> Callable[[], bool]:
    """The child runs `argv` itself: setpriv (if any) has set the signal and
    exec'd the command in its place."""

    def check() -> bool:
        try:
            return _cmdline(pid) == argv
        except OSError:
            return False

    return check


def _end(process: LocalProcess) -> None:
    process.kill()
    process.release(grace_s=0)
    process.close()


@linux_only
def test_setpriv_sets_the_signal_and_the_spawn_is_a_vfork(tmp_path: Path) -> None:
    # util-linux is on every Linux this runs on; its setpriv has --pdeathsig
    # since 2.33. Where it lacks it, `parent_death_wrapper` says None.
    assert shutil.which("setpriv") is not None
    wrapper = parent_death_wrapper()
    assert wrapper is not None
    assert wrapper[1:] == ("--pdeathsig", "KILL", "--")
    assert ProcessSpawner(tmp_path, guard=False).uses_vfork
    assert not ProcessSpawner(tmp_path, guard=False, setpriv=False).uses_vfork


@linux_only
@signal_ways
def test_the_child_reads_back_its_parent_death_signal(tmp_path: Path, way: Way) -> None:
    # /proc does not show it; the child reads it back with PR_GET_PDEATHSIG (2).
    code = (
        "import ctypes; v = ctypes.c_int();"
        "ctypes.CDLL(None).prctl(2, ctypes.byref(v), 0, 0, 0); print(v.value)"
    )
    spawner = ProcessSpawner(tmp_path, **way)
    process = spawner(a_spec(command=[sys.executable, "-c", code]))
    assert process.wait(timeout=30) == 0
    process.release(grace_s=0)
    tail = process.output_tail(100)
    process.close()
    assert tail.strip() == str(int(signal.SIGKILL))


@linux_only
@signal_ways
def test_the_child_dies_when_the_thread_that_spawned_it_ends(tmp_path: Path, way: Way) -> None:
    # PR_SET_PDEATHSIG follows the spawning THREAD, not the process: that is
    # why each runner thread outlives its child. Other threads ending do
    # nothing to it; its own thread ending kills it.
    spawner = ProcessSpawner(tmp_path, **way)
    spawned: dict[str, Any] = {}
    release = threading.Event()

    def runner() -> None:
        spawned["process"] = spawner(a_spec(command=["sleep", "60"]))
        release.wait(60)

    thread = threading.Thread(target=runner)
    thread.start()
    eventually(lambda: "process" in spawned, 10, "spawned")
    process: LocalProcess = spawned["process"]
    try:
        eventually(_is_running(process.pid, ["sleep", "60"]), 10, "sleep exec'd")
        bystander = threading.Thread(target=lambda: None)
        bystander.start()
        bystander.join()
        assert process.poll() is None  # another thread's exit: still running
        release.set()
        thread.join(10)
        assert process.wait(timeout=10) == -signal.SIGKILL
    finally:
        release.set()
        _end(process)


@linux_only
def test_the_recorded_pid_and_start_time_are_the_jobs_own(tmp_path: Path) -> None:
    # setpriv execs the command in its own process: the pid (the group id)
    # and the start time the journal records name the job itself.
    process = ProcessSpawner(tmp_path)(a_spec(command=["sleep", "60"]), offer_id=offer_id(0xAB))
    try:
        eventually(_is_running(process.pid, ["sleep", "60"]), 10, "sleep exec'd")
        info = procfs.proc_info(process.pid)
        assert info is not None
        assert (info.start_time, info.pgid) == (process.start_time, process.pgid)
        assert process.pgid == process.pid
        environ = Path(f"/proc/{process.pid}/environ").read_bytes().split(b"\0")
        assert f"{procfs.MARKER_ENV}={offer_id(0xAB)}".encode() in environ
    finally:
        _end(process)


@linux_only
@all_ways
def test_the_job_sees_its_own_argv(tmp_path: Path, way: Way) -> None:
    # No wrapper in the job's argv: $0 and the arguments are the spec's.
    script = 'tr "\\0" " " < /proc/$$/cmdline; echo; echo "$0|$1"'
    process = ProcessSpawner(tmp_path, **way)(a_spec(command=["sh", "-c", script, "zero", "one"]))
    assert process.wait(timeout=30) == 0
    process.release(grace_s=0)
    lines = process.output_tail(4096).splitlines()
    process.close()
    assert lines == [f"sh -c {script} zero one ", "zero|one"]


def _runner(tmp_path: Path, command: list[str], **spawner: Any) -> tuple[Any, FakeTransport]:
    transport = FakeTransport()
    runner = AttemptRunner(
        transport=transport,
        session_token="s" * 43,
        offer=an_offer(a_spec(command=command)),
        lease_token=TOKEN,
        spawn=ProcessSpawner(tmp_path, **spawner),
        poll_interval_s=0.01,
    )
    return runner.run(), transport


@all_ways
def test_a_program_that_is_not_there_is_a_refused_spawn(tmp_path: Path, way: Way) -> None:
    # Behind setpriv it would be setpriv's exit 127: found out before spawning.
    outcome, transport = _runner(tmp_path, ["no-such-program-ql"], **way)
    done = transport.calls[-1]
    assert (done["phase"], done["error_code"]) == ("start_failed", "spawn_failed")
    assert done["output_tail"] == "FileNotFoundError"
    assert (outcome.ran, outcome.stopped) == (False, "spawn_failed")


@all_ways
def test_a_file_that_may_not_be_executed_is_a_refused_spawn(tmp_path: Path, way: Way) -> None:
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\ntrue\n")
    script.chmod(0o644)
    outcome, transport = _runner(tmp_path, [str(script)], **way)
    done = transport.calls[-1]
    assert (done["phase"], done["error_code"]) == ("start_failed", "spawn_failed")
    assert done["output_tail"] == "PermissionError"
    assert outcome.ran is False


def test_an_empty_command_is_a_refused_spawn(tmp_path: Path) -> None:
    outcome, transport = _runner(tmp_path, [])
    done = transport.calls[-1]
    assert (done["phase"], done["error_code"]) == ("start_failed", "spawn_failed")
    assert outcome.ran is False


@all_ways
def test_the_program_is_found_on_the_specs_path(tmp_path: Path, way: Way) -> None:
    # The spec's PATH (not the agent's) is searched, as the exec does.
    tools = tmp_path / "tools"
    tools.mkdir()
    tool = tools / "ql-tool"
    tool.write_text("#!/bin/sh\necho tool ran\n")
    tool.chmod(0o755)
    spec = a_spec(command=["ql-tool"], env={"PATH": f"{tools}:/usr/bin:/bin"})
    process = ProcessSpawner(tmp_path, **way)(spec)
    assert process.wait(timeout=30) == 0
    process.release(grace_s=0)
    tail = process.output_tail(100)
    process.close()
    assert tail.strip() == "tool ran"


@linux_only
def test_no_setpriv_on_the_path_falls_back_to_the_preexec_function(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert parent_death_wrapper.__wrapped__() is None


@linux_only
def test_a_setpriv_without_pdeathsig_falls_back_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # util-linux before 2.33: "unrecognized option '--pdeathsig'", exit 1.
    old = tmp_path / "setpriv"
    old.write_text('#!/bin/sh\ncase "$1" in --pdeathsig) exit 1;; esac\nexit 0\n')
    old.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert parent_death_wrapper.__wrapped__() is None


@linux_only
@all_ways
def test_the_job_runs_with_the_agents_credentials_unchanged(tmp_path: Path, way: Way) -> None:
    # setpriv here only sets the parent-death signal: ids, groups,
    # capabilities, no_new_privs and seccomp are the agent's own.
    fields = ("Uid:", "Gid:", "Groups:", "Cap", "NoNewPrivs:", "Seccomp:")

    def wanted(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith(fields)]

    process = ProcessSpawner(tmp_path, **way)(a_spec(command=["cat", "/proc/self/status"]))
    assert process.wait(timeout=30) == 0
    process.release(grace_s=0)
    child = wanted(process.output_tail(64 * 1024))
    process.close()
    assert len(child) >= 8
    assert child == wanted(Path("/proc/self/status").read_text())


@linux_only
def test_a_program_removed_after_a_spawn_is_refused_at_the_next(tmp_path: Path) -> None:
    # The spawner remembers where it found a program: a check, not a
    # verdict; a program gone since (or moved along the PATH) is found out.
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    env = {"PATH": f"{first}:{second}:/usr/bin:/bin"}
    spawner = ProcessSpawner(tmp_path)

    def spawn() -> str:
        process = spawner(a_spec(command=["ql-tool"], env=env))
        assert process.wait(timeout=30) == 0
        process.release(grace_s=0)
        tail = process.output_tail(100).strip()
        process.close()
        return tail

    (first / "ql-tool").write_text("#!/bin/sh\necho first\n")
    (first / "ql-tool").chmod(0o755)
    assert spawn() == "first"
    (first / "ql-tool").unlink()
    with pytest.raises(FileNotFoundError):
        spawner(a_spec(command=["ql-tool"], env=env))
    (second / "ql-tool").write_text("#!/bin/sh\necho second\n")
    (second / "ql-tool").chmod(0o755)
    assert spawn() == "second"


# ---- the agent's death guard

_REPO = Path(__file__).resolve().parents[2]

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


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _held_by(guard: int) -> set[int]:
    """The pids whose pidfds the guard holds (its fds' fdinfo "Pid:" lines)."""
    pids = set()
    for info in Path(f"/proc/{guard}/fdinfo").iterdir():
        with contextlib.suppress(OSError):
            for line in info.read_text().splitlines():
                if line.startswith("Pid:"):
                    pids.add(int(line.split()[1]))
    return pids


@linux_only
def test_the_guard_kills_the_child_with_the_agent_process_not_with_its_thread(
    tmp_path: Path,
) -> None:
    agent = subprocess.Popen(
        [sys.executable, "-c", _STAND_IN, str(tmp_path)],
        cwd=_REPO,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
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
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)
        agent.wait(10)
        if agent.stdout is not None:
            agent.stdout.close()


@linux_only
def test_a_killed_guard_is_replaced_at_the_next_spawn(tmp_path: Path) -> None:
    spawner = ProcessSpawner(tmp_path)
    assert spawner.guarded
    old = executor.death_guard_pid()
    assert old is not None
    os.kill(old, signal.SIGKILL)
    eventually(lambda: not _alive(old), 10, "the guard died")
    process = spawner(a_spec(command=["sleep", "60"]))
    try:
        new = executor.death_guard_pid()
        assert spawner.guarded
        assert new is not None
        assert new != old
        eventually(lambda: process.pid in _held_by(new), 10, "the new guard holds the child")
    finally:
        _end(process)
    # Its exit drops its pidfd.
    eventually(lambda: process.pid not in _held_by(new), 10, "the guard let go of the child")


@linux_only
def test_a_stopped_guard_never_blocks_a_spawn_and_keeps_its_children(tmp_path: Path) -> None:
    """A guard that takes nothing (SIGSTOP) fills its socket's queue: the
    spawns go on uncovered, then with the parent-death signal; the guard is
    kept, and when it goes on it still holds (and has not killed) its child."""
    spawner = ProcessSpawner(tmp_path)
    assert spawner.guarded
    guard = executor.death_guard_pid()
    assert guard is not None
    held = spawner(a_spec(command=["sleep", "60"]))
    spawned = 0
    # A small send buffer: the queue fills within a few spawns whatever the
    # machine's default (wmem_default; 212 KiB here: 278 spawns).
    ours = executor._GUARD._socket
    assert ours is not None
    default = ours.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
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
        worker.start()
        worker.join(60)
        assert not worker.is_alive(), f"a spawn waited on the stopped guard after {spawned}"
        assert not spawner.guarded
        assert spawned < 5000
        assert _signal_of_child(spawner) == str(int(signal.SIGKILL))
    finally:
        os.kill(guard, signal.SIGCONT)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, default // 2)
    try:
        assert executor.death_guard_pid() == guard
        time.sleep(0.2)
        assert _alive(held.pid)
        assert held.pid in _held_by(guard)
    finally:
        _end(held)


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
def test_with_the_guard_the_child_has_no_signal_of_its_own(tmp_path: Path) -> None:
    spawner = ProcessSpawner(tmp_path)
    assert spawner.guarded
    assert spawner.uses_vfork
    assert _signal_of_child(spawner) == "0"


@linux_only
def test_no_guard_falls_back_to_the_parent_death_signal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(executor._GUARD, "start", lambda: False)
    spawner = ProcessSpawner(tmp_path)
    assert not spawner.guarded
    assert spawner.uses_vfork  # setpriv
    assert _signal_of_child(spawner) == str(int(signal.SIGKILL))


@linux_only
def test_a_child_the_guard_could_not_take_turns_the_spawner_to_the_signal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spawner = ProcessSpawner(tmp_path)
    assert spawner.guarded
    monkeypatch.setattr(executor._GUARD, "cover", lambda pid: False)
    assert _signal_of_child(spawner) == "0"  # spawned before the cover failed
    assert not spawner.guarded
    assert _signal_of_child(spawner) == str(int(signal.SIGKILL))
