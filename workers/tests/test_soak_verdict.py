"""The fault soak's verdict on web outages (workers/tests/soak.py).

A web server down for longer than the Session timeout costs the Sessions it
cut off by design, so the soak counts what it cost apart; anything else that
makes a Run run again — a terminal ACK lost to a short restart above all
(issue 10, finding 3) — must stay a violation. These tests pin the line
between the two (`outage_cost`) and that the Cluster records the outages it
causes (down at the fault, up when the restarted node is ready).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from workers.agent import procfs
from workers.tests.soak import Cluster, Outage, outage_cost

S = 10**9
T = 20.0  # Session timeout
HB = 1.0  # heartbeat interval
DOWN = 1_000 * S


def cost(
    outages: list[Outage],
    *,
    start: float = -5,
    state: str = "lost",
    error_code: str | None = "worker_lost",
    beat: float = -0.8,
    ended: float | None = 19.5,
) -> Outage | None:
    """Times in seconds from the outage's start."""
    return outage_cost(
        outages,
        start_ns=DOWN + int(start * S),
        attempt_state=state,
        error_code=error_code,
        beat_ns=DOWN + int(beat * S),
        ended_ns=None if ended is None else DOWN + int(ended * S),
        session_timeout_s=T,
        heartbeat_s=HB,
        now_ns=DOWN + 600 * S,
    )


def outage(seconds: float | None) -> Outage:
    return Outage("web", DOWN, 0 if seconds is None else DOWN + int(seconds * S))


def test_an_outage_over_the_session_timeout_costs_the_sessions_it_cut_off() -> None:
    long = outage(21)
    # The sweep declared the Session offline while the node was down.
    assert cost([long]) is long
    # The agent fenced the Session itself and opened another once it was back.
    assert cost([long], error_code="worker_restarted", ended=22.5) is long
    # The last heartbeat came up to two heartbeats before (a slow one under load).
    assert cost([long], beat=-2.9) is long
    # Just over the Session timeout less a heartbeat on either side.
    assert cost([outage(18.5)], ended=18.2) is not None
    # A node that never came back.
    assert cost([outage(None)]) is not None


def test_a_short_restart_costs_nothing() -> None:
    """Finding 3: a terminal ACK lost to a short restart is a violation, even
    if the Session was lost afterwards."""
    assert cost([outage(9.5)], ended=19.5) is None
    assert cost([outage(17.9)], ended=19.5) is None
    assert cost([outage(5)], error_code="worker_restarted", ended=6) is None


def test_a_session_that_outlived_the_outage_was_not_lost_to_it() -> None:
    long = outage(21)
    # A heartbeat was recorded after the node came back: whatever ended the
    # Session later is another cause.
    assert cost([long], beat=22, ended=45) is None
    # The Session stopped beating long before the node went down.
    assert cost([long], beat=-6) is None
    # The Session was still online.
    assert cost([long], ended=None) is None
    # It ended before the node went down.
    assert cost([long], ended=-1) is None


def test_only_a_lost_session_is_explained() -> None:
    long = outage(21)
    for state, error_code in [
        ("succeeded", None),
        ("failed", "exit_code"),
        ("lost", "not_held"),
        ("lost", "lease_expired"),
        ("lost", "credential_rotated"),
        ("start_failed", "undeliverable"),
    ]:
        assert cost([long], state=state, error_code=error_code) is None, (state, error_code)


def test_an_execution_started_after_the_outage_is_not_its_cost() -> None:
    assert cost([outage(21)], start=21.5, beat=30, ended=60) is None


def test_each_outage_is_judged_on_its_own() -> None:
    short, long = outage(3), Outage("web", DOWN + 100 * S, DOWN + 125 * S)
    assert cost([short, long], start=95, beat=99.5, ended=120) is long
    assert cost([short], start=95, beat=99.5, ended=120) is None


@pytest.mark.skipif(not procfs.procfs_available(), reason="needs Linux /proc")
def test_the_cluster_records_a_web_outage_from_the_fault_to_ready(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    cluster.add("web-1", sleeper, {}, kind="web", ready=lambda: True)
    cluster.add("web-2", sleeper, {}, kind="web", ready=lambda: True)
    cluster.add("agent-a", sleeper, {}, kind="agent", via="web-1")
    cluster.add("agent-b", sleeper, {}, kind="agent", via="web-2")
    cluster.add("agent-c", sleeper, {}, kind="agent")  # talks to any node
    cluster.add("worker", sleeper, {}, kind="celery", ready=lambda: True)
    try:
        for name in ("web-1", "web-2", "worker"):
            cluster.start(name)
        assert cluster.outages == []
        kill = cluster.sigkill("web-1")
        cluster.sigkill("worker")  # not a web node: no outage
        [down] = cluster.outages
        assert (down.node, down.down_ns, down.up_ns) == ("web-1", kill.at_ns, 0)
        cluster.restart("web-1")
        assert down.up_ns >= kill.dead_ns
        term = cluster.sigterm("web-2")
        cluster.restart("web-2")
        assert [(o.node, o.down_ns) for o in cluster.outages] == [
            ("web-1", kill.at_ns),
            ("web-2", term.at_ns),
        ]
        assert all(o.up_ns > o.down_ns for o in cluster.outages)
        assert cluster.agents_of("web-1") == {"agent-a", "agent-c"}
        assert cluster.agents_of("web-2") == {"agent-b", "agent-c"}
    finally:
        cluster.stop_all()
