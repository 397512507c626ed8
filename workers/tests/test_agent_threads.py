"""The agent's runner threads (`_RunnerThreads`), kept between Attempts (issue 12).

Work goes to a particular thread (its own inbox), never to a shared queue; a
thread idle for `idle_s` ends; a thread that owns a live child never ends
under it (the child's parent-death signal is bound to that thread); the
threads are daemons only when the thread that starts them is one, and idle
ones never hold the interpreter's exit up.
"""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from workers.agent import procfs
from workers.agent.agent import RunnerThread, _RunnerThreads
from workers.agent.executor import ProcessSpawner
from workers.tests.polling import eventually
from workers.tests.test_agent import a_spec

ROOT = Path(__file__).resolve().parents[2]
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux")


class Started:
    """The `start` hook: records every thread the pool starts; holds back
    the start of those listed in `held` (by number) until the test starts them."""

    def __init__(self, *, held: frozenset[int] = frozenset()) -> None:
        self.threads: list[threading.Thread] = []
        self.held = held

    def __call__(self, thread: threading.Thread) -> None:
        self.threads.append(thread)
        if len(self.threads) - 1 not in self.held:
            thread.start()

    def all_ended(self) -> bool:
        for thread in self.threads:
            thread.join(30)
        return not any(thread.is_alive() for thread in self.threads)


def test_an_attempts_thread_runs_a_later_attempt_and_a_busy_one_is_handed_none():
    # Runners run on pooled threads (issue 12): an Attempt waiting for its
    # child keeps its thread (the child's parent-death signal is bound to
    # it), and a later Attempt gets an idle thread instead of a new one.
    started = Started()
    pool = _RunnerThreads(start=started)
    ran: dict[str, int] = {}
    first_runs = threading.Event()
    first_may_end = threading.Event()

    def first() -> None:
        ran["first"] = threading.get_ident()
        first_runs.set()
        assert first_may_end.wait(30)

    def recorder(name: str) -> RunnerThread:
        return RunnerThread(pool, lambda: ran.__setitem__(name, threading.get_ident()))

    busy = RunnerThread(pool, first)
    busy.start()
    assert first_runs.wait(30)
    second = recorder("second")
    second.start()
    second.join(30)
    assert not second.is_alive()
    assert ran["second"] != ran["first"]  # not queued behind the busy thread
    first_may_end.set()
    busy.join(30)
    eventually(lambda: len(pool._idle) == 2, 30, "both threads idle")
    third = recorder("third")
    third.start()
    third.join(30)
    assert ran["third"] in (ran["first"], ran["second"])  # no third thread
    assert len(started.threads) == 2
    pool.close()
    assert started.all_ended()


def test_a_new_thread_started_late_runs_its_own_work_and_every_thread_ends():
    # The race of a shared queue: a busy thread finished just after `submit`
    # started a new thread for the next work, took that work from the queue,
    # and the new thread then waited for work forever (and, once there, took
    # work promised to an idle thread, which then waited forever in turn).
    # The new thread's start is held back until the busy one has finished and
    # either ran the work (a shared queue) or idled out on its own inbox.
    started = Started(held=frozenset({1}))
    pool = _RunnerThreads(idle_s=0.01, start=started)
    runs: Counter[str] = Counter()
    first_may_end = threading.Event()

    def first() -> None:
        runs["first"] += 1
        assert first_may_end.wait(30)

    def second() -> None:
        runs["second"] += 1

    pool.submit(first)
    pool.submit(second)  # the first thread is busy: a new one, held back
    assert len(started.threads) == 2
    first_may_end.set()
    eventually(
        lambda: runs["second"] == 1 or not started.threads[0].is_alive(),
        30,
        "the first thread ran the second work or ended",
    )
    started.threads[1].start()
    assert started.all_ended()  # each after its idle time: none left waiting
    assert runs == {"first": 1, "second": 1}  # none lost, none run twice
    assert pool._idle == []


