"""`manage.py dispatch_once`: run one global dispatch cycle, print its summary."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from dispatch.core.ports import DispatchScope
from dispatch.cycles import NullOfferNotifier, OfferNotifier, dispatch_cycle
from dispatch.notify import RedisOfferNotifier


class Command(BaseCommand):
    help = (
        "Run one bounded global dispatch cycle (docs/adr/0001) and print its redacted "
        "summary: status, reason, truncation and counts — never a spec or token. "
        "The cycle is recorded as a DispatchCycle row and honours the operator "
        "kill switch (status 'paused'). Exit status 0 whatever the cycle found."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="Print the summary as JSON.")
        parser.add_argument(
            "--notify",
            choices=("none", "redis"),
            default="none",
            help="Tell target Sessions about their offers (content-free) via Redis "
            "pub/sub; default none (Workers poll).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        notify: str = options["notify"]
        notifier: OfferNotifier = NullOfferNotifier()
        if notify == "redis":
            notifier = RedisOfferNotifier()
        summary = dispatch_cycle(scope=DispatchScope.global_(), notifier=notifier).summary()
        self.stdout.write(render_summary(summary, as_json=bool(options["json"])))


def render_summary(summary: dict[str, Any], *, as_json: bool) -> str:
    if as_json:
        return json.dumps(summary, sort_keys=True, separators=(",", ":"))
    counts = " ".join(f"{key}={value}" for key, value in summary["counts"].items())
    truncated = " truncated" if summary["truncated"] else ""
    return (
        f"{summary['scope']} cycle: {summary['status']}/{summary['reason']}{truncated} "
        f"in {summary['duration_ms']} ms; {counts}"
    )
