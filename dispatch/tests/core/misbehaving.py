"""Ports that break their contract on purpose, to prove the cycle fails closed.

Each is the well-behaved fake of `dispatch.core.fakes` with knobs: duplicate
rows, a cursor that does not advance, an over-size page, Worker order
regression, rows outside the requested scope or already expired, a Worker that
vanishes after the snapshot, a lost compare-and-set, a drifted or missing plan.
Only the core's cycle tests use them; the fakes themselves stay honest, held
to the same contract suite as the ORM adapters.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import replace
from datetime import datetime
from typing import Any, TypeVar, cast

from dispatch.core.fakes import (
    FakeCandidateSource,
    FakeClaimPort,
    FakeLease,
    FakeLeaseRecoverySource,
    FakePlanSource,
    FakeStore,
    FakeWorkerSnapshotSource,
)
from dispatch.core.placement import Placement
from dispatch.core.ports import (
    Candidate,
    ClaimOutcome,
    ClaimRequest,
    ClaimStatus,
    DispatchPlan,
    DispatchScope,
    Page,
    PlanUnavailable,
    SessionRef,
)

__all__ = [
    "MisbehavingCandidateSource",
    "MisbehavingClaimPort",
    "MisbehavingLeaseRecoverySource",
    "MisbehavingPlanSource",
    "MisbehavingWorkerSnapshotSource",
    "UnfilteredCandidateSource",
]

R = TypeVar("R")


class _BrokenPaging:
    """The paging knobs, over the honest keyset page of the fakes."""

    duplicate_rows: bool
    stuck_cursor: bool
    oversize: bool
    _last: object | None

    def _set_paging_knobs(
        self, *, duplicate_rows: bool, stuck_cursor: bool, oversize: bool
    ) -> None:
        self.duplicate_rows = duplicate_rows
        self.stuck_cursor = stuck_cursor
        self.oversize = oversize
        self._last = None

    def _page(
        self,
        rows: list[R],
        *,
        key: Callable[[R], tuple[Any, ...]],
        after: tuple[Any, ...] | None,
        encode: Callable[[R], str],
        cursor: str | None,
        limit: int,
    ) -> Page[R]:
        remaining = rows if after is None else [row for row in rows if key(row) > after]
        items = remaining[: limit + 1 if self.oversize else limit]
        more = len(remaining) > len(items)
        if self.duplicate_rows and cursor is not None and self._last is not None:
            # The classic off-by-one (">=" for ">"): the previous page's last row
            # comes back, even if it has been claimed since.
            items = [cast(R, self._last), *items[: limit - 1]]
            more = more or len(remaining) > limit - 1
        next_cursor = encode(items[-1]) if more and items else None
        if self.stuck_cursor and cursor is not None and next_cursor is not None:
            next_cursor = cursor
        if items:
            self._last = items[-1]
        return Page(tuple(items), next_cursor)


class MisbehavingLeaseRecoverySource(_BrokenPaging, FakeLeaseRecoverySource):
    def __init__(
        self,
        store: FakeStore,
        *,
        duplicate_rows: bool = False,
        stuck_cursor: bool = False,
        oversize: bool = False,
        include_expired: bool = False,
        ignore_scope: bool = False,
    ) -> None:
        super().__init__(store)
        self._set_paging_knobs(
            duplicate_rows=duplicate_rows, stuck_cursor=stuck_cursor, oversize=oversize
        )
        self.include_expired = include_expired
        self.ignore_scope = ignore_scope

    def _is_live(self, lease: FakeLease, observed_at: datetime) -> bool:
        return self.include_expired or super()._is_live(lease, observed_at)

    def _in_scope(self, scope: DispatchScope, ref: SessionRef) -> bool:
        return self.ignore_scope or super()._in_scope(scope, ref)


class MisbehavingCandidateSource(_BrokenPaging, FakeCandidateSource):
    def __init__(
        self,
        store: FakeStore,
        *,
        duplicate_rows: bool = False,
        stuck_cursor: bool = False,
        oversize: bool = False,
    ) -> None:
        super().__init__(store)
        self._set_paging_knobs(
            duplicate_rows=duplicate_rows, stuck_cursor=stuck_cursor, oversize=oversize
        )

    def candidate_page(
        self,
        *,
        observed_at: datetime,
        cursor: str | None,
        limit: int,
        scope: DispatchScope | None = None,
    ) -> Page[Candidate]:
        # The honest fair page (docs/adr/0012), then the knobs on top of it.
        page = super().candidate_page(
            observed_at=observed_at,
            cursor=cursor,
            limit=min(limit + 1, 64) if self.oversize else limit,
            scope=scope,
        )
        items, next_cursor = list(page.items), page.next_cursor
        if self.duplicate_rows and cursor is not None and self._last is not None:
            # The classic off-by-one: the previous page's last row comes back.
            items = [cast(Candidate, self._last), *items[: limit - 1]]
        if self.stuck_cursor and cursor is not None and next_cursor is not None:
            next_cursor = cursor
        if items:
            self._last = items[-1]
        return Page(tuple(items), next_cursor)


class UnfilteredCandidateSource(FakeCandidateSource):
    """Every queued Run, servable now or not: the candidate read without its
    serving filters (docs/adr/0012), so a test can show that the cycle's own
    checks (placement, Workers, slots) still hold behind it."""

    def candidate_page(
        self,
        *,
        observed_at: datetime,
        cursor: str | None,
        limit: int,
        scope: DispatchScope | None = None,
    ) -> Page[Candidate]:
        return super().candidate_page(observed_at=observed_at, cursor=cursor, limit=limit)


class MisbehavingWorkerSnapshotSource(_BrokenPaging, FakeWorkerSnapshotSource):
    def __init__(
        self,
        store: FakeStore,
        *,
        duplicate_rows: bool = False,
        stuck_cursor: bool = False,
        oversize: bool = False,
        order_regression: bool = False,
        ignore_scope: bool = False,
    ) -> None:
        super().__init__(store)
        self._set_paging_knobs(
            duplicate_rows=duplicate_rows, stuck_cursor=stuck_cursor, oversize=oversize
        )
        self.order_regression = order_regression
        self.ignore_scope = ignore_scope

    def _page(
        self,
        rows: list[R],
        *,
        key: Callable[[R], tuple[Any, ...]],
        after: tuple[Any, ...] | None,
        encode: Callable[[R], str],
        cursor: str | None,
        limit: int,
    ) -> Page[R]:
        page = super()._page(rows, key=key, after=after, encode=encode, cursor=cursor, limit=limit)
        if self.order_regression:
            return Page(tuple(reversed(page.items)), page.next_cursor)
        return page

    def _in_scope(self, scope: DispatchScope, ref: SessionRef) -> bool:
        return self.ignore_scope or super()._in_scope(scope, ref)


SpecPatch = Callable[[Candidate, dict[str, object]], dict[str, object]]


class MisbehavingPlanSource(FakePlanSource):
    """Plans for some Runs missing, specs patched, or another placement."""

    def __init__(
        self,
        store: FakeStore,
        *,
        unavailable_runs: Collection[str] = (),
        spec_patch: SpecPatch | None = None,
        placement_override: Placement | None = None,
    ) -> None:
        super().__init__(store)
        self.unavailable_runs = set(unavailable_runs)
        self.spec_patch = spec_patch
        self.placement_override = placement_override

    def _plan(self, candidate: Candidate) -> DispatchPlan:
        if candidate.run_id in self.unavailable_runs:
            raise PlanUnavailable(candidate.run_id)
        plan = super()._plan(candidate)
        if self.spec_patch is not None:
            plan = replace(
                plan, spec=self.spec_patch(candidate, cast(dict[str, object], plan.spec))
            )
        if self.placement_override is not None:
            plan = replace(plan, placement=self.placement_override)
        return plan


class MisbehavingClaimPort(FakeClaimPort):
    """Rivals the honest claim cannot see: a vanished Worker, a lost CAS."""

    def __init__(
        self,
        store: FakeStore,
        *,
        vanished_workers: Collection[str] = (),
        lost_attempts: Collection[str] = (),
    ) -> None:
        super().__init__(store)
        self.vanished_workers = set(vanished_workers)
        self.lost_attempts = set(lost_attempts)

    def _claim(self, request: ClaimRequest) -> ClaimOutcome:
        if request.attempt_id in self.lost_attempts:
            # A rival dispatcher committed between our read and our CAS.
            return ClaimOutcome(ClaimStatus.ATTEMPT_LOST)
        if request.worker_id in self.vanished_workers:
            # Gone since the snapshot: the Session really is offline now, so
            # the honest claim answers WORKER_UNAVAILABLE (or ATTEMPT_LOST
            # first, as the database would, when the Attempt is gone too).
            self.store.set_session_state(request.worker_id, "offline")
        return super()._claim(request)
