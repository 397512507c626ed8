"""The fair walk is prepared once per connection with its states as literals (issue 12).

PostgreSQL soon runs a prepared statement with a generic plan; a state passed
as a parameter would keep that plan off the partial indexes over queued Runs
and active leases (`qinglong.prepared.state_literal`).
"""

from __future__ import annotations

import pytest
from django.db import connection

from dispatch.adapters.queue import OrmQueueReader
from dispatch.core.ports import DispatchScope, SessionRef
from qinglong import testing
from qinglong.clock import db_now

pytestmark = [pytest.mark.postgres, pytest.mark.django_db]


def test_the_walk_is_prepared_once_per_scope_kind_with_literal_states() -> None:
    task = testing.make_task()
    for _ in range(3):
        testing.make_run(task)
    session = testing.open_session(slots=2).session
    scopes = [
        None,
        DispatchScope.for_session(
            SessionRef(str(session.worker_id), str(session.session_id), session.generation)
        ),
    ]
    for _ in range(6):  # past PostgreSQL's five custom plans
        for scope in scopes:
            groups, _more = OrmQueueReader(observed_at=db_now(), scope=scope).walk(
                start=None, cap=8
            )
            assert [g.group_id for g in groups] == [str(task.current_revision_id)]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT statement, generic_plans + custom_plans FROM pg_prepared_statements "
            "WHERE statement LIKE %s",
            ["%after_walk%"],
        )
        prepared = cursor.fetchall()
    assert sorted(runs for _, runs in prepared) == [6, 6]
    for text, _ in prepared:
        assert "r.state = 'queued'" in text, text
        # What is left as parameters: keys, the cursor, caps and clocks; no state.
        assert "state = $" not in text and "state IN ($" not in text, text
