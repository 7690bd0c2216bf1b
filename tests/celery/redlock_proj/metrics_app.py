"""`celery -A redlock_proj.metrics_app worker`: the project, with the Prometheus exporter on
``REDLOCK_TEST_METRICS_PORT``."""

from __future__ import annotations

import os

from celery_redlock.contrib import prometheus

from .celery_app import app

prometheus.install(app, port=int(os.environ["REDLOCK_TEST_METRICS_PORT"]), addr="127.0.0.1")

__all__ = ["app"]
