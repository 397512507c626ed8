"""The Worker's durable inbox (docs/adr/0008): the journal, the state directory,
and how the agent tells its own processes from strangers (procfs)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from workers.agent import procfs
from workers.agent.executor import ProcessSpawner, parent_death_signal
from workers.agent.journal import (
    JOURNAL_FILE,
    LOCK_FILE,
    Journal,
    OfferVerdict,
    Outcome,
    Phase,
    StateDirError,
    default_state_dir,
)
from workers.agent.protocol import CANCELLED, AttemptRunner, Response
from workers.tests.markers import offer_id
from workers.tests.polling import eventually
from workers.tests.test_agent import (
    FakeProcess,
    FakeSpawner,
    FakeTransport,
    a_spec,
    an_offer,
)

linux_only = pytest.mark.skipif(not procfs.procfs_available(), reason="needs Linux /proc")

OFFER = offer_id(0xAB)  # per test process: workers.tests.markers
DIGEST = "d" * 64
TOKEN = "secret-lease-token-" + "x" * 30


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state" / "agent"


@pytest.fixture
def journal(state_dir: Path):
    opened = Journal.open(state_dir)
    yield opened
    opened.close()


# ------------------------------------------------------------ the directory


def test_the_state_directory_is_private_and_the_journal_file_too(state_dir: Path) -> None:
    journal = Journal.open(state_dir)
    try:
        journal.record_offer(offer_id=OFFER, spec_sha256=DIGEST, lease_token=TOKEN, session_id="s1")
        files = {path.name: _mode(path) for path in state_dir.iterdir()}
    finally:
        journal.close()
    assert _mode(state_dir) == 0o700
    assert files[JOURNAL_FILE] == 0o600
    assert files[LOCK_FILE] == 0o600
    # WAL and shared-memory files take the database file's mode.
    assert all(mode == 0o600 for name, mode in files.items()), files


def test_an_existing_directory_open_to_others_is_made_private(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    Journal.open(loose).close()
    assert _mode(loose) == 0o700


def test_a_second_agent_on_the_same_directory_is_refused_until_the_first_is_gone(
    state_dir: Path,
) -> None:
    first = Journal.open(state_dir)
    with pytest.raises(StateDirError, match="another agent"):
        Journal.open(state_dir)
    first.close()
    Journal.open(state_dir).close()


def test_the_lock_dies_with_the_agent_process_not_with_its_children(state_dir: Path) -> None:
    # The agent, killed with -9, must not leave the directory locked (a child
    # that inherited the lock would keep it for as long as it runs).
    code = (
        "import sys, time, subprocess; from pathlib import Path;"
        "from workers.agent.journal import Journal;"
        f"j = Journal.open(Path({str(state_dir)!r}));"
        "c = subprocess.Popen(['sleep', '30'], start_new_session=True);"
        "print(c.pid, flush=True); time.sleep(60)"
    )
    root = Path(__file__).resolve().parents[2]
    agent = subprocess.Popen(
        [sys.executable, "-c", code], cwd=root, stdout=subprocess.PIPE, text=True
    )
    assert agent.stdout is not None
    child = 0
    try:
        child = int(agent.stdout.readline())
        with pytest.raises(StateDirError):
            Journal.open(state_dir)
        agent.kill()
        agent.wait(10)
        Journal.open(state_dir).close()  # the sleeping child does not hold it
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        agent.stdout.close()
        if child:
            os.kill(child, signal.SIGKILL)


def test_the_default_state_directory_follows_xdg(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", "/srv/state")
    assert default_state_dir() == Path("/srv/state/qinglong-agent")
    monkeypatch.delenv("XDG_STATE_HOME")
    assert default_state_dir() == Path.home() / ".local" / "state" / "qinglong-agent"


# ------------------------------------------------------------ the records


def test_an_offer_is_recorded_once_and_a_repeat_is_a_duplicate(journal: Journal) -> None:
    first = journal.record_offer(
        offer_id=OFFER, spec_sha256=DIGEST, lease_token=TOKEN, session_id="s1"
    )
    again = journal.record_offer(
        offer_id=OFFER, spec_sha256=DIGEST, lease_token="other", session_id="s2"
    )
    assert (first, again) == (OfferVerdict.NEW, OfferVerdict.DUPLICATE)
    execution = journal.get(OFFER)
    assert execution is not None
    assert (execution.phase, execution.lease_token, execution.session_id) == (
        Phase.RECEIVED,
        TOKEN,
        "s1",
    )


def test_the_same_offer_id_with_another_digest_is_a_conflict_and_changes_nothing(
    journal: Journal,
) -> None:
    journal.record_offer(offer_id=OFFER, spec_sha256=DIGEST, lease_token=TOKEN, session_id="s1")
    journal.mark_started(OFFER)
    verdict = journal.record_offer(
        offer_id=OFFER, spec_sha256="e" * 64, lease_token="other", session_id="s1"
    )
    assert verdict is OfferVerdict.CONFLICT
    execution = journal.get(OFFER)
    assert execution is not None
    assert (execution.spec_sha256, execution.lease_token, execution.phase) == (
        DIGEST,
        TOKEN,
        Phase.STARTED,
    )


def test_count_open_counts_one_sessions_unreported_executions(journal: Journal) -> None:
    # What a pull counts as taken slots: every phase but `reported`, one Session.
    for index in range(4):
        journal.record_offer(
            offer_id=f"{index:064x}", spec_sha256=DIGEST, lease_token=TOKEN, session_id="s1"
        )
    journal.record_offer(offer_id="f" * 64, spec_sha256=DIGEST, lease_token=TOKEN, session_id="s2")
    journal.mark_started(f"{1:064x}")
    journal.mark_finished(f"{2:064x}", outcome=Outcome.EXITED, exit_code=0)
    journal.mark_reported(f"{3:064x}", report="acked")
    counted = journal.count_open(session_id="s1")
    assert counted == 3
    assert counted == len(journal.open_executions(session_id="s1"))
    assert journal.count_open(session_id="s2") == 1
    assert journal.count_open(session_id="s3") == 0


def test_the_records_survive_a_reopen_and_the_token_goes_once_reported(state_dir: Path) -> None:
    journal = Journal.open(state_dir)
    journal.record_offer(offer_id=OFFER, spec_sha256=DIGEST, lease_token=TOKEN, session_id="s1")
    journal.mark_started(OFFER)
    journal.mark_spawning(OFFER)
    journal.mark_running(OFFER, pid=1234, start_time=5678, pgid=1234)
    journal.close()

    journal = Journal.open(state_dir)
    [execution] = journal.open_executions()
    assert (execution.phase, execution.pid, execution.start_time, execution.pgid) == (
        Phase.RUNNING,
        1234,
        5678,
        1234,
    )
    assert TOKEN not in repr(execution)
    journal.mark_finished(OFFER, outcome=Outcome.KILLED, exit_code=-9)
    journal.mark_reported(OFFER, report="reconciled:confirmed")
    journal.close()

    raw = (state_dir / JOURNAL_FILE).read_bytes()
    wal = state_dir / (JOURNAL_FILE + "-wal")
    if wal.exists():
        raw += wal.read_bytes()
    journal = Journal.open(state_dir)
    try:
        settled = journal.get(OFFER)
        assert settled is not None
        assert (settled.phase, settled.outcome, settled.exit_code, settled.lease_token) == (
            Phase.REPORTED,
            Outcome.KILLED,
            -9,
            "",
        )
        assert journal.open_executions() == []
    finally:
        journal.close()
    assert TOKEN.encode() not in raw  # overwritten, not left in a free page


def test_open_executions_of_one_session(journal: Journal) -> None:
    for index, session in enumerate(["s1", "s1", "s2"]):
        journal.record_offer(
            offer_id=f"{index:064x}", spec_sha256=DIGEST, lease_token=TOKEN, session_id=session
        )
    journal.mark_reported(f"{0:064x}", report="acked")
    assert [e.offer_id for e in journal.open_executions(session_id="s1")] == [f"{1:064x}"]
    assert len(journal.open_executions()) == 2


def test_purge_forgets_only_old_reported_executions(journal: Journal) -> None:
    journal.record_offer(offer_id=OFFER, spec_sha256=DIGEST, lease_token=TOKEN, session_id="s1")
    journal.record_offer(offer_id="cd" * 32, spec_sha256=DIGEST, lease_token=TOKEN, session_id="s1")
    journal.mark_reported(OFFER, report="acked")
    assert journal.purge(older_than_s=3600) == 0
    assert journal.purge(older_than_s=-1) == 1
    assert journal.get(OFFER) is None
    assert journal.get("cd" * 32) is not None


# ------------------------------------------------------------ procfs


@linux_only
def test_proc_info_reads_the_start_time_and_group_of_a_process() -> None:
    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        info = procfs.proc_info(child.pid)
        assert info is not None
        assert (info.pgid, info.alive) == (child.pid, True)
        again = procfs.proc_info(child.pid)
        assert again is not None and again.start_time == info.start_time > 0
    finally:
        child.kill()
        child.wait()
    assert procfs.proc_info(child.pid) is None


@linux_only
def test_a_pid_with_another_start_time_is_not_ours_and_is_left_alone() -> None:
    # As if the journal's process had exited and the pid been handed out again.
    stranger = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        info = procfs.proc_info(stranger.pid)
        assert info is not None
        ended = procfs.end_execution(
            offer_id=OFFER,
            pid=stranger.pid,
            start_time=info.start_time - 1,
            pgid=stranger.pid,
            grace_s=1,
        )
        assert ended is False
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


@linux_only
def test_end_execution_ends_the_group_whose_leader_matches_term_then_kill() -> None:
    # The leader ignores SIGTERM; its child in the same group too.
    script = "trap '' TERM; sleep 30 & wait"
    leader = subprocess.Popen(["sh", "-c", script], start_new_session=True)
    time.sleep(0.3)
    info = procfs.proc_info(leader.pid)
    assert info is not None
    started = time.monotonic()
    ended = procfs.end_execution(
        offer_id=OFFER, pid=leader.pid, start_time=info.start_time, pgid=leader.pid, grace_s=0.5
    )
    assert ended is True
    assert leader.wait(5) == -signal.SIGKILL
    assert time.monotonic() - started >= 0.5  # the grace was given
    view = procfs.snapshot(with_markers=False)
    assert not any(p.pgid == leader.pid and p.alive for p in view.procs.values())


@linux_only
def test_end_execution_finds_marked_processes_without_a_recorded_pid() -> None:
    # The agent died after the spawn, before it recorded the pid: the marker
    # in the environment is how the restarted agent finds the process.
    env = {**os.environ, procfs.MARKER_ENV: OFFER}
    marked = subprocess.Popen(["sleep", "30"], env=env, start_new_session=True)
    other = subprocess.Popen(
        ["sleep", "30"], env={**os.environ, procfs.MARKER_ENV: "cd" * 32}, start_new_session=True
    )
    try:
        time.sleep(0.1)
        ended = procfs.end_execution(
            offer_id=OFFER, pid=None, start_time=None, pgid=None, grace_s=1
        )
        assert ended is True
        assert marked.wait(5) == -signal.SIGTERM
        assert other.poll() is None  # another offer's process is not touched
    finally:
        for proc in (marked, other):
            if proc.poll() is None:
                proc.kill()
            proc.wait()


# ------------------------------------------------------------ the executor


@linux_only
def test_the_child_carries_the_marker_and_leads_its_own_group(tmp_path: Path) -> None:
    process = ProcessSpawner(tmp_path)(
        a_spec(command=["sh", "-c", "echo $QL_OFFER_ID; sleep 0.2"]), offer_id=OFFER
    )
    info = procfs.proc_info(process.pid)
    assert info is not None
    assert (process.pgid, process.start_time) == (process.pid, info.start_time)
    assert process.wait(timeout=10) == 0
    assert process.release(grace_s=1) == 0
    tail = process.output_tail(1000)
    process.close()
    assert tail == OFFER + "\n"


@linux_only
def test_release_ends_what_the_job_left_running_in_its_group(tmp_path: Path) -> None:
    # The job exits at once and leaves a background child that ignores TERM.
    script = "sh -c \"trap '' TERM; sleep 30\" & echo started"
    process = ProcessSpawner(tmp_path)(a_spec(command=["sh", "-c", script]), offer_id=OFFER)
    assert process.wait(timeout=10) == 0
    time.sleep(0.2)
    assert procfs.group_members_alive(process.pgid, exclude=(process.pid,))
    assert process.release(grace_s=0.3) == 0
    process.close()
    assert not procfs.group_members_alive(process.pgid, exclude=(process.pid,))


@linux_only
def test_one_pass_over_proc_answers_every_runner_that_asked_while_another_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Group commit (issue 12): a runner that asks while a pass is under way
    # waits for the next one, which answers it and everyone else who asked
    # meanwhile; each answer is its own group's.
    spawn = ProcessSpawner(tmp_path)
    left = spawn(a_spec(command=["sh", "-c", "sleep 30 & echo started"]), offer_id=OFFER)
    clean = spawn(a_spec(command=["true"]), offer_id=offer_id(0xAC))
    other = spawn(a_spec(command=["true"]), offer_id=offer_id(0xAD))
    for process in (left, clean, other):
        assert process.wait(timeout=10) == 0  # `left` forked its sleep before it exited
    scans = procfs.GroupScans()
    real_scan = procfs._scan
    passes: list[set[int]] = []
    first_pass = threading.Event()
    go_on = threading.Event()

    def scan(groups: dict[int, frozenset[str]]) -> set[int]:
        passes.append(set(groups))
        if len(passes) == 1:
            first_pass.set()
            assert go_on.wait(30)
        return real_scan(groups)

    monkeypatch.setattr(procfs, "_scan", scan)
    answers: dict[str, bool] = {}

    def ask(name: str, process: Any) -> None:
        answers[name] = scans.members_alive(process.pgid, exclude=(process.pid,))

    askers = [threading.Thread(target=ask, args=("clean", clean))]
    askers[0].start()
    assert first_pass.wait(30)
    for name, process in (("left", left), ("other", other)):
        askers.append(threading.Thread(target=ask, args=(name, process)))
        askers[-1].start()
    eventually(lambda: len(scans._asked) == 2, 30, "both wait for the next pass")
    go_on.set()
    for thread in askers:
        thread.join(30)
    try:
        assert passes == [{clean.pgid}, {left.pgid, other.pgid}]
        assert answers == {"clean": False, "left": True, "other": False}
        assert scans.passes == 2
    finally:
        for process in (left, clean, other):
            process.release(grace_s=1)
            process.close()


@linux_only
def test_poll_does_not_reap_so_the_group_id_stays_ours(tmp_path: Path) -> None:
    process = ProcessSpawner(tmp_path)(a_spec(command=["true"]), offer_id=OFFER)
    assert process.wait(timeout=10) == 0
    info = procfs.proc_info(process.pid)
    assert info is not None and info.state == "Z"  # exited, not reaped: pid held
    process.release(grace_s=0)
    process.close()
    assert procfs.proc_info(process.pid) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_the_parent_death_signal_is_set_in_the_child(tmp_path: Path) -> None:
    assert parent_death_signal() is not None
    # /proc does not show it; the child reads it back with PR_GET_PDEATHSIG (2).
    code = (
        "import ctypes; v = ctypes.c_int();"
        "ctypes.CDLL(None).prctl(2, ctypes.byref(v), 0, 0, 0); print(v.value)"
    )
    # Where there is no death guard (with one the child has no signal of its own).
    process = ProcessSpawner(tmp_path, guard=False)(a_spec(command=[sys.executable, "-c", code]))
    assert process.wait(timeout=30) == 0
    process.release(grace_s=0)
    tail = process.output_tail(100)
    process.close()
    assert tail.strip() == str(int(signal.SIGKILL))


# ------------------------------------------------------------ writes per Attempt


def _journal_writes(journal: Journal) -> list[str]:
    """Every statement that writes the journal, as SQLite runs it."""
    writes: list[str] = []
    journal._db.set_trace_callback(
        lambda sql: writes.append(sql) if sql.startswith(("INSERT", "UPDATE")) else None
    )
    return writes


def _phases(writes: list[str]) -> list[str]:
    return [
        "offer" if sql.startswith("INSERT") else sql.split("phase = '", 1)[1].split("'", 1)[0]
        for sql in writes
    ]


def test_an_attempt_that_runs_is_five_journal_writes_spawning_implying_started() -> None:
    # The offer, `spawning` straight after the accepted starting ACK (the
    # crash barrier, which implies `started`), `running` with the pid, the
    # outcome, `reported`: five commits, in this order, none skipped.
    journal = Journal.memory()
    writes = _journal_writes(journal)
    offer = an_offer(a_spec(command=["true"]))
    journal.record_offer(
        offer_id=offer["offer_id"], spec_sha256=offer["spec_sha256"], lease_token=TOKEN,
        session_id="s1",
    )  # fmt: skip
    phases_at_spawn: list[Phase | None] = []
    spawner = FakeSpawner(FakeProcess(), [])

    def spawn(spec: Any, *, offer_id: str = "") -> FakeProcess:
        execution = journal.get(offer_id)
        phases_at_spawn.append(execution.phase if execution else None)
        return spawner(spec, offer_id=offer_id)

    runner = AttemptRunner(
        transport=FakeTransport(), session_token="s" * 43, offer=offer, lease_token=TOKEN,
        spawn=spawn, journal=journal, poll_interval_s=0.01,
    )  # fmt: skip
    outcome = runner.run()
    assert (outcome.ran, outcome.final_phase) == (True, "succeeded")
    assert phases_at_spawn == [Phase.SPAWNING]
    assert _phases(writes) == ["offer", "spawning", "running", "finished", "reported"]


def test_an_attempt_stopped_before_its_spawn_is_journaled_started_then_not_started() -> None:
    # Cancelled while its starting ACK was answered: `started` (the control
    # plane knows it), never `spawning` (nothing ran), then the outcome.
    journal = Journal.memory()
    offer = an_offer(a_spec(command=["true"]))
    journal.record_offer(
        offer_id=offer["offer_id"], spec_sha256=offer["spec_sha256"], lease_token=TOKEN,
        session_id="s1",
    )  # fmt: skip
    writes = _journal_writes(journal)
    spawner = FakeSpawner(FakeProcess(), [])
    runner: AttemptRunner

    class CancelOnStarting(FakeTransport):
        def post(self, path: str, body: Any, *, token: str) -> Response:
            if body.get("phase") == "starting":
                runner.cancel(CANCELLED)
            return super().post(path, body, token=token)

    runner = AttemptRunner(
        transport=CancelOnStarting(), session_token="s" * 43, offer=offer, lease_token=TOKEN,
        spawn=spawner, journal=journal, poll_interval_s=0.01,
    )  # fmt: skip
    outcome = runner.run()
    assert spawner.specs == []
    assert outcome.ran is False
    assert _phases(writes) == ["started", "finished", "reported"]
    execution = journal.get(offer["offer_id"])
    assert execution is not None and execution.outcome is Outcome.NOT_STARTED
