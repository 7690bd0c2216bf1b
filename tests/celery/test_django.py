"""Django: ``CELERY_REDLOCK_*`` settings, read by Celery through
``app.config_from_object("django.conf:settings", namespace="CELERY")``, drive the worker;
``manage.py check`` flags a bad one.

Both run in subprocesses (a `celery worker`, ``python -m django check``), the way a Django
project runs them, so this process never configures Django.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from celery_redlock.testing import wait_for

from .redlock_testkit import ProjEnv

pytestmark = pytest.mark.timeout(90)

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_celery_redlock_settings_from_django_drive_the_worker(
    proj_env: ProjEnv, spawn_worker: Any
) -> None:
    spawn_worker("dj", app="redlock_proj.django_celery")
    client = proj_env.client_app()  # publishes by name to the same broker

    first = client.send_task("redlock_django.hold", ("x",))
    wait_for(
        lambda: any(e["task_id"] == first.id for e in proj_env.events()),
        timeout=15,
        message="first job started",
    )
    second = client.send_task("redlock_django.hold", ("x",))
    # CELERY_REDLOCK_ON_CONTENTION = "skip" (the default would reschedule it instead).
    wait_for(lambda: second.state == "IGNORED", timeout=15, message="IGNORED stored")
    proj_env.stop_loop("x")
    assert first.get(timeout=15) == "x"
    assert {e["task_id"] for e in proj_env.events()} == {first.id}


def _django_check(ttl: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "REDLOCK_TEST_"))}
    env.update(
        PYTHONPATH=os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]),
        REDLOCK_TEST_DJANGO_TTL=ttl,
    )
    return subprocess.run(
        [sys.executable, "-m", "django", "check", "--settings=redlock_proj.django_settings"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_manage_py_check_flags_a_bad_ttl() -> None:
    bad = _django_check("-1")
    assert bad.returncode != 0
    assert "celery_redlock.E001" in bad.stderr
    assert "CELERY_REDLOCK_TTL" in bad.stderr

    good = _django_check("30")
    assert good.returncode == 0, good.stderr
    assert "no issues" in good.stdout
