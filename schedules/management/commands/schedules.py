"""`manage.py schedules [--json]`: Schedules, their next fires and recent outcomes."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from schedules.models import Schedule, ScheduleFire
from schedules.selectors import fire_json, schedule_json

_MAX_SCHEDULES = 500


class Command(BaseCommand):
    help = (
        "List Schedules (at most 500, by id): cron, time zone, overlap policy, paused "
        "(who, why, until), the next fire in the Schedule's time zone and UTC, and the "
        "outcomes of its most recent fires. --json prints one JSON object."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="Print JSON.")
        parser.add_argument(
            "--recent", type=int, default=5, help="Recent ledger rows per Schedule (default 5)."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        recent = max(0, min(int(options["recent"]), 50))
        schedules = list(
            Schedule.objects.select_related("task__project").order_by("id")[:_MAX_SCHEDULES]
        )
        rows = []
        for schedule in schedules:
            fires = ScheduleFire.objects.filter(schedule=schedule).order_by("-fire_at", "-id")[
                :recent
            ]
            rows.append(
                {
                    **schedule_json(schedule),
                    "recent": [fire_json(fire, schedule.timezone) for fire in fires],
                }
            )
        if options["json"]:
            self.stdout.write(json.dumps({"schedules": rows}, sort_keys=True))
            return
        if not rows:
            self.stdout.write("no schedules")
            return
        for row in rows:
            state = "paused" if row["paused"] else "active"
            self.stdout.write(
                f"{row['id']:>4} {row['project']}/{row['task']}/{row['name']} "
                f"[{row['cron']}] {row['timezone']} overlap={row['overlap_policy']} {state}"
            )
            if row["paused"]:
                until = f" until {row['resume_at']}" if row["resume_at"] else ""
                self.stdout.write(
                    f"     paused by {row['paused_by'] or '?'}: {row['pause_reason'] or '-'}{until}"
                )
            else:
                self.stdout.write(
                    f"     next: {row['next_fire_local'] or 'never'} ({row['next_fire_at']})"
                )
            for fire in row["recent"]:
                extra = f" run {fire['run_id']}" if fire["run_id"] else ""
                self.stdout.write(f"     {_when(fire)} {fire['outcome']}{extra} {fire['detail']}")


def _when(fire: dict[str, Any]) -> str:
    return str(fire["fire_local"] or fire["fire_at"])
