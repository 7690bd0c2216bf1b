"""Django settings of the Django flavour of the test project (see ``django_celery.py``).

Celery reads every ``CELERY_*`` name here through
``app.config_from_object("django.conf:settings", namespace="CELERY")``; celery-redlock's
settings are the ``CELERY_REDLOCK_*`` ones. Connection URLs come from the same environment
variables as the plain project; ``REDLOCK_TEST_DJANGO_TTL`` and ``REDLOCK_TEST_DJANGO_DEDUPE``
(Python literals) become ``CELERY_REDLOCK_TTL`` and ``CELERY_REDLOCK_DEDUPE``, to test the
system checks and worker start with a bad value and to switch enqueue dedupe.
"""

from __future__ import annotations

import ast
import os

SECRET_KEY = "tests-only"
INSTALLED_APPS = ["celery_redlock.contrib.django"]
USE_TZ = True
DATABASES: dict[str, object] = {}

_UNUSED = "redis://127.0.0.1:1/0"  # `manage.py check` reads settings, it connects to nothing
CELERY_BROKER_URL = os.environ.get("REDLOCK_TEST_BROKER", _UNUSED)
CELERY_RESULT_BACKEND = os.environ.get("REDLOCK_TEST_BACKEND", _UNUSED)
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
if os.environ.get("REDLOCK_TEST_QUEUE"):  # the plain project's client publishes there
    CELERY_TASK_DEFAULT_QUEUE = CELERY_CONTROL_EXCHANGE = os.environ["REDLOCK_TEST_QUEUE"]
CELERY_WORKER_PREFETCH_MULTIPLIER = 1

CELERY_REDLOCK_REDIS_URLS = os.environ.get("REDLOCK_TEST_MASTERS", _UNUSED).split(",")
CELERY_REDLOCK_TTL = ast.literal_eval(os.environ.get("REDLOCK_TEST_DJANGO_TTL", "30"))
CELERY_REDLOCK_ON_CONTENTION = "skip"
CELERY_REDLOCK_DEDUPE = ast.literal_eval(os.environ.get("REDLOCK_TEST_DJANGO_DEDUPE", "None"))

# Another library's settings outside Celery's namespace (issue 15 item 10): celery-redlock
# judges only CELERY_REDLOCK_* names, so these never stop the worker or `manage.py check`.
REDLOCK_RETRY_COUNT = 3
REDLOCK_RETRY_DELAY = 200
