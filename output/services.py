"""Live output: the Worker's append and the operator's reads (docs/adr/0006).

`output_append` is the use case behind `POST /api/v1/worker/leases/{offer_id}/output`.
Only the Session holding the lease, with the lease token, may append, and only
while the lease is active and its Attempt started (`starting`/`running` at the
lease's generation), like a `running` ACK. A chunk is redacted of the pinned
revision's env values before it is stored (`output.redaction`), a repeat of a
sequence number stores nothing, and the per-Attempt total is bounded: the
oldest chunks are deleted and counted as dropped (a truncation marker every
reader shows).

Appends of one Attempt are serialized by a lock on its `AttemptOutput` row
(taken alone: no Run, Attempt or lease row is locked, so an append never waits
on an ACK or a sweep, nor they on it). The lease is checked before that lock,
without one: an append that races the terminal ACK may land just after it,
which stores output the process did write.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final

from django.conf import settings
from django.db import transaction

from dispatch.core.offer import token_digest, tokens_equal
from dispatch.core.ports import to_rfc3339
from leases import policy
from leases.errors import LeaseConflict, LeaseForbidden, LeaseNotFound
from leases.models import LeaseState, RunLease
from output.models import AttemptOutput, OutputChunk
from output.redaction import redact, redact_joined, redaction_values
from qinglong.clock import db_now
from runs.models import ATTEMPT_TERMINAL_STATES, Attempt, AttemptState, Run
from workers.models import WorkerSession

__all__ = [
    "MAX_OUTPUT_PAGE",
    "OUTPUT_PRUNE_BATCH",
    "OutputAppendResult",
    "OutputPage",
    "OutputTail",
    "output_append",
    "output_page",
    "output_prune",
    "output_tail",
]

logger = logging.getLogger("qinglong.output")

# Chunks one read returns at most (16 KiB each as sent: about 1 MiB).
MAX_OUTPUT_PAGE: Final = 64
_STARTED = (AttemptState.STARTING, AttemptState.RUNNING)
# Chunks deleted per query while trimming to the bound.
_TRIM_BATCH: Final = 64
_UNSTORABLE: Final = re.compile("[\x00\ud800-\udfff]")
# Attempts whose output one retention call deletes (each at most QL_OUTPUT_MAX_BYTES).
OUTPUT_PRUNE_BATCH: Final = 50


def max_output_bytes() -> int:
    return int(settings.QINGLONG_OUTPUT_MAX_BYTES)


@dataclass(frozen=True)
class OutputAppendResult:
    seq: int
    stored: bool  # False: a repeat of a sequence number already accepted
    cancel_requested: bool  # the Run was cancelled: stop the Attempt


def _utf8_size(text: str) -> int:
    return len(text.encode("utf-8"))


def _authorized_lease(*, session: WorkerSession, offer_id: str, lease_token: str) -> RunLease:
    """The lease, refused exactly like an ACK would refuse it (404, 403, 409)."""
    lease = (
        RunLease.objects.select_related("attempt", "run__task_revision")
        .only(
            "id",
            "session_id",
            "session_generation",
            "lease_generation",
            "token_digest",
            "state",
            "expires_at",
            "attempt__id",
            "attempt__state",
            "attempt__lease_generation",
            "run__id",
            "run__cancel_requested",
            "run__task_revision__env",
        )
        .filter(offer_id=offer_id)
        .first()
    )
    if lease is None:
        raise LeaseNotFound("no lease with that offer id")
    if lease.session_id != session.pk:
        raise LeaseForbidden("the lease belongs to another session")
    if not tokens_equal(token_digest(lease_token), lease.token_digest):
        raise LeaseForbidden("the lease token does not match", code="lease_token_invalid")
    if not policy.session_may_act(session, generation=lease.session_generation):
        raise LeaseConflict("the session is no longer current", code=f"session_{session.state}")
    if lease.state != LeaseState.ACTIVE:
        raise LeaseConflict(f"the lease is {lease.state}", code=f"lease_{lease.state}")
    if not policy.lease_is_live(lease, now=db_now()):
        raise LeaseConflict("the lease has expired", code="lease_expired")
    attempt = lease.attempt
    if attempt.lease_generation != lease.lease_generation:
        raise LeaseConflict("the lease is stale", code="lease_stale")
    if attempt.state not in _STARTED:
        # Output exists only once the Worker may run it (after `starting`).
        raise LeaseConflict(f"output is not accepted while {attempt.state}", code="not_started")
    return lease


def output_append(
    *,
    session: WorkerSession,
    offer_id: str,
    lease_token: str,
    seq: int,
    chunk: str,
    skipped_bytes: int = 0,
) -> OutputAppendResult:
    """Store one chunk of a started Attempt's output (idempotent per sequence number)."""
    lease = _authorized_lease(session=session, offer_id=offer_id, lease_token=lease_token)
    attempt_id = lease.attempt.pk
    cancel_requested = lease.run.cancel_requested
    values = redaction_values(lease.run.task_revision.env)
    # NUL and lone surrogates as U+FFFD (a text column refuses NUL), as for the tail.
    text = _UNSTORABLE.sub("\ufffd", chunk)
    with transaction.atomic(durable=True):
        now = db_now()
        AttemptOutput.objects.get_or_create(attempt_id=attempt_id, defaults={"updated_at": now})
        # The append lock of this Attempt (taken alone, see the module docstring).
        book = AttemptOutput.objects.select_for_update().get(attempt_id=attempt_id)
        if seq <= book.last_seq:
            return OutputAppendResult(seq=seq, stored=False, cancel_requested=cancel_requested)
        previous = None
        if skipped_bytes == 0 and seq == book.last_seq + 1:
            previous = OutputChunk.objects.filter(attempt_id=attempt_id, seq=book.last_seq).first()
        if previous is not None:
            # A value split across two chunks is redacted too (output.redaction).
            head, text = redact_joined(previous.text, text, values)
            if head != previous.text:
                size = _utf8_size(head)
                book.stored_bytes += size - previous.size
                OutputChunk.objects.filter(pk=previous.pk).update(text=head, size=size)
        else:
            text = redact(text, values)
        size = _utf8_size(text)
        OutputChunk.objects.create(
            attempt_id=attempt_id,
            seq=seq,
            text=text,
            size=size,
            skipped_bytes=skipped_bytes,
            received_at=now,
        )
        book.last_seq = seq
        book.stored_bytes += size
        book.skipped_bytes += skipped_bytes
        book.updated_at = now
        _trim(book)
        book.save()
    return OutputAppendResult(seq=seq, stored=True, cancel_requested=cancel_requested)


