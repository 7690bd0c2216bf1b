"""Django settings for the DatabaseScheduler test: django_celery_beat on a sqlite file."""

from __future__ import annotations

import os

SECRET_KEY = "tests-only"
INSTALLED_APPS = ["django_celery_beat"]
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ["BEAT_TEST_DJANGO_DB"],
        # Two beats write last_run_at now and then; wait for the file lock, don't fail.
        "OPTIONS": {"timeout": 30},
    }
}
