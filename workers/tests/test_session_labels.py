"""A Session advertises only what its Worker was enrolled with (placement is authority)."""

from __future__ import annotations

import pytest

from qinglong.testing import make_worker
from workers.models import WorkerSession
from workers.services import WorkerInputError, session_open

pytestmark = pytest.mark.django_db


def _open(worker, labels):
    return session_open(worker=worker, executor_types=["process"], labels=labels, slots=1)


@pytest.mark.parametrize("labels", [{"zone": "secure"}, {"gpu": "yes"}])
def test_session_cannot_advertise_labels_it_was_not_enrolled_with(labels):
    worker, _ = make_worker(labels={"zone": "a"})
    with pytest.raises(WorkerInputError) as err:
        _open(worker, labels)
    assert err.value.field == "labels"
    assert not WorkerSession.objects.filter(worker=worker).exists()


def test_session_labels_are_the_enrolled_ones():
    worker, _ = make_worker(labels={"zone": "a", "disk": "ssd"})
    session = _open(worker, {"zone": "a"}).session
    assert session.labels == {"zone": "a", "disk": "ssd"}
    assert _open(worker, {}).session.labels == {"zone": "a", "disk": "ssd"}
