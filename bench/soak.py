"""Fault soak, cluster topology (issue 10): the suite's fault soak, larger.

    .venv/bin/python bench/soak.py                 # 1,000 Runs, about 4-6 minutes
    .venv/bin/python bench/soak.py --runs 300      # a smaller one

The processes of a cluster deployment (README "Running it"), with the
production settings (`qinglong.settings`, DEBUG off) as bench/e2e_bench.py
starts them:

- PostgreSQL: a throw-away database `ql_soakbench` on the server of
  BENCH_POSTGRES_URL (default postgres://postgres@127.0.0.1:5432/postgres),
  created and migrated at start, dropped at the end (also on failure, Ctrl-C
  or SIGTERM);
- two web nodes, each `gunicorn -c qinglong/gunicorn.conf.py` on a port of
  its own;
- one Celery worker and two Celery beats (duplicate beats are safe by design:
  every claim is a compare-and-set);
- Redis database 7 (broker, offer announcements, rate-limit counters; flushed
  before and after);
- two reference agents with long-poll pulls (`--long-poll`,
  `QL_PULL_WAIT_MAX_S`), each its own --state-dir and work directory:
  agent-a talks to node 1, agent-b to node 2.

Runs of `stamp_task` definitions (workers/tests/soak.py: each execution
stamps its start and end) — N short ones (0.5 to 1.5 s, `--runs`) enqueued up
front, and a wave of long ones (5 s, first in line) before each fault that
kills an agent — run while the script goes through the fault list
(`--passes` times, one fault every `--fault-every` seconds): kill -9 of an
agent alone (its work runs on: the restarted agent must end it), of an agent
with its work, of the Celery worker, of one beat (the other keeps going; the
killed one comes back later), SIGTERM and kill -9 of each web node (once
while its agent is also killed), each followed by a restart. Then it waits
until every Run is terminal (`--drain-timeout`) and checks the suite soak's
invariants (workers/tests/soak.py `verify`, the same code and text): every
Run terminal; no two executions of one Run overlap; a Run whose execution no
kill hit ran exactly once, and a process that ran to its end has its Attempt
`succeeded`; no Attempt `starting`/`running` without a live process for
longer than a Session timeout (sampled all along); outside fault windows no
eligible Run queued while an online Session has a free slot; no journal owes
anything at the end; no Run `undeliverable`. Any violation makes the exit
status 1.

Every process it starts gets its own process group and is stopped (TERM,
then KILL) when the script ends, however it ends; a lock file keeps two runs
from dropping each other's database. Progress goes to stderr, the verdict to
stdout (`--json PATH` also writes it as JSON); process logs are kept on
failure (or with --keep-logs).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# bench/ is sys.path[0] when this file runs as a script: the e2e bench's
# process and database helpers are shared, not copied.
import _measure
import e2e_bench as e2e

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from workers.tests.soak import (  # noqa: E402  (after the path)
    Cluster,
    FaultWindows,
    Verdict,
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

DB = "ql_soakbench"
# Tests use Redis databases 3 and 15, the e2e bench 11; this script owns 7.
REDIS_URL = "redis://127.0.0.1:6379/7"
AGENTS = {"agent-a": "web-1", "agent-b": "web-2"}
SHORT_S = (0.5, 1.0, 1.5)
LONG_S = 5.0
BULK = 1000  # runs.services.MAX_BULK_RUNS


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--runs", type=int, default=1000, help="short Runs (0.5-1.5 s) enqueued at start")
    add("--long-per-wave", type=int, default=2, help="long Runs (5 s) before each agent fault")
    add("--max-attempts", type=int, default=5, help="max_attempts of every Task")
    add("--passes", type=int, default=1, help="times through the fault list")
    add("--fault-every", type=float, default=10.0, help="seconds of sampling between faults")
    add("--settle", type=float, default=6.0, help="after a fault, the stranded check waits (s)")
    add("--slots", type=int, default=4, help="slots per agent")
    add("--long-poll", type=int, default=2, help="agent --long-poll and QL_PULL_WAIT_MAX_S")
    add("--heartbeat", type=int, default=4, help="QL_HEARTBEAT_INTERVAL_S")
    add("--session-timeout", type=int, default=20, help="QL_SESSION_TIMEOUT_S")
    add("--lost-grace", type=int, default=24, help="QL_LOST_EXECUTION_GRACE_S")
    add("--stop-grace", type=float, default=2.0, help="agent --stop-grace (s)")
    add("--stall-bound", type=float, default=5.0, help="stranded check: longest queued wait (s)")
    add("--web-workers", type=int, default=2, help="gunicorn worker processes per node")
    add("--web-threads", type=int, default=4, help="gunicorn threads per worker")
    add("--celery-concurrency", type=int, default=2, help="Celery worker processes")
    add("--drain-timeout", type=float, default=300.0, help="bound on the wait for terminal Runs")
    add("--log-level", default="WARNING", help="LOG_LEVEL of the servers")
    add("--keep-logs", action="store_true", help="keep the process logs (kept on failure)")
    add("--json", type=Path, help="also write the verdict here")
    args = parser.parse_args(argv)
    # docs/adr/0005: a fenced agent's work is gone before its retry may start.
    if args.lost_grace <= args.session_timeout + args.stop_grace:
        parser.error("--lost-grace must exceed --session-timeout + --stop-grace")
    if args.long_poll > args.heartbeat // 2:
        parser.error("--long-poll is capped by the agent at half of --heartbeat")
    return args


def server_env(args: argparse.Namespace, base: str) -> dict[str, str]:
    """The e2e bench's production settings, with the soak's timings."""
    env = e2e.django_env(base, DB, log_level=args.log_level)
    env.update(
        {
            "CELERY_BROKER_URL": REDIS_URL,
            "QL_NOTIFY_REDIS_URL": REDIS_URL,
            "QL_PULL_WAIT_MAX_S": str(args.long_poll),
            "QL_HEARTBEAT_INTERVAL_S": str(args.heartbeat),
            "QL_SESSION_TIMEOUT_S": str(args.session_timeout),
            "QL_LOST_EXECUTION_GRACE_S": str(args.lost_grace),
            "QL_THROTTLE_WORKER_PULL": "60000/min",
            "QL_WEB_WORKERS": str(args.web_workers),
            "QL_WEB_THREADS": str(args.web_threads),
            # A SIGTERMed node waits this long for requests in flight.
            "QL_WEB_GRACEFUL_TIMEOUT_S": "3",
        }
    )
    return env


def soak(args: argparse.Namespace, env: dict[str, str], workdir: Path) -> Verdict:
    from django.db.models import Count

    from leases.models import RunLease
    from runs.services import project_create, run_enqueue_bulk, task_create

    python = sys.executable
    cluster = Cluster(workdir)
    gunicorn = [python, "-m", "gunicorn", "-c", str(ROOT / "qinglong" / "gunicorn.conf.py")]
    urls: dict[str, str] = {}
    for node in ("web-1", "web-2"):
        port = free_port()
        urls[node] = f"http://127.0.0.1:{port}"
        node_env = {**env, "QL_WEB_BIND": f"127.0.0.1:{port}"}
        cluster.add(node, gunicorn, node_env, kind="web", ready=http_ready(port))
    celery = [python, "-m", "celery", "-A", "qinglong"]
    quiet = ["--loglevel", "WARNING"]
    cluster.add(
        "celery-worker",
        [*celery, "worker", *quiet, "--concurrency", str(args.celery_concurrency),
         "--without-gossip", "--without-mingle", "--without-heartbeat",
         "--hostname", f"soak-{os.getpid()}@%h"],
        env,
        kind="celery",
    )  # fmt: skip
    for beat in ("beat-1", "beat-2"):
        schedule = str(workdir / f"{beat}-schedule")
        cluster.add(beat, [*celery, "beat", *quiet, "--schedule", schedule], env, kind="celery")
    agent_env = {k: v for k, v in env.items() if k not in {"SECRET_KEY", "DATABASE_URL"}}
    agent_dirs: dict[str, Path] = {}
    state_dirs: dict[str, Path] = {}
    for name, node in AGENTS.items():
        credential = workdir / f"{name}.credential"
        e2e._enroll(f"soak-{name}", args.slots, credential)
        agent_dirs[name] = workdir / name
        agent_dirs[name].mkdir()
        state_dirs[name] = workdir / f"{name}-state"
        cluster.add(
            name,
            agent_argv(
                urls[node], credential, state_dirs[name], agent_dirs[name],
                "--slots", str(args.slots), "--poll-interval", "0.2",
                "--long-poll", str(args.long_poll), "--stop-grace", str(args.stop_grace),
            ),
            agent_env,
            kind="agent",
            via=node,
        )  # fmt: skip

    project = project_create(slug="soak", name="Fault soak")
    tasks = {
        seconds: task_create(
            project=project,
            name=f"stamp-{str(seconds).replace('.', '-')}",
            definition=stamp_task(seconds, max_attempts=args.max_attempts),
        )
        for seconds in (*SHORT_S, LONG_S)
    }
    items = [(tasks[SHORT_S[i % len(SHORT_S)]], 0) for i in range(args.runs)]
    run_ids: list[int] = []
    for start in range(0, len(items), BULK):
        run_ids += [run.pk for run in run_enqueue_bulk(items=items[start : start + BULK])]

    def long_wave() -> None:
        # First in line (priority): running when the agent is killed.
        if args.long_per_wave > 0:
            wave = run_enqueue_bulk(items=[(tasks[LONG_S], 10)] * args.long_per_wave)
            run_ids.extend(run.pk for run in wave)

    windows = FaultWindows(args.settle)
    watch = Watch(
        unbacked_bound_s=args.session_timeout + 2 * args.heartbeat + 3,
        stall_bound_s=args.stall_bound,
        calm=windows.calm,
    )

    def restart_after(kill: Any, name: str) -> None:
        kill(name)
        cluster.restart(name)

    def web_and_agent() -> None:
        # Work ends while node 2 is down: agent-b's terminal ACKs wait (the
        # outcomes are journaled) when the agent dies too.
        cluster.sigkill("web-2")
        time.sleep(2.5)
        cluster.kill_agent_alone("agent-b")
        cluster.restart("web-2")
        cluster.restart("agent-b")

    def beat_swap() -> None:
        # beat-1 comes back, beat-2 goes: one beat keeps dispatching throughout.
        cluster.restart("beat-1")
        cluster.sigkill("beat-2")

    faults: list[tuple[str, Any]] = [
        ("kill -9 agent-a alone", lambda: restart_after(cluster.kill_agent_alone, "agent-a")),
        ("kill -9 beat-1 (beat-2 keeps going)", lambda: cluster.sigkill("beat-1")),
        ("SIGTERM web node 1", lambda: restart_after(cluster.sigterm, "web-1")),
        ("kill -9 the Celery worker", lambda: restart_after(cluster.sigkill, "celery-worker")),
        ("kill -9 agent-b and its work", lambda: restart_after(cluster.kill_agent_tree, "agent-b")),
        ("kill -9 web node 2", lambda: restart_after(cluster.sigkill, "web-2")),
        ("restart beat-1, kill -9 beat-2 (beat-1 keeps going)", beat_swap),
        ("SIGTERM web node 2", lambda: restart_after(cluster.sigterm, "web-2")),
        ("kill -9 agent-b alone", lambda: restart_after(cluster.kill_agent_alone, "agent-b")),
        ("kill -9 web node 1", lambda: restart_after(cluster.sigkill, "web-1")),
        ("kill -9 agent-a and its work", lambda: restart_after(cluster.kill_agent_tree, "agent-a")),
        ("kill -9 the Celery worker", lambda: restart_after(cluster.sigkill, "celery-worker")),
        ("kill -9 web node 2, then agent-b alone while it is down", web_and_agent),
    ]

    started = time.monotonic()
    timings: dict[str, float] = {}
    try:
        for name in ("web-1", "web-2", "celery-worker", "beat-1", "beat-2", *AGENTS):
            cluster.start(name)
        timings["start_s"] = time.monotonic() - started
        for number in range(1, args.passes + 1):
            log(f"pass {number}/{args.passes} through {len(faults)} faults")
            for what, action in faults:
                if "agent" in what:
                    long_wave()
                sample_for(watch, args.fault_every)
                windows.inject(what, action)
            cluster.restart("beat-2")  # the pass ends with both beats up
        timings["faults_s"] = time.monotonic() - started - timings["start_s"]
        sample_for(watch, 3)
        drained = drain(run_ids, watch, timeout=args.drain_timeout)
        log("drained; stopping the cluster" if drained else "drain timed out; stopping")
        timings["total_s"] = time.monotonic() - started
        cluster.stop_all()
        verdict = verify(
            run_ids=run_ids,
            cluster=cluster,
            agent_dirs=agent_dirs,
            watch=watch,
            elapsed_s=timings["total_s"],
            session_timeout_s=args.session_timeout,
            heartbeat_s=args.heartbeat,
        )
        verdict.violations += journals_settled(state_dirs)
        verdict.violations += undeliverable(run_ids)
        # Who claimed: Celery's global cycles (new_claim) or the agents' pulls.
        verdict.summary["leases by source"] = dict(
            RunLease.objects.filter(run_id__in=run_ids)
            .values_list("source")
            .annotate(n=Count("id"))
            .order_by()
        )
    finally:
        cluster.stop_all()
    verdict.summary["timings"] = {key: round(value, 1) for key, value in timings.items()}
    return verdict


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = os.environ.get("BENCH_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    lock = (Path(tempfile.gettempdir()) / "ql-bench-soak.lock").open("w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print("another bench/soak.py is running on this machine", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="ql-bench-soak-"))
    previous = signal.signal(signal.SIGTERM, e2e._raise_interrupt)
    meta: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "load_start": e2e._load(),
        "postgres": e2e._postgres_version(base),
        "code": e2e._code_version(),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    verdict: Verdict | None = None
    try:
        _measure.admin(base, f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)", f"CREATE DATABASE {DB}")
        import redis

        redis.Redis.from_url(REDIS_URL).flushdb()
        env = server_env(args, base)
        e2e.setup_django(env)
        from django.core.management import call_command
        from django.db import connection

        log(f"migrate {DB} (logs in {workdir})")
        call_command("migrate", verbosity=0)
        connection.close()
        verdict = soak(args, env, workdir)
    except KeyboardInterrupt:
        log("interrupted: stopping processes, dropping the database")
        return 130
    finally:
        with contextlib.suppress(Exception):
            from django.db import connections

            connections.close_all()
        _measure.admin(base, f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")
        with contextlib.suppress(Exception):
            import redis

            redis.Redis.from_url(REDIS_URL).flushdb()
        for credential in workdir.glob("*.credential"):
            credential.unlink()
        failed = verdict is None or bool(verdict.violations)
        if failed or args.keep_logs:
            log(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)

    assert verdict is not None
    meta["load_end"] = e2e._load()
    print(
        f"\nFault soak, cluster topology — {meta['date']}, PostgreSQL {meta['postgres']}, "
        f"{meta['cpus']} CPUs, load {meta['load_start']} at start, {meta['load_end']} at end; "
        f"code {meta['code']}"
    )
    print(
        f"config: {args.runs} short Runs + {args.long_per_wave} long per agent fault, "
        f"{args.passes} pass(es) of faults every {args.fault_every:g}s; 2 gunicorn nodes "
        f"{args.web_workers}x{args.web_threads}, Celery worker x{args.celery_concurrency} + "
        f"2 beats, 2 agents x {args.slots} slots (--long-poll {args.long_poll}); heartbeat "
        f"{args.heartbeat}s, Session timeout {args.session_timeout}s, lost-execution grace "
        f"{args.lost_grace}s"
    )
    print(f"fault soak:\n{verdict.text()}")
    print("verdict: " + ("PASS" if not verdict.violations else f"FAIL ({len(verdict.violations)})"))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"meta": meta, "summary": verdict.summary, "violations": verdict.violations},
                indent=2,
                sort_keys=True,
                default=str,
            )
        )
    return 1 if verdict.violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
