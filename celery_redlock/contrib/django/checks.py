"""Django system checks for the ``CELERY_REDLOCK_*`` settings.

They apply the validation Celery runs at worker start
(:mod:`celery_redlock.settings`) to ``django.conf.settings`` read with Celery's
usual Django namespace, ``CELERY``, so ``manage.py check`` catches the same
mistakes before deployment:

* ``celery_redlock.E001``: a setting has a value that is not accepted;
* ``celery_redlock.E002``: settings that are each valid do not fit together
  (``CELERY_REDLOCK_NODE_TIMEOUT`` not well below ``CELERY_REDLOCK_TTL``, ...);
* ``celery_redlock.E003``: a ``CELERY_REDLOCK_*`` name that is no setting, with the
  closest correct name;
* ``celery_redlock.W001``: one of our names outside the namespace (``REDLOCK_TTL``),
  never read; a warning only, as the name may be another library's. Other
  ``REDLOCK_*`` names (``REDLOCK_RETRY_COUNT``) are not ours to judge.
"""

from __future__ import annotations

import os
from typing import Any, Final

from django.conf import settings
from django.core.checks import Error, Warning  # noqa: A004 - Django's name

from celery_redlock.settings import (
    DEFAULTS,
    SettingProblem,
    check_values,
    find_unknown_settings,
    find_unread_settings,
    setting_names,
)

__all__ = ["NAMESPACE", "TAG", "check_settings"]

#: The namespace given to ``app.config_from_object("django.conf:settings", namespace=...)``.
NAMESPACE: Final = "CELERY"
#: The tag the checks are registered under: ``manage.py check --tag celery_redlock``.
TAG: Final = "celery_redlock"

_IDS: Final = {
    "invalid": "celery_redlock.E001",
    "conflict": "celery_redlock.E002",
    "unknown": "celery_redlock.E003",
}
#: One of our setting names outside the namespace (``REDLOCK_TTL``): never read, maybe
#: another library's, so a warning only.
_UNREAD_ID: Final = "celery_redlock.W001"


def _error(problem: SettingProblem) -> Any:
    if problem.kind == "unknown":
        obj = f"settings.{problem.setting}"
    else:
        obj = f"settings.{setting_names(problem.setting)[1]}"
    return Error(problem.message, obj=obj, id=_IDS[problem.kind])


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    """Return a Django :class:`~django.core.checks.Error` for every settings problem.

    Reads ``CELERY_REDLOCK_<NAME>`` for every setting, and ``CELERY_BROKER_URL``
    (or ``$CELERY_BROKER_URL``, which Celery prefers) for the default masters.
    """
    values: dict[str, object] = {}
    for name in DEFAULTS:
        django_name = setting_names(name)[1]
        if hasattr(settings, django_name):
            values[name] = getattr(settings, django_name)
    broker_url = os.environ.get("CELERY_BROKER_URL") or getattr(
        settings, f"{NAMESPACE}_BROKER_URL", None
    )
    _, problems = check_values(values, broker_url=broker_url)
    problems += find_unknown_settings(dir(settings), namespace=NAMESPACE)
    errors = [_error(problem) for problem in problems]
    warnings = [
        Warning(message, obj=f"settings.{name}", id=_UNREAD_ID)
        for name, message in find_unread_settings(dir(settings), namespace=NAMESPACE)
    ]
    return errors + warnings
