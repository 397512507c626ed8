"""The Worker Registry and Worker Sessions (docs/architecture.md "Data model").

Secrets are stored only as SHA-256 digests: the Worker credential (issued once
by an operator) and each Session token (shown once, when the Session opens).
"""

from __future__ import annotations

from django.db import models
from django.db.models import Q


class WorkerAdminState(models.TextChoices):
    ACTIVE = "active"  # takes new claims
    DRAINING = "draining"  # keeps its leases, takes no new claims
    DISABLED = "disabled"  # may not open Sessions


class Worker(models.Model):
    """A registered executor node."""

    name = models.SlugField(max_length=100, unique=True)
    credential_digest = models.CharField(max_length=64, unique=True)
    # First characters of the credential, so an operator can tell two apart.
    credential_prefix = models.CharField(max_length=12, blank=True, default="")
    executor_types = models.JSONField(default=list)
    labels = models.JSONField(default=dict, blank=True)
    slots = models.PositiveIntegerField(default=1)
    admin_state = models.CharField(
        max_length=16, choices=WorkerAdminState.choices, default=WorkerAdminState.ACTIVE
    )
    # The newest Session generation handed out; a new Session takes +1.
    last_generation = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    credential_rotated_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["id"]
        # A new credential opens a Session: more than changing a Worker (README
        # "Admin permissions").
        permissions = [("rotate_credential", "Can rotate a Worker's credential")]
        constraints = [
            models.CheckConstraint(
                condition=Q(admin_state__in=WorkerAdminState.values),
                name="worker_admin_state_valid",
            ),
            models.CheckConstraint(condition=Q(slots__gte=1), name="worker_slots_gte_1"),
        ]

    def __str__(self) -> str:
        return self.name


class SessionState(models.TextChoices):
    ONLINE = "online"  # current, takes new claims
    DRAINING = "draining"  # current, keeps its leases, no new claims
    OFFLINE = "offline"  # missed heartbeats (terminal for this Session)
    REPLACED = "replaced"  # fenced by a newer Session of the same Worker (terminal)


SESSION_CURRENT_STATES = (SessionState.ONLINE, SessionState.DRAINING)
SESSION_ENDED_STATES = (SessionState.OFFLINE, SessionState.REPLACED)


class SessionEndReason(models.TextChoices):
    """Why a Session ended; the 401 a fenced token gets tells the Worker what to do."""

    SESSION_REPLACED = "session_replaced"  # a newer Session of the Worker opened
    SESSION_OFFLINE = "session_offline"  # missed heartbeats
    WORKER_DISABLED = "worker_disabled"  # an operator disabled the Worker
    CREDENTIAL_ROTATED = "credential_rotated"  # the credential it was opened with is void


class WorkerSession(models.Model):
    """One live connection of a Worker; only the newest is current."""

    # No index of its own: workersession_unique_generation (worker, generation)
    # serves every lookup by worker.
    worker = models.ForeignKey(
        Worker, on_delete=models.PROTECT, related_name="sessions", db_index=False
    )
    session_id = models.UUIDField(unique=True)
    generation = models.PositiveIntegerField()
    state = models.CharField(
        max_length=16, choices=SessionState.choices, default=SessionState.ONLINE
    )
    # Unique through Meta.constraints (workersession_token_digest_unique): unique=True
    # would add a varchar_pattern_ops index on PostgreSQL, and a digest is only
    # ever matched exactly.
    token_digest = models.CharField(max_length=64)
    executor_types = models.JSONField(default=list)
    labels = models.JSONField(default=dict, blank=True)
    slots = models.PositiveIntegerField(default=1)
    agent_version = models.CharField(max_length=64, blank=True, default="")
    heartbeat_at = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    end_reason = models.CharField(
        max_length=32, choices=SessionEndReason.choices, blank=True, default=""
    )
    # Set by the retention sweep on an ended Session that leases point at: it
    # stays with their history, and the sweep never examines it again (so each
    # sweep stays bounded however many such Sessions accumulate).
    kept_for_leases = models.BooleanField(default=False)
    version = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["token_digest"], name="workersession_token_digest_unique"
            ),
            models.UniqueConstraint(
                fields=["worker", "generation"], name="workersession_unique_generation"
            ),
            # At most one current Session per Worker.
            models.UniqueConstraint(
                fields=["worker"],
                condition=Q(state__in=["online", "draining"]),
                name="workersession_one_current",
            ),
            models.CheckConstraint(
                condition=Q(state__in=SessionState.values), name="workersession_state_valid"
            ),
            models.CheckConstraint(condition=Q(slots__gte=1), name="workersession_slots_gte_1"),
        ]
        indexes = [
            # The Worker snapshot scan (keyset by worker id) and the offline
            # sweeper read current Sessions by worker through the unique
            # workersession_one_current above (same column, same condition).
            models.Index(
                fields=["heartbeat_at"],
                name="workersession_heartbeat",
                condition=Q(state__in=["online", "draining"]),
            ),
            # The retention sweep: ended Sessions not yet found to carry leases.
            models.Index(
                fields=["ended_at", "id"],
                name="workersession_prunable",
                condition=Q(state__in=["offline", "replaced"], kept_for_leases=False),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.worker_id}#{self.generation} ({self.state})"
