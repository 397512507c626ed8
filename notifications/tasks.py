"""Celery tasks of the webhook deliveries (cluster deployment): one bounded step each.

No arguments; results are counts only (never a URL, a body or a secret).
"""

from __future__ import annotations

from celery import shared_task

from notifications.delivery import webhook_deliveries_prune, webhooks_deliver_due

__all__ = ["deliver_webhooks_task", "prune_webhook_deliveries_task"]


@shared_task(name="notifications.tasks.deliver_webhooks_task")
def deliver_webhooks_task() -> dict[str, int | bool]:
    return webhooks_deliver_due().as_dict()


@shared_task(name="notifications.tasks.prune_webhook_deliveries_task")
def prune_webhook_deliveries_task() -> dict[str, int]:
    return {"deleted": webhook_deliveries_prune()}
