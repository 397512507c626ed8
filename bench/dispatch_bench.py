"""Dispatcher benchmark on PostgreSQL: is a cycle bounded whatever the backlog?

    .venv/bin/python bench/dispatch_bench.py

Creates a throw-away database (`qinglong_bench`, or `BENCH_DB_NAME`; dropped at the end) on the
server of BENCH_POSTGRES_URL (default postgres://postgres@127.0.0.1:5432/postgres),
migrates it, seeds 64 Worker Sessions, 50 Projects with a Task each (`--projects`)
and a backlog spread evenly over them with bulk_create, and prints:

(a) median and fastest wall time, this process's CPU time, and SQL query count of
    one global `dispatch_cycle` at a backlog of 100 and of 100,000 pending Runs,
    in two steady states:
    "full"  — every Worker slot taken (the candidate read finds nothing it could
              serve — docs/adr/0012 — and the cycle stops);
    "claim" — free slots: the cycle claims its budget (8); the claimed rows are
              reset outside the timed region before the next iteration (a
              rollback is impossible: each claim commits durably);
(b) tracemalloc peak per cycle at both backlogs;
(c) claims per second from 1 and 2 processes through `dispatch_cycle`, beside a
    bare psycopg loop doing the single-row CAS claim on the same database.

Goals (docs/adr/0001: "throughput from more, shorter cycles, never bigger ones"):
identical query counts, time ratio ≤ 1.25, memory ratio ≤ 1.1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
# BENCH_DB_NAME: another name, so two runs on one server do not drop each other's.
BENCH_DB = os.environ.get("BENCH_DB_NAME", "qinglong_bench")
SESSIONS = 64
PROJECTS = 50
SMALL, LARGE = 100, 100_000
ITERATIONS = 25
MEMORY_ITERATIONS = 5
THROUGHPUT_S = 5.0


def _db_url(base: str, name: str) -> str:
    parts = urlsplit(base)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))


def _bench_env(base: str) -> dict[str, str]:
    return {
        **os.environ,
        "DATABASE_URL": _db_url(base, BENCH_DB),
        "DJANGO_SETTINGS_MODULE": "qinglong.settings_test",
        "LOG_LEVEL": "WARNING",
        # All 64 Sessions fit one snapshot (32 x 2 = the hard cap of 64); no
        # global re-delivery during the run, so every cycle does the same work.
        "QL_DISPATCH_WORKER_PAGE_SIZE": "32",
        "QL_DISPATCH_WORKER_MAX_PAGES": "2",
        "QL_DISPATCH_REDELIVERY_BACKOFF_S": "3600",
    }


def _setup_django(base: str) -> None:
    # Project modules are imported inside the functions below, never at the
    # top: they import models, which need this setup (and its environment) first.
    os.environ.update(_bench_env(base))
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()


# --------------------------------------------------------------------- seeding


def seed_sessions(*, slots: int) -> None:
    from qinglong import testing

    for _ in range(SESSIONS):
        testing.open_session(slots=slots)


def seed_tasks(projects: int) -> list[int]:
    """One Task in each of `projects` Projects (docs/adr/0012: the unit of fairness)."""
    from qinglong import testing

    return [testing.make_task(testing.make_project(f"bench-{i}")).pk for i in range(projects)]


def seed_backlog(count: int, *, task_ids: list[int]) -> None:
    from qinglong.clock import db_now
    from runs.models import Attempt, Run, Task

    tasks = list(Task.objects.filter(pk__in=task_ids).order_by("pk"))
    revisions: dict[int, int] = {}
    for task in tasks:
        assert task.current_revision_id is not None
        revisions[task.pk] = task.current_revision_id
    rng = random.Random(count)
    start = db_now()
    for offset in range(0, count, 5000):
        batch = min(5000, count - offset)
        # Spread evenly: Run n goes to Task n mod the number of Tasks.
        chosen = [tasks[(offset + i) % len(tasks)] for i in range(batch)]
        runs = Run.objects.bulk_create(
            Run(
                project_id=task.project_id,
                task_id=task.pk,
                task_revision_id=revisions[task.pk],
                priority=rng.randint(0, 9),
                queued_at=start - timedelta(seconds=rng.randint(0, 86400)),
            )
            for task in chosen
        )
        Attempt.objects.bulk_create(
            Attempt(run=run, number=1, priority=run.priority, queued_at=run.queued_at)
            for run in runs
        )
    _analyze()


def _analyze() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")


def reset_claims(lease_ids: list[int]) -> None:
    """Undo claims outside the timed region: the backlog stays the same size."""
    from django.db import connection, transaction

    if not lease_ids:
        return
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            "DELETE FROM runs_attemptevent WHERE attempt_id IN "
            "(SELECT attempt_id FROM dispatch_runlease WHERE id = ANY(%s))",
            [lease_ids],
        )
        cursor.execute(
            "UPDATE runs_attempt SET state = 'pending', lease_generation = lease_generation - 1 "
            "WHERE id IN (SELECT attempt_id FROM dispatch_runlease WHERE id = ANY(%s))",
            [lease_ids],
        )
        cursor.execute(
            "UPDATE runs_run SET state = 'queued' WHERE id IN "
            "(SELECT run_id FROM dispatch_runlease WHERE id = ANY(%s))",
            [lease_ids],
        )
        cursor.execute("DELETE FROM dispatch_runlease WHERE id = ANY(%s)", [lease_ids])


def release_all() -> None:
    from leases.models import RunLease

    reset_claims(list(RunLease.objects.values_list("id", flat=True)))


# ------------------------------------------------------------------- measuring


def one_cycle() -> Any:
    from dispatch.core.ports import DispatchScope
    from dispatch.cycles import dispatch_cycle

    return dispatch_cycle(scope=DispatchScope.global_())


def measure(scenario: str) -> dict[str, Any]:
    """Median time, query count and tracemalloc peak of one global cycle."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    def after(result: Any) -> None:
        if scenario == "claim":
            reset_claims([int(o.lease.lease_id) for o in result.offers])

    # Warm caches and plans: PostgreSQL plans a prepared statement afresh for
    # its first five executions before it settles on a generic plan.
    for _ in range(10):
        after(one_cycle())
    times: list[float] = []
    cpu: list[float] = []
    statuses: set[str] = set()
    for _ in range(ITERATIONS):
        started, started_cpu = time.perf_counter(), time.process_time()
        result = one_cycle()
        times.append((time.perf_counter() - started) * 1000)
        cpu.append((time.process_time() - started_cpu) * 1000)
        projects = len({offer.project_id for offer in result.offers})
        statuses.add(
            f"{result.status}/{result.reason}/won={result.counts.claims_won}/projects={projects}"
        )
        after(result)
    with CaptureQueriesContext(connection) as queries:
        result = one_cycle()
    after(result)
    peaks: list[int] = []
    for _ in range(MEMORY_ITERATIONS):
        tracemalloc.start()
        result = one_cycle()
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        after(result)
    return {
        "median_ms": statistics.median(times),
        # On a shared box the median follows the load; the fastest cycle and
        # this process's own CPU time per cycle show the cycle's own cost.
        "min_ms": min(times),
        "cpu_ms": statistics.median(cpu),
        "queries": len(queries.captured_queries),
        "peak_kib": statistics.median(peaks) / 1024,
        "status": ",".join(sorted(statuses)),
    }


