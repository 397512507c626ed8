"""Nothing secret leaves except in the owning Session's pull response (docs/adr/0003).

A Task carries canary strings in its command, env and cwd. Every endpoint is
driven, error paths included, with every logger at DEBUG; the canaries may
appear only in the pull responses of the Session holding the lease, and lease
tokens only in pull responses (and the requests that sent them).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import Client

from dispatch.models import DispatchCycle
from leases.models import RunLease
from output.models import OutputChunk
from qinglong.testing import CANARY_COMMAND, CANARY_CWD, CANARY_ENV, canary_definition, make_worker
from runs.models import Attempt, AttemptEvent
from workers.tests.api_helpers import (
    API,
    WORKER_API,
    WorkerClient,
    bearer,
    new_lease_token,
    operator_headers,
    post_json,
    put_json,
)

pytestmark = pytest.mark.django_db

CANARIES = (CANARY_COMMAND, CANARY_ENV, CANARY_CWD.rsplit("/", 1)[-1])


@pytest.fixture
def all_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Every record of every logger at DEBUG, including non-propagating ones."""
    caplog.set_level(logging.DEBUG)
    attached = []
    for name in ("qinglong", "django", "django.request", "django.server", "django.db.backends"):
        logger = logging.getLogger(name)
        attached.append((logger, logger.level))
        logger.setLevel(logging.DEBUG)
        if not logger.propagate:
            logger.addHandler(caplog.handler)
    yield caplog
    for logger, level in attached:
        logger.setLevel(level)
        if caplog.handler in logger.handlers:
            logger.removeHandler(caplog.handler)


class Recorder:
    def __init__(self) -> None:
        self.responses: list[tuple[str, str]] = []

    def add(self, label: str, response: Any) -> Any:
        self.responses.append((label, response.content.decode("utf-8", "replace")))
        return response


def _log_text(caplog: pytest.LogCaptureFixture) -> str:
    parts = []
    for record in caplog.records:
        parts.append(record.getMessage())
        parts.append(json.dumps(record.__dict__, default=repr))
    return "\n".join(parts)


