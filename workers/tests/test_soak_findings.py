"""What the fault soak (workers/tests/test_fault_soak.py) found, one test each.

Finding S1 — an outcome journaled but owed dies with the agent. A job ran to
its end while the web server was down (its terminal ACK waiting); the agent
was killed before the server came back. The restarted agent knew the outcome
(journal: finished, exit code 0) but opened a new Session first, which ended
the Attempt `lost` (`worker_restarted`), and only then reported the outcome
through the reconcile: the Run ran again, and with `max_attempts` 1 it ended
`failed` although its job had succeeded. Now the restarted agent ACKs the
outcome under the Session it ran in (still online) before it opens a new one.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings

from leases.models import RunLease
from runs.models import Run
from workers.agent import procfs
from workers.agent.agent import Agent
from workers.agent.journal import Journal, Outcome
from workers.agent.protocol import Response
from workers.tests.markers import offer_id
from workers.tests.polling import eventually
from workers.tests.test_agent_faults import (
    FlakyProxy,
    attempt_running,
    executions,
    setup,  # noqa: F401  (a fixture)
)
from workers.tests.test_agent_inbox import FakeControlPlane, Spawner, an_offer

# ------------------------------------------------------------ fake plane


def journal_with_owed_outcome(exit_code: int, *, timeout_s: float = 5) -> Journal:
    """What a killed agent left: a finished execution whose terminal ACK it
    never got accepted, under a Session whose token it journaled."""
    journal = Journal.memory()
    journal.record_session(session_id="sid-old", token="session-old", timeout_s=timeout_s)
    offer = an_offer(1)
    journal.record_offer(
        offer_id=offer_id(1),
        spec_sha256=offer["spec_sha256"],
        lease_token=offer["lease"]["token"],
        session_id="sid-old",
    )
    journal.mark_started(offer_id(1))
    journal.mark_spawning(offer_id(1))
    journal.mark_running(offer_id(1), pid=4242, start_time=1, pgid=4242)
    journal.mark_finished(offer_id(1), outcome=Outcome.EXITED, exit_code=exit_code)
    return journal


def agent_for(plane: FakeControlPlane, journal: Journal) -> Agent:
    return Agent(
        transport=plane,
        credential="c" * 43,
        slots=1,
        executor="process",
        spawn=Spawner(journal),
        journal=journal,
        poll_interval_s=0.02,
        retry_initial_s=0.01,
        retry_cap_s=0.05,
    )


@pytest.mark.parametrize(("exit_code", "phase"), [(0, "succeeded"), (3, "failed")])
def test_a_restarted_agent_acks_what_it_owes_under_the_old_session_before_a_new_one(
    exit_code: int, phase: str
) -> None:
    plane = FakeControlPlane()
    plane.token = "session-old"  # the old Session is still online
    journal = journal_with_owed_outcome(exit_code)
    assert agent_for(plane, journal).run(once=True) == 0
    kinds = plane.kinds()
    assert kinds[:3] == ["ack:running", f"ack:{phase}", "sessions"]
    tokens = [token for kind, token, _ in plane.calls if kind.startswith("ack:")]
    assert tokens == ["session-old", "session-old"]
    final = plane.record(f"ack:{phase}")[0]
    assert final["exit_code"] == exit_code
    assert final["lease_token"] == an_offer(1)["lease"]["token"]
    assert "reconcile" not in kinds  # nothing left to reconcile
    execution = journal.get(offer_id(1))
    assert execution is not None and execution.report == "acked"
    assert execution.lease_token == ""  # erased once reported
    # The old Session's token is forgotten once nothing of it is owed.
    assert journal.session("sid-old") is None
    assert journal.session("sid-1") is not None


def test_an_owed_outcome_whose_session_is_gone_goes_to_the_reconcile() -> None:
    plane = FakeControlPlane()  # "session-old" is unknown: 401
    journal = journal_with_owed_outcome(0)
    assert agent_for(plane, journal).run(once=True) == 0
    kinds = plane.kinds()
    assert kinds[0] == "ack:running"  # tried once: the answer is final
    assert "ack:succeeded" not in kinds
    [body] = plane.record("reconcile")
    [item] = body["executions"]
    assert (item["offer_id"], item["outcome"], item["exit_code"]) == (offer_id(1), "exited", 0)


def test_owed_outcomes_are_tried_for_at_most_the_session_timeout() -> None:
    plane = FakeControlPlane()
    plane.down = True
    journal = journal_with_owed_outcome(0, timeout_s=1)
    agent = agent_for(plane, journal)
    original = plane.post
    began = time.monotonic()

    def back_after_timeout(path: str, body: Mapping[str, Any], *, token: str) -> Response:
        if time.monotonic() - began > 1.5:  # past the Session timeout
            plane.down = False
        return original(path, body, token=token)

    plane.post = back_after_timeout  # type: ignore[method-assign]
    assert agent.run(once=True) == 0
    kinds = plane.kinds()
    first_open = kinds.index("sessions")
    assert set(kinds[:first_open]) == {"ack:running"}  # retried, then given up
    assert "reconcile" in kinds


# ------------------------------------------------------------ real processes


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(not procfs.procfs_available(), reason="needs Linux /proc")
@override_settings(QINGLONG_HEARTBEAT_INTERVAL_S=1, QINGLONG_HEARTBEAT_MIN_INTERVAL_S=0)
def test_finding_s1_a_job_that_ended_during_an_outage_is_not_run_again_after_a_crash(
    live_server,
    setup,  # noqa: F811  (the fixture imported above)
) -> None:
    host, port = live_server.thread.host, live_server.thread.port
    proxy = FlakyProxy((host, port))
    try:
        run, agent, log = setup(proxy.url, long_s=1.5, max_attempts=1)
        agent.start()
        eventually(lambda: attempt_running(run), 30, "running")
        proxy.set("refused")  # the web server goes down while the job runs
        eventually(lambda: any(e.ended for e in executions(log)), 10, "the job ended")
        time.sleep(1)  # its outcome is journaled; the terminal ACK waits
        agent.kill9()
        proxy.set("up")
        agent.start()  # same --state-dir
        eventually(lambda: Run.objects.get(pk=run.pk).state != "running", 30, "the Run ended")
    finally:
        agent.stop()
        proxy.close()
    run.refresh_from_db()
    [attempt] = run.attempts.all()
    assert (run.state, attempt.state, attempt.exit_code) == ("succeeded", "succeeded", 0)
    assert len(executions(log)) == 1  # never again
    lease = RunLease.objects.get(attempt=attempt)
    assert (lease.state, lease.end_reason) == ("released", "ack_succeeded")
    events = agent.events()
    assert [e["status"] for e in events if e["event"] == "owed_ack"] == ["acked"]
    assert not any(e["event"] == "execution_reconciled" for e in events)


def test_the_journal_keeps_a_session_token_only_while_something_of_it_is_owed(
    tmp_path: Path,
) -> None:
    journal = Journal.open(tmp_path / "state")
    try:
        journal.record_session(session_id="a", token="tok-a", timeout_s=30)
        journal.record_session(session_id="b", token="tok-b", timeout_s=30)
        journal.record_offer(offer_id="o1", spec_sha256="d", lease_token="l", session_id="a")
        assert journal.forget_sessions(keep="b") == 0  # o1 of "a" is open
        journal.mark_reported("o1", report="acked")
        assert journal.forget_sessions(keep="b") == 1
        assert journal.session("a") is None
        record = journal.session("b")
        assert record is not None and record.token == "tok-b" and "tok-b" not in repr(record)
    finally:
        journal.close()
    assert (tmp_path / "state" / "journal.sqlite3").stat().st_mode & 0o777 == 0o600
