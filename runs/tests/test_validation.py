"""Task definitions go through the one shared validator; nothing bad is saved."""

from __future__ import annotations

import pytest

from qinglong.testing import definition, make_project, make_task
from runs.models import Task, TaskRevision
from runs.services import DefinitionError, task_create, task_update

pytestmark = pytest.mark.django_db

BAD = [
    ("command", {"command": []}),
    ("command", {"command": "echo hi"}),
    ("command", {"command": ["echo", 3]}),
    ("command", {"command": ["x" * 5000]}),
    ("command", {"command": ["a"] * 300}),
    ("env", {"env": {"1BAD": "x"}}),
    ("env", {"env": {"BAD-KEY": "x"}}),
    ("env", {"env": {"OK": 1}}),
    ("cwd", {"cwd": "/srv/../etc"}),
    ("cwd", {"cwd": ".."}),
    ("timeout_s", {"timeout_s": -1}),
    ("timeout_s", {"timeout_s": True}),
    ("executor_type", {"executor_type": "Bad Type!"}),
    ("executor_type", {"executor_type": ""}),
    ("placement", {"placement": "anywhere"}),
    ("placement", {"placement": {"required_labels": {"zone": 1}}}),
    ("placement", {"placement": {"preferred": [{"labels": {}, "weight": 0}]}}),
    ("placement", {"placement": {"executor_type": "docker"}}),
    ("placement", {"placement": {"surprise": True}}),
    ("max_attempts", {"max_attempts": 0}),
    ("resources", {"resources": {"cpu_millis": -5}}),
]


@pytest.mark.parametrize(
    ("field", "override"), BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)]
)
def test_bad_definition_names_the_field_and_saves_nothing(field, override):
    project = make_project()
    with pytest.raises(DefinitionError) as err:
        task_create(project=project, name="bad", definition=definition(**override))
    assert err.value.field.split(".")[0].split("[")[0] == field
    assert field in str(err.value)
    assert not Task.objects.filter(project=project).exists()


@pytest.mark.parametrize(("field", "override"), BAD[:3])
def test_bad_edit_keeps_the_current_revision(field, override):
    task = make_task()
    with pytest.raises(DefinitionError):
        task_update(task=task, definition=definition(**override))
    assert TaskRevision.objects.filter(task=task).count() == 1


def test_error_message_never_echoes_the_value():
    secret = "s3cr3t-value-never-echoed"
    with pytest.raises(DefinitionError) as err:
        task_create(
            project=make_project(), name="bad", definition=definition(cwd=f"/x/../{secret}")
        )
    assert secret not in str(err.value)


def test_unknown_definition_field_is_rejected():
    with pytest.raises(DefinitionError) as err:
        task_create(project=make_project(), name="bad", definition=definition(state="running"))
    assert err.value.field == "state"
