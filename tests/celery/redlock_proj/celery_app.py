"""`celery -A redlock_proj.celery_app worker|beat`: the project configured from the environment."""

from __future__ import annotations

import os

from .project import make_app, record_signals

app = make_app(os.environ)
record_signals(os.environ)
