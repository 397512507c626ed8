"""RunLease: the authority binding an Attempt to one Worker Session (docs/adr/0002).

Rows change only through the use cases of this package (`leases.claim`,
`leases.ack`, `leases.end`, `leases.renew`), each a compare-and-set on
(state, version) from `leases.transitions`.
"""

from __future__ import annotations

from django.db import models
from django.db.models import Q


class LeaseSource(models.TextChoices):
    NEW_CLAIM = "new_claim"  # global cycle; token = HMAC(secret, offer_id)
    PULL_CLAIM = "pull_claim"  # a Worker's pull; token chosen by the Worker (docs/adr/0003)


class LeaseState(models.TextChoices):
    ACTIVE = "active"  # the authority binding the Attempt to one Session
    RELEASED = "released"  # the Attempt reached a terminal state
    EXPIRED = "expired"  # passed expires_at (sweeper or audit)
    REVOKED = "revoked"  # session replaced/offline, cancel, operator, max deliveries


class ExecutionOutcome(models.TextChoices):
    """What a reconciling Worker reports about an execution of an earlier Session."""

    KILLED = "killed"  # it was still running and the Worker ended it
    EXITED = "exited"  # it had exited on its own
    NOT_STARTED = "not_started"  # no process was ever spawned


class RunLease(models.Model):
    """The authority binding an Attempt to one Worker Session."""

    # No index of their own (db_index=False): every lookup by attempt is served by
    # runlease_unique_generation (attempt, lease_generation) or runlease_one_active,
    # every lookup by session by runlease_pull (session, pull_id) or
    # runlease_active_session. A lease row is updated without HOT (its state and
    # expires_at are indexed), so each index costs an entry on every transition.
    attempt = models.ForeignKey(
        "runs.Attempt", on_delete=models.PROTECT, related_name="leases", db_index=False
    )
    run = models.ForeignKey("runs.Run", on_delete=models.PROTECT, related_name="leases")
    # No index at all: no read asks for a Worker's leases but among its active
    # ones (the console's slot counts, through runlease_active), and a Worker is
    # never deleted (disabled instead; read-only admin, no API delete).
    worker = models.ForeignKey(
        "workers.Worker", on_delete=models.PROTECT, related_name="leases", db_index=False
    )
    session = models.ForeignKey(
        "workers.WorkerSession", on_delete=models.PROTECT, related_name="leases", db_index=False
    )
    session_generation = models.PositiveIntegerField()
    lease_generation = models.PositiveIntegerField()
    # Unique through Meta.constraints (runlease_offer_id_unique), not unique=True:
    # on PostgreSQL that would add a second, varchar_pattern_ops index for LIKE
    # 'prefix%', and offer ids are only ever matched exactly.
    offer_id = models.CharField(max_length=64)
    token_digest = models.CharField(max_length=64)
    spec_digest = models.CharField(max_length=64)
    placement_score = models.IntegerField(null=True, blank=True)
    source = models.CharField(max_length=16, choices=LeaseSource.choices)
    pull_id = models.UUIDField(null=True, blank=True)
    state = models.CharField(max_length=16, choices=LeaseState.choices, default=LeaseState.ACTIVE)
    version = models.PositiveIntegerField(default=0)
    claimed_at = models.DateTimeField()
    expires_at = models.DateTimeField()
    delivery_count = models.PositiveIntegerField(default=0)
    last_delivered_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    end_reason = models.CharField(max_length=48, blank=True, default="")
    # The Worker's reconcile report (docs/adr/0005): the execution this lease
    # granted is confirmed gone, by whom, when and how. Set once.
    execution_confirmed_at = models.DateTimeField(null=True, blank=True)
    execution_outcome = models.CharField(
        max_length=16, choices=ExecutionOutcome.choices, blank=True, default=""
    )
    execution_exit_code = models.IntegerField(null=True, blank=True)
    execution_confirmed_by = models.CharField(max_length=80, blank=True, default="")

    class Meta:
        # The table keeps the name it had when the model lived in `dispatch`
        # (moved without touching the database, docs/adr/0004).
        db_table = "dispatch_runlease"
        ordering = ["-id"]
        # Leases change only through services: the one operator write is revoking.
        permissions = [("revoke_lease", "Can revoke an active lease")]
        constraints = [
            models.UniqueConstraint(fields=["offer_id"], name="runlease_offer_id_unique"),
            # At most one active lease per Attempt.
            models.UniqueConstraint(
                fields=["attempt"], condition=Q(state="active"), name="runlease_one_active"
            ),
            models.UniqueConstraint(
                fields=["attempt", "lease_generation"], name="runlease_unique_generation"
            ),
            models.CheckConstraint(
                condition=Q(state__in=LeaseState.values), name="runlease_state_valid"
            ),
            models.CheckConstraint(
                condition=Q(source__in=LeaseSource.values), name="runlease_source_valid"
            ),
            models.CheckConstraint(
                condition=Q(lease_generation__gte=1), name="runlease_generation_gte_1"
            ),
        ]
        # No index on `expires_at` (leases.0005): a lease's renewals (its
        # `starting` and `running` ACKs, heartbeats) change only it and
        # `version`, so PostgreSQL updates the row in place (HOT), without a
        # new entry in every index. The expiry sweep reads the active leases
        # through runlease_active (a few per slot) and sorts them.
        indexes = [
            # Recovery scan, slot counting and the expiry sweep touch active leases only.
            models.Index(fields=["id"], name="runlease_active", condition=Q(state="active")),
            models.Index(
                fields=["session"], name="runlease_active_session", condition=Q(state="active")
            ),
            models.Index(fields=["session", "pull_id"], name="runlease_pull"),
        ]

    def __str__(self) -> str:
        return f"lease {self.pk} gen {self.lease_generation} ({self.state})"
