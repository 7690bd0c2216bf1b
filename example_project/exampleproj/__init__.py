"""The example Django project. Importing it loads the Celery app, so ``@shared_task``
functions bind to it (the usual Django + Celery layout)."""

from __future__ import annotations

from .celery import app as celery_app

__all__ = ["celery_app"]
