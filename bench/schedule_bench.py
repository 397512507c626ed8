"""Schedule evaluation benchmark on PostgreSQL: is one step's cost flat in the number of Schedules?

    .venv/bin/python bench/schedule_bench.py

Creates a throw-away database (`qinglong_schedule_bench`, dropped at the end)
on the server of BENCH_POSTGRES_URL (default
postgres://postgres@127.0.0.1:5432/postgres), migrates it, and measures one
`schedules_evaluate` call (median wall time and SQL query count over
ITERATIONS calls) with 100 and with 10,000 Schedules, in two states:

  "idle" — no Schedule is due (the common second of a quiet box);
  "busy" — DUE Schedules are due, each firing once (a Run enqueued and a
           ledger row written per fire); every other Schedule is not due.

Goal (README "Schedules", docs/adr/0010): identical query counts and a time
ratio near 1 between 100 and 10,000 Schedules — a call's cost depends on how
many Schedules are due, not on how many exist.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
BENCH_DB = "qinglong_schedule_bench"
SMALL, LARGE = 100, 10_000
DUE = 16
ITERATIONS = 25
IDLE_ITERATIONS = 200
# Fire times of the busy iterations: one distinct minute each (the ledger's
# unique row per fire), all in the past so every one is due.
BASE = datetime(2026, 1, 1, tzinfo=UTC)


def _db_url(base: str, name: str) -> str:
    parts = urlsplit(base)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))


def _setup_django(base: str) -> None:
    # Project modules are imported inside the functions below: they import
    # models, which need this setup (and its environment) first.
    os.environ.update(
        {
            "DATABASE_URL": _db_url(base, BENCH_DB),
            "DJANGO_SETTINGS_MODULE": "qinglong.settings_test",
            "LOG_LEVEL": "WARNING",
        }
    )
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()


def _admin(base: str, sql: str) -> None:
    import psycopg

    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(sql)


def seed(count: int, *, task_id: int, start: int) -> None:
    """`count` Schedules that are not due (a yearly cron, attention next year)."""
    from schedules.models import Schedule

    far = BASE + timedelta(days=3650)
    Schedule.objects.bulk_create(
        (
            Schedule(
                task_id=task_id,
                name=f"idle-{start + i}",
                cron="0 0 1 1 *",
                timezone="UTC",
                overlap_policy="allow",
                next_fire_at=far,
                attention_at=far,
            )
            for i in range(count)
        ),
        batch_size=2000,
    )


def make_due(task: Any) -> list[int]:
    """DUE Schedules firing every minute; each busy call moves them to one fire."""
    from schedules.services import schedule_create

    return [
        schedule_create(
            task=task,
            name=f"due-{i}",
            definition={
                "cron": "* * * * *",
                "timezone": "UTC",
                "overlap_policy": "allow",
                "catchup_window_s": 7 * 86_400,
            },
            now=BASE,
        ).pk
        for i in range(DUE)
    ]


def measure(due_ids: list[int], *, round_no: int) -> dict[str, dict[str, Any]]:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from schedules.models import Schedule
    from schedules.services import schedules_evaluate

    far = BASE + timedelta(days=3650)
    out: dict[str, dict[str, Any]] = {}
    for state in ("idle", "busy"):
        times: list[float] = []
        queries: set[int] = set()
        fired: set[int] = set()
        for i in range(ITERATIONS if state == "busy" else IDLE_ITERATIONS):
            # Outside the timed region: this iteration's fire time for the due
            # Schedules (a new minute each, so every fire is a new ledger row).
            fire = BASE + timedelta(minutes=1 + round_no * 10_000 + i)
            due_at = fire if state == "busy" else far
            Schedule.objects.filter(pk__in=due_ids).update(next_fire_at=due_at, attention_at=due_at)
            # CaptureQueriesContext counts from the log's length, which stops
            # growing at 9,000 entries: start every call from an empty log.
            connection.queries_log.clear()
            with CaptureQueriesContext(connection) as captured:
                started = time.perf_counter()
                result = schedules_evaluate(now=fire + timedelta(seconds=1))
                times.append(time.perf_counter() - started)
            queries.add(len(captured.captured_queries))
            fired.add(result.fires)
        out[state] = {
            "median_ms": statistics.median(times) * 1000,
            "queries": sorted(queries),
            "fires": sorted(fired),
        }
    return out


def _timed(label: str, fn: Callable[[], Any]) -> Any:
    started = time.perf_counter()
    value = fn()
    print(f"  {label}: {time.perf_counter() - started:.1f}s", file=sys.stderr)
    return value


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None).parse_args()
    base = os.environ.get("BENCH_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    _admin(base, f"DROP DATABASE IF EXISTS {BENCH_DB} WITH (FORCE)")
    _admin(base, f"CREATE DATABASE {BENCH_DB}")
    try:
        _setup_django(base)
        from django.core.management import call_command
        from django.db import connection

        from qinglong import testing

        print("setting up (stderr shows progress)…", file=sys.stderr)
        _timed("migrate", lambda: call_command("migrate", verbosity=0))
        task = testing.make_task()
        due = make_due(task)
        _timed(f"{SMALL} schedules", lambda: seed(SMALL - DUE, task_id=task.pk, start=0))
        small = _timed("measure small", lambda: measure(due, round_no=0))
        _timed(f"{LARGE} schedules", lambda: seed(LARGE - SMALL, task_id=task.pk, start=SMALL))
        connection.cursor().execute("ANALYZE")
        large = _timed("measure large", lambda: measure(due, round_no=1))
        connection.close()
    finally:
        _admin(base, f"DROP DATABASE IF EXISTS {BENCH_DB} WITH (FORCE)")

    print(
        f"\nschedules_evaluate, PostgreSQL, {DUE} due Schedules per busy call, "
        f"{ITERATIONS} busy / {IDLE_ITERATIONS} idle calls per cell"
    )
    print(f"{'state':<6} {'metric':<12} {'100 sched.':>12} {'10,000 sched.':>14} {'ratio':>7}")
    for state in ("idle", "busy"):
        s, lg = small[state], large[state]
        ratio = lg["median_ms"] / s["median_ms"] if s["median_ms"] else float("nan")
        print(
            f"{state:<6} {'median ms':<12} {s['median_ms']:>12.2f} {lg['median_ms']:>14.2f} "
            f"{ratio:>7.2f}"
        )
        print(f"{'':<6} {'SQL queries':<12} {s['queries']!s:>12} {lg['queries']!s:>14}")
        print(f"{'':<6} {'fires':<12} {s['fires']!s:>12} {lg['fires']!s:>14}")
    same = all(small[k]["queries"] == large[k]["queries"] for k in ("idle", "busy"))
    print(f"\nidentical query counts: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
