"""CPU cost of one Worker API request, in process or under gunicorn, on PostgreSQL (issue #12).

    .venv/bin/python bench/request_cost.py                   # about a minute
    .venv/bin/python bench/request_cost.py --profile 400     # + where the CPU goes
    .venv/bin/python bench/request_cost.py --server gunicorn # over HTTP to gunicorn

End to end through REST, every process of the box shares two cores: what
bounds Runs/s is the CPU each Run costs, summed over processes. This script
measures the web tier's share request by request: every request goes through
the WSGI application exactly as gunicorn calls it (middleware, DRF,
authentication, throttles, the use case, rendering), with the production
settings (`qinglong.settings`, DEBUG off), persistent database connections
(`DB_CONN_MAX_AGE` 60 with health checks) and the throttle counters in Redis
(database 9, flushed before and after; `--cache memory` for per-process
counters) — only the socket and gunicorn's HTTP parsing are left out.

It creates `ql_bench_reqcost` (`BENCH_DB_NAME`) on the server of
BENCH_POSTGRES_URL (default postgres://postgres@127.0.0.1:5432/postgres),
migrates it and drops it at the end. One Worker with 8 slots and one Session;
Runs of a Task whose command is `true`. The requests, in rounds, as the
reference agent sends them (docs/adr/0013):

- `pull, nothing queued` — `POST pull` with every slot free and no Run
  queued: a whole session-scope cycle that finds nothing (an idle agent's
  poll);
- `pull, claiming 8` — `POST pull` with `max_offers` 8 and 8 Runs queued;
- `acks, 8 starting` / `8 running` / `8 succeeded` — `POST acks` of those 8
  leases, one phase per request;
- `pull, no free slot` — `POST pull` with every slot taken by a started
  lease (after the `starting` ACKs);
- `heartbeat` — `POST heartbeat` with the held offers listed, every one
  recorded (`QL_HEARTBEAT_MIN_INTERVAL_S=0`).

Printed per kind: CPU ms per request (this process's user + system time),
wall ms, CPU ms per Run (a claiming pull and each ACK request serve 8 Runs),
the CPU of the connection's PostgreSQL backend per request (from /proc, in
clock ticks summed over the rounds: the server must run on this box), and
SQL statements per request (counted in one extra round, as Django's
`CaptureQueriesContext` sees them). The
reference agent spends on one Run a share of a pull and about two thirds of
an ACK request (`running` and the outcome travel together for short jobs);
the `per Run` line adds a claiming pull and the three ACK requests of 8
Runs, divided by 8.

`--server gunicorn` sends the same requests over HTTP (one keep-alive
connection, as an agent's) to gunicorn started with qinglong/gunicorn.conf.py
and one worker process: what the web tier really pays per request, socket,
HTTP parsing and gunicorn's threads included. The CPU is then the worker
process's (from /proc, clock ticks, so means over the rounds only, no
medians) and the PostgreSQL figure the sum over the backends of the bench
database but this process's own.

`--profile N` then runs N more rounds under cProfile and prints, per kind,
where the time goes by package (own time of the functions of each: the
lease and dispatch code, the ORM, psycopg, DRF, Django's middleware, JSON,
logging, the throttle cache) and the top functions by own time.
Wall-clock figures move with the box's load; CPU ms much less.
"""

from __future__ import annotations

import argparse
import functools
import http.client
import json
import os
import pstats
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

# bench/ is sys.path[0] when this file runs as a script.
from _measure import (
    ROOT,
    Measure,
    Round,
    Samples,
    Wsgi,
    admin,
    db_url,
    django_setup,
    log,
    pid_cpu,
    profile_rounds,
    warm_then_measure,
    where,
)

BENCH_DB = os.environ.get("BENCH_DB_NAME", "ql_bench_reqcost")
REDIS_URL = "redis://127.0.0.1:6379/9"
SLOTS = 8
WORKER_API = "/api/v1/worker"


def _env(base: str, cache: str, log_level: str) -> dict[str, str]:
    return {
        "DJANGO_SETTINGS_MODULE": "qinglong.settings",
        "DATABASE_URL": db_url(base, BENCH_DB),
        "DEBUG": "0",
        "SECRET_KEY": secrets.token_urlsafe(50),
        "ALLOWED_HOSTS": "127.0.0.1,localhost",
        "LOG_LEVEL": log_level,
        "QL_CACHE_URL": REDIS_URL if cache == "redis" else "memory",
        # As the e2e bench: the product's 600/min would throttle this loop.
        "QL_THROTTLE_WORKER_PULL": "60000/min",
        "QL_THROTTLE_WORKER_HEARTBEAT": "60000/min",
        # Every heartbeat recorded: the agent beats every 10 s, past the minimum.
        "QL_HEARTBEAT_MIN_INTERVAL_S": "0",
    }


