"""SQL statements per claimed Run on PostgreSQL (issue #12): counted, never timed.

Issue #12's goal was at most 5 statements per claimed Run in a global cycle
that claims its budget (every read of the cycle included: kill switch,
clock, recovery, candidates, Workers, plans, the DispatchCycle row); the
cycle's page of claims is one transaction (BEGIN, 2 statements, COMMIT),
which brings it under 2. A claim without quotas is 2 statements and an ACK 2
(the write of a success also tells whether the Run's Project has a webhook
subscription; only then are its deliveries read and written), each plus its
transaction's BEGIN and COMMIT, which are counted like every other round trip. Measured the way
bench/e2e_bench.py does, outside any test transaction (`transaction=True`),
so no savepoint is counted.
"""

from __future__ import annotations

import secrets
import uuid

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from dispatch.core.offer import ClaimedExecutionOffer
from dispatch.core.ports import DispatchScope, PullCredential, SessionRef
from dispatch.cycles import cycle_recorder, dispatch_budget, dispatch_cycle
from leases.ack import AckPhase, lease_ack
from leases.claim import lease_claim
from notifications.models import WebhookDelivery
from qinglong import testing

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

# Issue #12's goal was 5; a page of claims in one transaction (docs/adr/0011)
# brings a global cycle of 8 claims to about 1.5.
MAX_STATEMENTS_PER_CLAIMED_RUN = 2


def _statements(queries: CaptureQueriesContext) -> list[str]:
    return [q["sql"] for q in queries.captured_queries]


def test_a_global_cycle_that_claims_its_budget_costs_at_most_five_statements_per_run() -> None:
    budget = dispatch_budget().max_claim_attempts
    worker, _ = testing.make_worker(slots=budget)
    testing.open_session(worker)
    task = testing.make_task()
    for _ in range(budget * 3):
        testing.make_run(task)
    dispatch_cycle(scope=DispatchScope.global_())  # warm-up: first row of the outcome
    testing.open_session(worker)  # a fresh Session of the Worker: every slot free again
    with CaptureQueriesContext(connection) as queries:
        result = dispatch_cycle(scope=DispatchScope.global_())
    won = result.counts.claims_won
    assert won == budget
    statements = _statements(queries)
    print(f"\nglobal cycle: {len(statements)} statements for {won} claims")
    assert len(statements) / won <= MAX_STATEMENTS_PER_CLAIMED_RUN, "\n".join(statements)
    # The claims themselves: one transaction for the page.
    assert statements.count("BEGIN") == statements.count("COMMIT") == 1, statements


def _claim_and_ack_each_phase(*, subscribed: bool) -> tuple[int, dict[AckPhase, int]]:
    """Statements of one claim and of each of its ACKs (subscribed: the Run's
    Project has a webhook subscription to `run.succeeded`)."""
    session = testing.open_session().session
    run = testing.make_run()
    if subscribed:
        testing.subscribe_to_success(run)
    attempt = testing.pending_attempt(run)
    request, token = testing.claim_request(attempt, session)
    with CaptureQueriesContext(connection) as claim:
        outcome = lease_claim(request)
    assert outcome.status == "won"
    # Its transaction's BEGIN and COMMIT are round trips too, and counted.
    statements = _statements(claim)
    assert (statements[0], statements[-1], len(statements)) == ("BEGIN", "COMMIT", 4), statements

    counts = {}
    for phase in (AckPhase.STARTING, AckPhase.RUNNING, AckPhase.SUCCEEDED):
        with CaptureQueriesContext(connection) as ack:
            lease_ack(
                session=session,
                offer_id=request.offer_id,
                phase=phase,
                lease_token=token,
                spec_sha256=request.spec_sha256,
                executor_handle="pid:1",
                exit_code=0,
            )
        counts[phase] = len(ack.captured_queries)
    return len(statements), counts


def test_a_claim_is_two_statements_and_each_ack_one() -> None:
    claim, acks = _claim_and_ack_each_phase(subscribed=False)
    assert claim == 4
    # Each ACK locks, checks and writes in one statement in autocommit
    # (leases.ack_statement): no BEGIN, no COMMIT; the success's statement
    # also found that the Project has no webhook subscription.
    assert acks == {AckPhase.STARTING: 1, AckPhase.RUNNING: 1, AckPhase.SUCCEEDED: 1}
    assert not WebhookDelivery.objects.exists()


def test_a_success_in_a_project_with_a_webhook_subscription_records_its_delivery() -> None:
    _, acks = _claim_and_ack_each_phase(subscribed=True)
    # notifications.services.run_event_emit reads the subscriptions and writes
    # the delivery in the ACK's transaction: the one statement writes nothing
    # and the portable path (BEGIN, locks, writes, more, COMMIT) applies it.
    assert acks[AckPhase.STARTING] == acks[AckPhase.RUNNING] == 1
    assert acks[AckPhase.SUCCEEDED] > 5
    assert list(WebhookDelivery.objects.values_list("event", flat=True)) == ["run.succeeded"]


def test_a_pull_that_claims_one_run_is_five_statements() -> None:
    session = testing.open_session(testing.make_worker(slots=4)[0]).session
    task = testing.make_task()
    for _ in range(4):
        testing.make_run(task)
    ref = SessionRef(str(session.worker_id), str(session.session_id), session.generation)
    scope = DispatchScope.for_session(ref)

    def pull() -> tuple[PullCredential, list[ClaimedExecutionOffer]]:
        credential = PullCredential(pull_id=str(uuid.uuid4()), token=secrets.token_urlsafe(32))
        result = dispatch_cycle(scope=scope, pull=credential, max_offers=1, session_pk=session.pk)
        assert result.counts.claims_won == 1
        return credential, list(result.offers)

    def start(credential: PullCredential, offers: list[ClaimedExecutionOffer]) -> None:
        for offer in offers:  # started: no longer re-delivered, so the next pull claims
            lease_ack(
                session=session,
                offer_id=offer.offer_id,
                phase=AckPhase.STARTING,
                lease_token=credential.token,
                spec_sha256=offer.spec_sha256,
            )

    # Warm-up: the revision is read once per process, and the first cycle of
    # each outcome (more behind, then the last Runs) writes its row.
    cycle_recorder.reset()
    start(*pull())
    start(*pull())
    with CaptureQueriesContext(connection) as queries:
        pull()
    # The snapshot (kill switch and clock, over-delivered and re-deliverable
    # leases, the Session, the first walk and the first servable group's
    # rows: dispatch.cycles.pull_snapshot), the claim (BEGIN, lock, guard and
    # writes, COMMIT);
    # the lease is written delivered, so no telemetry write, and the outcome's
    # row is summed (dispatch.cycles.CycleRecorder).
    statements = _statements(queries)
    print(f"\npull claiming 1: {len(statements)} statements")
    assert len(statements) == 5, statements
    assert (statements[1], statements[4]) == ("BEGIN", "COMMIT"), statements
