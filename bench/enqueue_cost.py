"""CPU cost of enqueueing Runs through `POST /api/v1/runs`, in process, on PostgreSQL (issue #12).

    .venv/bin/python bench/enqueue_cost.py                 # about a minute
    .venv/bin/python bench/enqueue_cost.py --profile 20    # + where the CPU goes

End to end, the web tier, PostgreSQL and the client share the box's two
cores, so what bounds enqueued Runs per second is the CPU each one costs.
This script measures the web tier's share: every request goes through the
WSGI application exactly as gunicorn calls it (middleware, DRF, the operator
Token's authentication, the use case, rendering), with the production
settings (`qinglong.settings`, DEBUG off) and a persistent database
connection; only the socket and gunicorn's HTTP parsing are left out.

It creates `ql_bench_enqcost` (`BENCH_DB_NAME`) on the server of
BENCH_POSTGRES_URL (default postgres://postgres@127.0.0.1:5432/postgres),
migrates it and drops it at the end. One Project, one Task (`true`), one
enrolled Worker with an online Session of 8 slots (so the answers say
`eligible`, the full why-waiting walk). The requests:

- `single, paused` — one object, dispatch paused (as `bench/e2e_bench.py`
  enqueues: why-waiting stops at the kill switch);
- `single, dispatching` — one object, dispatch running: why-waiting asks
  the limits and the online Workers;
- `list of 10`, `list of 1000` — the list form.

Printed per kind: CPU ms per request and per Run (this process's user +
system time), wall ms, the CPU of the connection's PostgreSQL backend per
Run (read from /proc: the server must run on this box), and the SQL
statements per request (one extra request each, as Django's
`CaptureQueriesContext` sees them). `--profile N` then runs N more rounds
under cProfile and prints the top functions by own and cumulative time.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pstats
import secrets
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# bench/ is sys.path[0] when this file runs as a script.
from _measure import (
    Measure,
    Wsgi,
    admin,
    db_url,
    django_setup,
    log,
    profile_rounds,
    warm_then_measure,
    where,
)

BENCH_DB = os.environ.get("BENCH_DB_NAME", "ql_bench_enqcost")
PROJECT, TASK = "enqcost", "true"


class Bench:
    def __init__(self) -> None:
        from django.contrib.auth import get_user_model
        from rest_framework.authtoken.models import Token

        from runs.services import project_create, task_create
        from workers.services import session_open, worker_enroll

        # Another Project's Task of the same name: the lookup must pick the right one.
        task_create(
            project=project_create(slug="other", name="Other"),
            name=TASK,
            definition={"executor_type": "process", "command": ["true"]},
        )
        task_create(
            project=project_create(slug=PROJECT, name="Enqueue cost"),
            name=TASK,
            definition={"executor_type": "process", "command": ["true"], "max_attempts": 1},
        )
        worker, _ = worker_enroll(name="enqcost", slots=8, executor_types=["process"], labels={})
        session_open(
            worker=worker, executor_types=["process"], labels={}, slots=8, agent_version="bench"
        )
        user = get_user_model().objects.create_superuser(
            "bench", "bench@example.invalid", secrets.token_urlsafe(24)
        )
        self.wsgi = Wsgi()
        self.headers = {"HTTP_AUTHORIZATION": f"Token {Token.objects.create(user=user).key}"}

    def _post(self, body: Any, *, runs: int) -> None:
        code, answer = self.wsgi.post("/api/v1/runs", body, self.headers)
        if code != 201:
            raise RuntimeError(f"enqueue: {code} {answer}")
        got = len(answer["results"]) if isinstance(body, list) else 1
        if got != runs:
            raise RuntimeError(f"enqueue: {got} answered, {runs} sent")

    def single(self) -> None:
        self._post({"project": PROJECT, "task": TASK}, runs=1)

    def many(self, count: int) -> Callable[[], None]:
        body = [{"project": PROJECT, "task": TASK, "priority": i % 3} for i in range(count)]
        return lambda: self._post(body, runs=count)


def _paused(paused: bool) -> None:
    from dispatch.cycles import dispatch_set_paused

    dispatch_set_paused(paused=paused, reason="bench", actor="bench")


# kind -> (Runs per request, requests per round, dispatch paused)
KINDS: dict[str, tuple[int, int, bool]] = {
    "single, paused": (1, 50, True),
    "single, dispatching": (1, 50, False),
    "list of 10": (10, 10, False),
    "list of 1000": (1000, 1, False),
}


def one_round(bench: Bench, measure: Measure) -> None:
    for kind, (runs, requests, paused) in KINDS.items():
        _paused(paused)
        call = bench.single if runs == 1 else bench.many(runs)
        for _ in range(requests):
            measure(kind, call)
    _trim()


def _trim() -> None:
    """Keep the queue small: the enqueue's cost must not follow the backlog."""
    from runs.models import Attempt, Run

    Attempt.objects.all().delete()
    Run.objects.all().delete()


