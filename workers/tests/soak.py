"""The fault soak (issue 10): real processes, injected faults, checked invariants.

Shared by the suite's bounded soak (workers/tests/test_fault_soak.py: one web
server, `run_dispatcher`, two agents) and the larger cluster soak
(bench/soak.py: two gunicorn nodes, Celery worker and two beats, long-poll).
Both build a `Cluster` of named processes, enqueue Runs of `stamp_task`
definitions, inject faults through the Cluster while a `Watch` samples the
database and /proc, then `verify` the invariants.

Every execution stamps itself. A Task's command is a shell whose child (the
"work", a grandchild of the agent in the same process group) appends
`<offer id> start|end|term <ns> <pid>` to `stamps.log` in the agent's work
directory: `start` before it works, `end` when it is done, `term` when a
SIGTERM ends it (its trap). The direct child dies with the agent (the
parent-death signal) while the work runs on, so killing the agent alone
leaves a real orphan. Only SIGKILL leaves an execution without a last stamp;
the Cluster records every SIGKILL it sends with the markers (`QL_OFFER_ID`)
of what it killed and when all of it was verified gone, so such an
execution's end is known from the process facts, never guessed. An execution
without a last stamp that no recorded kill explains is treated as never
ending (it overlaps everything after it).

The Cluster also records every web outage: from the SIGKILL or SIGTERM of a
web node to its restart answering again. A web server down for longer than
the Session timeout costs the Sessions it cut off, by design (README "The
reference agent", Partitions): an execution that ended while it was down and
whose terminal ACK met it is ended `lost` with its Session and its Run runs
again. `verify` counts such executions apart ("executions lost to outages
over the Session timeout", see `outage_cost`); a Run that ran again for any
other reason, a short restart included (finding 3), is a violation, and no
outage excuses an overlap.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from workers.agent import procfs

ROOT = Path(__file__).resolve().parents[2]
STAMPS = "stamps.log"
INFINITY = 2**63
# From the work's `end` stamp to the agent's journal holding its outcome: the
# runner polls the process every 0.2 s, ends its group's leftovers, writes the
# row. A kill later than this after the end finds the outcome journaled.
JOURNALED_WITHIN_NS = 2 * 10**9
# From the agent's spawn to the work's `start` stamp: a shell starting, under
# the soak's load. A kill of the agent inside this window, before the stamp,
# still hits the execution: the process was spawned by the instance killed
# (seen once: the kill 10 ms before the stamp, the orphan then ended by the
# restarted agent and the Run retried, as it must be). Far shorter than an
# agent's restart, so an execution of the next instance is never counted.
SPAWNED_WITHIN_NS = 250 * 10**6

# The work: traps TERM (stamps `term`), stamps `start`, sleeps in the
# background (so the trap runs at once), stamps `end`. $1: seconds.
_WORK = (
    'trap \'echo "$QL_OFFER_ID term $(date +%s%N) $$" >> ' + STAMPS + "; exit 143' TERM\n"
    'echo "$QL_OFFER_ID start $(date +%s%N) $$" >> ' + STAMPS + "\n"
    'sleep "$1" & wait $!\n'
    'echo "$QL_OFFER_ID end $(date +%s%N) $$" >> ' + STAMPS + "\n"
)


def stamp_command(seconds: float) -> list[str]:
    """The agent's child starts the work as its own child and waits for it."""
    return ["sh", "-c", 'sh -c "$0" work "$1" & wait $!', _WORK, f"{seconds:g}"]


def stamp_task(seconds: float, *, max_attempts: int, timeout_s: int = 120) -> dict[str, Any]:
    return {
        "executor_type": "process",
        "command": stamp_command(seconds),
        "timeout_s": timeout_s,
        "max_attempts": max_attempts,
    }


