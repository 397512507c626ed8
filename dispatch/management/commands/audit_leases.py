"""`manage.py audit_leases`: classify every active lease; `--expire` repairs them.

The classification is `leases.audit` (the admin overview shows the same
categories). Repairs go through the same services the sweepers use
(`lease_expire`, `lease_revoke`), so the audit can never do anything a sweeper
could not.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from leases.audit import CATEGORIES, PROBLEMS, REVOKE_REASONS, LeaseFinding, audit, classify
from leases.end import lease_expire, lease_revoke
from leases.errors import Outcome
from leases.models import LeaseState, RunLease
from qinglong.clock import db_now
from runs.models import AttemptState


def repair(finding: LeaseFinding) -> Outcome:
    if finding.category == "expired":
        # lease_expire re-checks expiry by the database clock under the locks.
        return lease_expire(finding.lease_id)
    if finding.category == "over_delivered":
        # The sweep's own revoke: still claimed under the locks, or left alone
        # (a starting ACK that won meanwhile keeps its lease).
        return lease_revoke(
            finding.lease_id,
            reason=REVOKE_REASONS[finding.category],
            only_if_attempt_state=AttemptState.CLAIMED,
        )
    return lease_revoke(finding.lease_id, reason=REVOKE_REASONS[finding.category])


class Command(BaseCommand):
    help = (
        "Audit every ACTIVE RunLease and classify it: deliverable, awaiting_start "
        "(delivered, no starting ACK), running, cancelling (started, its Run's "
        "cancel waits for the Worker's terminal ACK) (healthy); orphaned (Attempt/Run "
        "state inconsistent with an active lease), expired (past expires_at by the "
        "database clock), session_replaced, session_offline (repaired as worker_restarted "
        "and worker_lost), cancelled (Run cancelled, lease never started), "
        "spec_drift (the pinned revision no longer hashes to the lease's digest), "
        "over_delivered (pulled max_deliveries times without a starting ACK) "
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
