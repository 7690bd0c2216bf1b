"""`celery -A redlock_proj.django_celery worker`: a Celery app configured from Django settings,
the way a Django project's ``proj/celery.py`` does it."""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

import celery_redlock
from celery_redlock import SingletonTask

from .project import EventLog

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "redlock_proj.django_settings")

app = Celery("redlock_django")
app.config_from_object("django.conf:settings", namespace="CELERY")
celery_redlock.install(app)

HOLD = "redlock_django.hold"
_events = EventLog(os.environ["REDLOCK_TEST_EVENTS"])


@app.task(shared=False, bind=True, base=SingletonTask, name=HOLD, lock_key="hold:{name}")
def hold(self: Any, name: str, seconds: float = 30.0) -> str:
    """Holds ``hold:<name>`` until ``stop:<name>`` is set; no lock option is set here."""
    return _events.run_until_stopped(self, name, seconds)