def fill_all_slots() -> None:
    from dispatch.core.result import CycleReason

    for _ in range(100):
        result = one_cycle()
        # docs/adr/0012: with every slot taken nothing can be served, so the
        # candidate read finds nothing and the cycle is idle.
        if result.reason in (CycleReason.NO_FREE_SLOTS, CycleReason.NO_CANDIDATES):
            return
    raise RuntimeError("could not fill the Worker slots")


def backlog_round() -> dict[str, dict[str, Any]]:
    out = {"claim": measure("claim")}
    fill_all_slots()
    out["full"] = measure("full")
    release_all()
    return out


# ------------------------------------------------------------------ throughput


def child_dispatch(seconds: float) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    won = cycles = 0
    while time.monotonic() < deadline:
        result = one_cycle()
        won += result.counts.claims_won
        cycles += 1
    return {"claims": won, "cycles": cycles, "seconds": seconds}


def child_bare(seconds: float, index: int, of: int) -> dict[str, Any]:
    import psycopg

    url = os.environ["DATABASE_URL"]
    won = 0
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT id, version FROM runs_attempt WHERE state = 'pending' AND id %% %s = %s "
            "ORDER BY id DESC LIMIT 200000",
            (of, index),
        ).fetchall()
        deadline = time.monotonic() + seconds
        for attempt_id, version in rows:
            if time.monotonic() >= deadline:
                break
            cur = conn.execute(
                "UPDATE runs_attempt SET state = 'claimed', version = version + 1 "
                "WHERE id = %s AND version = %s AND state = 'pending'",
                (attempt_id, version),
            )
            won += cur.rowcount == 1
    return {"claims": won, "seconds": seconds}


