"""The reference agent's own CPU per Run, against an in-memory control plane (issue 12).

End to end every process shares two cores, so CPU per Run summed over
processes bounds Runs/s. This measures the agent's share alone: the real
`Agent` (its threads, the on-disk journal, the real process spawner running
`true`, live output on), in this process, served by a control plane in
memory that hands out N offers and answers every request at once (pulls,
`POST acks`, heartbeats). Printed: this process's CPU ms per Run (utime +
stime of the agent's own threads, plus its death guard's from /proc — the
process that kills its children with it; the children's fork/exec is counted
apart, from their rusage), the wall time, the requests per Run; `--profile` adds a
cProfile of every thread of the agent (CPU time) and its top functions.

    .venv/bin/python bench/agent_cost.py --runs 600 --slots 16
    .venv/bin/python bench/agent_cost.py --runs 300 --profile
    .venv/bin/python bench/agent_cost.py --runs 600 --no-guard  # setpriv, as without a guard
    .venv/bin/python bench/agent_cost.py --runs 600 --no-guard --no-setpriv  # the fork fallback

No database, no network: runs anywhere the agent does.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import resource
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.agent.agent import Agent
from workers.agent.executor import ProcessSpawner, death_guard_pid
from workers.agent.journal import Journal
from workers.agent.protocol import Response, spec_sha256


def a_spec(index: int) -> dict[str, Any]:
    return {
        "spec_version": 1,
        "run_id": str(index),
        "attempt_id": str(index),
        "project_id": "1",
        "task_id": "1",
        "task_revision": 1,
        "executor_type": "process",
        "command": ["true"],
        "cwd": None,
        "env": {},
        "timeout_s": 60,
        "resources": {"cpu_millis": 1000, "memory_mb": 256},
    }


class Plane:
    """The Worker API in memory; counts requests; knows when every offer ended."""

    def __init__(self, runs: int) -> None:
        self.lock = threading.Lock()
        self.offers = []
        for index in range(runs):
            spec = a_spec(index)
            self.offers.append(
                {
                    "offer_id": uuid.uuid4().hex + uuid.uuid4().hex,
                    "run_id": str(index),
                    "attempt_id": str(index),
                    "source": "pull_claim",
                    "spec": spec,
                    "spec_sha256": spec_sha256(spec),
                    "lease": {"token": None},
                }
            )
        self.total = runs
        self.ended = 0
        self.done = threading.Event()
        self.requests: Counter[str] = Counter()

    def post(self, path: str, body: Mapping[str, Any], *, token: str) -> Response:
        kind = path.split("?")[0].rsplit("/", 1)[-1]
        with self.lock:
            self.requests[kind] += 1
        if kind == "sessions":
            return Response(
                201,
                {
                    "session_id": "sid-1",
                    "generation": 1,
                    "session_token": "session-token",
                    "heartbeat_interval_s": 10,
                    "session_timeout_s": 30,
                },
            )
        if kind == "heartbeat":
            return Response(200, {"session_state": "online", "cancel": [], "stop": []})
        if kind == "pull":
            with self.lock:
                count = int(body["max_offers"])
                handed, self.offers = self.offers[:count], self.offers[count:]
            return Response(200, {"offers": handed, "status": "offered", "reason": ""})
        if kind == "reconcile":
            return Response(200, {"results": []})
        if kind == "acks":
            results = []
            for item in body["acks"]:
                results.append(
                    {"offer_id": item["offer_id"], "status": 200, "cancel_requested": False}
                )
                self._ended(str(item.get("phase")))
            return Response(200, {"results": results})
        # a single ACK or an output chunk
        self._ended(str(body.get("phase")))
        return Response(200, {"cancel_requested": False})

    def _ended(self, phase: str) -> None:
        if phase in ("succeeded", "failed", "start_failed"):
            with self.lock:
                self.ended += 1
                if self.ended >= self.total:
                    self.done.set()


def _thread_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _guard_cpu() -> float:
    """The agent's death guard's CPU seconds so far (0 without a guard)."""
    pid = death_guard_pid()
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(
    runs: int, slots: int, poll: float, *, profile: bool, setpriv: bool = True, guard: bool = True
) -> dict[str, Any]:
    plane = Plane(runs)
    state = Path(tempfile.mkdtemp(prefix="ql-agent-cost-"))
    journal = Journal.open(state / "state")
    workdir = state / "work"
    workdir.mkdir()
    agent = Agent(
        transport=plane,
        credential="credential",
        slots=slots,
        executor="process",
        spawn=ProcessSpawner(workdir, guard=guard, setpriv=setpriv),
        journal=journal,
        poll_interval_s=poll,
    )
    profiles: list[cProfile.Profile] = []
    profiles_lock = threading.Lock()

    def thread_profiler(*_: Any) -> None:
        # The first event of each new thread: profile it from here on.
        sys.setprofile(None)  # this thread's hook; new threads still get it
        prof = cProfile.Profile(time.thread_time)
        with profiles_lock:
            profiles.append(prof)
        prof.enable()

    # The agent logs a JSON line per event on stderr: keep it, as the CLI does.
    saved_stderr = sys.stderr
    sys.stderr = Path(os.devnull).open("w")  # noqa: SIM115
    cpu0, children0, wall0 = _thread_cpu(), _children_cpu(), time.monotonic()
    guard0 = _guard_cpu()
    thread = threading.Thread(target=agent.run, name="agent-main")
    if profile:
        threading.setprofile(thread_profiler)
    thread.start()
    finished = plane.done.wait(timeout=max(60.0, runs * 0.2))
    wall = time.monotonic() - wall0
    cpu, children = _thread_cpu() - cpu0, _children_cpu() - children0
    guard_cpu = _guard_cpu() - guard0
    agent.drain()
    # `run` returns once every runner is out of the agent's table, its end logged.
    thread.join(timeout=30)
    threading.setprofile(None)
    for prof in profiles:
        prof.disable()
    sys.stderr.close()
    sys.stderr = saved_stderr
    journal.close()
    report: dict[str, Any] = {
        "runs": runs,
        "finished": finished,
        "cpu_ms_per_run": 1000 * (cpu + guard_cpu) / runs,
        "guard_cpu_ms_per_run": 1000 * guard_cpu / runs,
        "children_cpu_ms_per_run": 1000 * children / runs,
        "wall_s": wall,
        "runs_per_s": runs / wall,
        "requests_per_run": {k: round(v / runs, 3) for k, v in sorted(plane.requests.items())},
    }
    if profile and profiles:
        stats = pstats.Stats(profiles[0])
        for prof in profiles[1:]:
            stats.add(prof)
        out = io.StringIO()
        stats.stream = out  # type: ignore[attr-defined]
        stats.sort_stats("tottime").print_stats(35)
        out.write("\n")
        stats.sort_stats("cumulative").print_stats(80)
        report["profile"] = out.getvalue()
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=600)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--poll-interval", type=float, default=0.05)
    parser.add_argument("--repeat", type=int, default=3, help="measurements (min and median)")
    parser.add_argument("--profile", action="store_true", help="cProfile every agent thread")
    parser.add_argument(
        "--no-setpriv",
        dest="setpriv",
        action="store_false",
        help="spawn as where setpriv is missing (preexec_fn, fork) instead of by vfork",
    )
    parser.add_argument(
        "--no-guard",
        dest="guard",
        action="store_false",
        help="no death guard: the parent-death signal set in each child (setpriv or preexec_fn)",
    )
    args = parser.parse_args()
    if args.profile:
        report = measure(
            args.runs,
            args.slots,
            args.poll_interval,
            profile=True,
            setpriv=args.setpriv,
            guard=args.guard,
        )
        print(report.pop("profile"))
        print(report)
        return 0
    cpus, kids, rates = [], [], []
    for _ in range(args.repeat):
        report = measure(
            args.runs,
            args.slots,
            args.poll_interval,
            profile=False,
            setpriv=args.setpriv,
            guard=args.guard,
        )
        if not report["finished"]:
            print("not every Run ended:", report, file=sys.stderr)
            return 1
        cpus.append(report["cpu_ms_per_run"])
        kids.append(report["children_cpu_ms_per_run"])
        rates.append(report["runs_per_s"])
        print(
            f"agent CPU {report['cpu_ms_per_run']:.2f} ms/Run (its guard"
            f" {report['guard_cpu_ms_per_run']:.2f}; children"
            f" {report['children_cpu_ms_per_run']:.2f}), {report['runs_per_s']:.0f} Runs/s,"
            f" requests/Run {report['requests_per_run']}",
            flush=True,
        )
    cpus.sort()
    print(
        f"agent CPU ms per Run: min {cpus[0]:.2f} median {cpus[len(cpus) // 2]:.2f};"
        f" children min {min(kids):.2f}; load {os.getloadavg()[0]:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
