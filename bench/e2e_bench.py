"""End-to-end throughput on PostgreSQL, beside Procrastinate in the same run.

    .venv/bin/pip install -r bench/requirements.txt   # once: the peer (bench only)
    .venv/bin/python bench/e2e_bench.py               # 1.5 to 3 minutes

On the server of BENCH_POSTGRES_URL (default postgres://postgres@127.0.0.1:5432/postgres)
it creates throw-away databases (BENCH_DB_NAME, default `ql_bench_e2e`, and
`<that name>_micro`, `<that name>_peer`; dropped at the end, also on failure
or Ctrl-C) and runs, one after the other:

e2e    the real thing: gunicorn with qinglong/gunicorn.conf.py and the
       production settings (DEBUG off), `manage.py run_dispatcher` (or Celery
       worker + beat with --celery, Redis db 11), reference agents
       (`python -m workers.agent`). N Runs of a Task whose command is `true`
       (max_attempts 1) are enqueued through `POST /api/v1/runs` one by one
       from a few client threads (enqueue Runs/s), while dispatch is paused.
       Then the agents and the dispatcher start, both Sessions come online,
       dispatch is resumed and the clock runs until every Run is terminal
       (Runs/s). Checked in the database and in the agents' logs: every Run
       `succeeded`, one Attempt, one lease, one succeeded transition and one
       spawn each.
peer   Procrastinate 3.10 in process (no REST, no spawn): N no-op jobs
       deferred, one worker (`run_worker_async(wait=False)`) at concurrency 1
       and 4, jobs/s; the ratio Qinglong e2e / Procrastinate. It runs before
       e2e and again after micro; the ratios use the mean of the two.
micro  in process, one Run at a time through the services: a session-scope
       `dispatch_cycle` (a pull claiming 1) + `lease_ack` starting, running,
       succeeded; against Procrastinate's `fetch_job` + `finish_job` of one
       job. Also the CPU time per Run of each step, of this process and
       (a local server) of its PostgreSQL backend; SQL statements per claimed
       Run (Django's CaptureQueriesContext) for that path and for a global
       `dispatch_cycle` that claims its budget of 8, and its claims/s.

Every process it starts gets its own process group and is stopped (TERM,
then KILL) when the bench ends, however it ends. Progress goes to stderr,
the figures to stdout (`--json PATH` also writes them as JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import http.client
import importlib
import io
import itertools
import json
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# bench/ is sys.path[0] when this file runs as a script.
from _measure import admin, db_url, pid_cpu, pid_start_and_cpu

ROOT = Path(__file__).resolve().parent.parent
# Every database name comes from here. BENCH_DB_NAME names the e2e database (as
# in the other bench scripts); the micro bench's and the peer's are named after
# it, so two runs with different names do not drop each other's. The child
# processes inherit the environment and so the same names.
E2E_DB = os.environ.get("BENCH_DB_NAME", "ql_bench_e2e")
MICRO_DB, PEER_DB = f"{E2E_DB}_micro", f"{E2E_DB}_peer"
# Interpolated into CREATE/DROP DATABASE: a plain identifier, and short enough
# for PostgreSQL's 63 bytes with the longest suffix ("_micro").
DB_NAME_RE = re.compile(r"[a-z_][a-z0-9_]{0,56}")
# Tests use Redis databases 3 and 12 to 15; the bench owns 11 (flushed before and after).
REDIS_URL = "redis://127.0.0.1:6379/11"
PROJECT, TASK, BULK_TASK = "bench", "noop", "noop-bulk"
TERMINAL = ("succeeded", "failed", "cancelled")
INSTALL_HINT = "the peer needs: .venv/bin/pip install -r bench/requirements.txt"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def django_env(base: str, db: str, *, log_level: str) -> dict[str, str]:
    """The production settings (qinglong.settings), DEBUG off, for one database."""
    # QL_* from the caller's environment pass through (printed with the
    # figures); the bench's own settings below win.
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJANGO_")}
    env.update(
        {
            "DJANGO_SETTINGS_MODULE": "qinglong.settings",
            "DATABASE_URL": db_url(base, db),
            "DEBUG": "0",
            "SECRET_KEY": os.environ.get("BENCH_SECRET_KEY") or secrets.token_urlsafe(50),
            "ALLOWED_HOSTS": "127.0.0.1,localhost",
            "LOG_LEVEL": log_level,
            "CELERY_BROKER_URL": REDIS_URL,
            "PYTHONUNBUFFERED": "1",
        }
    )
    # Connection reuse is a deployment knob: pass it through when given.
    if "DB_CONN_MAX_AGE" in os.environ:
        env["DB_CONN_MAX_AGE"] = os.environ["DB_CONN_MAX_AGE"]
    return env


def setup_django(env: dict[str, str]) -> None:
    # Project modules are imported inside the functions below, never at the
    # top: they import models, which need this setup (and its environment) first.
    os.environ.update(env)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import django

    django.setup()


# ------------------------------------------------------------------ processes


class Processes:
    """Every process the bench starts, each in its own process group."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        with (self.logdir / f"{name}.log").open("wb") as out:
            proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs[name] = proc
        return proc

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited early ({proc.returncode}); see {name}.log")

    def stop(self, names: list[str], *, timeout: float = 20.0) -> None:
        for name in names:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for name in names:
            proc = self.procs.pop(name, None)
            if proc is None:
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            # Whatever is left of its group (gunicorn/celery children, a spawn).
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)

    def stop_all(self) -> None:
        self.stop(list(self.procs))

    def run_child(self, name: str, args: list[str], env: dict[str, str], timeout: float) -> Any:
        """A bench child (`--child …`): its last stdout line is its JSON report."""
        with (self.logdir / f"{name}.log").open("wb") as err:
            proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--child", *args],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                start_new_session=True,
            )
            self.procs[name] = proc
            try:
                out, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{name} took longer than {timeout:.0f}s") from None
            finally:
                self.stop([name])
        if proc.returncode != 0:
            tail = (self.logdir / f"{name}.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{name} failed ({proc.returncode}):\n{tail}")
        return json.loads(out.decode().strip().splitlines()[-1])


# ----------------------------------------------------------------------- HTTP


