"""DispatchCycle records and the operator kill switch (RunLease lives in `leases.models`)."""

from __future__ import annotations

from django.db import models
from django.db.models import Q


class DispatchCycle(models.Model):
    """A redacted record of dispatch cycles: `DispatchCycleResult.summary()`.

    One row is one cycle, or (`cycles` > 1) the summary of that many cycles of
    one outcome in one process and window, counts summed (`dispatch.cycles.CycleRecorder`).
    """

    started_at = models.DateTimeField()
    observed_at = models.DateTimeField(null=True, blank=True)
    duration_ms = models.PositiveIntegerField(default=0)
    scope = models.CharField(max_length=16)
    status = models.CharField(max_length=16)
    reason = models.CharField(max_length=48)
    truncated = models.BooleanField(default=False)
    counts = models.JSONField(default=dict, blank=True)
    # Which Session pulled (session scope); never a token.
    session_id = models.UUIDField(null=True, blank=True)
    # How many cycles of this outcome the row stands for (1: the row is one cycle).
    cycles = models.PositiveIntegerField(default=1)

    class Meta:
        ordering = ["-id"]
        indexes = [
            models.Index(fields=["started_at"], name="dispatchcycle_started"),
            # The overview's newest truncated cycles, however many cycles there are.
            models.Index(
                fields=["id"], name="dispatchcycle_truncated", condition=Q(truncated=True)
            ),
        ]

    def __str__(self) -> str:
        return f"cycle {self.pk} {self.scope} {self.status}/{self.reason}"


class DispatchControl(models.Model):
    """The operator kill switch: a single row (pk=1)."""

    paused = models.BooleanField(default=False)
    reason = models.CharField(max_length=200, blank=True, default="")
    updated_at = models.DateTimeField(auto_now=True)
    updated_by = models.CharField(max_length=150, blank=True, default="")

    class Meta:
        verbose_name = "dispatch control"
        # The kill switch is its own permission: `change_dispatchcontrol` alone
        # flips nothing (README "Admin permissions").
        permissions = [("pause_dispatch", "Can pause and resume dispatch")]

    def __str__(self) -> str:
        return "dispatch paused" if self.paused else "dispatch running"