def count_queries(bench: Bench) -> dict[str, int]:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    counts: dict[str, int] = {}
    for kind, (runs, _requests, paused) in KINDS.items():
        _paused(paused)
        call = bench.single if runs == 1 else bench.many(runs)
        with CaptureQueriesContext(connection) as captured:
            call()
        counts[kind] = len(captured.captured_queries)
        if os.environ.get("BENCH_SHOW_SQL"):
            for query in captured.captured_queries:
                log(f"  [{kind}] {str(query['sql'])[:200]}")
    _trim()
    return counts


def profile(bench: Bench, rounds: int) -> None:
    profilers = profile_rounds(functools.partial(one_round, bench), rounds)
    for kind, (runs, requests, _) in KINDS.items():
        n = rounds * requests * runs
        print(f"\n== {kind}: ms per Run under cProfile (own, cumulative, calls per Run)")
        stats = pstats.Stats(profilers[kind])
        rows: list[tuple[float, float, int, str]] = []
        for (filename, line, name), (_cc, calls, own, cum, _callers) in stats.stats.items():  # type: ignore[attr-defined]
            rows.append((own, cum, calls, where(filename, line, name)))
        print(f"   total {1000 * sum(r[0] for r in rows) / n:.3f} ms per Run")
        for key, title in ((0, "own"), (1, "cumulative")):
            print(f"   top by {title}:")
            ranked = sorted(rows, key=lambda r: r[0] if key == 0 else r[1], reverse=True)
            for own, cum, calls, place in ranked[: int(os.environ.get("BENCH_TOP", "22"))]:
                print(f"   {1000 * own / n:8.4f} {1000 * cum / n:8.4f} {calls / n:8.2f}  {place}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="measured rounds")
    parser.add_argument("--warmup", type=int, default=3, help="rounds before measuring")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="N rounds profiled")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)

    base = os.environ.get("BENCH_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    admin(base, f"DROP DATABASE IF EXISTS {BENCH_DB} WITH (FORCE)", f"CREATE DATABASE {BENCH_DB}")
    try:
        django_setup(
            {
                "DJANGO_SETTINGS_MODULE": "qinglong.settings",
                "DATABASE_URL": db_url(base, BENCH_DB),
                "DEBUG": "0",
                "SECRET_KEY": secrets.token_urlsafe(50),
                "ALLOWED_HOSTS": "127.0.0.1,localhost",
                "LOG_LEVEL": "INFO",
                "QL_CACHE_URL": "memory",
            },
            BENCH_DB,
        )
        from django.db import connection

        bench = Bench()
        samples = warm_then_measure(functools.partial(one_round, bench), args.warmup, args.rounds)
        queries = count_queries(bench)
        figures: dict[str, Any] = {"load_1m": os.getloadavg()[0], "kinds": {}}
        print(f"POST /api/v1/runs in process (WSGI), PostgreSQL, {args.rounds} rounds, ", end="")
        print(f"load {figures['load_1m']:.1f}")
        print(
            f"{'request':<22} {'CPU ms':>8} {'median':>8} {'wall ms':>8} {'CPU ms/Run':>11} "
            f"{'PG CPU ms/Run':>14} SQL"
        )
        for kind, (runs, _requests, _p) in KINDS.items():
            cpu, wall = samples[kind]["cpu"], samples[kind]["wall"]
            row = figures["kinds"][kind] = {
                "cpu_ms": 1000 * statistics.fmean(cpu),
                "cpu_ms_median": 1000 * statistics.median(cpu),
                "wall_ms_median": 1000 * statistics.median(wall),
                "cpu_ms_per_run": 1000 * statistics.fmean(cpu) / runs,
                "pg_cpu_ms_per_run": 1000 * statistics.fmean(samples[kind]["pg"]) / runs,
                "sql": queries[kind],
            }
            print(
                f"{kind:<22} {row['cpu_ms']:8.2f} {row['cpu_ms_median']:8.2f} "
                f"{row['wall_ms_median']:8.2f} {row['cpu_ms_per_run']:11.3f} "
                f"{row['pg_cpu_ms_per_run']:14.3f} {row['sql']:>3}"
            )
        if args.profile:
            log(f"profile: {args.profile} rounds")
            profile(bench, args.profile)
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=2))
        connection.close()
    finally:
        admin(base, f"DROP DATABASE IF EXISTS {BENCH_DB} WITH (FORCE)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