class Api:
    """A keep-alive JSON client for one thread."""

    def __init__(self, port: int, token: str) -> None:
        self.port = port
        self.headers = {"Authorization": f"Token {token}", "Content-Type": "application/json"}
        self.conn: http.client.HTTPConnection | None = None

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body)
        for attempt in (1, 2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            try:
                self.conn.request(method, path, body=data, headers=self.headers)
                response = self.conn.getresponse()
                raw = response.read()
            except (OSError, http.client.HTTPException) as err:
                # Never reuse a connection a request failed on.
                self.conn.close()
                self.conn = None
                # A keep-alive connection the server closed while idle: retry
                # once, and only what is safe to repeat.
                idle_closed = isinstance(err, (http.client.RemoteDisconnected, BrokenPipeError))
                if attempt == 2 or method != "GET" or not idle_closed:
                    raise
                continue
            if response.getheader("Connection", "").lower() == "close":
                self.conn.close()
                self.conn = None
            return response.status, (json.loads(raw) if raw else None)
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


def _expect(status: int, body: Any, want: int, what: str) -> Any:
    if status != want:
        code = body.get("error", {}).get("code") if isinstance(body, dict) else None
        raise RuntimeError(f"{what}: HTTP {status} ({code})")
    return body


def enqueue(port: int, token: str, *, runs: int, threads: int, deadline: float) -> dict[str, Any]:
    """POST /api/v1/runs one Run per request from `threads` keep-alive clients."""
    lock = threading.Lock()
    remaining = [runs]
    ids: list[int] = []
    latencies: list[float] = []
    errors: list[str] = []

    def client() -> None:
        api = Api(port, token)
        try:
            while not errors and time.monotonic() < deadline:
                with lock:
                    if remaining[0] <= 0:
                        return
                    remaining[0] -= 1
                started = time.perf_counter()
                status, body = api.call("POST", "/api/v1/runs", {"project": PROJECT, "task": TASK})
                elapsed = time.perf_counter() - started
                if status != 201:
                    code = body.get("error", {}).get("code") if isinstance(body, dict) else None
                    errors.append(f"HTTP {status} ({code})")
                    return
                with lock:
                    ids.append(int(body["id"]))
                    latencies.append(elapsed)
        except Exception as err:
            errors.append(f"{type(err).__name__}: {err}")
        finally:
            api.close()

    workers = [threading.Thread(target=client, daemon=True) for _ in range(threads)]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(max(0.1, deadline - time.monotonic()))
    seconds = time.perf_counter() - started
    if errors or len(ids) != runs:
        raise RuntimeError(f"enqueue: {len(ids)}/{runs} accepted; {errors[:3]}")
    latencies.sort()
    return {
        "runs": runs,
        "threads": threads,
        "seconds": seconds,
        "per_s": runs / seconds,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
        "ids": ids,
    }


def enqueue_bulk(port: int, token: str, *, runs: int, per_request: int) -> dict[str, Any]:
    """POST /api/v1/runs with lists of `per_request` Runs, one client, one after another."""
    api = Api(port, token)
    latencies: list[float] = []
    ids: list[int] = []
    try:
        started = time.perf_counter()
        for offset in range(0, runs, per_request):
            batch = min(per_request, runs - offset)
            body = [{"project": PROJECT, "task": BULK_TASK}] * batch
            request_started = time.perf_counter()
            status, answer = api.call("POST", "/api/v1/runs", body)
            latencies.append(time.perf_counter() - request_started)
            results = _expect(status, answer, 201, "bulk enqueue")["results"]
            if len(results) != batch:
                raise RuntimeError(f"bulk enqueue: {len(results)} of {batch} answered")
            ids.extend(int(run["id"]) for run in results)
        seconds = time.perf_counter() - started
    finally:
        api.close()
    return {
        "runs": runs,
        "per_request": per_request,
        "seconds": seconds,
        "per_s": runs / seconds,
        "request_p50_ms": 1000 * statistics.median(latencies),
        "ids": ids,
    }


# ------------------------------------------------------------------------ e2e


def _wait(what: str, check: Any, *, timeout: float, procs: Processes) -> None:
    deadline = time.monotonic() + timeout
    while True:
        procs.check_alive()
        with contextlib.suppress(OSError, http.client.HTTPException):
            if check():
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)


def _operator_token() -> str:
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    get_user_model().objects.create_superuser(
        "bench", "bench@example.invalid", secrets.token_urlsafe(24)
    )
    out = io.StringIO()
    call_command("drf_create_token", "bench", stdout=out)
    found = re.search(r"Generated token (\S+) for user", out.getvalue())
    if found is None:
        raise RuntimeError("drf_create_token printed no token")
    return found.group(1)


def _enroll(name: str, slots: int, credential_file: Path) -> None:
    from django.core.management import call_command

    out = io.StringIO()
    call_command(
        "enroll_worker", name, "--slots", str(slots), "--executor", "process", "--json", stdout=out
    )
    credential = json.loads(out.getvalue().strip().splitlines()[-1])["credential"]
    fd = os.open(credential_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(credential)


def _group_cpu(pgid: int) -> tuple[float, float]:
    """CPU seconds of every live process in a process group (each process the
    bench starts leads its own): (their own utime + stime, their reaped
    children's). An agent's `true` children run in groups of their own and
    are counted in its second figure once reaped."""
    tick = os.sysconf("SC_CLK_TCK")
    own = children = 0
    for name in os.listdir("/proc"):  # noqa: PTH208
        if not name.isdigit():
            continue
        try:
            raw = Path(f"/proc/{name}/stat").read_bytes()
        except OSError:
            continue
        fields = raw[raw.rfind(b")") + 2 :].split()
        if int(fields[2]) != pgid:
            continue
        own += int(fields[11]) + int(fields[12])
        children += int(fields[13]) + int(fields[14])
    return own / tick, children / tick


def _cpu_by_process(procs: Processes) -> dict[str, tuple[float, float]]:
    return {name: _group_cpu(proc.pid) for name, proc in procs.procs.items()}


class BackendCpu:
    """CPU seconds the PostgreSQL backends connected to `db` use between
    `start()` and `stop()`, this process's own connection left out (the server
    runs on this box; elsewhere /proc has no such pids and the figure is 0).

    Reading each live backend's /proc/<pid>/stat before and after would miss
    every backend that exits in between (gunicorn restarting a worker, a
    connection closed after CONN_MAX_AGE, a parallel worker): its CPU leaves
    /proc with it, and PostgreSQL keeps no per-backend CPU that outlives the
    process (the postmaster's reaped-children times mix every database of the
    server). So a thread samples every `interval` seconds — the pids of `db`'s
    backends from pg_stat_activity, then each one's /proc reading — and keeps
    each backend's last reading. Its queries go through a connection of its own
    to the server's `base` database: not a backend of `db`, and no commit in
    `db`'s pg_stat_database row. A backend present at `start()` counts from its
    reading then; one that appears later counts from its start (0). A backend
    is a (pid, start time) pair, so a reused pid is another backend. Still
    missed: what a backend uses in its last `interval` before it exits, and a
    backend that starts and exits between two samples.
    """

    def __init__(self, base: str, db: str, *, own: int, interval: float = 0.1) -> None:
        self.base = base
        self.db = db
        self.own = {own}
        self.interval = interval
        self.first: dict[tuple[int, int], float] = {}
        self.last: dict[tuple[int, int], float] = {}
        self.failure: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="backend-cpu", daemon=True)
        self._conn: Any = None

    def start(self) -> None:
        import psycopg

        self._conn = psycopg.connect(self.base, autocommit=True)
        self.first = self._sample()
        self._thread.start()

    def _sample(self) -> dict[tuple[int, int], float]:
        """Each live backend's reading now, kept as its last."""
        rows = self._conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s", [self.db]
        ).fetchall()
        now: dict[tuple[int, int], float] = {}
        for (pid,) in rows:
            if pid in self.own:
                continue
            try:
                start, cpu = pid_start_and_cpu(pid)
            except OSError:  # exited since the query: its last reading stands
                continue
            now[(pid, start)] = cpu
        self.last.update(now)
        return now

    def _run(self) -> None:
        while not self._done.wait(self.interval):
            try:
                self._sample()
            except Exception as err:
                self.failure = f"{type(err).__name__}: {err}"
                return

    def stop(self, *, own: int) -> dict[str, Any]:
        """Stops sampling (`own`: this process's backend now, left out too) and
        returns the CPU seconds, the backends seen and how many exited."""
        self._done.set()
        self._thread.join()
        try:
            if self.failure is not None:
                raise RuntimeError(f"sampling the PostgreSQL backends failed: {self.failure}")
            self.own.add(own)
            alive = self._sample()
        finally:
            self._conn.close()
        counted = {key: cpu for key, cpu in self.last.items() if key[0] not in self.own}
        return {
            "seconds": sum(cpu - self.first.get(key, 0.0) for key, cpu in counted.items()),
            "seen": len(counted),
            "exited": len(counted.keys() - alive.keys()),
            "interval_s": self.interval,
        }


