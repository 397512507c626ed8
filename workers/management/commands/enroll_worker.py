"""`manage.py enroll_worker NAME --slots N --executor TYPE --label KEY=VALUE [--json]`.

Creates a Worker in the Registry and prints its credential once: only its
SHA-256 digest is stored, so it cannot be shown again (rotate it instead, with
`manage.py rotate_worker_credential NAME`). The credential is the last thing
printed, so scripts can take the last token of the output.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import IntegrityError

from workers.services import WorkerInputError, worker_enroll


def parse_labels(raw: list[str]) -> dict[str, str]:
    labels: dict[str, str] = {}
    for item in raw:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CommandError("label: must be KEY=VALUE")
        if key in labels:
            raise CommandError("label: a key is given twice")
        labels[key] = value
    return labels


def validation_message(err: ValidationError) -> str:
    """Name the fields; Django's texts quote values only for choices we never use here."""
    by_field = getattr(err, "error_dict", None)
    if not by_field:
        return "invalid worker"
    parts = []
    for field, errors in sorted(by_field.items()):
        codes = {e.code for e in errors}
        text = (
            "already exists"
            if codes & {"unique"}
            else "; ".join(str(m) for e in errors for m in e.messages)
        )
        parts.append(f"{field}: {text}")
    return "; ".join(parts)


class Command(BaseCommand):
    help = "Enroll a Worker and print its credential (shown once)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="Worker name (a slug, unique).")
        parser.add_argument("--slots", type=int, default=1, help="Concurrent Attempts (1-256).")
        parser.add_argument(
            "--executor",
            action="append",
            default=[],
            dest="executors",
            metavar="TYPE",
            help="Executor type it runs; repeat for several.",
        )
        parser.add_argument(
            "--label",
            action="append",
            default=[],
            dest="labels",
            metavar="KEY=VALUE",
            help="A placement label; repeat for several.",
        )
        parser.add_argument("--json", action="store_true", help="Print one JSON object.")

    def handle(self, *args: Any, **options: Any) -> None:
        if not options["executors"]:
            raise CommandError("executor_types: give at least one --executor TYPE")
        labels = parse_labels(options["labels"])
        try:
            worker, credential = worker_enroll(
                name=options["name"],
                slots=options["slots"],
                executor_types=options["executors"],
                labels=labels,
            )
        except WorkerInputError as err:
            raise CommandError(f"{err.field}: {err.message}") from None
        except ValidationError as err:
            raise CommandError(validation_message(err)) from None
        except IntegrityError:
            raise CommandError("name: a worker with this name already exists") from None
        if options["json"]:
            self.stdout.write(
                json.dumps(
                    {
                        "worker_id": str(worker.pk),
                        "name": worker.name,
                        "slots": worker.slots,
                        "executor_types": worker.executor_types,
                        "labels": worker.labels,
                        # Last key on purpose: the credential is the last token printed.
                        "credential": credential,
                    }
                )
            )
            return
        labels_text = ",".join(f"{k}={v}" for k, v in sorted(worker.labels.items())) or "-"
        self.stdout.write(
            f"Enrolled worker {worker.name} (id {worker.pk}): slots={worker.slots} "
            f"executors={','.join(worker.executor_types)} labels={labels_text}"
        )
        self.stdout.write("The credential is shown once; only its digest is stored.")
        self.stdout.write(f"credential: {credential}")
