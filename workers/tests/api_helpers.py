"""Helpers for the REST API tests: clients, auth headers and protocol steps."""

from __future__ import annotations

import base64
import json
import secrets
import uuid
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client
from rest_framework.authtoken.models import Token

from qinglong.testing import make_worker, open_session
from workers.models import Worker

API = "/api/v1"
WORKER_API = f"{API}/worker"


def new_lease_token() -> str:
    return base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode()


def bearer(secret: str) -> dict[str, Any]:
    return {"HTTP_AUTHORIZATION": f"Bearer {secret}"}


# Every model permission the operator API checks (runs.api.views).
OPERATOR_PERMISSIONS = (
    "runs.view_project",
    "runs.add_project",
    "runs.add_task",
    "runs.change_task",
    "runs.add_taskrevision",
    "runs.view_run",
    "runs.add_run",
    "runs.change_run",
)


def grant(user: Any, *perms: str) -> None:
    for perm in perms:
        app_label, codename = perm.split(".")
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label=app_label, codename=codename)
        )


def operator_headers(
    *,
    staff: bool = True,
    username: str | None = None,
    perms: tuple[str, ...] = OPERATOR_PERMISSIONS,
    superuser: bool = False,
) -> dict[str, Any]:
    """A Token header of a new user: by default staff with every operator permission."""
    user = get_user_model().objects.create_user(
        username=username or f"op-{uuid.uuid4().hex[:8]}", is_staff=staff, is_superuser=superuser
    )
    grant(user, *perms)
    token = Token.objects.create(user=user)
    return {"HTTP_AUTHORIZATION": f"Token {token.key}"}


def post_json(client: Client, path: str, body: Any, headers: dict[str, Any]) -> Any:
    return client.post(path, data=json.dumps(body), content_type="application/json", **headers)


def put_json(client: Client, path: str, body: Any, headers: dict[str, Any]) -> Any:
    return client.put(path, data=json.dumps(body), content_type="application/json", **headers)


def error_code(response: Any) -> str:
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "message"}, body
    return str(body["error"]["code"])


class WorkerClient:
    """One Worker's view of the protocol: its session token and its pulls."""

    def __init__(self, client: Client, session_token: str, worker: Worker) -> None:
        self.client = client
        self.token = session_token
        self.worker = worker

    @classmethod
    def open(cls, client: Client, *, slots: int = 2, worker: Worker | None = None) -> WorkerClient:
        if worker is None:
            worker, _ = make_worker(slots=slots)
        opened = open_session(worker)
        return cls(client, opened.token, worker)

    def pull(
        self,
        *,
        pull_id: str | None = None,
        lease_token: str | None = None,
        max_offers: int = 1,
    ) -> tuple[Any, str, str]:
        pull_id = pull_id or str(uuid.uuid4())
        lease_token = lease_token or new_lease_token()
        response = post_json(
            self.client,
            f"{WORKER_API}/pull",
            {"pull_id": pull_id, "lease_token": lease_token, "max_offers": max_offers},
            bearer(self.token),
        )
        return response, pull_id, lease_token

    def ack(self, offer: dict[str, Any], phase: str, lease_token: str, **extra: Any) -> Any:
        body = {
            "phase": phase,
            "lease_token": lease_token,
            "spec_sha256": offer["spec_sha256"],
            **extra,
        }
        return post_json(
            self.client,
            f"{WORKER_API}/leases/{offer['offer_id']}/ack",
            body,
            bearer(self.token),
        )

    def heartbeat(self, draining: bool = False, *, held: list[str] | None = None) -> Any:
        body: dict[str, Any] = {"draining": draining}
        if held is not None:
            body["held"] = held
        return post_json(self.client, f"{WORKER_API}/heartbeat", body, bearer(self.token))

    def reconcile(self, executions: list[dict[str, Any]]) -> Any:
        return post_json(
            self.client,
            f"{WORKER_API}/reconcile",
            {"executions": executions},
            bearer(self.token),
        )


PHASE_EXTRA: dict[str, dict[str, Any]] = {
    "starting": {},
    "running": {"executor_handle": "pid:42"},
    "succeeded": {"exit_code": 0},
    "failed": {"exit_code": 1},
    "start_failed": {"error_code": "spawn_failed"},
}


def state_snapshot() -> dict[str, Any]:
    """Every row a Worker call could change; equal snapshots mean nothing changed."""
    from leases.models import RunLease
    from runs.models import Attempt, AttemptEvent, Run
    from workers.models import WorkerSession

    return {
        "attempts": list(
            Attempt.objects.order_by("id").values_list(
                "id", "state", "version", "lease_generation", "executor_handle", "exit_code"
            )
        ),
        "runs": list(
            Run.objects.order_by("id").values_list("id", "state", "version", "cancel_requested")
        ),
        "leases": list(
            RunLease.objects.order_by("id").values_list(
                "id", "state", "version", "expires_at", "delivery_count"
            )
        ),
        "events": AttemptEvent.objects.count(),
        "sessions": list(
            WorkerSession.objects.order_by("id").values_list("id", "state", "heartbeat_at")
        ),
    }