def _own_backend() -> int:
    """The pid of this process's PostgreSQL backend (Django's connection)."""
    from django.db import connection

    connection.ensure_connection()
    return int(connection.connection.info.backend_pid)


def _xact_commits(db: str) -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        with contextlib.suppress(Exception):
            cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = %s", [db])
        return int(cursor.fetchone()[0])


def _agent_events(logdir: Path, agents: int) -> dict[str, Any]:
    events: Counter[str] = Counter()
    run_of_offer: dict[str, str] = {}
    spawned: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    for index in range(agents):
        for line in (logdir / f"agent{index}.log").read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            name = str(event.get("event"))
            events[name] += 1
            if name == "offer_received":
                run_of_offer[str(event["offer_id"])] = str(event.get("run_id"))
            elif name == "attempt_done" and event.get("ran"):
                spawned[str(event["offer_id"])] += 1
                statuses[str(event.get("phase"))] += 1
            elif name == "pull_refused":
                statuses[f"pull_refused_{event.get('status')}"] += 1
    runs_spawned = Counter(run_of_offer.get(offer, "?") for offer in spawned.elements())
    return {"events": dict(events), "runs_spawned": runs_spawned, "outcomes": dict(statuses)}


def verify(*, runs: int, ids: list[int], agent: dict[str, Any]) -> list[str]:
    """Every Run succeeded exactly once: DB rows and the agents' own account."""
    from django.db.models import Count

    from leases.models import RunLease
    from runs.models import Attempt, AttemptEvent, Run

    problems: list[str] = []
    states = dict(Run.objects.values_list("state").annotate(n=Count("id")))
    if states != {"succeeded": runs}:
        problems.append(f"Run states {states}")
    if set(Run.objects.values_list("id", flat=True)) != set(ids):
        problems.append("the Runs in the database are not the ones the API accepted")
    attempts = dict(Attempt.objects.values_list("state").annotate(n=Count("id")))
    if attempts != {"succeeded": runs}:
        problems.append(f"Attempt states {attempts}")
    multi = Attempt.objects.values("run_id").annotate(n=Count("id")).filter(n__gt=1).count()
    if multi:
        problems.append(f"{multi} Runs with more than one Attempt")
    leases = dict(RunLease.objects.values_list("state").annotate(n=Count("id")))
    if leases != {"released": runs}:
        problems.append(f"lease states {leases}")
    multi = RunLease.objects.values("attempt_id").annotate(n=Count("id")).filter(n__gt=1).count()
    if multi:
        problems.append(f"{multi} Attempts with more than one lease")
    done = AttemptEvent.objects.filter(to_state="succeeded")
    if done.count() != runs or done.values("attempt_id").distinct().count() != runs:
        problems.append(f"{done.count()} succeeded transitions for {runs} Runs")
    spawned: Counter[str] = agent["runs_spawned"]
    if len(spawned) != runs or any(n != 1 for n in spawned.values()):
        twice = sum(1 for n in spawned.values() if n > 1)
        problems.append(f"agents spawned {len(spawned)} distinct Runs ({twice} more than once)")
    return problems


def phase_gaps() -> dict[str, dict[str, float]]:
    """Median and p90 ms between an Attempt's recorded transitions (AttemptEvent)."""
    from runs.models import AttemptEvent

    steps = ("claimed", "starting", "running", "succeeded")
    seen: dict[int, dict[str, datetime]] = {}
    rows = AttemptEvent.objects.filter(to_state__in=steps).values_list(
        "attempt_id", "to_state", "at"
    )
    for attempt_id, state, at in rows:
        seen.setdefault(attempt_id, {})[state] = at
    gaps: dict[str, dict[str, float]] = {}
    for before, after in itertools.pairwise(steps):
        ms = sorted(
            (times[after] - times[before]).total_seconds() * 1000
            for times in seen.values()
            if before in times and after in times
        )
        if ms:
            gaps[f"{before}->{after}"] = {
                "median_ms": statistics.median(ms),
                "p90_ms": ms[int(len(ms) * 0.9)],
            }
    return gaps


