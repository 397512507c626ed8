"""Fire times (schedules.cron, docs/adr/0010): DST in two time zones, seconds, bad input."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from cronsim import CronSim

from schedules.cron import (
    CronSchedule,
    ScheduleError,
    validate_cron,
    validate_timezone,
    wall_to_instant,
)

NY = "America/New_York"  # 2026: forward 8 March 02:00 → 03:00, back 1 November 02:00 → 01:00
BERLIN = "Europe/Berlin"  # 2026: forward 29 March 02:00 → 03:00, back 25 October 03:00 → 02:00


def local(fires: list[datetime], zone: str) -> list[str]:
    return [fire.astimezone(ZoneInfo(zone)).strftime("%m-%d %H:%M:%S%z") for fire in fires]


def utc(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0
) -> datetime:
    return datetime(year, month, day, hour, minute, second, tzinfo=UTC)


# ---------------------------------------------------------------- skipped


@pytest.mark.parametrize(
    ("zone", "start", "expected"),
    [
        (NY, utc(2026, 3, 7, 12), ["03-08 03:00:00-0400", "03-09 02:30:00-0400"]),
        (BERLIN, utc(2026, 3, 28, 12), ["03-29 03:00:00+0200", "03-30 02:30:00+0200"]),
    ],
)
def test_a_skipped_local_time_fires_once_at_the_next_valid_instant(
    zone: str, start: datetime, expected: list[str]
) -> None:
    assert local(CronSchedule("30 2 * * *", zone).fires(start, limit=2), zone) == expected


@pytest.mark.parametrize(
    ("zone", "start", "day", "before", "after"),
    [
        (NY, utc(2026, 3, 8, 6, 20), "03-08", "-0500", "-0400"),
        (BERLIN, utc(2026, 3, 29, 0, 20), "03-29", "+0100", "+0200"),
    ],
)
def test_frequent_fires_in_a_skipped_hour_collapse_into_one_fire(
    zone: str, start: datetime, day: str, before: str, after: str
) -> None:
    fires = CronSchedule("*/15 * * * *", zone).fires(start, limit=5)
    assert local(fires, zone) == [
        f"{day} 01:30:00{before}",
        f"{day} 01:45:00{before}",
        # 02:00, 02:15, 02:30 and 02:45 do not exist: one fire at 03:00 for all of them.
        f"{day} 03:00:00{after}",
        f"{day} 03:15:00{after}",
        f"{day} 03:30:00{after}",
    ]


# ---------------------------------------------------------------- repeated


@pytest.mark.parametrize(
    ("zone", "expression", "start", "expected"),
    [
        # 01:30 happens twice in New York on 1 November: it fires at the first.
        (NY, "30 1 * * *", utc(2026, 10, 31, 12), ["11-01 01:30:00-0400", "11-02 01:30:00-0500"]),
        # 02:30 happens twice in Berlin on 25 October.
        (
            BERLIN,
            "30 2 * * *",
            utc(2026, 10, 24, 12),
            ["10-25 02:30:00+0200", "10-26 02:30:00+0100"],
        ),
    ],
)
def test_a_repeated_local_time_fires_once(
    zone: str, expression: str, start: datetime, expected: list[str]
) -> None:
    assert local(CronSchedule(expression, zone).fires(start, limit=2), zone) == expected


@pytest.mark.parametrize(
    ("zone", "start", "repeated_hour"),
    [(NY, utc(2026, 11, 1, 4, 50), "01"), (BERLIN, utc(2026, 10, 24, 23, 50), "02")],
)
def test_frequent_fires_in_a_repeated_hour_fire_once_per_local_time(
    zone: str, start: datetime, repeated_hour: str
) -> None:
    fires = CronSchedule("*/30 * * * *", zone).fires(start, limit=4)
    shown = [fire.astimezone(ZoneInfo(zone)).strftime("%H:%M") for fire in fires]
    following = f"{int(repeated_hour) + 1:02d}"
    # :00 and :30 of the repeated hour once each (its first pass), then on.
    assert shown == [
        f"{repeated_hour}:00",
        f"{repeated_hour}:30",
        f"{following}:00",
        f"{following}:30",
    ]
    # Between the first pass's :30 and the next hour lies the whole second pass.
    assert fires[2] - fires[1] == timedelta(minutes=90)


def test_a_search_that_starts_inside_the_second_pass_finds_the_next_new_local_time() -> None:
    # 01:10 EST is the second pass through 01:xx in New York.
    inside = datetime(2026, 11, 1, 1, 10, tzinfo=ZoneInfo(NY)).replace(fold=1)
    fire = CronSchedule("*/15 * * * *", NY).next_after(inside.astimezone(UTC))
    assert fire is not None
    assert local([fire], NY) == ["11-01 02:00:00-0500"]


def test_specific_times_agree_with_cronsim_s_own_dst_handling() -> None:
    # cronsim mimics Debian cron for 5-field expressions with a fixed minute
    # and hour; for those our one rule must give the same answers.
    for zone in (NY, BERLIN, "Australia/Lord_Howe"):  # Lord Howe moves 30 minutes
        for expression in ("30 2 * * *", "0 2 * * *", "15 1 * * *", "45 2 * * 0"):
            ours = CronSchedule(expression, zone).fires(utc(2026, 1, 1), limit=400)
            theirs = CronSim(expression, utc(2026, 1, 1).astimezone(ZoneInfo(zone)))
            expected = [next(theirs).astimezone(UTC) for _ in range(400)]
            assert ours == expected, (zone, expression)


def test_previous_before_mirrors_next_after_across_transitions() -> None:
    for zone in (NY, BERLIN):
        cron = CronSchedule("*/20 * * * *", zone)
        fires = cron.fires(utc(2026, 3, 1), limit=2000) + cron.fires(utc(2026, 10, 20), limit=2000)
        for earlier, later in itertools.pairwise(fires):
            if later - earlier < timedelta(hours=3):
                assert cron.previous_before(later) == earlier


def test_wall_to_instant() -> None:
    zone = ZoneInfo(NY)
    assert wall_to_instant(datetime(2026, 3, 8, 2, 30), zone) == utc(2026, 3, 8, 7)
    assert wall_to_instant(datetime(2026, 11, 1, 1, 30), zone) == utc(2026, 11, 1, 5, 30)
    assert wall_to_instant(datetime(2026, 6, 1, 12), zone) == utc(2026, 6, 1, 16)


# ----------------------------------------------------------------- fields


def test_a_sixth_field_is_seconds_first() -> None:
    fires = CronSchedule("*/5 * * * * *", "UTC").fires(utc(2026, 1, 1), limit=3)
    assert fires == [utc(2026, 1, 1, 0, 0, 5), utc(2026, 1, 1, 0, 0, 10), utc(2026, 1, 1, 0, 0, 15)]


def test_count_between_is_capped() -> None:
    cron = CronSchedule("* * * * * *", "UTC")
    assert cron.count_between(utc(2026, 1, 1), utc(2026, 1, 1, 0, 0, 9), cap=100) == 10
    assert cron.count_between(utc(2026, 1, 1), utc(2026, 1, 1, 1), cap=100) is None


@pytest.mark.parametrize(
    "value",
    [
        "",
        "* * * *",
        "* * * * * * *",
        "61 * * * *",
        "* 24 * * *",
        "0 0 31 2 *",
        "a b c d e",
        "*/0 * * * *",
        "* * * * * ; rm",
        5,
        None,
        "1" * 200,
    ],
)
def test_bad_cron_expressions_are_refused(value: object) -> None:
    with pytest.raises(ScheduleError) as err:
        validate_cron(value)
    assert err.value.field == "cron"


def test_cron_is_normalized() -> None:
    assert validate_cron("  */5   *  * * *  ") == "*/5 * * * *"
    assert validate_cron("0 9 * * MON-FRI") == "0 9 * * MON-FRI"


@pytest.mark.parametrize(
    "value", ["", "Mars/Olympus", "../../etc/passwd", "/etc/localtime", "utc ", 3, None, "X" * 80]
)
def test_unknown_timezones_are_refused(value: object) -> None:
    with pytest.raises(ScheduleError) as err:
        validate_timezone(value)
    assert err.value.field == "timezone"


def test_known_timezones_pass() -> None:
    for name in ("UTC", NY, BERLIN, "Asia/Shanghai", "Australia/Lord_Howe"):
        assert validate_timezone(name) == name
