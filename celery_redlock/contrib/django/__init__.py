"""Django integration: system checks for the ``CELERY_REDLOCK_*`` settings.

Add ``"celery_redlock.contrib.django"`` to ``INSTALLED_APPS``; ``manage.py check``
(and every management command that runs checks) then reports bad values and
misspelled names. Celery validates the same settings again at worker and beat
start, so projects that skip this app are not left unguarded.
"""
