"""`manage.py audit_leases`: classify every active lease; `--expire` repairs them.

The active RunLease is the recovery authority (docs/adr/0002), so an active lease that
can no longer be honoured — expired, fenced Session, cancelled Run, an Attempt
that moved on, a pinned spec that no longer hashes to the lease's digest — is
what an operator must see. Repairs go through the same services the sweepers
use (`lease_expire`, `lease_revoke`), so the audit can never do anything a
sweeper could not.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, Final

from django.core.management.base import BaseCommand, CommandParser

from dispatch.core.errors import SpecError
from dispatch.core.policy import spec_matches_lease
from dispatch.core.spec import spec_sha256
from leases import policy
from leases.end import lease_expire, lease_revoke
from leases.errors import Outcome
from leases.models import LeaseState, RunLease
from qinglong.clock import db_now
from runs.models import ATTEMPT_TERMINAL_STATES, RUN_TERMINAL_STATES, AttemptState
from runs.services import attempt_spec
from workers.models import SessionState

# Healthy categories first, then problems in the order they are checked: the
# first matching problem names the lease.
HEALTHY: Final = ("deliverable", "awaiting_start", "running", "cancelling")
PROBLEMS: Final = (
    "orphaned",
    "expired",
    "session_replaced",
    "session_offline",
    "cancelled",
    "spec_drift",
)
CATEGORIES: Final = HEALTHY + PROBLEMS
# The reason recorded on a repaired lease (end_reason / AttemptEvent.reason).
REVOKE_REASONS: Final = {
    "orphaned": "audit_orphaned",
    "session_replaced": "session_replaced",
    "session_offline": "session_offline",
    "cancelled": "run_cancelled",
    "spec_drift": "spec_drift",
}
PAGE_SIZE: Final = 200


@dataclass(frozen=True)
class LeaseFinding:
    lease_id: int
    attempt_id: int
    attempt_state: AttemptState
    worker_id: int
    session_generation: int
    lease_generation: int
    category: str


def classify(lease: RunLease, *, now: datetime) -> str:
    attempt, run, session = lease.attempt, lease.run, lease.session
    if (
        attempt.state in ATTEMPT_TERMINAL_STATES
        or attempt.state == AttemptState.PENDING
        or run.state in RUN_TERMINAL_STATES
        or attempt.lease_generation != lease.lease_generation
        or session.generation != lease.session_generation
    ):
        return "orphaned"
    if not policy.lease_is_live(lease, now=now):
        return "expired"
    if not policy.session_may_act(session, generation=lease.session_generation):
        # Fenced at the lease's own generation (checked above): the Session
        # was replaced or went offline, and the category names which.
        return f"session_{SessionState(session.state)}"
    if run.cancel_requested:
        # A started Attempt of a cancelled Run is the normal in-progress cancel:
        # heartbeats and ACKs carry the verdict and the Worker's terminal ACK
        # ends it. Only a lease that never started should have been revoked.
        if attempt.state in (AttemptState.STARTING, AttemptState.RUNNING):
            return "cancelling"
        return "cancelled"
    if _spec_drifted(lease):
        return "spec_drift"
    if attempt.state in (AttemptState.STARTING, AttemptState.RUNNING):
        return "running"
    if lease.last_delivered_at is not None:
        # Pulled or announced to its Session, not yet ACKed starting.
        return "awaiting_start"
    return "deliverable"


def _spec_drifted(lease: RunLease) -> bool:
    # Re-materialize from the pinned revision exactly as recovery does
    # (docs/adr/0001 step 1); a revision that no longer validates is drift too.
    try:
        spec = attempt_spec(attempt=lease.attempt, run=lease.run, revision=lease.run.task_revision)
    except SpecError:
        return True
    return not spec_matches_lease(spec_sha256(spec), lease.spec_digest)


def audit(*, now: datetime) -> list[LeaseFinding]:
    """Every active lease, classified; read-only, paged by id."""
    findings: list[LeaseFinding] = []
    after = 0
    while True:
        page = list(
            RunLease.objects.filter(state=LeaseState.ACTIVE, pk__gt=after)
            .select_related("attempt", "run", "run__task_revision", "session")
            .order_by("id")[:PAGE_SIZE]
        )
        for lease in page:
            findings.append(
                LeaseFinding(
                    lease_id=lease.pk,
                    attempt_id=lease.attempt_id,
                    attempt_state=AttemptState(lease.attempt.state),
                    worker_id=lease.worker_id,
                    session_generation=lease.session_generation,
                    lease_generation=lease.lease_generation,
                    category=classify(lease, now=now),
                )
            )
        if len(page) < PAGE_SIZE:
            return findings
        after = page[-1].pk


def repair(finding: LeaseFinding) -> Outcome:
    if finding.category == "expired":
        # lease_expire re-checks expiry by the database clock under the locks.
        return lease_expire(finding.lease_id)
    return lease_revoke(finding.lease_id, reason=REVOKE_REASONS[finding.category])


class Command(BaseCommand):
    help = (
        "Audit every ACTIVE RunLease and classify it: deliverable, awaiting_start "
        "(delivered, no starting ACK), running, cancelling (started, its Run's "
        "cancel waits for the Worker's terminal ACK) (healthy); orphaned (Attempt/Run "
        "state inconsistent with an active lease), expired (past expires_at by the "
        "database clock), session_replaced, session_offline, cancelled (Run cancelled, lease "
        "never started), "
        "spec_drift (the pinned revision no longer hashes to the lease's digest) "
        "(problems). Prints counts per category and one row per lease (ids, "
        "generations, category; never a spec or token). Read-only unless --expire, "
        "which repairs every problem through the lease services (expire or revoke). "
        "Exit status: 0 = nothing to fix; 1 = problems found (read-only run); "
        "0 after --expire repaired them all; 1 if --expire could not repair some."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="Print the report as JSON.")
        parser.add_argument(
            "--expire",
            action="store_true",
            help="Repair what the audit reports (lease_expire / lease_revoke).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        findings = audit(now=db_now())
        counts = Counter({category: 0 for category in CATEGORIES})
        counts.update(finding.category for finding in findings)
        problems = [f for f in findings if f.category in PROBLEMS]
        repaired: Counter[str] = Counter()
        unrepaired = 0
        if options["expire"]:
            for finding in problems:
                outcome = repair(finding)
                repaired[str(outcome)] += 1
                if outcome is not Outcome.APPLIED and _still_active(finding.lease_id):
                    unrepaired += 1
        report: dict[str, Any] = {
            "leases": len(findings),
            "problems": len(problems),
            "counts": dict(counts),
            "rows": [asdict(f) for f in findings],
        }
        if options["expire"]:
            report["repaired"] = dict(repaired)
            report["unrepaired"] = unrepaired
        if options["json"]:
            self.stdout.write(json.dumps(report, sort_keys=True))
        else:
            self._write_table(report)
        failed = unrepaired > 0 if options["expire"] else bool(problems)
        if failed:
            # Exit 1 without a traceback (CommandError would print one line to
            # stderr and also exit 1, but the report already says everything).
            raise SystemExit(1)

    def _write_table(self, report: dict[str, Any]) -> None:
        self.stdout.write(f"{report['leases']} active leases, {report['problems']} problems")
        for category in CATEGORIES:
            self.stdout.write(f"  {category:<17} {report['counts'][category]}")
        if report["rows"]:
            self.stdout.write("lease    attempt  state      worker  s.gen  l.gen  category")
        for row in report["rows"]:
            self.stdout.write(
                f"{row['lease_id']:<8} {row['attempt_id']:<8} {row['attempt_state']:<10} "
                f"{row['worker_id']:<7} {row['session_generation']:<6} "
                f"{row['lease_generation']:<6} {row['category']}"
            )
        if "repaired" in report:
            self.stdout.write(f"repaired: {report['repaired']}; unrepaired: {report['unrepaired']}")


def _still_active(lease_id: int) -> bool:
    # UNCHANGED / LOST_RACE means someone else ended or renewed it meanwhile:
    # only a lease still active and still a problem counts as unrepaired.
    lease = (
        RunLease.objects.filter(pk=lease_id, state=LeaseState.ACTIVE)
        .select_related("attempt", "run", "run__task_revision", "session")
        .first()
    )
    return lease is not None and classify(lease, now=db_now()) in PROBLEMS
