"""`manage.py rotate_worker_credential NAME [--json]`: issue a new credential.

The old credential stops working at once, and so does every Session opened
with it: they are fenced like a replacement (their tokens get
`401 credential_rotated`, claimed Attempts go back to pending, started ones are
lost and retried by policy). The new credential is printed once, last.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from workers.models import Worker
from workers.services import worker_rotate_credential


class Command(BaseCommand):
    help = "Rotate a Worker's credential and print the new one (shown once)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="Worker name.")
        parser.add_argument("--json", action="store_true", help="Print one JSON object.")

    def handle(self, *args: Any, **options: Any) -> None:
        worker = Worker.objects.filter(name=options["name"]).first()
        if worker is None:
            raise CommandError("name: no worker with this name")
        credential = worker_rotate_credential(worker=worker)
        if options["json"]:
            self.stdout.write(
                json.dumps(
                    {"worker_id": str(worker.pk), "name": worker.name, "credential": credential}
                )
            )
            return
        self.stdout.write(f"Rotated the credential of worker {worker.name} (id {worker.pk}).")
        self.stdout.write(
            "The old credential and its Sessions no longer work; the new one is shown once."
        )
        self.stdout.write(f"credential: {credential}")
