"""When a Schedule fires: cron expressions in an IANA time zone, in plain Python.

Parsing and matching are `cronsim`'s (a maintained library; no cron parser of
our own). This module adds one thing cronsim leaves to Debian cron's quirks:
what a fire time means when the wall clock jumps (docs/adr/0010).

A Schedule's fire times are the **wall-clock** times in its time zone that
match the expression, each mapped to exactly one instant:

- a wall time that exists once is that instant;
- a wall time that happens twice (clocks go back) is its **first** occurrence,
  so a repeated local time fires once;
- a wall time that never happens (clocks go forward) is the first instant
  after the gap, so a skipped local time fires once, at the next valid instant;
- two wall times that map to the same instant (02:30 skipped onto 03:00, and
  03:00 itself) are one fire.

cronsim applies Debian's rule only to 5-field expressions with a fixed minute
and hour and counts elapsed time for the rest (`*/15` fires twice in a
repeated hour, `30 * * * *` not at all in a skipped one); here every
expression follows the one rule above, so "fires once" holds for all of them.
Iteration is naive wall-clock time (cronsim without a tzinfo), and the
mapping is `wall_to_instant`.

Everything here is bounded: every search stops after a fixed number of steps
and says so (`ScheduleError`), so one evaluation costs at most that.
"""

from __future__ import annotations

import functools
import re
import zoneinfo
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final

from cronsim import CronSim, CronSimError

__all__ = [
    "MAX_CRON_CHARS",
    "MAX_TIMEZONE_CHARS",
    "CronSchedule",
    "ScheduleError",
    "validate_cron",
    "validate_timezone",
    "wall_to_instant",
]

MAX_CRON_CHARS: Final = 120
MAX_TIMEZONE_CHARS: Final = 64
# Wall-clock candidates examined per search: a repeated hour of an every-second
# expression is 3,600 candidates that are all in the past; nothing real needs more.
_MAX_STEPS: Final = 20_000
_CRON_CHARS = re.compile(r"[0-9A-Za-z*/,#\- ]+")


class ScheduleError(ValueError):
    """A schedule input is unusable; `field` names which, never the value."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def validate_cron(value: object) -> str:
    """A cron expression: 5 fields, or 6 with seconds first; returned normalized."""
    if not isinstance(value, str):
        raise ScheduleError("cron", "must be a string")
    if len(value) > MAX_CRON_CHARS:
        raise ScheduleError("cron", f"must be at most {MAX_CRON_CHARS} characters")
    if _CRON_CHARS.fullmatch(value) is None:
        raise ScheduleError("cron", "may contain only digits, letters, spaces and * / , # -")
    fields = value.split()
    if len(fields) not in (5, 6):
        raise ScheduleError(
            "cron", "must have 5 fields (minute hour day month weekday) or 6 (seconds first)"
        )
    normalized = " ".join(fields)
    try:
        probe = CronSim(normalized, datetime(2000, 1, 1))
    except CronSimError as err:
        # cronsim names the field ("Bad minute"); the expression itself is echoed nowhere.
        raise ScheduleError("cron", str(err).lower()) from None
    try:
        next(probe)
    except StopIteration:
        raise ScheduleError("cron", "never matches a date") from None
    return normalized


@functools.cache
def _zone_names() -> frozenset[str]:
    return frozenset(zoneinfo.available_timezones())


def validate_timezone(value: object) -> str:
    """An IANA time zone name ("Europe/Berlin", "UTC"), as zoneinfo knows it."""
    if not isinstance(value, str) or not value:
        raise ScheduleError("timezone", "must be an IANA time zone name, e.g. Europe/Berlin")
    if len(value) > MAX_TIMEZONE_CHARS or value not in _zone_names():
        # Only names from the zone database: never a file path zoneinfo would open.
        raise ScheduleError("timezone", "is not a known IANA time zone name")
    return value


def _wall(instant: datetime, zone: zoneinfo.ZoneInfo) -> datetime:
    return instant.astimezone(zone).replace(tzinfo=None)


def wall_to_instant(wall: datetime, zone: zoneinfo.ZoneInfo) -> datetime:
    """The one UTC instant a naive wall-clock time fires at (module docstring)."""
    first = wall.replace(tzinfo=zone, fold=0).astimezone(UTC)
    if _wall(first, zone) == wall:
        return first  # exists; fold=0 is the first of two occurrences
    # In a gap: fold=1 reads it with the offset after the jump (an instant
    # before the gap), fold=0 with the offset before it (an instant after).
    # The answer is the first instant whose wall clock reaches `wall`; the
    # bisection over whole seconds takes about 12 steps for a one-hour gap.
    low = wall.replace(tzinfo=zone, fold=1).astimezone(UTC)
    high = first
    while high - low > timedelta(seconds=1):
        middle = low + (high - low) // 2
        middle = middle.replace(microsecond=0)
        if _wall(middle, zone) >= wall:
            high = middle
        else:
            low = middle
    return high


@dataclass(frozen=True)
class CronSchedule:
    """A validated expression in a zone; fire times are UTC instants."""

    expression: str
    timezone: str

    @property
    def zone(self) -> zoneinfo.ZoneInfo:
        return zoneinfo.ZoneInfo(self.timezone)

    def _walls(self, start: datetime, *, reverse: bool) -> Iterator[datetime]:
        walls = CronSim(self.expression, start, reverse=reverse)
        for _ in range(_MAX_STEPS):
            try:
                yield next(walls)
            except StopIteration:
                return
        raise ScheduleError("cron", f"no fire found within {_MAX_STEPS} candidates")

    def next_after(self, instant: datetime) -> datetime | None:
        """The first fire strictly after `instant`; None if it never fires again."""
        zone = self.zone
        # From the wall time of `instant` with its seconds cut: every wall time
        # after it is a candidate; candidates that map to `instant` or earlier
        # (the second pass through a repeated hour) are passed over.
        start = _wall(instant, zone).replace(microsecond=0) - timedelta(seconds=1)
        for wall in self._walls(start, reverse=False):
            fire = wall_to_instant(wall, zone)
            if fire > instant:
                return fire
        return None

    def previous_before(self, instant: datetime) -> datetime | None:
        """The last fire strictly before `instant`; None if there is none."""
        zone = self.zone
        # Candidates from the wall time of `instant` down; one that maps to
        # `instant` or later (a gap's candidates map forward) is passed over.
        start = _wall(instant, zone).replace(microsecond=0) + timedelta(seconds=1)
        for wall in self._walls(start, reverse=True):
            fire = wall_to_instant(wall, zone)
            if fire < instant:
                return fire
        return None

    def fires(self, after: datetime, *, limit: int) -> list[datetime]:
        """Up to `limit` fires strictly after `after`, in order."""
        out: list[datetime] = []
        cursor = after
        while len(out) < limit:
            fire = self.next_after(cursor)
            if fire is None:
                break
            out.append(fire)
            cursor = fire
        return out

    def count_between(self, first: datetime, last: datetime, *, cap: int) -> int | None:
        """Fires in [first, last]; None when more than `cap` (counting is bounded)."""
        count = 0
        cursor = first - timedelta(microseconds=1)
        while True:
            fire = self.next_after(cursor)
            if fire is None or fire > last:
                return count
            count += 1
            if count > cap:
                return None
            cursor = fire
