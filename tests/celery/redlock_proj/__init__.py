"""A small Celery project for the tests that run real ``celery worker`` / ``celery beat``.

Configured entirely from environment variables (see :mod:`.celery_app`), so a test can
point a subprocess at the redis-server processes it started.
"""
