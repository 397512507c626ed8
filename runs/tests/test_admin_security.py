"""The console never becomes an oracle for secrets.

- DRF stores operator API keys in plaintext; its TokenProxy admin would list
  them. It is unregistered: no page shows a key.
- Changelist filters on digest fields (`?token_digest__startswith=ab`) would
  let staff recover a whole digest one prefix at a time: Django refuses them
  (400, DisallowedModelAdminLookup).
"""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib import admin
from django.test import Client
from rest_framework.authtoken.models import Token, TokenProxy

from leases.models import RunLease
from qinglong.admin import DIGEST_FIELDS
from qinglong.testing import claim, make_run, make_worker, open_session, pending_attempt
from workers.models import Worker, WorkerSession

pytestmark = pytest.mark.django_db


@pytest.fixture
def leased() -> RunLease:
    worker, _ = make_worker()
    opened = open_session(worker)
    _, offer_id, _ = claim(pending_attempt(make_run()), opened.session)
    return RunLease.objects.get(offer_id=offer_id)


# ------------------------------------------------------------------- tokens


def test_the_token_admin_is_not_registered(admin_client: Client, admin_user: Any) -> None:
    token = Token.objects.create(user=admin_user)
    assert not admin.site.is_registered(TokenProxy)
    assert not admin.site.is_registered(Token)
    for path in (
        "/admin/authtoken/tokenproxy/",
        f"/admin/authtoken/tokenproxy/{token.key}/change/",
        "/admin/authtoken/token/",
    ):
        assert admin_client.get(path).status_code == 404, path
    index = admin_client.get("/admin/").content.decode()
    assert token.key not in index
    assert "authtoken" not in index
    user_page = admin_client.get(f"/admin/auth/user/{admin_user.pk}/change/")
    assert user_page.status_code == 200
    assert token.key not in user_page.content.decode()


# ------------------------------------------------------------ digest lookups


def _digest_probes(lease: RunLease) -> list[tuple[str, str]]:
    worker = Worker.objects.get(pk=lease.worker_id)
    session = WorkerSession.objects.get(pk=lease.session_id)
    return [
        ("/admin/leases/runlease/", f"token_digest__startswith={lease.token_digest[:2]}"),
        ("/admin/leases/runlease/", f"token_digest={lease.token_digest}"),
        ("/admin/leases/runlease/", f"token_digest__exact={lease.token_digest}"),
        ("/admin/leases/runlease/", f"spec_digest__startswith={lease.spec_digest[:2]}"),
        ("/admin/leases/runlease/", f"token_digest__gt={lease.token_digest[:2]}"),
        (
            "/admin/leases/runlease/",
            f"session__token_digest__startswith={session.token_digest[:2]}",
        ),
        (
            "/admin/leases/runlease/",
            f"worker__credential_digest__startswith={worker.credential_digest[:2]}",
        ),
        ("/admin/workers/worker/", f"credential_digest__startswith={worker.credential_digest[:2]}"),
        ("/admin/workers/worker/", f"credential_digest__regex=^{worker.credential_digest[:2]}"),
        (
            "/admin/workers/workersession/",
            f"token_digest__startswith={session.token_digest[:2]}",
        ),
        (
            "/admin/workers/workersession/",
            f"worker__credential_digest__startswith={worker.credential_digest[:2]}",
        ),
        ("/admin/runs/run/", f"leases__token_digest__startswith={lease.token_digest[:2]}"),
        ("/admin/runs/attempt/", f"leases__token_digest__startswith={lease.token_digest[:2]}"),
    ]


def test_lookups_on_digest_fields_are_refused(admin_client: Client, leased: RunLease) -> None:
    for path, query in _digest_probes(leased):
        response = admin_client.get(f"{path}?{query}")
        assert response.status_code == 400, (path, query, response.status_code)
        assert leased.token_digest not in response.content.decode()


def test_ordinary_filters_still_work(admin_client: Client, leased: RunLease) -> None:
    for path, query in (
        ("/admin/leases/runlease/", "state__exact=active"),
        ("/admin/workers/worker/", "admin_state__exact=active"),
        ("/admin/workers/workersession/", "state__exact=online"),
    ):
        response = admin_client.get(f"{path}?{query}")
        assert response.status_code == 200, (path, query)
        assert response.context["cl"].result_count == 1


def test_no_admin_searches_a_digest_field(rf: Any, admin_user: Any) -> None:
    request = rf.get("/admin/")
    request.user = admin_user
    for model, model_admin in admin.site._registry.items():
        for field in model_admin.get_search_fields(request):
            parts = field.lstrip("^=@").split("__")
            assert not DIGEST_FIELDS & set(parts), (model, field)


def test_a_search_for_a_digest_prefix_finds_nothing(admin_client: Client, leased: RunLease) -> None:
    for path, prefix in (
        ("/admin/leases/runlease/", leased.token_digest[:12]),
        ("/admin/workers/workersession/", leased.session.token_digest[:12]),
        ("/admin/workers/worker/", leased.worker.credential_digest[:12]),
    ):
        response = admin_client.get(path, {"q": prefix})
        assert response.status_code == 200
        assert response.context["cl"].result_count == 0, path
