"""Django settings of the example project.

Where things live comes from the environment, so the same project runs against your
servers or against the throwaway ones ``demo.py`` starts:

``CELERY_BROKER_URL``          broker (default ``redis://localhost:6379/0``)
``CELERY_RESULT_BACKEND``      result backend (default ``redis://localhost:6379/1``)
``CELERY_REDLOCK_REDIS_URLS``  comma-separated Redlock masters (default: one, the local
                               Redis; production wants 3 or 5 independent servers)
``EXAMPLEPROJ_DB``             the sqlite file (default ``db.sqlite3`` beside manage.py)
"""

from __future__ import annotations

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-project-not-a-secret")
DEBUG = False  # DEBUG keeps every SQL query in memory: not in a worker
ALLOWED_HOSTS: list[str] = []

INSTALLED_APPS = [
    "celery_redlock.contrib.django",  # system checks for the CELERY_REDLOCK_* settings
    "accounts",
]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("EXAMPLEPROJ_DB", str(BASE_DIR / "db.sqlite3")),
        # Four worker processes write to one sqlite file: wait for its lock, do not fail.
        "OPTIONS": {"timeout": 20},
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"

# -- Celery (app.conf.<name> is CELERY_<NAME> here) -------------------------------------------

CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "redis://localhost:6379/0")
CELERY_RESULT_BACKEND = os.environ.get("CELERY_RESULT_BACKEND", "redis://localhost:6379/1")
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TIMEZONE = "UTC"
CELERY_TASK_TRACK_STARTED = True
# One message at a time per worker process, so a job never waits behind another one
# that the same process reserved.
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# A message that a dead worker took but never acknowledged (acks_late tasks) goes back to
# the queue after `visibility_timeout` seconds. Short here, so the demo's killed worker's
# job comes back quickly; in production make it longer than your longest acks_late task
# and any countdown (a message held longer than that is delivered a second time).
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": 6,
    "unacked_restore_interval": 1,
    "unacked_restore_throttle": 1,
}

# -- celery-redlock ----------------------------------------------------------------------------

CELERY_REDLOCK_REDIS_URLS = os.environ.get(
    "CELERY_REDLOCK_REDIS_URLS", "redis://localhost:6379/0"
).split(",")
# A job that finds its key taken comes back after a random 0.5 s to 2 s (doubling cap).
CELERY_REDLOCK_CONTENTION_BACKOFF = (0.5, 2)
# A dead beat's leadership passes to another beat within 5 s.
CELERY_REDLOCK_BEAT_LEASE_TTL = 5

CELERY_BEAT_SCHEDULE = {
    # Every second, exactly once, however many `celery beat` processes run.
    "heartbeat-report": {"task": "accounts.tasks.heartbeat_report", "schedule": 1.0},
}
