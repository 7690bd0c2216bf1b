"""The Django application of celery-redlock."""

from __future__ import annotations

from django.apps import AppConfig
from django.core import checks


class RedlockConfig(AppConfig):  # type: ignore[misc]  # django ships no type information
    """Registers the ``celery_redlock`` system checks when Django starts."""

    name = "celery_redlock.contrib.django"
    label = "celery_redlock"
    verbose_name = "celery-redlock"

    def ready(self) -> None:
        from .checks import TAG, check_settings

        checks.register(check_settings, TAG)