def log(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ /proc


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgid) of a process, None if gone."""
    try:
        raw = (Path("/proc") / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()
    try:
        return fields[0].decode(), int(fields[1]), int(fields[2])
    except (IndexError, ValueError):
        return None


def _all_pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = defaultdict(list)
    for pid in _all_pids():
        info = _stat(pid)
        if info is not None:
            children[info[1]].append(pid)
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    info = _stat(pid)
    return info is not None and info[0] not in ("Z", "X", "x")


def live_markers() -> dict[str, set[int]]:
    """Offer id -> live pids carrying its QL_OFFER_ID marker."""
    found: dict[str, set[int]] = defaultdict(set)
    for pid, offer_id in procfs.snapshot().markers.items():
        found[offer_id].add(pid)
    return found


def _marker_of(pid: int) -> str | None:
    try:
        environ = (Path("/proc") / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    for entry in environ.split(b"\0"):
        if entry.startswith(b"QL_OFFER_ID="):
            return entry.split(b"=", 1)[1].decode("ascii", "replace")
    return None


# ---------------------------------------------------------------- processes


@dataclass
class Kill:
    """A fault the Cluster injected, and the process facts it recorded."""

    kind: str  # agent_alone | agent_tree | sigkill | sigterm
    target: str
    at_ns: int
    dead_ns: int = 0  # everything it SIGKILLed was verified gone by then
    killed_offers: frozenset[str] = frozenset()  # markers of what it SIGKILLed
    orphans: frozenset[str] = frozenset()  # agent_alone: markers left running


@dataclass
class Outage:
    """A web node down: from the fault that took it down (SIGKILL or SIGTERM
    sent) to its restart answering `ready` again. An agent talking to that
    node can neither heartbeat nor ACK meanwhile."""

    node: str
    down_ns: int
    up_ns: int = 0  # 0: not back (yet)

    def seconds(self, now_ns: int) -> float:
        return ((self.up_ns or now_ns) - self.down_ns) / 1e9


@dataclass
class Proc:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    kind: str  # web | dispatcher | agent | celery
    ready: Callable[[], bool] | None = None
    via: str | None = None  # agent: the web node it talks to (None: any)
    popen: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid


class Cluster:
    """Named processes, each in its own process group, and the faults."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: dict[str, Proc] = {}
        self.kills: list[Kill] = []
        self.outages: list[Outage] = []
        self.restarts: Counter[str] = Counter()

    def add(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        *,
        kind: str,
        ready: Callable[[], bool] | None = None,
        via: str | None = None,
    ) -> Proc:
        proc = Proc(name, argv, env, self.workdir / f"{name}.log", kind, ready, via)
        self.procs[name] = proc
        return proc

    def start(self, name: str, *, timeout: float = 60.0) -> None:
        proc = self.procs[name]
        with proc.log_path.open("ab") as out:
            proc.popen = subprocess.Popen(
                proc.argv,
                cwd=ROOT,
                env=proc.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc.starts += 1
        if proc.ready is not None:
            self.wait_ready(name, timeout=timeout)
        for outage in self.outages:
            if outage.node == name and not outage.up_ns:
                outage.up_ns = time.time_ns()
                log(f"{name} back after {outage.seconds(outage.up_ns):.1f}s")

    def _down(self, proc: Proc, at_ns: int) -> None:
        """A web node stops answering from the moment its fault is sent."""
        if proc.kind == "web" and not any(
            o.node == proc.name and not o.up_ns for o in self.outages
        ):
            self.outages.append(Outage(proc.name, at_ns))

    def agents_of(self, node: str) -> set[str]:
        """The agents a web node's outage cuts off."""
        return {p.name for p in self.procs.values() if p.kind == "agent" and p.via in (None, node)}

    def wait_ready(self, name: str, *, timeout: float) -> None:
        proc = self.procs[name]
        assert proc.ready is not None and proc.popen is not None
        deadline = time.monotonic() + timeout
        while not proc.ready():
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.popen.returncode}); see {proc.log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not ready after {timeout:.0f}s")
            time.sleep(0.1)

    def restart(self, name: str) -> None:
        self.restarts[name] += 1
        self.start(name)

    def _reap(self, proc: Proc, timeout: float = 30.0) -> None:
        assert proc.popen is not None
        proc.popen.wait(timeout)

    # ---- faults

    def kill_agent_alone(self, name: str) -> Kill:
        """SIGKILL the agent process only: its work runs on (orphans)."""
        proc = self.procs[name]
        tree = descendants(proc.pid)
        at = time.time_ns()
        os.kill(proc.pid, signal.SIGKILL)
        self._reap(proc)
        time.sleep(0.2)  # the direct children's parent-death signal lands
        orphans = {m for pid in tree if _alive(pid) and (m := _marker_of(pid)) is not None}
        kill = Kill("agent_alone", name, at, time.time_ns(), frozenset(), frozenset(orphans))
        self.kills.append(kill)
        return kill

    def kill_agent_tree(self, name: str) -> Kill:
        """SIGKILL the agent and everything it started (its children lead
        process groups of their own): a crashed container."""
        proc = self.procs[name]
        os.kill(proc.pid, signal.SIGSTOP)  # spawns nothing more meanwhile
        tree = descendants(proc.pid)
        groups = {info[2] for pid in tree if (info := _stat(pid)) is not None}
        markers = {m for pid in tree if (m := _marker_of(pid)) is not None}
        at = time.time_ns()
        for group in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
        os.kill(proc.pid, signal.SIGKILL)
        self._reap(proc)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in tree) and time.monotonic() < deadline:
            time.sleep(0.02)
        left = {pid for pid in tree if _alive(pid)}
        if left:
            raise RuntimeError(f"{name}: {len(left)} processes outlived SIGKILL")
        kill = Kill("agent_tree", name, at, time.time_ns(), frozenset(markers))
        self.kills.append(kill)
        return kill

    def sigkill(self, name: str) -> Kill:
        """SIGKILL the process's whole group (a crashed web node, dispatcher, beat)."""
        proc = self.procs[name]
        at = time.time_ns()
        self._down(proc, at)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        self._reap(proc)
        kill = Kill("sigkill", name, at, time.time_ns())
        self.kills.append(kill)
        return kill

    def sigterm(self, name: str, *, timeout: float = 30.0) -> Kill:
        """SIGTERM and wait for the exit (a deployment's restart)."""
        proc = self.procs[name]
        at = time.time_ns()
        self._down(proc, at)
        assert proc.popen is not None
        proc.popen.send_signal(signal.SIGTERM)
        try:
            proc.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.popen.wait(10)
        # Whatever is left of its group (a gunicorn worker) goes too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        kill = Kill("sigterm", name, at, time.time_ns())
        log(f"{name} exited {(kill.dead_ns - at) / 1e9:.1f}s after SIGTERM")
        self.kills.append(kill)
        return kill

    def stop_all(self, *, timeout: float = 30.0) -> None:
        live = [p for p in self.procs.values() if p.popen is not None and p.popen.poll() is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                proc.popen.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        deadline = time.monotonic() + timeout
        for proc in live:
            assert proc.popen is not None
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(5)

    def agent_events(self, name: str) -> list[dict[str, Any]]:
        path = self.procs[name].log_path
        events = []
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict):
                    events.append(event)
        return events