def run_children(base: str, args_list: list[list[str]]) -> list[dict[str, Any]]:
    env = _bench_env(base)
    children = [
        subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--child", *args],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for args in args_list
    ]
    reports = []
    for child in children:
        out, _ = child.communicate(timeout=300)
        if child.returncode != 0:
            raise RuntimeError(f"bench child failed: {child.returncode}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def throughput(base: str) -> dict[str, float]:
    from workers.models import Worker, WorkerSession

    # Plenty of capacity: claims/s is then the claim path's own speed.
    Worker.objects.update(slots=256)
    WorkerSession.objects.update(slots=256)
    rates: dict[str, float] = {}
    for procs in (1, 2):
        reports = run_children(base, [["dispatch", str(THROUGHPUT_S)] for _ in range(procs)])
        rates[f"dispatch_cycle x{procs}"] = sum(r["claims"] for r in reports) / THROUGHPUT_S
    for procs in (1, 2):
        reports = run_children(
            base, [["bare", str(THROUGHPUT_S), str(i), str(procs)] for i in range(procs)]
        )
        rates[f"bare CAS x{procs}"] = sum(r["claims"] for r in reports) / THROUGHPUT_S
    return rates


# ------------------------------------------------------------------------ main


def _admin(base: str, sql: str) -> None:
    import psycopg

    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(sql)


def _timed(label: str, fn: Callable[[], Any]) -> Any:
    started = time.perf_counter()
    value = fn()
    print(f"  {label}: {time.perf_counter() - started:.1f}s", file=sys.stderr)
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument(
        "--projects",
        type=int,
        default=PROJECTS,
        help=f"Projects the backlog is spread over, one Task each (default {PROJECTS})",
    )
    parser.add_argument(
        "--small",
        type=int,
        default=SMALL,
        help=(
            f"the smaller backlog (default {SMALL}); e.g. 10000, where every queue group "
            f"already fills the page's cap as at {LARGE}, to tell growth from the cap"
        ),
    )
    args = parser.parse_args()
    if not 0 < args.small < LARGE:
        parser.error(f"--small must be between 1 and {LARGE - 1}")
    small_n = args.small
    base = os.environ.get("BENCH_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/postgres")

    if args.child:
        _setup_django(base)
        kind = args.child[0]
        if kind == "dispatch":
            report = child_dispatch(float(args.child[1]))
        else:
            report = child_bare(float(args.child[1]), int(args.child[2]), int(args.child[3]))
        print(json.dumps(report))
        return 0

    _admin(base, f"DROP DATABASE IF EXISTS {BENCH_DB} WITH (FORCE)")
    _admin(base, f"CREATE DATABASE {BENCH_DB}")
    try:
        _setup_django(base)
        from django.core.management import call_command

        print("setting up (stderr shows progress)…", file=sys.stderr)
        _timed("migrate", lambda: call_command("migrate", verbosity=0))
        task_ids = seed_tasks(args.projects)
        _timed("64 sessions", lambda: seed_sessions(slots=1))
        _timed(f"backlog {small_n}", lambda: seed_backlog(small_n, task_ids=task_ids))
        small = _timed("measure small", backlog_round)
        _timed(f"backlog {LARGE}", lambda: seed_backlog(LARGE - small_n, task_ids=task_ids))
        large = _timed("measure large", backlog_round)
        rates = _timed("throughput", lambda: throughput(base))
        from django.db import connection

        from dispatch.cycles import cycle_recorder

        cycle_recorder.flush()  # the repeats summed since the last row, before the drop
        connection.close()
    finally:
        _admin(base, f"DROP DATABASE IF EXISTS {BENCH_DB} WITH (FORCE)")

    print(
        f"\nglobal dispatch_cycle, {SESSIONS} worker sessions, {args.projects} projects, "
        f"PostgreSQL, budget 8/8x2 (workers 32x2), {ITERATIONS} cycles per cell"
    )
    print(
        f"{'scenario':<8} {'metric':<16} {f'backlog {small_n}':>12} "
        f"{'backlog 100k':>13} {'ratio':>7}"
    )
    for scenario in ("full", "claim"):
        s, lg = small[scenario], large[scenario]
        for metric, key, fmt in (
            ("median ms", "median_ms", "{:.2f}"),
            ("min ms", "min_ms", "{:.2f}"),
            ("CPU ms (median)", "cpu_ms", "{:.2f}"),
            ("SQL queries", "queries", "{}"),
            ("tracemalloc KiB", "peak_kib", "{:.1f}"),
        ):
            ratio = lg[key] / s[key] if s[key] else float("nan")
            print(
                f"{scenario:<8} {metric:<16} {fmt.format(s[key]):>12} "
                f"{fmt.format(lg[key]):>13} {ratio:>7.2f}"
            )
        print(f"{'':<8} {'outcome':<16} {s['status']}  |  {lg['status']}")
    print("\nclaims per second (backlog ~100k, 64 sessions x 256 slots)")
    for label, rate in rates.items():
        print(f"  {label:<18} {rate:>9.1f}/s")
    for procs in (1, 2):
        d, b = rates[f"dispatch_cycle x{procs}"], rates[f"bare CAS x{procs}"]
        print(f"  ratio x{procs}: dispatch_cycle / bare CAS = {d / b:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