def test_work_promised_to_a_thread_as_its_idle_time_ran_out_is_run_by_it():
    # A thread whose wait timed out ends only if its inbox is still on the
    # idle list; a submit that took it off meanwhile has put the work in it.
    started = Started()
    pool = _RunnerThreads(idle_s=0.01, start=started)
    ran: list[int] = []
    for _ in range(200):
        done = threading.Event()

        def work(done: threading.Event = done) -> None:
            ran.append(threading.get_ident())
            done.set()

        pool.submit(work)
        assert done.wait(30)
    assert len(ran) == 200
    pool.close()
    assert started.all_ended()


@linux_only
def test_a_thread_that_owns_a_live_child_outlives_its_idle_time(tmp_path: Path) -> None:
    # The child's parent-death signal (SIGKILL) is bound to the thread that
    # spawned it: that thread must not end while the child runs, however
    # short its idle time (0 here: another thread of the pool ends at once).
    started = Started()
    pool = _RunnerThreads(idle_s=0, start=started)
    go = tmp_path / "go"
    wait_for_go = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.01)"
    spawned: queue.SimpleQueue[int] = queue.SimpleQueue()
    codes: list[int] = []

    def spawn_and_wait() -> None:
        process = ProcessSpawner(tmp_path)(a_spec(command=[sys.executable, "-c", wait_for_go]))
        spawned.put(process.pid)
        codes.append(process.release(grace_s=0))  # waits for the exit, reaps
        process.close()

    pool.submit(spawn_and_wait)
    pid = spawned.get(timeout=30)
    pool.submit(lambda: None)  # the first thread is busy: a second one
    assert len(started.threads) == 2
    started.threads[1].join(30)
    assert not started.threads[1].is_alive()  # its idle time ran out: it ended
    assert started.threads[0].is_alive()
    info = procfs.proc_info(pid)
    assert info is not None and info.alive
    go.touch()
    started.threads[0].join(30)
    assert codes == [0]  # exited of itself, not killed (-9) by its thread's end
    assert started.all_ended()


def test_runner_threads_are_daemons_only_when_their_starter_is_and_close_ends_idle_ones():
    # As a thread per Attempt was: started by the agent's main loop on the
    # main thread, a runner thread that owns a running child keeps the
    # interpreter alive after an exception (its child is not killed by the
    # parent-death signal of an interpreter that exited).
    started = Started()
    pool = _RunnerThreads(idle_s=3600, start=started)
    may_end = threading.Event()

    def busy() -> None:
        assert may_end.wait(30)

    pool.submit(busy)
    from_daemon = threading.Thread(target=pool.submit, args=(lambda: None,), daemon=True)
    from_daemon.start()
    from_daemon.join(30)
    assert [thread.daemon for thread in started.threads] == [False, True]
    may_end.set()
    eventually(lambda: len(pool._idle) == 2, 30, "both threads idle")
    pool.close()  # no idle time of an hour: they end now
    assert started.all_ended()
    done = threading.Event()
    pool.submit(done.set)  # a closed pool still runs work, on a thread of its own
    assert done.wait(30)
    assert started.all_ended()


def test_idle_runner_threads_do_not_hold_the_exit_up_and_a_busy_one_is_waited_for():
    # The interpreter waits for its non-daemon threads; the pool is closed
    # before it does: an idle thread (an hour's idle time) ends at once, a
    # busy one when its work returns (here: once the main thread ended).
    code = (
        "import threading\n"
        "from workers.agent.agent import _RunnerThreads\n"
        "pool = _RunnerThreads(idle_s=3600)\n"
        "ran = threading.Event()\n"
        "pool.submit(ran.set)\n"
        "assert ran.wait(30)\n"
        "def busy():\n"
        "    threading.main_thread().join()\n"
        "    print('busy work ended after the main thread', flush=True)\n"
        "pool.submit(busy)\n"
        "pool.submit(ran.set)\n"  # and then idle for an hour
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, timeout=60, check=False, capture_output=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"busy work ended after the main thread\n"