def http_ready(port: int) -> Callable[[], bool]:
    def ready() -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        try:
            conn.request("GET", "/healthz")
            return conn.getresponse().status == 200
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()

    return ready


def agent_argv(
    url: str, credential: Path, state_dir: Path, workdir: Path, *extra: str
) -> list[str]:
    return [
        sys.executable, "-m", "workers.agent", "--url", url,
        "--credential-file", str(credential), "--state-dir", str(state_dir),
        "--workdir", str(workdir), *extra,
    ]  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class FaultWindows:
    """When the soak injects faults. `calm()` is false during a fault and for
    `settle_s` after it (the cluster is recovering): the Watch's stranded
    check samples only outside these windows."""

    def __init__(self, settle_s: float) -> None:
        self.settle_s = settle_s
        self._until = 0.0

    def calm(self) -> bool:
        return time.monotonic() > self._until

    def inject(self, what: str, action: Callable[[], object]) -> None:
        self._until = float("inf")
        log(what)
        try:
            action()
        finally:
            self._until = time.monotonic() + self.settle_s


def sample_for(watch: Watch, seconds: float, *, every: float = 0.5) -> None:
    """Let the soak run `seconds`, sampling the Watch all along."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        watch.sample()
        time.sleep(every)


def drain(run_ids: Iterable[int], watch: Watch, *, timeout: float) -> bool:
    """Sample until every Run is terminal (True) or `timeout` has passed."""
    from runs.models import Run, RunState

    pending = Run.objects.filter(pk__in=list(run_ids)).exclude(
        state__in=(RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED)
    )
    deadline = time.monotonic() + timeout
    while pending.exists():
        if time.monotonic() > deadline:
            return False
        sample_for(watch, 1)
    return True


def undeliverable(run_ids: Iterable[int]) -> list[str]:
    """No Run of the soak may fail `undeliverable` (finding 2)."""
    from runs.models import Attempt

    found = Attempt.objects.filter(run_id__in=list(run_ids), error_code="undeliverable").count()
    return [f"{found} Attempts undeliverable"] if found else []


# ----------------------------------------------------------------- the watch


@dataclass
class Watch:
    """Samples the database and /proc while the soak runs.

    - backed: no Attempt stays `starting`/`running` with no live process of
      its offer for longer than `unbacked_bound_s` (the issue's "one Session
      timeout", plus a heartbeat and scheduling slack);
    - stranded: outside fault windows (`calm`), never for longer than
      `stall_bound_s` an eligible queued Run while an online Session has a
      free slot (finding 2).
    """

    unbacked_bound_s: float
    stall_bound_s: float
    calm: Callable[[], bool] = lambda: True
    violations: list[str] = field(default_factory=list)
    samples: int = 0
    _unbacked_since: dict[int, float] = field(default_factory=dict)
    _stalled_since: float | None = None

    def sample(self) -> None:
        from django.db.models import Count, Q

        from leases.models import LeaseState, RunLease
        from runs.models import Attempt, AttemptState, RunState
        from workers.models import SessionState, WorkerSession

        self.samples += 1
        now = time.monotonic()
        started = {
            lease["attempt_id"]: lease["offer_id"]
            for lease in RunLease.objects.filter(
                state=LeaseState.ACTIVE,
                attempt__state__in=(AttemptState.STARTING, AttemptState.RUNNING),
            ).values("attempt_id", "offer_id")
        }
        bare = set(
            Attempt.objects.filter(
                state__in=(AttemptState.STARTING, AttemptState.RUNNING)
            ).values_list("id", flat=True)
        )
        alive = live_markers()
        unbacked = {a for a in bare if started.get(a) not in alive}
        for attempt_id in list(self._unbacked_since):
            if attempt_id not in unbacked:
                del self._unbacked_since[attempt_id]
        for attempt_id in unbacked:
            since = self._unbacked_since.setdefault(attempt_id, now)
            if now - since > self.unbacked_bound_s:
                self.violations.append(
                    f"Attempt {attempt_id} {started.get(attempt_id, '(no active lease)')[:12]} "
                    f"starting/running with no process for {now - since:.1f}s"
                )
                self._unbacked_since[attempt_id] = float("inf")  # once
        if not self.calm():
            self._stalled_since = None
            return
        wall = datetime.now().astimezone()
        eligible = Attempt.objects.filter(
            Q(not_before__isnull=True) | Q(not_before__lte=wall),
            state=AttemptState.PENDING,
            run__state=RunState.QUEUED,
        ).exists()
        free = 0
        sessions = (
            WorkerSession.objects.filter(state=SessionState.ONLINE)
            .select_related("worker")
            .annotate(active=Count("leases", filter=Q(leases__state=LeaseState.ACTIVE)))
        )
        for session in sessions:
            free += max(0, min(session.slots, session.worker.slots) - session.active)
        if eligible and free > 0:
            if self._stalled_since is None:
                self._stalled_since = now
            elif now - self._stalled_since > self.stall_bound_s:
                self.violations.append(
                    f"an eligible Run stayed queued {now - self._stalled_since:.1f}s "
                    f"while online Sessions had {free} free slots"
                )
                self._stalled_since = None
        else:
            self._stalled_since = None


# ------------------------------------------------------------------ verdicts


@dataclass
class Execution:
    offer_id: str
    agent: str
    pid: int
    start: int
    end: int | None = None  # `end` stamp
    term: int | None = None  # `term` stamp

    @property
    def last(self) -> int | None:
        return self.end if self.end is not None else self.term


def read_stamps(agent_dirs: dict[str, Path]) -> tuple[list[Execution], list[str]]:
    executions: dict[str, Execution] = {}
    problems: list[str] = []
    for agent, workdir in agent_dirs.items():
        path = workdir / STAMPS
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) != 4:
                problems.append(f"{agent}: malformed stamp {line!r}")
                continue
            offer_id, kind, ns, pid = parts[0], parts[1], int(parts[2]), int(parts[3])
            if kind == "start":
                if offer_id in executions:
                    problems.append(f"offer {offer_id[:12]} started twice (one offer, one run)")
                    continue
                executions[offer_id] = Execution(offer_id, agent, pid, ns)
                continue
            found = executions.get(offer_id)
            if found is None:
                problems.append(f"{agent}: {kind} stamp of {offer_id[:12]} without a start")
            elif kind == "end":
                found.end = ns
            else:
                found.term = ns
    return sorted(executions.values(), key=lambda e: e.start), problems


@dataclass
class Verdict:
    violations: list[str]
    summary: dict[str, Any]

    def text(self) -> str:
        lines = [f"  {key}: {value}" for key, value in self.summary.items()]
        lines += [f"  VIOLATION: {v}" for v in self.violations[:40]]
        if len(self.violations) > 40:
            lines.append(f"  ... and {len(self.violations) - 40} more")
        return "\n".join(lines)


def verify(
    *,
    run_ids: Iterable[int],
    cluster: Cluster,
    agent_dirs: dict[str, Path],
    watch: Watch,
    elapsed_s: float,
    session_timeout_s: float,
    heartbeat_s: float,
) -> Verdict:
    """Every invariant of the soak, from the database, the stamps, the
    agents' logs and journals, and what the Cluster recorded.

    `session_timeout_s` and `heartbeat_s` are the cluster's
    QL_SESSION_TIMEOUT_S and QL_HEARTBEAT_INTERVAL_S: an execution whose
    Attempt a web outage over the Session timeout cost (`outage_cost`) may
    run again, counted apart ("executions lost to outages over the Session
    timeout"); every other invariant holds for it as for any execution."""
    from leases.models import RunLease
    from runs.models import Attempt, Run, RunState

    run_ids = list(run_ids)
    now_ns = time.time_ns()
    violations = list(watch.violations)
    executions, problems = read_stamps(agent_dirs)
    violations += problems

    runs = {run.pk: run for run in Run.objects.filter(pk__in=run_ids)}
    attempts = list(Attempt.objects.filter(run_id__in=run_ids))
    by_attempt = {attempt.pk: attempt for attempt in attempts}
    leases: dict[str, int] = {}
    # offer id -> (its Session's last recorded heartbeat, when the Session ended)
    sessions: dict[str, tuple[int, int | None]] = {}
    rows = RunLease.objects.filter(run_id__in=run_ids).values_list(
        "offer_id", "attempt_id", "session__heartbeat_at", "session__ended_at"
    )
    for offer, attempt_pk, beat, ended in rows:
        leases[offer] = attempt_pk
        sessions[offer] = (_ns(beat), _ns(ended) if ended is not None else None)

    # 1. Every Run terminal.
    states = Counter(str(run.state) for run in runs.values())
    for run in runs.values():
        if run.state not in (RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED):
            violations.append(f"Run {run.pk} not terminal: {run.state}")
    if len(runs) != len(run_ids):
        violations.append(f"{len(run_ids) - len(runs)} Runs missing")

    # The process facts: SIGKILLed offers and when they were verified gone;
    # agent kills and fences by agent and time.
    killed_at: dict[str, int] = {}
    for kill in cluster.kills:
        for offer_id in kill.killed_offers:
            killed_at.setdefault(offer_id, kill.dead_ns)
    agent_kills: dict[str, list[int]] = defaultdict(list)
    for kill in cluster.kills:
        if kill.kind in ("agent_alone", "agent_tree"):
            agent_kills[kill.target].append(kill.at_ns)
    fenced: set[str] = set()
    stops: set[str] = set()
    fences = 0
    offer_events: dict[str, list[str]] = defaultdict(list)
    for agent in agent_dirs:
        for event in cluster.agent_events(agent):
            if "offer_id" in event:
                offer_events[str(event["offer_id"])].append(
                    ",".join(f"{k}={v}" for k, v in sorted(event.items()) if k != "offer_id")
                )
            if event.get("event") == "execution_fenced":
                fenced.add(str(event.get("offer_id")))
            elif event.get("event") == "session_fenced":
                fences += 1
            elif event.get("event") == "attempt_stop_requested":
                stops.add(str(event.get("offer_id")))

    per_run: dict[int, list[Execution]] = defaultdict(list)
    alive_now = live_markers()
    for execution in executions:
        attempt_id = leases.get(execution.offer_id)
        if attempt_id is None or by_attempt[attempt_id].run_id not in runs:
            violations.append(f"execution of unknown offer {execution.offer_id[:12]}")
            continue
        per_run[by_attempt[attempt_id].run_id].append(execution)
        if execution.offer_id in alive_now:
            violations.append(f"offer {execution.offer_id[:12]} still has live processes")

    def end_of(execution: Execution) -> int:
        if execution.last is not None:
            return execution.last
        # No last stamp: only a recorded SIGKILL explains it.
        return killed_at.get(execution.offer_id, INFINITY)

    def hit(execution: Execution) -> bool:
        """Its agent fenced it, or a kill of its agent came after its spawn
        (`SPAWNED_WITHIN_NS` before its start stamp) and before its outcome
        was both journaled and accepted. A kill after the work ended (and its
        outcome was journaled) does not count: the journal has the outcome,
        and the restarted agent must deliver it."""
        if execution.offer_id in fenced:
            return True
        attempt = by_attempt[leases[execution.offer_id]]
        settled = int(attempt.finished_at.timestamp() * 1e9) if attempt.finished_at else INFINITY
        if execution.end is not None:
            settled = min(settled, execution.end + JOURNALED_WITHIN_NS)
        spawned = execution.start - SPAWNED_WITHIN_NS
        return any(spawned <= at <= settled for at in agent_kills[execution.agent])

    def facts(execution: Execution, attempt: Any) -> str:
        return _facts(execution, attempt, sessions, agent_kills, cluster.outages, offer_events)

    # The web outages that cut each agent off.
    cut_off: dict[str, list[Outage]] = defaultdict(list)
    for outage in cluster.outages:
        for agent in cluster.agents_of(outage.node):
            cut_off[agent].append(outage)

    def lost_to_outage(execution: Execution) -> Outage | None:
        attempt = by_attempt[leases[execution.offer_id]]
        beat, ended = sessions[execution.offer_id]
        return outage_cost(
            cut_off[execution.agent],
            start_ns=execution.start,
            attempt_state=str(attempt.state),
            error_code=attempt.error_code,
            beat_ns=beat,
            ended_ns=ended,
            session_timeout_s=session_timeout_s,
            heartbeat_s=heartbeat_s,
            now_ns=now_ns,
        )

    ran_twice = 0
    unexplained_end = 0
    outage_lost: set[str] = set()
    for execution in executions:
        if execution.offer_id in leases and lost_to_outage(execution) is not None:
            outage_lost.add(execution.offer_id)
    for run_id, found in per_run.items():
        # 2. No two executions of one Run overlap.
        for index, earlier in enumerate(found):
            for later in found[index + 1 :]:
                if later.start <= end_of(earlier):
                    until = end_of(earlier)
                    violations.append(
                        f"Run {run_id}: executions {earlier.offer_id[:8]} ({earlier.agent}) and "
                        f"{later.offer_id[:8]} ({later.agent}) overlap"
                        + (" (the earlier never provably ended)" if until == INFINITY else "")
                    )
        # 3. A Run whose execution was not hit by a kill ran exactly once.
        if len(found) > 1:
            ran_twice += 1
            for execution in found[:-1]:
                if not hit(execution) and execution.offer_id not in outage_lost:
                    attempt = by_attempt[leases[execution.offer_id]]
                    violations.append(
                        f"Run {run_id} ran {len(found)} times though execution "
                        f"{execution.offer_id[:8]} ({execution.agent}, "
                        f"{'stopped by the control plane, ' if execution.offer_id in stops else ''}"
                        f"attempt {attempt.number} {attempt.state}/{attempt.error_code}) was hit "
                        "by no kill nor a long outage: " + facts(execution, attempt)
                    )
        for execution in found:
            if end_of(execution) == INFINITY:
                unexplained_end += 1
            # Finding 3: a process that ran to its end is reported, unless a
            # kill took the report with it.
            attempt = by_attempt[leases[execution.offer_id]]
            if (
                execution.end is not None
                and not hit(execution)
                and execution.offer_id not in outage_lost
                and attempt.state != "succeeded"
            ):
                violations.append(
                    f"Run {run_id}: execution {execution.offer_id[:8]} ended but its Attempt "
                    f"is {attempt.state}/{attempt.error_code}: " + facts(execution, attempt)
                )
    # 4. Nothing claims to run at the end.
    open_attempts = [a.pk for a in attempts if a.state in ("starting", "running", "claimed")]
    if open_attempts:
        violations.append(f"Attempts still open at the end: {open_attempts[:10]}")
    # A Run that succeeded ran its work to the end at least once.
    for run_id, run in runs.items():
        if run.state == RunState.SUCCEEDED and not any(e.end for e in per_run.get(run_id, [])):
            violations.append(f"Run {run_id} succeeded without an execution that ended")

    outcomes = Counter(
        f"{a.state}/{a.error_code}" if a.error_code else str(a.state) for a in attempts
    )
    kills = Counter(f"{k.kind}:{k.target}" for k in cluster.kills)
    summary: dict[str, Any] = {
        "seconds": round(elapsed_s, 1),
        "runs": dict(states),
        "attempts": dict(outcomes),
        "executions": len(executions),
        "runs executed more than once": ran_twice,
        "executions ended by SIGKILL": sum(1 for e in executions if e.last is None),
        "executions without a provable end": unexplained_end,
        "faults": dict(kills),
        "web outages (s)": [round(o.seconds(now_ns), 1) for o in cluster.outages],
        f"executions lost to outages over the Session timeout ({session_timeout_s:g}s)": len(
            outage_lost
        ),
        "restarts": dict(cluster.restarts),
        "orphans left by agent-only kills": sum(len(k.orphans) for k in cluster.kills),
        "agent fences": fences,
        "heartbeat stops": len(stops),
        "watch samples": watch.samples,
    }
    return Verdict(violations, summary)


def outage_cost(
    outages: Iterable[Outage],
    *,
    start_ns: int,
    attempt_state: str,
    error_code: str | None,
    beat_ns: int,
    ended_ns: int | None,
    session_timeout_s: float,
    heartbeat_s: float,
    now_ns: int,
) -> Outage | None:
    """The web outage (of those that cut the execution's agent off) that
    cost the execution's Attempt, if any: the documented price of an outage
    over the Session timeout (README "The reference agent", Partitions).

    It cost the Attempt when the Attempt ended `lost` because its Session
    was lost — `worker_lost` (the sweep declared it offline) or
    `worker_restarted` (the agent, silent for the Session timeout, fenced it
    and opened another) — and that Session's heartbeats stopped at the
    outage: its last recorded one came at most two heartbeats (and a second
    of scheduling) before the node went down and none after it came back;
    and the outage lasted longer than the Session timeout less two
    heartbeats (the last one before it, the first one after it). A shorter
    outage, a Session that outlived the outage, or any other ending explains
    nothing: a terminal ACK lost to a short restart stays a violation
    (finding 3)."""
    if attempt_state != "lost" or error_code not in ("worker_lost", "worker_restarted"):
        return None
    if ended_ns is None:
        return None
    long_enough_s = session_timeout_s - 2 * heartbeat_s
    slack_ns = int((2 * heartbeat_s + 1) * 1e9)
    for outage in outages:
        up = outage.up_ns or now_ns
        if (
            outage.seconds(now_ns) > long_enough_s
            and start_ns < up
            and outage.down_ns - slack_ns <= beat_ns <= up
            and ended_ns >= outage.down_ns
        ):
            return outage
    return None


def _ns(moment: datetime) -> int:
    return int(moment.timestamp() * 1e9)


def _facts(
    execution: Execution,
    attempt: Any,
    sessions: dict[str, tuple[int, int | None]],
    agent_kills: dict[str, list[int]],
    outages: list[Outage],
    offer_events: dict[str, list[str]],
) -> str:
    """Times relative to the execution's start (s), for a failure message."""

    def rel(ns: int | None) -> str:
        return "-" if ns is None else f"{(ns - execution.start) / 1e9:+.2f}"

    finished = int(attempt.finished_at.timestamp() * 1e9) if attempt.finished_at else None
    kills = ", ".join(rel(at) for at in agent_kills[execution.agent])
    down = ", ".join(f"{o.node} {rel(o.down_ns)}..{rel(o.up_ns or None)}" for o in outages)
    beat, ended = sessions.get(execution.offer_id, (None, None))
    return (
        f"end {rel(execution.end)} term {rel(execution.term)} attempt finished "
        f"{rel(finished)}; its Session's last heartbeat {rel(beat)}, ended {rel(ended)}; "
        f"kills of {execution.agent} at [{kills}]; web outages [{down}]; agent events: "
        + " | ".join(offer_events.get(execution.offer_id, []))
    )


def journals_settled(state_dirs: dict[str, Path]) -> list[str]:
    """After the agents stopped: nothing owed or running in any journal."""
    from workers.agent.journal import Journal

    problems = []
    for agent, state_dir in state_dirs.items():
        journal = Journal.open(state_dir)
        try:
            for execution in journal.open_executions():
                problems.append(f"{agent}: journal still holds {execution!r}")
        finally:
            journal.close()
    return problems
