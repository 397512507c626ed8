"""Lazy keyset paging over a port, re-checking the port's contract on every page.

Every read of `dispatch_once` goes through a `PageReader`: at most `max_pages`
pages of at most `page_size` rows (docs/adr/0001, budgets), fetched only when
the cycle asks for the next row. A page that breaks the paging contract — too
many rows, a cursor that does not advance, a row seen before, or a row the
caller's check refuses — raises `PortContractError`, and the cycle fails closed
with its reason (docs/adr/0001, "Fail closed").
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from dispatch.core.ports import Page
from dispatch.core.result import CycleReason

__all__ = ["PageReader", "PortContractError"]

T = TypeVar("T")


class PortContractError(Exception):
    """A port broke its contract: the cycle fails closed with `reason`."""

    def __init__(self, reason: CycleReason) -> None:
        super().__init__(str(reason))
        self.reason = reason


class PageReader(Generic[T]):
    """Rows of a keyset-paged port, one page at a time, each page checked whole.

    Rows are read only when the cycle asks for the next one, so no page is
    fetched that the cycle does not need. Each page is checked on arrival —
    size, cursor progress, duplicate keys and the caller's per-row `check` — so
    a bad page is rejected even if its tail is never consumed.
    """

    def __init__(
        self,
        fetch: Callable[[str | None, int], Page[T]],
        *,
        page_size: int,
        max_pages: int,
        key: Callable[[T], str],
        check: Callable[[T], None] | None = None,
    ) -> None:
        self._fetch = fetch
        self._page_size = page_size
        self._max_pages = max_pages
        self._key = key
        self._check = check
        self._buffer: deque[T] = deque()
        self._cursor: str | None = None
        self._cursors_seen: set[str] = set()
        self._keys_seen: set[str] = set()
        self._done = False
        self.pages_read = 0
        self.rows_read = 0

    def next(self) -> T | None:
        """The next row, reading a page if needed; None when the port or the budget ends."""
        while not self._buffer:
            if self._done or self.pages_read >= self._max_pages:
                return None
            self._read_page()
        return self._buffer.popleft()

    @property
    def budget_exhausted(self) -> bool:
        """The page budget ended while the port still had rows (a cursor)."""
        return not self._done and not self._buffer and self.pages_read >= self._max_pages

    @property
    def may_have_more(self) -> bool:
        return bool(self._buffer) or not self._done

    def _read_page(self) -> None:
        previous = self._cursor
        page = self._fetch(previous, self._page_size)
        self.pages_read += 1
        if len(page.items) > self._page_size:
            raise PortContractError(CycleReason.PAGE_OVERSIZE)
        next_cursor = page.next_cursor
        if next_cursor is not None and (
            next_cursor == previous or next_cursor in self._cursors_seen
        ):
            # A cursor that repeats would re-read the same rows forever.
            raise PortContractError(CycleReason.CURSOR_NOT_ADVANCING)
        for item in page.items:
            key = self._key(item)
            if key in self._keys_seen:
                raise PortContractError(CycleReason.DUPLICATE_ROW)
            self._keys_seen.add(key)
            if self._check is not None:
                self._check(item)
        self.rows_read += len(page.items)
        self._buffer.extend(page.items)
        if next_cursor is None:
            self._done = True
        else:
            self._cursors_seen.add(next_cursor)
            self._cursor = next_cursor