def e2e(args: argparse.Namespace, base: str, procs: Processes, logdir: Path) -> dict[str, Any]:
    from django.db import connection
    from django.db.models import Count

    from dispatch.cycles import dispatch_set_paused
    from dispatch.models import DispatchCycle
    from leases.models import RunLease
    from runs.models import Attempt, Run
    from workers.models import WorkerSession

    port = _free_port()
    env = django_env(base, E2E_DB, log_level=args.log_level)
    env.update(
        {
            "QL_WEB_BIND": f"127.0.0.1:{port}",
            "QL_WEB_WORKERS": str(args.web_workers),
            "QL_WEB_THREADS": str(args.web_threads),
            "QL_THROTTLE_WORKER_PULL": args.pull_throttle,
            # The Celery app and the notifier read the bench's Redis database.
            "QL_NOTIFY_REDIS_URL": REDIS_URL,
        }
    )
    if args.long_poll:
        env["QL_PULL_WAIT_MAX_S"] = str(args.long_poll)

    token = _operator_token()
    log(f"gunicorn {args.web_workers}x{args.web_threads} on 127.0.0.1:{port}")
    procs.start(
        "gunicorn",
        [sys.executable, "-m", "gunicorn", "-c", str(ROOT / "qinglong" / "gunicorn.conf.py")],
        env,
    )
    api = Api(port, token)
    _wait(
        "gunicorn",
        lambda: api.call("GET", "/api/v1/runs?limit=1")[0] == 200,
        timeout=60,
        procs=procs,
    )
    _expect(
        *api.call("POST", "/api/v1/projects", {"slug": PROJECT, "name": "Bench"}), 201, "project"
    )
    definition = {
        "name": TASK,
        "executor_type": "process",
        "command": ["true"],
        "max_attempts": 1,
        "timeout_s": 60,
    }
    _expect(*api.call("POST", f"/api/v1/projects/{PROJECT}/tasks", definition), 201, "task")
    bulk_definition = {**definition, "name": BULK_TASK}
    _expect(*api.call("POST", f"/api/v1/projects/{PROJECT}/tasks", bulk_definition), 201, "task")
    api.close()

    # Dispatch stays paused until the drain: the bulk-enqueued Runs are
    # counted, checked and deleted again before any of them could be claimed.
    dispatch_set_paused(paused=True, reason="bench start", actor="bench")
    log(f"bulk enqueue {args.bulk_runs} Runs, {args.bulk_size} per POST /api/v1/runs")
    bulk = enqueue_bulk(port, token, runs=args.bulk_runs, per_request=args.bulk_size)
    bulk_ids = bulk.pop("ids")
    stored = Run.objects.filter(pk__in=bulk_ids, task__name=BULK_TASK, state="queued").count()
    if stored != args.bulk_runs or len(set(bulk_ids)) != args.bulk_runs:
        raise RuntimeError(f"bulk enqueue: {stored} queued Runs for {args.bulk_runs} answered")
    Attempt.objects.filter(run__task__name=BULK_TASK).delete()
    Run.objects.filter(task__name=BULK_TASK).delete()
    log(f"  {bulk['per_s']:.0f} Runs/s (p50 {bulk['request_p50_ms']:.0f} ms per request)")

    log(f"enqueue {args.runs} Runs through POST /api/v1/runs ({args.enqueue_threads} threads)")
    enq = enqueue(
        port,
        token,
        runs=args.runs,
        threads=args.enqueue_threads,
        deadline=time.monotonic() + args.enqueue_timeout,
    )
    ids = enq.pop("ids")
    log(f"  {enq['per_s']:.1f} Runs/s")

    # Everything comes up idle (dispatch still paused), then dispatch is
    # resumed: the clock measures the drain, not process start-up.
    python = [sys.executable]
    if args.celery:
        celery = [*python, "-m", "celery", "-A", "qinglong"]
        quiet = ["--loglevel", "WARNING"]
        worker = [*celery, "worker", *quiet, "--concurrency", "1", "--without-gossip"]
        worker += ["--without-mingle", "--hostname", f"bench-{os.getpid()}@%h"]
        procs.start("celery-worker", worker, env)
        schedule = str(logdir / "celerybeat-schedule")
        procs.start("celery-beat", [*celery, "beat", *quiet, "--schedule", schedule], env)
    else:
        command = [*python, "manage.py", "run_dispatcher"]
        command += ["--interval", str(args.dispatcher_interval)]
        if args.long_poll:
            command += ["--notify", "redis"]
        procs.start("dispatcher", command, env)
    agent_env = {k: v for k, v in env.items() if k not in {"SECRET_KEY", "DATABASE_URL"}}
    for index in range(args.agents):
        credential = logdir / f"agent{index}.credential"
        _enroll(f"bench-agent-{index}", args.slots, credential)
        command = [*python, "-m", "workers.agent", "--url", f"http://127.0.0.1:{port}"]
        command += ["--credential-file", str(credential), "--slots", str(args.slots)]
        command += ["--poll-interval", str(args.poll_interval), "--workdir", str(logdir)]
        # One journal per agent (docs/adr/0008): a state directory takes one agent.
        command += ["--state-dir", str(logdir / f"agent{index}.state")]
        if args.long_poll:
            command += ["--long-poll", str(args.long_poll)]
        if not args.batch_acks:
            command += ["--no-batch-acks"]
        procs.start(f"agent{index}", command, agent_env)
    _wait(
        f"{args.agents} online Sessions",
        lambda: WorkerSession.objects.filter(state="online").count() == args.agents,
        timeout=60,
        procs=procs,
    )
    # Statistics as autovacuum would have them after the enqueue (this box's
    # server runs with autovacuum off): plans made in the drain's first
    # seconds would otherwise be made for empty tables.
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    connection.close()
    commits_before = _xact_commits(E2E_DB)

    log("dispatch resumed: draining")
    cpu_before = _cpu_by_process(procs)
    backends = BackendCpu(base, E2E_DB, own=_own_backend())
    backends.start()
    polls = 0
    started = time.perf_counter()
    dispatch_set_paused(paused=False, reason="", actor="bench")
    deadline = time.monotonic() + args.drain_timeout
    first_done: float | None = None
    while True:
        done = Run.objects.filter(state__in=TERMINAL).count()
        polls += 1
        if done and first_done is None:
            first_done = time.perf_counter() - started
        if done >= args.runs:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"drain: {done}/{args.runs} terminal after {args.drain_timeout}s")
        procs.check_alive()
        time.sleep(args.check_interval)
    seconds = time.perf_counter() - started
    cpu_after = _cpu_by_process(procs)
    backends_cpu = backends.stop(own=_own_backend())
    log(f"  {args.runs / seconds:.1f} Runs/s")
    # CPU ms per Run over the drain, by process kind (agents: their own threads
    # and, apart, their reaped `true` children).
    cpu_ms: dict[str, float] = {}
    for name, (own, kids) in cpu_after.items():
        own0, kids0 = cpu_before.get(name, (0.0, 0.0))
        kind = "agents" if name.startswith("agent") else name
        cpu_ms[kind] = cpu_ms.get(kind, 0.0) + 1000 * (own - own0) / args.runs
        if kind == "agents":
            cpu_ms["agents_children"] = (
                cpu_ms.get("agents_children", 0.0) + 1000 * (kids - kids0) / args.runs
            )
    # The servers' PostgreSQL backends, those that exited during the drain
    # included (BackendCpu).
    cpu_ms["postgres_backends"] = 1000 * backends_cpu.pop("seconds") / args.runs
    idle: dict[str, Any] | None = None
    if args.idle_s > 0:
        time.sleep(1.1)  # let the backends' statistics reach pg_stat_database
        # The pause toggle and this loop's own count polls are not the product's
        # (the second just slept, idle, is counted in: a few pulls).
        commits = _xact_commits(E2E_DB) - commits_before - polls - 2
        idle = idle_window(args.idle_s, logdir, procs)
    log("stopping the processes")
    agent_names = [f"agent{i}" for i in range(args.agents)]
    procs.stop(agent_names)
    procs.stop_all()
    for index in range(args.agents):
        (logdir / f"agent{index}.credential").unlink(missing_ok=True)
    if idle is None:
        time.sleep(1.1)  # let the stopped backends' statistics reach pg_stat_database
        # The pause toggle and this loop's own count polls are not the product's.
        commits = _xact_commits(E2E_DB) - commits_before - polls - 2

    agent = _agent_events(logdir, args.agents)
    problems = verify(runs=args.runs, ids=ids, agent=agent)
    sources = dict(RunLease.objects.values_list("source").annotate(n=Count("id")))
    cycles = dict(DispatchCycle.objects.values_list("scope").annotate(n=Count("id")))
    return {
        "enqueue": enq,
        "enqueue_bulk": bulk,
        "idle": idle,
        "runs": args.runs,
        "seconds": seconds,
        "per_s": args.runs / seconds,
        "first_terminal_s": first_done,
        "db_commits_per_run": commits / args.runs,
        "cpu_ms_per_run": cpu_ms,
        "postgres_backends": backends_cpu,
        "lease_sources": sources,
        "dispatch_cycles": cycles,
        "agent_events": agent["events"],
        "agent_outcomes": agent["outcomes"],
        "phase_gaps": phase_gaps(),
        "problems": problems,
    }


