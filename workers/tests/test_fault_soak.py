"""The fault soak in the suite (issue 10): real processes under ordinary faults.

A web server (gunicorn with qinglong/gunicorn.conf.py), `manage.py
run_dispatcher` and two reference agents (`python -m workers.agent`, each with
its own --state-dir and work directory) run about 200 short Runs and a few
long ones, while the test kills -9 an agent alone (its work runs on: the
restarted agent must end it), an agent with everything it started, the
dispatcher, and restarts the web server (SIGTERM, and once SIGKILL of the
whole node); every killed process is restarted. Then, from the executions'
own stamps, the database, the agents' logs and journals and /proc
(workers/tests/soak.py):

- every Run ends in a terminal state (bounded wait);
- no two executions of one Run overlap in time (an execution without a last
  stamp ends when a recorded SIGKILL provably ended it, else never);
- a Run whose execution no kill hit ran exactly once; a process that ran to
  its end has its Attempt `succeeded` unless a kill took the report with it
  — or a web outage over the Session timeout cost its Session, the
  documented price of such an outage, counted apart (`outage_cost`); web
  restarts here take a few seconds even on a loaded 2-core box, far below
  the 20 s Session timeout, so a terminal ACK lost to one is a violation
  (finding 3);
- no Attempt stays `starting`/`running` without a live process for longer
  than a Session timeout (sampled all along), none is open at the end, no
  journal owes anything after the agents stop, and no process is left;
- outside fault windows no eligible Run waits `queued` while an online
  Session has a free slot (finding 2), and none fails `undeliverable`.

PostgreSQL only (the processes share the test database). About 70 s on an
idle box, under two minutes on a loaded one.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from django.db import connection

from qinglong.testing import make_project, make_worker
from runs.services import run_enqueue_bulk, task_create
from workers.agent import procfs
from workers.tests.soak import (
    Cluster,
    FaultWindows,
    Kill,
    Watch,
    agent_argv,
    drain,
    free_port,
    http_ready,
    journals_settled,
    log,
    sample_for,
    stamp_task,
    undeliverable,
    verify,
)

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not procfs.procfs_available(), reason="needs Linux /proc"),
]

# Well over a web restart on a loaded 2-core box (a few seconds, see
# qinglong/gunicorn.conf.py below), so a restart costs no Session; an outage
# longer than it (less two heartbeats) may, and `verify` counts what it cost
# apart ("executions lost to outages over the Session timeout").
SESSION_TIMEOUT_S = 20
STOP_GRACE_S = 2
# docs/adr/0005: the grace must exceed the Session timeout + the stop grace.
LOST_EXECUTION_GRACE_S = 24
HEARTBEAT_S = 1
SHORT_RUNS = 200
LONG_RUNS_PER_WAVE = 2  # before each fault that kills an agent
SLOTS = 4
SETTLE_S = 8.0  # after a fault, the stranded check waits
TERMINAL_BOUND_S = 100


def server_env(port: int) -> dict[str, str]:
    db = connection.settings_dict
    host = db["HOST"] or "127.0.0.1"
    url = f"postgres://{db['USER']}@{host}:{db['PORT'] or 5432}/{db['NAME']}"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "qinglong.settings_test",
        "DATABASE_URL": url,
        "LOG_LEVEL": "WARNING",
        "QL_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_S),
        "QL_HEARTBEAT_MIN_INTERVAL_S": "0",
        "QL_SESSION_TIMEOUT_S": str(SESSION_TIMEOUT_S),
        "QL_LOST_EXECUTION_GRACE_S": str(LOST_EXECUTION_GRACE_S),
        "QL_THROTTLE_WORKER_PULL": "6000/min",
        "QL_CACHE_URL": "memory",
        # No broker: nothing here needs one (run_dispatcher, no long poll).
        "CELERY_BROKER_URL": "redis://127.0.0.1:1/0",
        "QL_WEB_BIND": f"127.0.0.1:{port}",
        # One worker process: it boots in half the time two take on a loaded
        # 2-core box (each imports the whole project), which keeps a restart
        # far below the Session timeout; the cluster soak (bench/soak.py)
        # runs two nodes of two.
        "QL_WEB_WORKERS": "1",
        "QL_WEB_THREADS": "8",
        "QL_WEB_GRACEFUL_TIMEOUT_S": "3",
        "PYTHONUNBUFFERED": "1",
    }
    if db.get("PASSWORD"):
        env["PGPASSWORD"] = str(db["PASSWORD"])
    return env


def test_fault_soak(tmp_path: Path) -> None:
    port = free_port()
    env = server_env(port)
    url = f"http://127.0.0.1:{port}"
    cluster = Cluster(tmp_path)
    cluster.add(
        "web",
        [sys.executable, "-m", "gunicorn", "-c", "qinglong/gunicorn.conf.py"],
        env,
        kind="web",
        ready=http_ready(port),
    )
    cluster.add(
        "dispatcher",
        [sys.executable, "manage.py", "run_dispatcher", "--interval", "0.2",
         "--sweep-interval", "1"],
        env,
        kind="dispatcher",
    )  # fmt: skip
    agent_dirs: dict[str, Path] = {}
    state_dirs: dict[str, Path] = {}
    for name in ("agent-a", "agent-b"):
        _, credential = make_worker(name=name, slots=SLOTS)
        credential_file = tmp_path / f"{name}.credential"
        credential_file.write_text(credential)
        agent_dirs[name] = tmp_path / name
        agent_dirs[name].mkdir()
        state_dirs[name] = tmp_path / f"{name}-state"
        cluster.add(
            name,
            agent_argv(
                url, credential_file, state_dirs[name], agent_dirs[name],
                "--slots", str(SLOTS), "--poll-interval", "0.2",
                "--stop-grace", str(STOP_GRACE_S),
            ),
            {**os.environ, "PYTHONUNBUFFERED": "1"},
            kind="agent",
            via="web",
        )  # fmt: skip

    project = make_project()
    tasks = {
        seconds: task_create(
            project=project,
            name=f"stamp-{str(seconds).replace('.', '-')}",
            definition=stamp_task(seconds, max_attempts=5),
        )
        for seconds in (0.5, 1.0, 1.5, 5)
    }
    items = [(tasks[(0.5, 1.0, 1.5)[i % 3]], 0) for i in range(SHORT_RUNS)]
    run_ids = [run.pk for run in run_enqueue_bulk(items=items)]

    def long_runs() -> None:
        # First in line (priority): running when the agent is killed.
        wave = run_enqueue_bulk(items=[(tasks[5], 10)] * LONG_RUNS_PER_WAVE)
        run_ids.extend(run.pk for run in wave)

    windows = FaultWindows(SETTLE_S)
    watch = Watch(
        unbacked_bound_s=SESSION_TIMEOUT_S + 2 * HEARTBEAT_S + 3,
        stall_bound_s=5,
        calm=windows.calm,
    )

    def restart_after(kill: Callable[[str], Kill], name: str) -> None:
        kill(name)
        cluster.restart(name)

    def web_and_agent() -> None:
        # Work ends while the web server is down: its terminal ACKs wait (the
        # outcomes are journaled) when the agent dies too.
        cluster.sigkill("web")
        time.sleep(2.5)
        cluster.kill_agent_alone("agent-b")
        cluster.restart("web")
        cluster.restart("agent-b")

    faults: list[tuple[str, Callable[[], object]]] = [
        ("kill -9 agent-a alone", lambda: restart_after(cluster.kill_agent_alone, "agent-a")),
        ("kill -9 the dispatcher", lambda: restart_after(cluster.sigkill, "dispatcher")),
        ("SIGTERM the web server", lambda: restart_after(cluster.sigterm, "web")),
        ("kill -9 agent-b and its work", lambda: restart_after(cluster.kill_agent_tree, "agent-b")),
        ("kill -9 the web server node", lambda: restart_after(cluster.sigkill, "web")),
        ("kill -9 agent-b alone", lambda: restart_after(cluster.kill_agent_alone, "agent-b")),
        ("kill -9 agent-a and its work", lambda: restart_after(cluster.kill_agent_tree, "agent-a")),
        ("kill -9 the dispatcher", lambda: restart_after(cluster.sigkill, "dispatcher")),
        ("kill -9 the web node, then agent-b alone while it is down", web_and_agent),
    ]

    started = time.monotonic()
    verdict = None
    try:
        for name in ("web", "dispatcher", "agent-a", "agent-b"):
            cluster.start(name)
        for index, (what, action) in enumerate(faults):
            if "agent" in what:
                long_runs()
            # Once, a calm stretch mid-run: the stranded check (finding 2)
            # samples while the queue is still full.
            sample_for(watch, 3 if index != 5 else SETTLE_S + 6)
            windows.inject(what, action)
        sample_for(watch, 3)
        drained = drain(run_ids, watch, timeout=TERMINAL_BOUND_S)
        log("drained; stopping the agents" if drained else "drain timed out; stopping")
        cluster.stop_all()
        verdict = verify(
            run_ids=run_ids,
            cluster=cluster,
            agent_dirs=agent_dirs,
            watch=watch,
            elapsed_s=time.monotonic() - started,
            session_timeout_s=SESSION_TIMEOUT_S,
            heartbeat_s=HEARTBEAT_S,
        )
        verdict.violations += journals_settled(state_dirs)
        verdict.violations += undeliverable(run_ids)
    finally:
        cluster.stop_all()
    print(f"fault soak:\n{verdict.text()}")
    assert not verdict.violations, f"fault soak failed (logs in {tmp_path}):\n{verdict.text()}"
    # The faults hit something: orphans were left and ended, work was killed.
    assert verdict.summary["orphans left by agent-only kills"] > 0
    assert verdict.summary["runs executed more than once"] > 0
