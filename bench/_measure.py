"""Helpers the bench scripts share (bench only; nothing in the product imports it).

The scripts run as `python bench/<name>.py`, so bench/ is `sys.path[0]` and
they import this module by its name (`import _measure`). Nothing here imports
Django at module level: the scripts set the environment before
`django.setup()`.
"""

from __future__ import annotations

import cProfile
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent

# `measure(kind, call)`: runs `call` once and books it under `kind`.
Measure = Callable[[str, Callable[[], None]], None]
# One round of a script's requests, each passed through the given `measure`.
Round = Callable[[Measure], None]
Samples = dict[str, dict[str, list[float]]]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def db_url(base: str, name: str) -> str:
    """`base` (a PostgreSQL URL) naming the database `name` instead."""
    parts = urlsplit(base)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))


def admin(base: str, *statements: str) -> None:
    """Runs each statement in autocommit (CREATE/DROP DATABASE) on `base`."""
    import psycopg

    with psycopg.connect(base, autocommit=True) as conn:
        for sql in statements:
            conn.execute(sql)


class Wsgi:
    """Calls the WSGI application as a server would, one request at a time."""

    def __init__(self) -> None:
        from django.core.wsgi import get_wsgi_application

        self.app = get_wsgi_application()

    def post(self, path: str, body: Any, headers: Mapping[str, str]) -> tuple[int, Any]:
        """POSTs `body` as JSON with the extra `headers` (WSGI `HTTP_*` keys);
        returns the status code and the decoded answer."""
        # The one builder, shared with the tests (imported here, after
        # `django_setup` put the repository on sys.path).
        from qinglong.tests.wsgi import call_json, json_environ

        environ = json_environ(
            "POST",
            path,
            body,
            {**headers, "HTTP_ACCEPT": "application/json"},
            host="127.0.0.1",
            port=8000,
        )
        return call_json(self.app, environ)


_TICK = os.sysconf("SC_CLK_TCK")


def pid_cpu(pid: int) -> float:
    """CPU seconds (user + system) process `pid` of this machine has used so
    far, from /proc. Clock ticks: meaningful summed over many requests."""
    return pid_start_and_cpu(pid)[1]


def pid_start_and_cpu(pid: int) -> tuple[int, float]:
    """(its start time in clock ticks after boot, `pid_cpu`) of process
    `pid`: the start time tells a reused pid from the process it was."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[19]), (int(fields[11]) + int(fields[12])) / _TICK


def backend_cpu() -> tuple[int, float]:
    """Django's connection's PostgreSQL backend and its CPU seconds so far (the
    server runs on this box)."""
    from django.db import connection

    connection.ensure_connection()
    pid: int = connection.connection.info.backend_pid
    return pid, pid_cpu(pid)


def django_setup(env: Mapping[str, str], database: str) -> None:
    """Sets `env`, sets Django up from the repository and migrates `database`
    (the one `env` names). Project modules are imported after this only."""
    os.environ.update(env)
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.core.management import call_command

    log(f"migrate {database}")
    call_command("migrate", verbosity=0)


def warm_then_measure(each_round: Round, warmup: int, rounds: int) -> Samples:
    """`warmup` rounds not kept, then `measure_rounds` of `rounds`."""
    log(f"warm-up: {warmup} rounds")
    measure_rounds(each_round, warmup)
    log(f"measure: {rounds} rounds")
    return measure_rounds(each_round, rounds)


def measure_rounds(each_round: Round, rounds: int) -> Samples:
    """Runs `rounds` rounds; per kind, each call's CPU seconds of this process
    (`cpu`), wall seconds (`wall`) and CPU seconds of the connection's
    PostgreSQL backend (`pg`; left out when the connection was renewed)."""
    samples: Samples = defaultdict(lambda: {"cpu": [], "wall": [], "pg": []})

    def measure(kind: str, call: Callable[[], None]) -> None:
        pid, pg = backend_cpu()
        cpu, wall = time.process_time(), time.perf_counter()
        call()
        samples[kind]["cpu"].append(time.process_time() - cpu)
        samples[kind]["wall"].append(time.perf_counter() - wall)
        pid_after, pg_after = backend_cpu()
        if pid_after == pid:  # else the connection was renewed (CONN_MAX_AGE)
            samples[kind]["pg"].append(pg_after - pg)

    for _ in range(rounds):
        each_round(measure)
    return samples


def profile_rounds(each_round: Round, rounds: int) -> dict[str, cProfile.Profile]:
    """Runs `rounds` rounds, each kind's calls under its own profiler, in CPU
    time (waiting for PostgreSQL or Redis costs no CPU here)."""
    profilers: dict[str, cProfile.Profile] = defaultdict(
        lambda: cProfile.Profile(time.process_time)
    )

    def measure(kind: str, call: Callable[[], None]) -> None:
        profiler = profilers[kind]
        profiler.enable()
        try:
            call()
        finally:
            profiler.disable()

    for _ in range(rounds):
        each_round(measure)
    return profilers


def where(filename: str, line: int, name: str) -> str:
    """A profiled function's place, short: relative to site-packages or the repo."""
    short = filename.split("site-packages/")[-1].replace(str(ROOT) + "/", "")
    return f"{short}:{line}({name})"
