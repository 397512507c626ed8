"""Live output of running Attempts: bounded chunks, stored redacted (docs/adr/0006).

A Worker sends the output of a started Attempt in chunks numbered 1, 2, 3, …
(`output.services.output_append`). Each chunk is stored once (a repeat of a
sequence number is a no-op), redacted of the Task's env values. Per Attempt
at most `QINGLONG_OUTPUT_MAX_BYTES` are kept: the newest chunks (the tail);
older ones are deleted and `AttemptOutput` says how much was dropped, so every
reader can show an explicit truncation marker. The live output of an Attempt
that ended more than `QINGLONG_OUTPUT_RETENTION_DAYS` ago is deleted by the
sweeps (`output.services.output_prune`); its terminal ACK's tail stays on the
Attempt.
"""

from __future__ import annotations

from django.db import models


class AttemptOutput(models.Model):
    """Per-Attempt bookkeeping of its output: the append lock and the truncation marker."""

    attempt = models.OneToOneField(
        "runs.Attempt", on_delete=models.CASCADE, primary_key=True, related_name="output"
    )
    # Highest sequence number accepted (0: none yet); a chunk at or below it is a repeat.
    last_seq = models.PositiveIntegerField(default=0)
    # UTF-8 bytes of the chunks still stored.
    stored_bytes = models.PositiveBigIntegerField(default=0)
    # Chunks up to this sequence number were deleted to keep the total bounded.
    dropped_through_seq = models.PositiveIntegerField(default=0)
    dropped_bytes = models.PositiveBigIntegerField(default=0)
    # Output the Worker reported it skipped (it fell too far behind its process).
    skipped_bytes = models.PositiveBigIntegerField(default=0)
    updated_at = models.DateTimeField()

    class Meta:
        indexes = [
            # The retention sweep's read: the least recently appended first.
            models.Index(fields=["updated_at"], name="attemptoutput_updated"),
        ]

    def __str__(self) -> str:
        return f"output of attempt {self.attempt_id}"


class OutputChunk(models.Model):
    """One accepted chunk of an Attempt's output, redacted."""

    attempt = models.ForeignKey(
        "runs.Attempt", on_delete=models.CASCADE, related_name="output_chunks"
    )
    seq = models.PositiveIntegerField()
    text = models.TextField()
    # UTF-8 bytes of `text` (what counts against the per-Attempt bound).
    size = models.PositiveIntegerField()
    # Output the Worker skipped right before this chunk (0: contiguous).
    skipped_bytes = models.PositiveBigIntegerField(default=0)
    received_at = models.DateTimeField()

    class Meta:
        ordering = ["attempt_id", "seq"]
        constraints = [
            # Idempotency: a retried request with the same sequence number
            # can never store a second copy.
            models.UniqueConstraint(fields=["attempt", "seq"], name="outputchunk_unique_seq"),
        ]

    def __str__(self) -> str:
        return f"attempt {self.attempt_id} chunk {self.seq}"
