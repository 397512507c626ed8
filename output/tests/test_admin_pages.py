"""The Run and Attempt pages: the output panel (redacted, bounded) and the Run page's cancel."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse

from leases.ack import AckPhase, lease_ack
from leases.models import RunLease
from output.services import output_append
from qinglong.testing import (
    CANARY_COMMAND,
    CANARY_CWD,
    CANARY_ENV,
    canary_definition,
    claim,
    make_project,
    open_session,
    pending_attempt,
)
from runs.models import Run
from runs.services import run_enqueue, task_create

pytestmark = pytest.mark.django_db


@pytest.fixture
def running():
    """A canary Run whose Attempt is running, and a way to append its output."""
    opened = open_session()
    task = task_create(project=make_project(), name="canary", definition=canary_definition())
    run = run_enqueue(task=task)
    attempt = pending_attempt(run)
    _, offer_id, token = claim(attempt, opened.session)
    lease = RunLease.objects.get(offer_id=offer_id)
    lease_ack(
        session=opened.session,
        offer_id=offer_id,
        phase=AckPhase.STARTING,
        lease_token=token,
        spec_sha256=lease.spec_digest,
    )

    def append(seq: int, chunk: str) -> None:
        output_append(
            session=opened.session, offer_id=offer_id, lease_token=token, seq=seq, chunk=chunk
        )

    return run, attempt, append, token


def _viewer(client: Client, *extra: str) -> Client:
    user = User.objects.create_user("viewer", is_staff=True)
    perms = list(Permission.objects.filter(codename__startswith="view_"))
    perms += [Permission.objects.get(codename=codename) for codename in extra]
    user.user_permissions.set(perms)
    client.force_login(user)
    return client


def test_the_run_and_attempt_pages_show_the_output_redacted(admin_client, running):
    run, attempt, append, token = running
    append(1, f"starting with {CANARY_ENV}\n")
    append(2, "working\n")
    for url in (
        reverse("admin:runs_run_change", args=[run.pk]),
        reverse("admin:runs_attempt_change", args=[attempt.pk]),
    ):
        body = admin_client.get(url).content.decode()
        assert "starting with [redacted]\nworking\n" in body, url
        assert f'data-url="/api/v1/runs/{run.pk}/output"' in body
        assert 'data-after="2"' in body and 'data-live="1"' in body
        assert "output/follow.js" in body
        for secret in (CANARY_ENV, CANARY_COMMAND, CANARY_CWD, token):
            assert secret not in body, url
    attempt_page = admin_client.get(reverse("admin:runs_attempt_change", args=[attempt.pk]))
    assert 'data-pinned="1"' in attempt_page.content.decode()


def test_the_first_render_is_bounded_and_says_older_output_exists(admin_client, running):
    run, _, append, _ = running
    for seq in range(1, 101):
        append(seq, f"{seq:04d}" + "z" * 2000 + "\n")
    body = admin_client.get(reverse("admin:runs_run_change", args=[run.pk])).content.decode()
    assert "0100zz" in body  # the newest
    assert "0001zz" not in body  # not the oldest: about 64 KiB are rendered
    assert body.count("z" * 2000) <= 33
    assert "older output is stored" in body


def test_the_cancel_button_cancels_and_returns_to_the_run_page(admin_client, running):
    run, _, _, _ = running
    page = admin_client.get(reverse("admin:runs_run_change", args=[run.pk])).content.decode()
    assert 'class="ql-cancel-button"' in page and 'name="reason"' in page
    response = admin_client.post(
        reverse("admin:runs_run_changelist"),
        {
            "action": "cancel_runs",
            "index": "0",
            "select_across": "0",
            "_selected_action": [run.pk],
            "_return_to_run": "1",
            "reason": "wrong input",
        },
    )
    assert response.status_code == 302
    assert response["Location"] == reverse("admin:runs_run_change", args=[run.pk])
    assert Run.objects.get(pk=run.pk).cancel_requested is True
    [entry] = LogEntry.objects.filter(object_id=str(run.pk))
    assert (entry.user.username, entry.change_message) == (
        "admin",
        "Action: Cancel selected runs (reason: wrong input)",
    )


def test_a_viewer_sees_the_output_but_no_cancel_button_and_cannot_cancel(client, running):
    run, _, append, _ = running
    append(1, "visible\n")
    viewer = _viewer(client)
    page = viewer.get(reverse("admin:runs_run_change", args=[run.pk])).content.decode()
    assert "visible" in page
    assert "ql-cancel-button" not in page
    viewer.post(
        reverse("admin:runs_run_changelist"),
        {"action": "cancel_runs", "_selected_action": [run.pk], "reason": "x", "index": "0"},
    )
    assert Run.objects.get(pk=run.pk).cancel_requested is False
    # The page follows the output through the operator API, which view_run opens.
    api = viewer.get(f"/api/v1/runs/{run.pk}/output")
    assert api.status_code == 200 and api.json()["chunks"][0]["text"] == "visible\n"


def test_output_is_text_never_markup(admin_client, running):
    run, _, append, _ = running
    append(1, "<script>alert(1)</script>\n")
    body = admin_client.get(reverse("admin:runs_run_change", args=[run.pk])).content.decode()
    assert "<script>alert(1)</script>" not in body
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in body


def test_a_finished_run_offers_no_cancel(admin_client, running):
    run, _, _, _ = running
    Run.objects.filter(pk=run.pk).update(state="succeeded")
    page = admin_client.get(reverse("admin:runs_run_change", args=[run.pk])).content.decode()
    assert "ql-cancel-button" not in page


def test_old_output_of_ended_attempts_is_pruned_and_the_page_falls_back_to_the_tail(
    admin_client, running
):
    from datetime import timedelta

    from django.utils import timezone

    from dispatch.sweeps import prune_live_output, run_all_sweeps
    from output.models import AttemptOutput, OutputChunk
    from runs.models import Attempt

    run, attempt, append, _ = running
    append(1, "live line\n")
    old = timezone.now() - timedelta(days=31)
    AttemptOutput.objects.update(updated_at=old)
    # Still running: kept, however old.
    assert prune_live_output().applied == 0
    Attempt.objects.filter(pk=attempt.pk).update(state="failed", output_tail="the end\n")
    assert "pruned_output" in run_all_sweeps()
    assert not OutputChunk.objects.exists() and not AttemptOutput.objects.exists()
    body = admin_client.get(reverse("admin:runs_run_change", args=[run.pk])).content.decode()
    assert "the end\n" in body and "as the Worker reported it" in body


def test_recent_output_of_an_ended_attempt_is_kept(running):
    from dispatch.sweeps import prune_live_output
    from output.models import OutputChunk
    from runs.models import Attempt

    _, attempt, append, _ = running
    append(1, "recent\n")
    Attempt.objects.filter(pk=attempt.pk).update(state="succeeded")
    assert prune_live_output().applied == 0
    assert OutputChunk.objects.count() == 1