class Transport(Protocol):
    def post(self, path: str, body: Any, headers: Mapping[str, str]) -> tuple[int, Any]: ...


class Http:
    """POSTs over one keep-alive HTTP connection, as the reference agent does."""

    def __init__(self, port: int) -> None:
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def post(self, path: str, body: Any, headers: Mapping[str, str]) -> tuple[int, Any]:
        raw = json.dumps(body).encode()
        # WSGI `HTTP_FOO_BAR` keys back to header names.
        sent = {key[5:].replace("_", "-").title(): value for key, value in headers.items()}
        sent |= {"Content-Type": "application/json", "Accept": "application/json"}
        self.connection.request("POST", path, body=raw, headers=sent)
        answer = self.connection.getresponse()
        payload = answer.read()
        return answer.status, json.loads(payload) if payload else None


class Gunicorn:
    """gunicorn with qinglong/gunicorn.conf.py, one worker process, in its own
    process group (stopped with it, however the bench ends)."""

    def __init__(self) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        env = {**os.environ, "QL_WEB_BIND": f"127.0.0.1:{self.port}", "QL_WEB_WORKERS": "1"}
        config = str(ROOT / "qinglong" / "gunicorn.conf.py")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "-c", config],
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while not self._worker_pids():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("gunicorn did not start")
            time.sleep(0.1)
        self.worker = self._worker_pids()[0]

    def _worker_pids(self) -> list[int]:
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        try:
            return [int(pid) for pid in children.read_text().split()]
        except OSError:
            return []

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _backends_cpu(own: int) -> dict[int, float]:
    """CPU seconds so far of each backend of the bench database but `own`."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> %s", [BENCH_DB, own]
        )
        pids = [int(pid) for (pid,) in cursor.fetchall()]
    found = {}
    for pid in pids:
        try:
            found[pid] = pid_cpu(pid)
        except OSError:  # pragma: no cover - a backend that just ended
            continue
    return found


def measure_server_rounds(each_round: Round, rounds: int, server: Gunicorn) -> Samples:
    """As `_measure.measure_rounds`, but the CPU is the gunicorn worker's and the
    PostgreSQL backends': each backend's growth over the call, a new one's from
    zero (a backend that ends inside a call, its connection past
    DB_CONN_MAX_AGE, loses that call's share)."""
    from django.db import connection

    connection.ensure_connection()
    own = connection.connection.info.backend_pid
    samples: Samples = defaultdict(lambda: {"cpu": [], "wall": [], "pg": []})

    def measure(kind: str, call: Callable[[], None]) -> None:
        pg = _backends_cpu(own)
        cpu, wall = pid_cpu(server.worker), time.perf_counter()
        call()
        samples[kind]["wall"].append(time.perf_counter() - wall)
        samples[kind]["cpu"].append(pid_cpu(server.worker) - cpu)
        after = _backends_cpu(own)
        samples[kind]["pg"].append(sum(used - pg.get(pid, 0.0) for pid, used in after.items()))

    for _ in range(rounds):
        each_round(measure)
    return samples


class Bench:
    """One Session of 8 slots and the requests of its agent."""

    def __init__(self, transport: Transport | None = None) -> None:
        from runs.services import project_create, task_create
        from workers.services import session_open, worker_enroll

        project = project_create(slug="reqcost", name="Request cost")
        self.task = task_create(
            project=project,
            name="true",
            definition={"executor_type": "process", "command": ["true"], "max_attempts": 1},
        )
        worker, _ = worker_enroll(
            name="reqcost", slots=SLOTS, executor_types=["process"], labels={}
        )
        self.token = session_open(
            worker=worker,
            executor_types=["process"],
            labels={},
            slots=SLOTS,
            agent_version="bench",
        ).token
        self.transport = transport or Wsgi()
        self.headers = {
            "HTTP_AUTHORIZATION": f"Bearer {self.token}",
            "HTTP_USER_AGENT": "qinglong-agent/bench",
        }
        self.offers: list[dict[str, Any]] = []
        self.lease_token = ""

    def enqueue(self, count: int) -> None:
        from runs.services import run_enqueue

        for _ in range(count):
            run_enqueue(task=self.task)

    def _post(self, path: str, body: Any, *, expect: int = 200) -> Any:
        code, answer = self.transport.post(f"{WORKER_API}/{path}", body, self.headers)
        if code != expect:
            raise RuntimeError(f"{path}: {code} {answer}")
        return answer

    def pull(self, *, want: int) -> None:
        lease_token = secrets.token_urlsafe(32)
        answer = self._post(
            "pull",
            {"pull_id": str(uuid.uuid4()), "lease_token": lease_token, "max_offers": SLOTS},
        )
        offers: list[dict[str, Any]] = answer["offers"]
        if len(offers) != want:
            raise RuntimeError(f"pull: {len(offers)} offers, wanted {want}: {answer['reason']}")
        if want:
            self.offers, self.lease_token = offers, lease_token

    def acks(self, phase: str) -> None:
        extras: dict[str, dict[str, Any]] = {
            "starting": {},
            "running": {"executor_handle": "pid:4242"},
            "succeeded": {"exit_code": 0, "output_tail": ""},
        }
        extra = extras[phase]
        items = [
            {
                "offer_id": offer["offer_id"],
                "phase": phase,
                "lease_token": offer.get("lease_token") or self.lease_token,
                "spec_sha256": offer["spec_sha256"],
                **extra,
            }
            for offer in self.offers
        ]
        results = self._post("acks", {"acks": items})["results"]
        bad = [r for r in results if r["status"] != 200]
        if bad:
            raise RuntimeError(f"acks {phase}: {bad[:2]}")

    def heartbeat(self) -> None:
        held = [offer["offer_id"] for offer in self.offers]
        self._post("heartbeat", {"draining": False, "held": held})


KINDS = (
    "pull, nothing queued",
    "pull, no free slot",
    "pull, claiming 8",
    "acks, 8 starting",
    "acks, 8 running",
    "heartbeat",
    "acks, 8 succeeded",
)
RUNS_SERVED = {"pull, claiming 8": SLOTS, **{k: SLOTS for k in KINDS if k.startswith("acks")}}


def one_round(bench: Bench, measure: Measure) -> None:
    """The requests of 8 Runs, in the agent's order, each through `measure`."""
    measure("pull, nothing queued", lambda: bench.pull(want=0))
    bench.enqueue(SLOTS)  # not measured
    measure("pull, claiming 8", lambda: bench.pull(want=SLOTS))
    measure("acks, 8 starting", lambda: bench.acks("starting"))
    measure("pull, no free slot", lambda: bench.pull(want=0))
    measure("acks, 8 running", lambda: bench.acks("running"))
    measure("heartbeat", bench.heartbeat)
    measure("acks, 8 succeeded", lambda: bench.acks("succeeded"))


def count_queries(bench: Bench) -> dict[str, int]:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    counts: dict[str, int] = {}

    def measure(kind: str, call: Callable[[], None]) -> None:
        with CaptureQueriesContext(connection) as captured:
            call()
        counts[kind] = len(captured.captured_queries)
        if os.environ.get("BENCH_SHOW_SQL"):
            for query in captured.captured_queries:
                log(f"  [{kind}] {str(query['sql'])[:160]}")

    one_round(bench, measure)
    return counts


# Own time by where the code lives (first match wins).
CATEGORIES = (
    ("lease and dispatch code", ("/leases/", "/dispatch/")),
    ("psycopg and the socket", ("psycopg", "socket", "{method 'recv", "{method 'send")),
    ("Django ORM and db backend", ("django/db/",)),
    ("throttle cache (redis client)", ("redis/", "django/core/cache")),
    ("DRF", ("rest_framework/",)),
    (
        "Django request, middleware, urls",
        (
            "django/core/handlers",
            "django/middleware",
            "django/contrib",
            "django/http",
            "django/urls",
            "django/utils",
            "django/dispatch",
            "django/conf",
            "django/core/signals",
            "django/core/validators",
        ),
    ),
    ("JSON", ("json/", "{built-in method _json", "orjson")),
    ("logging", ("logging/",)),
    ("Worker API and qinglong (ours)", ("/workers/", "/qinglong/", "/runs/", "/notifications/")),
)


def _category(filename: str, name: str) -> str:
    key = f"{filename} {name}"
    for label, needles in CATEGORIES:
        if any(needle in key for needle in needles):
            return label
    return "other (stdlib, builtins)"


# Inclusive CPU of the request's stages (a function's cumulative time; nested
# stages overlap: the middleware chain holds the view).
STAGES = (
    ("WSGI handler, whole request", "django/core/handlers/wsgi.py", "__call__"),
    ("DRF dispatch (view, auth, throttles, render)", "rest_framework/views.py", "dispatch"),
    ("DRF initial (auth, permissions, throttles)", "rest_framework/views.py", "initial"),
    ("authentication", "rest_framework/request.py", "_authenticate"),
    ("throttles", "rest_framework/views.py", "check_throttles"),
    ("body parsing", "rest_framework/request.py", "_parse"),
    ("view handler (validation + use case)", "workers/api/views.py", "post"),
    ("request body validation (serializers)", "qinglong/api_common.py", "validated"),
    ("ACK items validation", "workers/api/views.py", "_ack_items"),
    ("use case: lease_ack_each", "leases/ack.py", "lease_ack_each"),
    ("use case: worker_pull", "workers/api/pull.py", "worker_pull"),
    ("use case: dispatch_cycle", "dispatch/cycles.py", "dispatch_cycle"),
    ("use case: session_heartbeat", "workers/services.py", "session_heartbeat"),
    ("response rendering", "rest_framework/response.py", "rendered_content"),
    ("DRF finalize_response", "rest_framework/views.py", "finalize_response"),
    ("request_started/finished signals", "django/dispatch/dispatcher.py", "send"),
    ("logging calls", "logging/__init__.py", "_log"),
)


def _inclusive(stats: pstats.Stats) -> dict[str, float]:
    found: dict[str, float] = defaultdict(float)
    for (filename, _line, name), (_cc, _calls, _own, cumulative, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        for label, path, function in STAGES:
            if name == function and filename.endswith(path):
                # Only outermost calls: skip recursion through the same function.
                found[label] += cumulative
    return dict(found)


def profile(bench: Bench, rounds: int) -> dict[str, Any]:
    profilers = profile_rounds(functools.partial(one_round, bench), rounds)
    report: dict[str, Any] = {}
    for kind in KINDS:
        stats = pstats.Stats(profilers[kind])
        by_category: dict[str, float] = defaultdict(float)
        rows = []
        for (filename, line, name), (_cc, calls, own, cumulative, _callers) in stats.stats.items():  # type: ignore[attr-defined]
            by_category[_category(filename, name)] += own
            rows.append((own, cumulative, calls, where(filename, line, name)))
        total = sum(by_category.values())
        rows.sort(reverse=True)
        report[kind] = {
            "total_ms_per_request": 1000 * total / rounds,
            "by_category_ms": {
                label: 1000 * own / rounds
                for label, own in sorted(by_category.items(), key=lambda kv: -kv[1])
            },
            "inclusive_ms": {
                label: 1000 * cumulative / rounds for label, cumulative in _inclusive(stats).items()
            },
            "top_own": [
                {
                    "own_ms": 1000 * own / rounds,
                    "cum_ms": 1000 * cum / rounds,
                    "calls": calls / rounds,
                    "function": place,
                }
                for own, cum, calls, place in rows[:15]
            ],
        }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=300, help="measured rounds (8 Runs each)")
    parser.add_argument("--warmup", type=int, default=30, help="rounds before measuring")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="N rounds profiled")
    parser.add_argument("--cache", choices=("redis", "memory"), default="redis")
    parser.add_argument("--log-level", default="INFO", help="LOG_LEVEL of the server code")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument(
        "--server",
        choices=("wsgi", "gunicorn"),
        default="wsgi",
        help="in process (wsgi) or over HTTP to gunicorn with one worker process",
    )
    args = parser.parse_args(argv)
    if args.server == "gunicorn" and args.profile:
        parser.error("--profile profiles this process: only with --server wsgi")

    base = os.environ.get("BENCH_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    admin(base, f"DROP DATABASE IF EXISTS {BENCH_DB} WITH (FORCE)", f"CREATE DATABASE {BENCH_DB}")
    flush = None
    server: Gunicorn | None = None
    if args.cache == "redis":
        import redis

        flush = redis.Redis.from_url(REDIS_URL).flushdb
        flush()
    try:
        django_setup(_env(base, args.cache, args.log_level), BENCH_DB)
        from django.db import connection

        if args.server == "gunicorn":
            server = Gunicorn()
            bench = Bench(Http(server.port))
            each_round = functools.partial(one_round, bench)
            log(f"warm-up: {args.warmup} rounds")
            measure_server_rounds(each_round, args.warmup, server)
            log(f"measure: {args.rounds} rounds (gunicorn worker {server.worker})")
            samples = measure_server_rounds(each_round, args.rounds, server)
            # The statements are the same code's: counted in process.
            bench.transport = Wsgi()
        else:
            bench = Bench()
            samples = warm_then_measure(
                functools.partial(one_round, bench), args.warmup, args.rounds
            )
        queries = count_queries(bench)
        figures = _figures(samples, queries)
        _print(figures, args)
        if args.profile:
            log(f"profile: {args.profile} rounds")
            figures["profile"] = profile(bench, args.profile)
            _print_profile(figures["profile"])
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=2))
        connection.close()
    finally:
        if server is not None:
            server.stop()
        admin(base, f"DROP DATABASE IF EXISTS {BENCH_DB} WITH (FORCE)")
        if flush is not None:
            flush()
    return 0


