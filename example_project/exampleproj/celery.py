"""The Celery app: ``celery -A exampleproj worker`` / ``celery -A exampleproj beat``."""

from __future__ import annotations

import os

from celery import Celery

import celery_redlock

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "exampleproj.settings")

app = Celery("exampleproj")
# Every CELERY_* Django setting, CELERY_REDLOCK_* included, becomes app.conf.<lower name>.
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
# Signal handlers, the worker bootstep that drops duplicate beat occurrences, and beat
# leadership: no extra command-line flag for `celery worker` or `celery beat`.
celery_redlock.install(app)