def _trim(book: AttemptOutput) -> None:
    """Keep the newest chunks within the bound; count what is deleted (the marker)."""
    limit = max_output_bytes()
    while book.stored_bytes > limit:
        # The newest chunk is always kept, whatever its size.
        oldest = list(
            OutputChunk.objects.filter(attempt_id=book.attempt_id, seq__lt=book.last_seq)
            .order_by("seq")
            .values_list("id", "seq", "size")[:_TRIM_BATCH]
        )
        doomed: list[int] = []
        for chunk_id, seq, size in oldest:
            if book.stored_bytes <= limit:
                break
            doomed.append(chunk_id)
            book.stored_bytes -= size
            book.dropped_bytes += size
            book.dropped_through_seq = seq
        if not doomed:
            return
        OutputChunk.objects.filter(pk__in=doomed).delete()


# ---------------------------------------------------------------------- reads


@dataclass(frozen=True)
class OutputPage:
    """A keyset page of one Attempt's output after a sequence number."""

    attempt: Attempt | None
    latest_attempt: int | None  # the Run's newest Attempt: a retry may follow this one
    chunks: list[OutputChunk]
    next_after: int  # pass as `after` to read on
    more: bool  # more chunks are stored after this page: read again now
    live: bool  # the Attempt may still produce output: poll again later
    dropped_through_seq: int
    dropped_bytes: int
    skipped_bytes: int

    def as_json(self) -> dict[str, Any]:
        return {
            "attempt": (
                None
                if self.attempt is None
                else {
                    "id": str(self.attempt.pk),
                    "number": self.attempt.number,
                    "state": self.attempt.state,
                }
            ),
            "latest_attempt": self.latest_attempt,
            "chunks": [
                {
                    "seq": c.seq,
                    "text": c.text,
                    "skipped_bytes": c.skipped_bytes,
                    "received_at": to_rfc3339(c.received_at),
                }
                for c in self.chunks
            ],
            "next_after": self.next_after,
            "more": self.more,
            "live": self.live,
            "truncated": (
                None
                if not self.dropped_through_seq
                else {
                    "dropped_through_seq": self.dropped_through_seq,
                    "dropped_bytes": self.dropped_bytes,
                }
            ),
            "skipped_bytes": self.skipped_bytes,
        }


def _attempt_of(run_id: int, number: int | None) -> Attempt | None:
    qs = Attempt.objects.filter(run_id=run_id).only("id", "number", "state", "run_id")
    if number is not None:
        return qs.filter(number=number).first()
    return qs.order_by("-number").first()


