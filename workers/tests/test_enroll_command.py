"""`manage.py enroll_worker` and `rotate_worker_credential`."""

from __future__ import annotations

import json
import re
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from dispatch.core.offer import token_digest
from workers.models import Worker
from workers.services import worker_authenticate

pytestmark = pytest.mark.django_db

SECRET_TOKEN = re.compile(r"[A-Za-z0-9_\-\.]{24,}")


def _run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def test_enroll_prints_the_credential_once_as_the_last_long_token() -> None:
    output = _run(
        "enroll_worker",
        "edge-1",
        "--slots",
        "3",
        "--executor",
        "process",
        "--executor",
        "docker",
        "--label",
        "zone=a",
        "--label",
        "gpu=none",
    )
    credential = SECRET_TOKEN.findall(output)[-1]
    assert output.strip().splitlines()[-1] == f"credential: {credential}"
    worker = Worker.objects.get(name="edge-1")
    assert worker_authenticate(credential) == worker
    assert worker.credential_digest == token_digest(credential)
    assert credential not in str(Worker.objects.filter(pk=worker.pk).values().get())
    assert worker.slots == 3
    assert worker.executor_types == ["docker", "process"]
    assert worker.labels == {"zone": "a", "gpu": "none"}


def test_enroll_json_output() -> None:
    data = json.loads(_run("enroll_worker", "edge-2", "--executor", "process", "--json"))
    assert data["name"] == "edge-2"
    assert data["slots"] == 1
    assert worker_authenticate(data["credential"]).name == "edge-2"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["edge", "--executor", "process", "--slots", "0"], "slots"),
        (["edge", "--executor", "process", "--slots", "999"], "slots"),
        (["edge"], "executor_types"),
        (["edge", "--executor", "Bad Type!"], "executor_types"),
        (["edge", "--executor", "process", "--label", "novalue"], "label"),
        (["edge", "--executor", "process", "--label", "BAD KEY=x"], "labels"),
        (["not a slug!", "--executor", "process"], "name"),
    ],
)
def test_enroll_bad_input_names_the_field_and_saves_nothing(args: list[str], field: str) -> None:
    with pytest.raises(CommandError) as err:
        _run("enroll_worker", *args)
    assert str(err.value).startswith(field)
    assert not Worker.objects.exists()


def test_enroll_duplicate_name_is_an_error_naming_the_field() -> None:
    _run("enroll_worker", "edge", "--executor", "process")
    with pytest.raises(CommandError) as err:
        _run("enroll_worker", "edge", "--executor", "process")
    assert str(err.value).startswith("name")
    assert Worker.objects.count() == 1


def test_rotate_issues_a_new_credential_and_the_old_one_stops_working() -> None:
    old = SECRET_TOKEN.findall(_run("enroll_worker", "edge", "--executor", "process"))[-1]
    output = _run("rotate_worker_credential", "edge")
    new = SECRET_TOKEN.findall(output)[-1]
    assert new != old
    assert worker_authenticate(old) is None
    assert worker_authenticate(new) is not None
    with pytest.raises(CommandError, match=r"^name"):
        _run("rotate_worker_credential", "nobody")
