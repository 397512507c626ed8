"""The one validator of a Schedule's settings (API, admin, commands all call it).

Plain Python: every rule violation is a `ScheduleError` naming the field
(never the value), which the operator API turns into a 400 that changes
nothing.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Final

from schedules.cron import ScheduleError, validate_cron, validate_timezone

__all__ = [
    "MAX_CATCHUP_WINDOW_S",
    "MAX_JITTER_S",
    "MAX_PAUSE_REASON_CHARS",
    "ON_TIME_GRACE_S",
    "OVERLAP_POLICIES",
    "SCHEDULE_FIELDS",
    "ScheduleDefinition",
    "jitter_offset_s",
    "validate_name",
    "validate_schedule",
]

# A catch-up window longer than a week would enqueue a week of stale work
# after an outage; over it is a 400 (README "Schedules").
MAX_CATCHUP_WINDOW_S: Final = 7 * 86_400
MAX_JITTER_S: Final = 3_600
DEFAULT_CATCHUP_WINDOW_S: Final = 300
# However small the window, a fire evaluated this late is still on time: the
# evaluator runs every second, a beat may wait a few in the broker.
ON_TIME_GRACE_S: Final = 30
MAX_PAUSE_REASON_CHARS: Final = 200
OVERLAP_POLICIES: Final = ("allow", "skip", "buffer_one", "cancel_running")
SCHEDULE_FIELDS: Final = frozenset(
    {"cron", "timezone", "overlap_policy", "catchup_window_s", "jitter_s", "priority"}
)
_NAME = re.compile(r"[-a-zA-Z0-9_]{1,100}")


@dataclass(frozen=True)
class ScheduleDefinition:
    cron: str
    timezone: str = "UTC"
    overlap_policy: str = "skip"
    catchup_window_s: int = DEFAULT_CATCHUP_WINDOW_S
    jitter_s: int = 0
    priority: int = 0


def _int(raw: Mapping[str, object], field: str, default: int, low: int, high: int) -> int:
    value = raw.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScheduleError(field, "must be an integer")
    if not low <= value <= high:
        raise ScheduleError(field, f"must be between {low} and {high}")
    return value


def validate_name(value: object) -> str:
    if not isinstance(value, str) or _NAME.fullmatch(value) is None:
        raise ScheduleError("name", "must be 1 to 100 letters, digits, '-' or '_'")
    return value


def validate_schedule(
    raw: Mapping[str, object], *, base: ScheduleDefinition | None = None
) -> ScheduleDefinition:
    """A full definition (create: `cron` required) or `base` with `raw`'s changes."""
    if not isinstance(raw, Mapping):
        raise ScheduleError("body", "must be an object")
    for key in raw:
        if key not in SCHEDULE_FIELDS:
            name = key if isinstance(key, str) and re.fullmatch(r"\w{1,64}", key) else "body"
            raise ScheduleError(name, "unknown field")
    if base is None:
        if "cron" not in raw:
            raise ScheduleError("cron", "is required")
        base = ScheduleDefinition(cron="")
    current = base
    if "cron" in raw:
        current = replace(current, cron=validate_cron(raw["cron"]))
    if "timezone" in raw:
        current = replace(current, timezone=validate_timezone(raw["timezone"]))
    if "overlap_policy" in raw:
        policy = raw["overlap_policy"]
        if not isinstance(policy, str) or policy not in OVERLAP_POLICIES:
            raise ScheduleError("overlap_policy", "must be one of " + ", ".join(OVERLAP_POLICIES))
        current = replace(current, overlap_policy=policy)
    return replace(
        current,
        catchup_window_s=_int(
            raw, "catchup_window_s", current.catchup_window_s, 0, MAX_CATCHUP_WINDOW_S
        ),
        jitter_s=_int(raw, "jitter_s", current.jitter_s, 0, MAX_JITTER_S),
        priority=_int(raw, "priority", current.priority, -1000, 1000),
    )


def jitter_offset_s(schedule_id: int, jitter_s: int) -> int:
    """The Schedule's fixed delay after each fire time, in [0, jitter_s].

    Deterministic (a hash of the id): the same Schedule always fires at the
    same offset, so its fires stay evenly spaced; different Schedules on the
    same cron line spread over the window.
    """
    if jitter_s <= 0:
        return 0
    digest = hashlib.sha256(f"schedule:{schedule_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % (jitter_s + 1)
