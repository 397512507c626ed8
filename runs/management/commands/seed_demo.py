"""Create demo data and a development admin login (idempotent)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from runs.models import Project, Task
from runs.services import project_create, run_enqueue, task_create
from schedules.models import Schedule
from schedules.services import schedule_create

DEMO_TASKS: dict[str, dict[str, object]] = {
    "hello": {
        "executor_type": "process",
        "command": ["echo", "hello from qinglong"],
        "env": {"GREETING": "hello"},
        "timeout_s": 60,
        "max_attempts": 2,
    },
    "sleep": {
        "executor_type": "process",
        "command": ["sleep", "2"],
        "timeout_s": 60,
        "max_attempts": 1,
        "placement": {"preferred": [{"labels": {"zone": "a"}, "weight": 10}]},
    },
}


DEMO_SCHEDULE = "every-10s"


class Command(BaseCommand):
    help = (
        "Create the demo Project, Tasks, Runs and a Schedule firing every 10 seconds, and a "
        "development admin login (DEBUG only)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--runs", type=int, default=3, help="Runs to enqueue per demo task.")
        parser.add_argument("--admin-password", default="qinglong-dev", help="Dev admin password.")

    def handle(self, *args: Any, runs: int, admin_password: str, **options: Any) -> None:
        if not settings.DEBUG:
            raise CommandError(
                "seed_demo creates a known admin password: run it with DEBUG=1 only."
            )
        user_model = get_user_model()
        admin, _ = user_model.objects.get_or_create(
            username="admin", defaults={"email": "admin@localhost.invalid"}
        )
        admin.is_staff = True
        admin.is_superuser = True
        admin.set_password(admin_password)
        admin.save()

        project = Project.objects.filter(slug="demo").first() or project_create(
            slug="demo", name="Demo project"
        )
        created = 0
        for name, definition in DEMO_TASKS.items():
            task = Task.objects.filter(project=project, name=name).first()
            if task is None:
                task = task_create(project=project, name=name, definition=definition)
            if not task.runs.exists():
                for _ in range(runs):
                    run_enqueue(task=task)
                    created += 1
        # A Schedule that fires every 10 seconds, so a newcomer sees it work:
        # its Runs appear in the admin and its ledger under Schedule fires.
        hello = Task.objects.get(project=project, name="hello")
        if not Schedule.objects.filter(task=hello, name=DEMO_SCHEDULE).exists():
            schedule_create(
                task=hello,
                name=DEMO_SCHEDULE,
                definition={"cron": "*/10 * * * * *", "timezone": "UTC", "overlap_policy": "skip"},
                actor="seed_demo",
            )
        self.stdout.write(f"demo data ready: project 'demo', {created} new runs enqueued")
        self.stdout.write(f"demo schedule '{DEMO_SCHEDULE}': hello every 10 seconds")
        self.stdout.write(f"admin login (development only): admin / {admin_password}")
