"""Template tags of the Run and Attempt pages: the live output panel and the cancel button.

`{% output_panel run_id attempt_number %}` renders the newest stored output
(server-side, so the page is useful without JavaScript) and the data the
vendored `output/follow.js` needs to follow it through the operator API
(`GET /api/v1/runs/{id}/output`, with the admin session). Without an
Attempt number it follows the Run's newest Attempt, retries included.

`{% run_cancel_form run %}` is a one-click cancel on the Run page: a POST of the
changelist's own "Cancel selected runs" action for this one Run, so it needs
exactly that action's permission (`runs.change_run`) and nothing new.
"""

from __future__ import annotations

from typing import Any

from django import template
from django.conf import settings
from django.urls import reverse

from output.services import output_tail
from runs.models import RUN_TERMINAL_STATES, Run

register = template.Library()


@register.inclusion_tag("output/panel.html")
def output_panel(run_id: int, attempt_number: int | None = None) -> dict[str, Any]:
    tail = output_tail(run_id=run_id, attempt_number=attempt_number)
    return {
        "api_url": reverse("operator-api:run-output", args=[run_id]),
        "pinned": attempt_number is not None,
        "tail": tail,
        "limit_bytes": int(settings.QINGLONG_OUTPUT_MAX_BYTES),
    }


@register.inclusion_tag("output/cancel_form.html", takes_context=True)
def run_cancel_form(context: template.Context, run: Run) -> dict[str, Any]:
    request = context.get("request")
    user = getattr(request, "user", None)
    allowed = bool(user is not None and user.has_perm("runs.change_run"))
    return {
        "show": allowed and run.state not in RUN_TERMINAL_STATES,
        "requested": run.cancel_requested,
        "run": run,
        "changelist": reverse("admin:runs_run_changelist"),
        "csrf_token": context.get("csrf_token"),
    }
