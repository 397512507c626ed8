"""The Qinglong control plane project package.

Importing the Celery app here (Celery's Django integration) makes
`@shared_task` bind to it whenever Django starts.
"""

from __future__ import annotations

from qinglong.celery import app as celery_app

__all__ = ["celery_app"]