def test_canaries_and_lease_tokens_appear_only_in_the_owners_pull_responses(
    client: Client, all_logs: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = Recorder()
    op = operator_headers()
    rec.add("project", post_json(client, f"{API}/projects", {"slug": "leak", "name": "L"}, op))
    task_body = {"name": "canary", **canary_definition()}
    rec.add("task", post_json(client, f"{API}/projects/leak/tasks", task_body, op))
    rec.add("task-dup", post_json(client, f"{API}/projects/leak/tasks", task_body, op))
    bad = {**task_body, "name": "bad", "env": {"bad key!": CANARY_ENV}, "cwd": f"../{CANARY_CWD}"}
    rec.add("task-bad", post_json(client, f"{API}/projects/leak/tasks", bad, op))
    edit = {k: v for k, v in canary_definition().items()}
    rec.add("task-edit", put_json(client, f"{API}/projects/leak/tasks/canary", edit, op))
    rec.add("task-edit-bad", put_json(client, f"{API}/projects/leak/tasks/canary", bad, op))
    run = rec.add(
        "run", post_json(client, f"{API}/runs", {"project": "leak", "task": "canary"}, op)
    ).json()

    owner_worker, owner_credential = make_worker(slots=1)
    other_worker, other_credential = make_worker(slots=1)
    sessions = {}
    for name, credential in (("owner", owner_credential), ("other", other_credential)):
        body = {"executor_types": ["process"], "slots": 1, "agent_version": "leak"}
        opened = rec.add(
            f"session-{name}", post_json(client, f"{WORKER_API}/sessions", body, bearer(credential))
        )
        sessions[name] = opened.json()["session_token"]
    owner = WorkerClient(client, sessions["owner"], owner_worker)
    other = WorkerClient(client, sessions["other"], other_worker)

    tokens: list[str] = []

    def pull(who: str, wc: WorkerClient, **kwargs: Any) -> Any:
        response, _, token = wc.pull(**kwargs)
        tokens.append(token)
        return rec.add(f"pull-{who}", response)

    first = pull("owner", owner)
    [offer] = first.json()["offers"]
    token = offer["lease"]["token"]
    pull_id = str(uuid.uuid4())
    pull("owner", owner, pull_id=pull_id, lease_token=token)  # replay path
    pull("owner", owner, pull_id=pull_id, lease_token=token)
    pull("owner", owner, pull_id=pull_id)  # 409 conflict
    pull("other", other)

    ack_url = f"{WORKER_API}/leases/{offer['offer_id']}/ack"
    base = {"lease_token": token, "spec_sha256": offer["spec_sha256"]}
    rec.add("ack-other", other.ack(offer, "starting", token))
    rec.add("ack-wrong-token", owner.ack(offer, "starting", new_lease_token()))
    rec.add("ack-spec", owner.ack({**offer, "spec_sha256": "0" * 64}, "starting", token))
    rec.add(
        "ack-extra",
        post_json(client, ack_url, {**base, "phase": "starting", "spec": "x"}, bearer(owner.token)),
    )
    rec.add(
        "ack-bad-json",
        client.post(
            ack_url,
            data=b'{"lease_token": "' + token.encode() + b'"',
            content_type="application/json",
            **bearer(owner.token),
        ),
    )
    rec.add(
        "ack-415",
        client.post(
            ack_url, data=f"lease_token={token}", content_type="text/plain", **bearer(owner.token)
        ),
    )
    rec.add(
        "ack-413",
        post_json(
            client,
            ack_url,
            {**base, "phase": "failed", "exit_code": 1, "output_tail": token * 2000},
            bearer(owner.token),
        ),
    )
    # Several ACKs in one request (issue 12): refusals, a bad item, oversize, bad JSON.
    acks_url = f"{WORKER_API}/acks"
    item = {"offer_id": offer["offer_id"], **base, "phase": "starting"}

    def acks(label: str, body: Any, who: WorkerClient = owner) -> None:
        rec.add(label, post_json(client, acks_url, body, bearer(who.token)))

    acks("acks-other", {"acks": [item, item]}, other)
    acks("acks-wrong-token", {"acks": [{**item, "lease_token": new_lease_token()}, item]})
    acks("acks-extra", {"acks": [item, {**item, "spec": token, token[:40]: CANARY_ENV}]})
    acks("acks-bad-phase", {"acks": [{**item, "phase": token}]})
    acks("acks-envelope", {"acks": [item], token[:40]: token})
    tail = {**item, "phase": "failed", "exit_code": 1, "output_tail": f"{CANARY_ENV} {token}"}
    acks("acks-413", {"acks": [tail] * 64 + [{**tail, "output_tail": token * 2000}] * 12})
    rec.add(
        "acks-bad-json",
        client.post(
            acks_url,
            data=b'{"acks": [{"lease_token": "' + token.encode() + b'"',
            content_type="application/json",
            **bearer(owner.token),
        ),
    )
    rec.add("ack-starting", owner.ack(offer, "starting", token))
    acks(
        "acks-running",
        {
            "acks": [
                {**item, "phase": "running", "executor_handle": "pid:7"},
                item,  # `starting` again: a no-op
                {**item, "phase": "start_failed", "output_tail": CANARY_ENV},  # too late
            ]
        },
    )
    # Live output (issue 14): the process printed its env; stored and served redacted.
    output_url = f"{WORKER_API}/leases/{offer['offer_id']}/output"
    printed = {"lease_token": token, "seq": 1, "chunk": f"env: {CANARY_ENV}\n"}
    rec.add("output", post_json(client, output_url, printed, bearer(owner.token)))
    rec.add("output-again", post_json(client, output_url, printed, bearer(owner.token)))
    rec.add("output-other", post_json(client, output_url, printed, bearer(other.token)))
    wrong = {**printed, "lease_token": new_lease_token()}
    rec.add("output-wrong-token", post_json(client, output_url, wrong, bearer(owner.token)))
    bad_seq = {**printed, "seq": token}
    rec.add("output-bad", post_json(client, output_url, bad_seq, bearer(owner.token)))
    rec.add("run-output", client.get(f"{API}/runs/{run['id']}/output", **op))
    rec.add("heartbeat", owner.heartbeat())
    rec.add("heartbeat-held", owner.heartbeat(held=[offer["offer_id"], "ab" * 32]))
    rec.add("run-detail", client.get(f"{API}/runs/{run['id']}", **op))
    rec.add("runs", client.get(f"{API}/runs", **op))
    rec.add("cancel", post_json(client, f"{API}/runs/{run['id']}/cancel", {}, op))
    rec.add("heartbeat-cancel", owner.heartbeat())
    rec.add(
        "ack-failed",
        owner.ack(offer, "failed", token, exit_code=143, output_tail=f"bye {CANARY_ENV}"),
    )
    rec.add("run-output-end", client.get(f"{API}/runs/{run['id']}/output?after=0", **op))
    rec.add("ack-after", owner.ack(offer, "starting", token))
    acks("acks-after", {"acks": [tail, {**item, "phase": "running", "executor_handle": "x"}]})
    rec.add("run-detail-end", client.get(f"{API}/runs/{run['id']}", **op))
    rec.add("projects", client.get(f"{API}/projects", **op))
    rec.add("404", client.get(f"{API}/nothing/{token}", **op))
    rec.add("405", client.get(ack_url, **bearer(owner.token)))
    rec.add(
        "401",
        post_json(
            client, f"{WORKER_API}/pull", {"pull_id": pull_id, "lease_token": token}, bearer(token)
        ),
    )
    rec.add("schema", client.get("/api/schema/"))
    # The old session after a replacement: 401 on every call, with its token in the body.
    reopened = rec.add(
        "session-owner-2",
        post_json(
            client,
            f"{WORKER_API}/sessions",
            {"executor_types": ["process"], "slots": 1},
            bearer(owner_credential),
        ),
    )
    sessions["owner-2"] = reopened.json()["session_token"]
    rec.add("pull-replaced", owner.pull(pull_id=pull_id, lease_token=token)[0])
    acks("acks-replaced", {"acks": [tail, tail]})
    # The reconcile report carries lease tokens in; nothing answers with one.
    owner2 = WorkerClient(client, sessions["owner-2"], owner_worker)
    report = {"offer_id": offer["offer_id"], "lease_token": token, "outcome": "exited"}
    rec.add("reconcile", owner2.reconcile([{**report, "exit_code": 143}]))
    rec.add("reconcile-again", owner2.reconcile([report]))
    rec.add("reconcile-other", other.reconcile([report]))
    rec.add("reconcile-replaced", owner.reconcile([report]))
    rec.add("reconcile-bad-outcome", owner2.reconcile([{**report, "outcome": token}]))
    rec.add("reconcile-bad-field", owner2.reconcile([{**report, token[:40]: token}]))
    rec.add("heartbeat-held-2", owner2.heartbeat(held=[offer["offer_id"]]))
    rec.add("run-detail-reconciled", client.get(f"{API}/runs/{run['id']}", **op))

    assert any(CANARY_ENV in body for label, body in rec.responses if label == "pull-owner")
    # The requests carrying several ACKs met their refusals and their successes.
    answers = dict(rec.responses)
    assert '"status":403' in answers["acks-other"] and '"status":200' in answers["acks-running"]
    assert "acks[1].spec" in answers["acks-extra"]
    assert "payload_too_large" in answers["acks-413"]
    assert "session_replaced" in answers["acks-replaced"]
    # The output really was stored and served, redacted.
    assert any("env: [redacted]" in body for label, body in rec.responses if label == "run-output")
    all_tokens = {token, *tokens}
    for label, text in rec.responses:
        if label != "pull-owner":
            for canary in CANARIES:
                assert canary not in text, (label, canary)
        if not label.startswith("pull-"):
            for secret in all_tokens:
                assert secret not in text, (label, "lease token")
        if label == "pull-other":
            assert token not in text

    logs = _log_text(all_logs) + capsys.readouterr().err
    # The capture really saw the service and request logs it is checking.
    assert "dispatch cycle" in logs and "session opened" in logs and "Forbidden" in logs
    secrets = [*CANARIES, *all_tokens, owner_credential, other_credential, *sessions.values()]
    for secret in secrets:
        assert secret not in logs

    # Durable telemetry is redacted too.
    for rows in (
        DispatchCycle.objects.values(),
        AttemptEvent.objects.values(),
        RunLease.objects.values(),
        OutputChunk.objects.values(),
        Attempt.objects.values("output_tail"),
    ):
        text = str(list(rows))
        for secret in (*CANARIES, *all_tokens):
            assert secret not in text