def idle_window(seconds: float, logdir: Path, procs: Processes) -> dict[str, Any]:
    """Everything running, nothing queued: what an idle box writes and logs."""
    from dispatch.models import DispatchCycle

    log(f"idle {seconds:.0f}s: every process up, nothing queued")
    last_row = DispatchCycle.objects.order_by("-id").values_list("id", flat=True).first() or 0
    sizes = {path: path.stat().st_size for path in logdir.glob("*.log")}
    time.sleep(seconds)
    procs.check_alive()
    rows = DispatchCycle.objects.filter(id__gt=last_row).count()
    info = cycle_lines = 0
    for path, size in sizes.items():
        with path.open("rb") as handle:
            handle.seek(size)
            for line in handle.read().decode(errors="replace").splitlines():
                if '"level":"INFO"' in line:
                    info += 1
                    cycle_lines += '"event":"dispatch_cycle' in line
    return {
        "seconds": seconds,
        "cycle_rows": rows,
        "info_lines": info,
        "cycle_info_lines": cycle_lines,
    }


# ----------------------------------------------------------------------- peer


def _peer_app(url: str) -> tuple[Any, Any]:
    procrastinate = importlib.import_module("procrastinate")
    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(conninfo=url, min_size=1, max_size=8)
    )

    async def bench_noop() -> None:
        return None

    task = app.task(name="bench_noop")(bench_noop)
    return app, task


def _peer_sql(url: str, sql: str) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        cursor = conn.execute(sql)
        return cursor.fetchall() if cursor.description else []


def _peer_reset(url: str) -> None:
    _peer_sql(url, "TRUNCATE procrastinate_jobs RESTART IDENTITY CASCADE")


def _peer_check(url: str, jobs: int) -> None:
    counts = dict(_peer_sql(url, "SELECT status, count(*) FROM procrastinate_jobs GROUP BY 1"))
    if counts != {"succeeded": jobs}:
        raise RuntimeError(f"procrastinate job statuses {counts}, expected {jobs} succeeded")


def child_peer(url: str, jobs: int, micro_jobs: int, concurrencies: list[int]) -> dict[str, Any]:
    import asyncio

    app, task = _peer_app(url)
    status = importlib.import_module("procrastinate.jobs").Status
    report: dict[str, Any] = {"jobs": jobs, "workers": {}}

    async def main() -> None:
        async with app.open_async():
            if not _peer_sql(url, "SELECT to_regclass('procrastinate_jobs')")[0][0]:
                await app.schema_manager.apply_schema_async()
            # Untimed warm-up: connections, plans, imports.
            await task.batch_defer_async(*({} for _ in range(100)))
            await app.run_worker_async(
                wait=False, install_signal_handlers=False, listen_notify=False
            )
            for concurrency in concurrencies:
                _peer_reset(url)
                await task.batch_defer_async(*({} for _ in range(jobs)))
                started = time.perf_counter()
                await app.run_worker_async(
                    concurrency=concurrency,
                    wait=False,
                    install_signal_handlers=False,
                    listen_notify=False,
                    delete_jobs="never",
                )
                seconds = time.perf_counter() - started
                _peer_check(url, jobs)
                report["workers"][str(concurrency)] = {"seconds": seconds, "per_s": jobs / seconds}
            # fetch + finish of one job at a time, through its JobManager.
            warmup = 20
            _peer_reset(url)
            await task.batch_defer_async(*({} for _ in range(micro_jobs + warmup)))
            manager = app.job_manager
            worker_id = await manager.register_worker()
            times: list[float] = []
            for index in range(micro_jobs + warmup):
                started = time.perf_counter()
                job = await manager.fetch_job(queues=None, worker_id=worker_id)
                assert job is not None
                await manager.finish_job(job, status=status.SUCCEEDED, delete_job=False)
                if index >= warmup:
                    times.append(time.perf_counter() - started)
            await manager.unregister_worker(worker_id)
            _peer_check(url, micro_jobs + warmup)
            report["micro"] = {
                "jobs": micro_jobs,
                "per_s": micro_jobs / sum(times),
                "median_ms": 1000 * statistics.median(times),
                "sql_per_job": 2,  # the fetch_job and finish_job procedures
            }

    asyncio.run(main())
    report["version"] = importlib.import_module("importlib.metadata").version("procrastinate")
    return report


