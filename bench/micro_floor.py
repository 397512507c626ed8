"""The micro goal's floor: what bare one-row commits do beside Procrastinate.

    .venv/bin/python bench/micro_floor.py [--iterations 600]

Needs a local PostgreSQL and bench/requirements.txt (Procrastinate). Creates a
throw-away database (`ql_bench_floor`, or BENCH_DB_NAME) on the server of
BENCH_POSTGRES_URL (default postgres://postgres@127.0.0.1:5432/postgres) and
drops it at the end (also on failure).

Each iteration times, one after the other on the same database, so that all
see the same load:

- Procrastinate's `fetch_job` + `finish_job` of one job (its two PL/pgSQL
  calls, the peer's side of `e2e_bench.py`'s micro);
- four durable one-row compare-and-set commits
  (`UPDATE … SET state, version = version + 1, at = now() WHERE id AND
  version`, autocommit) on a plain psycopg connection;
- the micro's shape: one such commit with `synchronous_commit = off` (a
  claim commits asynchronously, docs/adr/0011), then three durable ones (the
  `starting`, `running` and `succeeded` ACKs);
- two durable one-row commits.

It prints each loop's rate, median and ratio to the peer: the ratio of the
micro's shape is the most any lease authority keeping those commits could
reach, with no logic at all.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import statistics
import time
from typing import Any

from _measure import admin, db_url, log

WARMUP = 20
CAS = (
    "UPDATE floor SET state = %s, version = version + 1, at = now() WHERE id = %s AND version = %s"
)


async def measure(url: str, iterations: int) -> dict[str, list[float]]:
    import psycopg

    procrastinate = importlib.import_module("procrastinate")
    status = importlib.import_module("procrastinate.jobs").Status
    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(conninfo=url, min_size=1, max_size=2)
    )

    async def bench_noop() -> None:
        return None

    task = app.task(name="bench_noop")(bench_noop)
    times: dict[str, list[float]] = {"peer": [], "four": [], "shape": [], "two": []}
    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        await task.batch_defer_async(*({} for _ in range(iterations + WARMUP)))
        manager = app.job_manager
        worker_id = await manager.register_worker()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE floor"
                " (id bigint PRIMARY KEY, state text, version int, at timestamptz)"
            )
            conn.execute(
                "INSERT INTO floor SELECT n, 'pending', 0, NULL FROM generate_series(1, %s) n",
                (3 * (iterations + WARMUP),),
            )
            row = 0
            for index in range(iterations + WARMUP):
                started = time.perf_counter()
                job = await manager.fetch_job(queues=None, worker_id=worker_id)
                if job is None:
                    raise RuntimeError("Procrastinate fetched no job")
                await manager.finish_job(job, status=status.SUCCEEDED, delete_job=False)
                peer = time.perf_counter()
                row += 1
                for version in range(4):
                    conn.execute(CAS, (f"s{version}", row, version))
                four = time.perf_counter()
                row += 1
                with conn.transaction():
                    conn.execute("SET LOCAL synchronous_commit = off")
                    conn.execute(CAS, ("claimed", row, 0))
                for version in range(1, 4):
                    conn.execute(CAS, (f"s{version}", row, version))
                shape = time.perf_counter()
                row += 1
                for version in range(2):
                    conn.execute(CAS, (f"s{version}", row, version))
                two = time.perf_counter()
                if index >= WARMUP:
                    times["peer"].append(peer - started)
                    times["four"].append(four - peer)
                    times["shape"].append(shape - four)
                    times["two"].append(two - shape)
            done = conn.execute("SELECT count(*) FROM floor WHERE version = 4").fetchone()
        await manager.unregister_worker(worker_id)
    # Every CAS applied: 4 versions on the rows of the first two loops.
    if done is None or done[0] != 2 * (iterations + WARMUP):
        raise RuntimeError(f"{done} rows reached version 4, expected {2 * (iterations + WARMUP)}")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=600)
    args = parser.parse_args()
    base = os.environ.get("BENCH_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    name = os.environ.get("BENCH_DB_NAME", "ql_bench_floor")
    admin(base, f'DROP DATABASE IF EXISTS "{name}"', f'CREATE DATABASE "{name}"')
    try:
        log(f"{args.iterations} iterations on {name}")
        times: Any = asyncio.run(measure(db_url(base, name), args.iterations))
    finally:
        admin(base, f'DROP DATABASE IF EXISTS "{name}"')
    peer = sum(times["peer"])
    print(f"{'loop':48s} {'per s':>7s} {'median ms':>10s} {'ratio':>6s}")
    for key, label in (
        ("peer", "Procrastinate fetch_job + finish_job"),
        ("four", "4 durable one-row commits"),
        ("shape", "1 asynchronous + 3 durable (the micro's shape)"),
        ("two", "2 durable one-row commits"),
    ):
        spent = sum(times[key])
        print(
            f"{label:48s} {args.iterations / spent:7.0f} "
            f"{1000 * statistics.median(times[key]):10.3f} {peer / spent:6.2f}"
        )


if __name__ == "__main__":
    main()
