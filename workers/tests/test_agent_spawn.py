"""How the agent spawns a child (issue 12): by vfork, the command exec'd
directly, the agent's death guard killing it with the agent process; where
there is no guard, by vfork with the parent-death signal set by util-linux's
`setpriv --pdeathsig KILL` in the child itself, which then execs the spec's
command in the same process; a `preexec_fn` (fork) where setpriv cannot.
Every way the child dies with the agent (with the thread that spawned it,
for the signal), the job sees its own argv, the recorded pid and start time
are the job's, and a program that cannot be run is a refused spawn, not an
exit code. The guard itself: test_agent_guard.py."""

from __future__ import annotations

import shutil
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from workers.agent import procfs
from workers.agent.executor import LocalProcess, ProcessSpawner, parent_death_wrapper
from workers.agent.protocol import AttemptRunner
from workers.tests.markers import offer_id
from workers.tests.polling import eventually
from workers.tests.test_agent import TOKEN, FakeTransport, a_spec, an_offer

linux_only = pytest.mark.skipif(not procfs.procfs_available(), reason="needs Linux /proc")

Way = dict[str, Any]  # ProcessSpawner's keyword arguments

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