def output_page(
    *,
    run_id: int,
    attempt_number: int | None = None,
    after: int = 0,
    limit: int = MAX_OUTPUT_PAGE,
) -> OutputPage | None:
    """Chunks with `seq > after` of one Attempt of a Run (default: its newest Attempt).

    None when the Run does not exist. Bounded: at most `limit` chunks (capped at
    `MAX_OUTPUT_PAGE`), read by the (attempt, seq) unique index.
    """
    if not Run.objects.filter(pk=run_id).exists():
        return None
    latest = _attempt_of(run_id, None)
    attempt = latest if attempt_number is None else _attempt_of(run_id, attempt_number)
    limit = max(1, min(limit, MAX_OUTPUT_PAGE))
    latest_number = None if latest is None else latest.number
    if attempt is None:
        return OutputPage(None, latest_number, [], after, False, False, 0, 0, 0)
    book = AttemptOutput.objects.filter(attempt_id=attempt.pk).first()
    rows = list(
        OutputChunk.objects.filter(attempt_id=attempt.pk, seq__gt=after).order_by("seq")[
            : limit + 1
        ]
    )
    more = len(rows) > limit
    rows = rows[:limit]
    return OutputPage(
        attempt=attempt,
        latest_attempt=latest_number,
        chunks=rows,
        next_after=rows[-1].seq if rows else after,
        more=more,
        live=attempt.state not in ATTEMPT_TERMINAL_STATES,
        dropped_through_seq=0 if book is None else book.dropped_through_seq,
        dropped_bytes=0 if book is None else book.dropped_bytes,
        skipped_bytes=0 if book is None else book.skipped_bytes,
    )


@dataclass(frozen=True)
class OutputTail:
    """The newest stored output of one Attempt, for the first render of a page."""

    attempt: Attempt
    text: str
    last_seq: int  # follow with output_page(after=last_seq)
    older_stored: bool  # older chunks are stored but not in `text`
    live: bool
    dropped_bytes: int
    skipped_bytes: int
    from_ack_tail: bool = False  # no live output stored: the terminal ACK's tail


def output_tail(
    *, run_id: int, attempt_number: int | None = None, max_bytes: int = 64 * 1024
) -> OutputTail | None:
    """About the last `max_bytes` of an Attempt's stored output (default: the newest Attempt).

    Reads at most MAX_OUTPUT_PAGE chunks, newest first: bounded whatever is stored.
    """
    attempt = _attempt_of(run_id, attempt_number)
    if attempt is None:
        return None
    texts: list[str] = []
    total = 0
    last = 0
    older = False
    for seq, text, size in (
        OutputChunk.objects.filter(attempt_id=attempt.pk)
        .order_by("-seq")
        .values_list("seq", "text", "size")[:MAX_OUTPUT_PAGE]
    ):
        if texts and total + size > max_bytes:
            older = True
            break
        last = max(last, seq)
        texts.append(text)
        total += size
    if not texts and attempt.state in ATTEMPT_TERMINAL_STATES:
        # No live output (pruned, or a Worker that sends none): the end of it,
        # as the terminal ACK reported it (stored redacted too).
        tail = Attempt.objects.filter(pk=attempt.pk).values_list("output_tail", flat=True).first()
        if tail:
            return OutputTail(attempt, tail, 0, False, False, 0, 0, from_ack_tail=True)
    book = AttemptOutput.objects.filter(attempt_id=attempt.pk).first()
    return OutputTail(
        attempt=attempt,
        text="".join(reversed(texts)),
        last_seq=last,
        older_stored=older or len(texts) == MAX_OUTPUT_PAGE,
        live=attempt.state not in ATTEMPT_TERMINAL_STATES,
        dropped_bytes=0 if book is None else book.dropped_bytes,
        skipped_bytes=0 if book is None else book.skipped_bytes,
    )


def output_prune(*, days: int | None = None, limit: int = OUTPUT_PRUNE_BATCH) -> int:
    """Delete the live output of Attempts that ended and got none for `days`.

    `QINGLONG_OUTPUT_RETENTION_DAYS` by default; at most `limit` Attempts per
    call, least recently appended first (index `attemptoutput_updated`). An
    ended Attempt takes no more output (its lease is over), so nothing can be
    appended to what is being deleted. Its terminal ACK's tail stays on the
    Attempt. Returns how many Attempts' output was deleted.
    """
    keep = int(settings.QINGLONG_OUTPUT_RETENTION_DAYS if days is None else days)
    cutoff = db_now() - timedelta(days=keep)
    ids = list(
        AttemptOutput.objects.filter(
            updated_at__lt=cutoff, attempt__state__in=ATTEMPT_TERMINAL_STATES
        )
        .order_by("updated_at")
        .values_list("attempt_id", flat=True)[:limit]
    )
    if not ids:
        return 0
    with transaction.atomic(durable=True):
        OutputChunk.objects.filter(attempt_id__in=ids).delete()
        AttemptOutput.objects.filter(attempt_id__in=ids).delete()
    logger.info("output pruned", extra={"event": "output_pruned", "attempts": len(ids)})
    return len(ids)