def _peer_mean(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    def mean(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        return {
            **a,
            "per_s": (a["per_s"] + b["per_s"]) / 2,
            "before": a["per_s"],
            "after": b["per_s"],
            "median_ms": (a.get("median_ms", 0) + b.get("median_ms", 0)) / 2,
        }

    return {
        "version": before["version"],
        "jobs": before["jobs"],
        "workers": {c: mean(w, after["workers"][c]) for c, w in before["workers"].items()},
        "micro": mean(before["micro"], after["micro"]),
    }


# ---------------------------------------------------------------------- micro


def _backend_cpu(connection: Any) -> Any:
    """A function returning the CPU seconds this connection's PostgreSQL backend
    has used so far, or None when its process is not on this machine."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid(), inet_server_addr()")
        pid, address = cursor.fetchone()
    stat = Path(f"/proc/{pid}/stat")
    if address not in (None, "127.0.0.1", "::1") or not stat.exists():
        return None
    return functools.partial(pid_cpu, pid)


def child_micro(runs: int, global_cycles: int) -> dict[str, Any]:
    """Claim + starting + running + succeeded of one Run through the services."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from dispatch.core.ports import DispatchScope, PullCredential, SessionRef
    from dispatch.cycles import dispatch_budget, dispatch_cycle
    from leases.ack import AckItem, AckPhase, AckResult, lease_ack, lease_ack_each
    from runs.services import project_create, run_enqueue, task_create
    from workers.services import session_open, worker_enroll

    slots = dispatch_budget().max_claim_attempts
    project = project_create(slug=PROJECT, name="Bench")
    task = task_create(
        project=project,
        name=TASK,
        definition={"executor_type": "process", "command": ["true"], "max_attempts": 1},
    )
    worker, _ = worker_enroll(
        name="bench-micro", slots=slots, executor_types=["process"], labels={}
    )
    session = session_open(
        worker=worker, executor_types=["process"], labels={}, slots=slots, agent_version="bench"
    ).session
    ref = SessionRef(
        worker_id=str(worker.pk),
        session_id=str(session.session_id),
        session_generation=session.generation,
    )
    warmup = 20
    for _ in range(warmup + runs + 3 + 2 * slots * (global_cycles + 1)):
        run_enqueue(task=task)

    def claim() -> Any:
        pull = PullCredential(pull_id=str(uuid.uuid4()), token=secrets.token_urlsafe(32))
        result = dispatch_cycle(
            scope=DispatchScope.for_session(ref), pull=pull, max_offers=1, session_pk=session.pk
        )
        (offer,) = result.offers
        return offer, offer.lease.token or pull.token

    def ack(offer: Any, token: str, phase: Any) -> None:
        lease_ack(
            session=session,
            offer_id=offer.offer_id,
            phase=phase,
            lease_token=token,
            spec_sha256=offer.spec_sha256,
            executor_handle="pid:1" if phase is AckPhase.RUNNING else "",
            exit_code=0 if phase is AckPhase.SUCCEEDED else None,
        )

    phases = (AckPhase.STARTING, AckPhase.RUNNING, AckPhase.SUCCEEDED)
    backend = _backend_cpu(connection)
    times: list[float] = []
    claim_times: list[float] = []
    # CPU seconds per step over the measured Runs: this process's
    # (time.process_time) and, when the server runs on this machine, its
    # PostgreSQL backend's (/proc; None elsewhere). On a shared box these
    # move far less with the load than wall time.
    cpu: dict[str, float] = {"claim": 0.0, **{str(p): 0.0 for p in phases}}
    server: dict[str, float] | None = None if backend is None else dict.fromkeys(cpu, 0.0)

    def step(name: str, index: int, call: Any) -> Any:
        server_before = backend() if backend is not None and index >= warmup else 0.0
        cpu_before = time.process_time()
        answer = call()
        if index >= warmup:
            cpu[name] += time.process_time() - cpu_before
            if server is not None and backend is not None:
                server[name] += backend() - server_before
        return answer

    for index in range(warmup + runs):
        started = time.perf_counter()
        offer, token = step("claim", index, claim)
        claimed = time.perf_counter()
        for phase in phases:
            step(str(phase), index, functools.partial(ack, offer, token, phase))
        if index >= warmup:
            times.append(time.perf_counter() - started)
            claim_times.append(claimed - started)

    queries: dict[str, list[int]] = {"claim": [], **{str(p): [] for p in phases}}
    for _ in range(3):
        with CaptureQueriesContext(connection) as captured:
            offer, token = claim()
        queries["claim"].append(len(captured.captured_queries))
        for phase in phases:
            with CaptureQueriesContext(connection) as captured:
                ack(offer, token, phase)
            queries[str(phase)].append(len(captured.captured_queries))

    # A global cycle claims its budget for the one Session (every slot free).
    global_queries: list[float] = []
    global_times: list[float] = []
    claimed_total = 0
    for index in range(global_cycles + 1):
        with CaptureQueriesContext(connection) as captured:
            started = time.perf_counter()
            result = dispatch_cycle(scope=DispatchScope.global_())
            seconds = time.perf_counter() - started
        won = result.counts.claims_won
        if not won:
            raise RuntimeError(f"global cycle claimed nothing: {result.summary()}")
        if index:  # the first one warms up
            global_queries.append(len(captured.captured_queries) / won)
            global_times.append(seconds)
            claimed_total += won
        for offer in result.offers:
            for phase in phases:
                ack(offer, str(offer.lease.token), phase)

    # The ACKs as the reference agent sends them (docs/adr/0013): a global cycle
    # claims the Session's slots, then one request starts them all and one
    # carries each Run's `running` and `succeeded` (lease_ack_each).
    def acked_together(offers: Any) -> None:
        def items(*phases: Any) -> list[AckItem]:
            return [
                AckItem(
                    offer_id=offer.offer_id,
                    phase=phase,
                    lease_token=str(offer.lease.token),
                    spec_sha256=offer.spec_sha256,
                    executor_handle="pid:1",
                    exit_code=0,
                )
                for offer in offers
                for phase in phases
            ]

        for batch in (items(AckPhase.STARTING), items(AckPhase.RUNNING, AckPhase.SUCCEEDED)):
            answers = list(lease_ack_each(session=session, items=batch))
            if any(not isinstance(answer, AckResult) for answer in answers):
                raise RuntimeError(f"a batched ACK was refused: {answers}")

    batched_queries: list[float] = []
    batched_times: list[float] = []
    batched_total = 0
    for index in range(global_cycles + 1):
        started = time.perf_counter()
        result = dispatch_cycle(scope=DispatchScope.global_())
        with CaptureQueriesContext(connection) as captured:
            acked_together(result.offers)
        seconds = time.perf_counter() - started
        if index:
            batched_queries.append(len(captured.captured_queries) / len(result.offers))
            batched_times.append(seconds)
            batched_total += len(result.offers)

    per_phase = {name: int(statistics.median(counts)) for name, counts in queries.items()}
    return {
        "cpu_ms": {name: 1000 * seconds / runs for name, seconds in cpu.items()},
        "server_cpu_ms": None
        if server is None
        else {name: 1000 * seconds / runs for name, seconds in server.items()},
        "runs": runs,
        "per_s": runs / sum(times),
        "median_ms": 1000 * statistics.median(times),
        "claim_median_ms": 1000 * statistics.median(claim_times),
        "sql": per_phase,
        "sql_lifecycle": sum(per_phase.values()),
        "global_sql_per_claim": statistics.median(global_queries),
        "global_claims_per_s": claimed_total / sum(global_times),
        "global_claims_per_cycle": claimed_total / global_cycles,
        "batched_ack_sql_per_run": statistics.median(batched_queries),
        "batched_per_s": batched_total / sum(batched_times),
    }


# ----------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--runs", type=int, default=600, help="Runs enqueued and drained end to end")
    add("--agents", type=int, default=2, help="reference agents (one Worker each)")
    add("--slots", type=int, default=8, help="slots per agent")
    add("--poll-interval", type=float, default=0.05, help="agent --poll-interval (s)")
    add("--long-poll", type=int, default=0, help="agent --long-poll and QL_PULL_WAIT_MAX_S")
    add(
        "--no-batch-acks",
        dest="batch_acks",
        action="store_false",
        help="agents send one ACK per request (--no-batch-acks), as before #12's POST acks",
    )
    add("--web-workers", type=int, default=2, help="gunicorn worker processes")
    add("--web-threads", type=int, default=8, help="gunicorn threads per worker")
    add("--celery", action="store_true", help="Celery worker + beat instead of run_dispatcher")
    add("--dispatcher-interval", type=float, default=1.0, help="run_dispatcher --interval (s)")
    add("--pull-throttle", default="60000/min", help="QL_THROTTLE_WORKER_PULL (per Session)")
    add("--enqueue-threads", type=int, default=4, help="client threads enqueueing")
    add("--bulk-runs", type=int, default=5000, help="Runs enqueued with lists (then deleted)")
    add("--bulk-size", type=int, default=1000, help="Runs per bulk POST /api/v1/runs")
    add("--idle-s", type=float, default=30.0, help="after the drain, idle this long (0: skip)")
    add("--log-level", default=os.environ.get("LOG_LEVEL", "INFO"), help="LOG_LEVEL of servers")
    add("--enqueue-timeout", type=float, default=90.0, help="bound on the enqueue (s)")
    add("--drain-timeout", type=float, default=150.0, help="bound on the drain (s)")
    add("--check-interval", type=float, default=0.05, help="seconds between progress counts")
    add("--peer-jobs", type=int, default=2000, help="Procrastinate jobs per worker run")
    add("--micro-runs", type=int, default=300, help="Runs (and peer jobs) in the micro bench")
    add("--global-cycles", type=int, default=10, help="global cycles in the micro bench")
    add("--skip-e2e", action="store_true")
    add("--skip-peer", action="store_true")
    add("--skip-micro", action="store_true")
    add("--keep-logs", action="store_true", help="keep the process logs (kept on failure)")
    add("--json", type=Path, help="also write the figures here")
    add("--child", nargs="+", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _caller_env() -> str:
    """QL_* settings the caller exported (they change what is measured)."""
    secret = re.compile("SECRET|TOKEN|KEY|PASSWORD|URL")
    return " ".join(
        f"{k}={'<set>' if secret.search(k) else v}"
        for k, v in sorted(os.environ.items())
        if k.startswith("QL_")
    )


def _load() -> str:
    """Load average, and the share of time tasks waited for a CPU (Linux PSI)."""
    text = " ".join(f"{x:.2f}" for x in os.getloadavg())
    with contextlib.suppress(OSError, ValueError, IndexError):
        some = Path("/proc/pressure/cpu").read_text().split("\n")[0]
        text += f" (cpu pressure avg60 {some.split('avg60=')[1].split()[0]}%)"
    return text


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    out = print
    meta = results["meta"]
    out(
        f"\nQinglong end to end beside Procrastinate — {meta['date']}, PostgreSQL "
        f"{meta['postgres']}, {meta['cpus']} CPUs, load {meta['load_start']} at start, "
        f"{meta['load_end']} at end; code {meta['code']}"
    )
    e2e_result = results.get("e2e")
    peer = results.get("peer")
    micro = results.get("micro")

    def both(before: float, after: float) -> str:
        # The peer ran before and after the Qinglong parts: drift shows here.
        return f"{(before + after) / 2:.0f} (before {before:.0f}, after {after:.0f})"

    if e2e_result:
        enq = e2e_result["enqueue"]
        dispatcher = (
            "Celery worker + beat"
            if args.celery
            else f"run_dispatcher --interval {args.dispatcher_interval}"
        )
        out(
            f"config: {args.runs} Runs of `true`, {args.agents} agents x {args.slots} slots "
            f"(--poll-interval {args.poll_interval}"
            + (f", --long-poll {args.long_poll}" if args.long_poll else "")
            + ("" if args.batch_acks else ", --no-batch-acks")
            + f"), gunicorn {args.web_workers}x{args.web_threads}, {dispatcher}, "
            f"pull throttle {args.pull_throttle}, "
            f"DB_CONN_MAX_AGE={os.environ.get('DB_CONN_MAX_AGE', '60 (default)')}, "
            f"LOG_LEVEL={args.log_level}"
            + (f"; from the environment: {_caller_env()}" if _caller_env() else "")
        )
        out(
            f"\n  enqueue  POST /api/v1/runs, one Run per request, {enq['threads']} threads: "
            f"{enq['runs']} in {enq['seconds']:.1f}s = {enq['per_s']:.1f} Runs/s "
            f"(p50 {enq['p50_ms']:.0f} ms, p99 {enq['p99_ms']:.0f} ms)   goal: single >= 300/s"
        )
        bulk = e2e_result.get("enqueue_bulk")
        if bulk:
            out(
                f"           a list of {bulk['per_request']} Runs per request, 1 thread: "
                f"{bulk['runs']} in {bulk['seconds']:.1f}s = {bulk['per_s']:.0f} Runs/s "
                f"(p50 {bulk['request_p50_ms']:.0f} ms per request)   goal: bulk >= 2000/s"
            )
        out(
            f"  e2e      queued -> succeeded through REST: {e2e_result['runs']} in "
            f"{e2e_result['seconds']:.1f}s = {e2e_result['per_s']:.1f} Runs/s "
            f"(first terminal after {_fmt(e2e_result['first_terminal_s'], '.2f')}s)   "
            "goal >= 150 Runs/s"
        )
        verdict = (
            "every Run succeeded exactly once (1 Attempt, 1 lease, 1 succeeded "
            "transition, 1 spawn each)"
            if not e2e_result["problems"]
            else "PROBLEMS: " + "; ".join(e2e_result["problems"])
        )
        out(f"           verified: {verdict}")
        gaps = ", ".join(
            f"{step} {g['median_ms']:.0f} ms (p90 {g['p90_ms']:.0f})"
            for step, g in e2e_result["phase_gaps"].items()
        )
        out(f"           per Run, median between recorded transitions: {gaps}")
        cpu_ms = e2e_result.get("cpu_ms_per_run")
        if cpu_ms:
            out(
                "           CPU ms per Run over the drain: "
                + ", ".join(f"{kind} {ms:.2f}" for kind, ms in sorted(cpu_ms.items()))
            )
        backends = e2e_result.get("postgres_backends")
        if backends:
            out(
                f"           PostgreSQL backends of {E2E_DB} over the drain: {backends['seen']} "
                f"({backends['exited']} exited during it, counted to their last sample; "
                f"sampled every {backends['interval_s']}s)"
            )
        idle = e2e_result.get("idle")
        if idle:
            out(
                f"  idle     {idle['seconds']:.0f}s with every process up and nothing queued "
                f"(agents polling every {args.poll_interval}s): {idle['cycle_rows']} DispatchCycle "
                f"rows, {idle['info_lines']} INFO lines ({idle['cycle_info_lines']} about cycles)"
            )
        out(
            f"           DB commits per Run (all processes): "
            f"{e2e_result['db_commits_per_run']:.1f}; leases by source "
            f"{e2e_result['lease_sources']}; DispatchCycle rows {e2e_result['dispatch_cycles']}; "
            f"agent pulls refused {e2e_result['agent_events'].get('pull_refused', 0)}"
        )
    if peer:
        rates = "; ".join(
            f"concurrency {c}: {both(w['before'], w['after'])} jobs/s"
            for c, w in peer["workers"].items()
        )
        out(
            f"\n  peer     Procrastinate {peer['version']} in process (no REST, no spawn), "
            f"{peer['jobs']} no-op jobs: {rates}"
        )
        if e2e_result:
            ratios = ", ".join(
                f"{e2e_result['per_s'] / w['per_s']:.3f} (vs concurrency {c})"
                for c, w in peer["workers"].items()
            )
            out(f"  ratio    Qinglong e2e / Procrastinate: {ratios}   goal >= 0.35")
    if micro:
        sql = micro["sql"]
        out(
            f"\n  micro    Qinglong claim + starting + running + succeeded, one Run at a time "
            f"(services, in process): {micro['per_s']:.0f} Runs/s "
            f"(median {micro['median_ms']:.2f} ms, "
            f"of which claim {micro['claim_median_ms']:.2f} ms)"
        )
        if peer:
            pm = peer["micro"]
            out(
                f"           Procrastinate fetch_job + finish_job, one job at a time: "
                f"{both(pm['before'], pm['after'])} jobs/s (median {pm['median_ms']:.2f} ms)"
            )
            out(
                f"  ratio    Qinglong / Procrastinate: "
                f"{micro['per_s'] / pm['per_s']:.3f}   goal >= 1.0"
            )
        cpu = micro.get("cpu_ms")
        if cpu:
            server = micro.get("server_cpu_ms")

            def per_step(values: dict[str, float]) -> str:
                steps = " + ".join(f"{name} {ms:.2f}" for name, ms in values.items())
                return f"{steps} = {sum(values.values()):.2f} ms"

            out(f"  CPU      per Run, this process: {per_step(cpu)}")
            if server:
                out(f"           per Run, its PostgreSQL backend: {per_step(server)}")
        out(
            f"  SQL      per Run, session pull (claim 1) {sql['claim']} + starting "
            f"{sql['starting']} + running {sql['running']} + succeeded {sql['succeeded']} "
            f"= {micro['sql_lifecycle']}"
            + (f" (Procrastinate: {peer['micro']['sql_per_job']})" if peer else "")
        )
        out(
            f"           per claimed Run in a global dispatch_cycle: "
            f"{micro['global_sql_per_claim']:.1f} "
            f"({micro['global_claims_per_cycle']:.0f} claims per cycle)   goal <= 5"
        )
        if "batched_ack_sql_per_run" in micro:
            out(
                f"  batched  global cycle claiming 8, then their ACKs as the agent sends them "
                f"(one request of 8 starting, one of 8 running + succeeded): "
                f"{micro['batched_per_s']:.0f} Runs/s; SQL per Run for the ACKs: "
                f"{micro['batched_ack_sql_per_run']:.1f}"
            )
        out(
            f"  global   dispatch_cycle claims/s, 1 process, one Session with 8 free slots: "
            f"{micro['global_claims_per_s']:.0f}/s   (the >= 600/s goal is "
            "bench/dispatch_bench.py (c): 64 Sessions, 100k backlog)"
        )


def _code_version() -> str:
    """The commit measured, and whether the working tree differed from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return f"{head or 'unknown'}{' + uncommitted changes' if dirty else ''}"


def _postgres_version(base: str) -> str:
    import psycopg

    with psycopg.connect(base, autocommit=True) as conn:
        row = conn.execute("SHOW server_version").fetchone()
        return str(row[0]).split()[0] if row else "?"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = os.environ.get("BENCH_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/postgres")

    if args.child:
        kind, rest = args.child[0], args.child[1:]
        if kind == "peer":
            result = child_peer(
                rest[0], int(rest[1]), int(rest[2]), [int(c) for c in rest[3].split(",")]
            )
        else:
            setup_django(django_env(base, MICRO_DB, log_level="WARNING"))
            result = child_micro(int(rest[0]), int(rest[1]))
        print(json.dumps(result))
        return 0

    if not args.skip_peer:
        try:
            importlib.import_module("procrastinate")
        except ImportError:
            print(
                f"procrastinate is not installed; {INSTALL_HINT} (or --skip-peer)", file=sys.stderr
            )
            return 2

    if not DB_NAME_RE.fullmatch(E2E_DB):
        print(
            f"BENCH_DB_NAME={E2E_DB!r}: lower-case letters, digits and _, 57 at most",
            file=sys.stderr,
        )
        return 2
    # Two runs with the same database names would drop each other's (the lock
    # is named after the database: ql-bench-e2e.lock by default, as before
    # BENCH_DB_NAME); two using Redis (--celery, --long-poll) would flush each
    # other's database 11.
    locks = [f"{E2E_DB.replace('_', '-')}.lock"]
    if args.celery or args.long_poll > 0:
        locks.append("ql-bench-e2e-redis.lock")
    held = []
    for name in locks:
        lock = (Path(tempfile.gettempdir()) / name).open("w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"another bench/e2e_bench.py holds {lock.name}", file=sys.stderr)
            return 2
        held.append(lock)
    logdir = Path(tempfile.mkdtemp(prefix="ql-bench-e2e-"))
    procs = Processes(logdir)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    results: dict[str, Any] = {
        "meta": {
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_start": _load(),
            "postgres": _postgres_version(base),
            "code": _code_version(),
            "args": {k: str(v) for k, v in vars(args).items() if k != "child"},
        }
    }
    failed = True
    dbs = (E2E_DB, MICRO_DB, PEER_DB)
    uses_redis = args.celery or args.long_poll > 0
    try:
        admin(base, *(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)" for db in dbs))
        admin(base, f"CREATE DATABASE {E2E_DB}", f"CREATE DATABASE {PEER_DB}")
        if uses_redis:
            import redis

            redis.Redis.from_url(REDIS_URL).flushdb()
        setup_django(django_env(base, E2E_DB, log_level="WARNING"))
        from django.core.management import call_command
        from django.db import connection

        log(f"migrate {E2E_DB} (logs in {logdir})")
        call_command("migrate", verbosity=0)
        connection.close()
        # The micro bench starts from the same freshly migrated schema.
        admin(base, f"CREATE DATABASE {MICRO_DB} TEMPLATE {E2E_DB}")

        def peer(when: str) -> dict[str, Any]:
            log(f"Procrastinate ({when}): {args.peer_jobs} jobs at concurrency 1 and 4, micro")
            argv = ["peer", db_url(base, PEER_DB), str(args.peer_jobs), str(args.micro_runs)]
            return procs.run_child(f"peer-{when}", [*argv, "1,4"], os.environ.copy(), 300)

        # The peer runs before and after the Qinglong parts; the ratios use
        # the mean of the two, so load that changes during the run hits both.
        before = None if args.skip_peer else peer("before")
        if not args.skip_e2e:
            results["e2e"] = e2e(args, base, procs, logdir)
            connection.close()
        if not args.skip_micro:
            log(f"micro: {args.micro_runs} Runs through the services")
            results["micro"] = procs.run_child(
                "micro",
                ["micro", str(args.micro_runs), str(args.global_cycles)],
                os.environ.copy(),
                timeout=300,
            )
        if before is not None:
            results["peer"] = _peer_mean(before, peer("after"))
        failed = bool(results.get("e2e", {}).get("problems"))
    except KeyboardInterrupt:
        log("interrupted: stopping processes, dropping databases")
        return 130
    finally:
        procs.stop_all()
        with contextlib.suppress(Exception):
            from django.db import connections

            connections.close_all()
        admin(base, *(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)" for db in dbs))
        if uses_redis:
            with contextlib.suppress(Exception):
                import redis

                redis.Redis.from_url(REDIS_URL).flushdb()
        for credential in logdir.glob("*.credential"):
            credential.unlink()
        if failed or args.keep_logs:
            log(f"logs kept in {logdir}")
        else:
            shutil.rmtree(logdir, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)

    results["meta"]["load_end"] = _load()
    report(results, args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, sort_keys=True, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