def _figures(samples: Samples, queries: dict[str, int]) -> dict[str, Any]:
    kinds: dict[str, Any] = {}
    for kind in KINDS:
        cpu, wall, pg = samples[kind]["cpu"], samples[kind]["wall"], samples[kind]["pg"]
        kinds[kind] = {
            "cpu_ms": 1000 * statistics.fmean(cpu),
            "pg_cpu_ms": 1000 * statistics.fmean(pg) if pg else float("nan"),
            "cpu_ms_median": 1000 * statistics.median(cpu),
            "wall_ms_median": 1000 * statistics.median(wall),
            "sql": queries[kind],
            "runs_served": RUNS_SERVED.get(kind),
        }
    per_run = sum(kinds[k]["cpu_ms"] / SLOTS for k in RUNS_SERVED)
    pg_per_run = sum(kinds[k]["pg_cpu_ms"] / SLOTS for k in RUNS_SERVED)
    try:
        load = os.getloadavg()[0]
    except OSError:  # pragma: no cover
        load = float("nan")
    return {
        "kinds": kinds,
        "cpu_ms_per_run": per_run,
        "pg_cpu_ms_per_run": pg_per_run,
        "load_1m": load,
    }


def _print(figures: dict[str, Any], args: argparse.Namespace) -> None:
    transport = (
        "in process (WSGI)"
        if args.server == "wsgi"
        else "over HTTP to gunicorn (1 worker process; its CPU, clock ticks: no medians)"
    )
    print(
        f"Worker API requests {transport}, PostgreSQL, cache {args.cache}, "
        f"LOG_LEVEL {args.log_level}, {args.rounds} rounds, load {figures['load_1m']:.1f}"
    )
    head = ("request", "CPU ms", "median", "wall ms", "CPU ms/Run", "PG CPU ms", "SQL")
    print(
        f"{head[0]:<22} {head[1]:>8} {head[2]:>8} {head[3]:>8} {head[4]:>11} {head[5]:>10} "
        f"{head[6]:>4}"
    )
    for kind, row in figures["kinds"].items():
        per_run = f"{row['cpu_ms'] / row['runs_served']:.2f}" if row["runs_served"] else "-"
        median = f"{row['cpu_ms_median']:8.2f}" if args.server == "wsgi" else f"{'-':>8}"
        print(
            f"{kind:<22} {row['cpu_ms']:8.2f} {median} "
            f"{row['wall_ms_median']:8.2f} {per_run:>11} {row['pg_cpu_ms']:10.2f} {row['sql']:>4}"
        )
    here = "here" if args.server == "wsgi" else "in gunicorn"
    print(
        f"per Run (a claiming pull + 3 ACK requests, each / 8): "
        f"{figures['cpu_ms_per_run']:.2f} CPU ms {here}, "
        f"{figures['pg_cpu_ms_per_run']:.2f} in the PostgreSQL backend"
    )


def _print_profile(report: dict[str, Any]) -> None:
    for kind, row in report.items():
        print(f"\n== {kind}: {row['total_ms_per_request']:.2f} ms per request under cProfile")
        print("   stages, inclusive (ms per request):")
        for label, ms in row["inclusive_ms"].items():
            print(f"   {ms:7.3f} ms  {label}")
        print("   own time by package (ms per request):")
        for label, ms in row["by_category_ms"].items():
            print(f"   {ms:7.3f} ms  {label}")
        print("   top functions by own time (ms per request, cumulative, calls):")
        for item in row["top_own"]:
            print(
                f"   {item['own_ms']:7.3f} {item['cum_ms']:8.3f} {item['calls']:7.1f}  "
                f"{item['function']}"
            )


if __name__ == "__main__":
    sys.exit(main())
