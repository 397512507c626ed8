"""One OS process of the multi-process dispatch race (`test_race_postgres.py`).

Run as `python -m dispatch.tests._race_child ROLE DEADLINE [SESSION_PK ...]` with
DATABASE_URL naming the parent's test database. Roles:

- `global`: loops global-scope `dispatch_cycle` (Celery beat on many nodes);
- `puller`: acts as the Workers of the given Sessions: pulls (session scope,
  docs/adr/0003 PullCredential), then ACKs `starting` and `succeeded` for every offer,
  so slots free up while the global dispatchers keep claiming.

Prints one JSON line of counts on stdout when the deadline passes or no work is
left.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
import uuid


def main(argv: list[str]) -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "qinglong.settings_test")
    import django

    django.setup()

    from dispatch.core.ports import DispatchScope, PullCredential, SessionRef
    from dispatch.cycles import cycle_recorder, dispatch_cycle
    from leases.ack import AckPhase, lease_ack
    from leases.errors import LeaseError
    from runs.models import Run, RunState
    from workers.models import WorkerSession

    role, deadline = argv[0], float(argv[1])
    session_pks = [int(pk) for pk in argv[2:]]
    counts = {"cycles": 0, "claims_won": 0, "offers": 0, "acked": 0, "ack_refused": 0}
    refusals: dict[str, int] = {}

    def work_left() -> bool:
        return Run.objects.exclude(
            state__in=(RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED)
        ).exists()

    if role == "global":
        while time.time() < deadline:
            result = dispatch_cycle(scope=DispatchScope.global_())
            counts["cycles"] += 1
            counts["claims_won"] += result.counts.claims_won
            counts["offers"] += len(result.offers)
            if not result.offers and not work_left():
                break
    elif role == "puller":
        sessions = list(WorkerSession.objects.select_related("worker").filter(pk__in=session_pks))
        tokens: dict[str, str] = {}  # offer_id -> the token this "Worker" generated
        while time.time() < deadline:
            busy = False
            for session in sessions:
                credential = PullCredential(str(uuid.uuid4()), secrets.token_urlsafe(32))
                scope = DispatchScope.for_session(
                    SessionRef(str(session.worker_id), str(session.session_id), session.generation)
                )
                result = dispatch_cycle(
                    scope=scope, pull=credential, max_offers=2, session_pk=session.pk
                )
                counts["cycles"] += 1
                counts["claims_won"] += result.counts.claims_won
                counts["offers"] += len(result.offers)
                for offer in result.offers:
                    busy = True
                    token = offer.lease.token or tokens.get(offer.offer_id)
                    if token is None:
                        counts["ack_refused"] += 1
                        continue
                    tokens[offer.offer_id] = token
                    try:
                        for phase in (AckPhase.STARTING, AckPhase.RUNNING, AckPhase.SUCCEEDED):
                            lease_ack(
                                session=session,
                                offer_id=offer.offer_id,
                                phase=phase,
                                lease_token=token,
                                spec_sha256=offer.spec_sha256,
                            )
                        counts["acked"] += 1
                    except LeaseError as err:
                        counts["ack_refused"] += 1
                        refusals[err.code] = refusals.get(err.code, 0) + 1
            if not busy and not work_left():
                break
    else:
        raise SystemExit(f"unknown role {role!r}")
    # The repeats of an outcome are summed into rows at the end: write them now.
    cycle_recorder.flush()
    print(json.dumps({"role": role, **counts, "refusals": refusals}))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
