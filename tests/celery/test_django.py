"""Django: ``CELERY_REDLOCK_*`` settings, read by Celery through
``app.config_from_object("django.conf:settings", namespace="CELERY")``, drive the worker;
a bad one stops `celery worker` at start and ``manage.py check`` flags it.

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

from .redlock_testkit import FAILING_WORKER_ARGS, ProjEnv, exit_code, queue_length

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
    wait_for(lambda: second.state == "FAILURE", timeout=15, message="skip stored")
    proj_env.stop_loop("x")
    assert first.get(timeout=15) == "x"
    assert {e["task_id"] for e in proj_env.events()} == {first.id}


@pytest.mark.parametrize(
    ("ttl", "got"),
    [pytest.param("'soon'", "got 'soon'", id="str"), pytest.param("-1", "got -1", id="negative")],
)
def test_worker_exits_at_start_on_a_bad_django_setting(
    proj_env: ProjEnv, celery_cmd: Any, ttl: str, got: str
) -> None:
    worker = celery_cmd(
        {**proj_env.vars, "REDLOCK_TEST_DJANGO_TTL": ttl},
        *FAILING_WORKER_ARGS,
        app="redlock_proj.django_celery",
    )
    assert exit_code(worker) != 0
    log = worker.log
    assert "ImproperlyConfigured" in log
    # The Django spelling, what is accepted, and the value given.
    assert "CELERY_REDLOCK_TTL" in log
    assert "must be a number of seconds in [0.01, 86400] (int or float)" in log
    assert got in log
    assert " ready." not in log


_PUBLISH_TWICE = """
import sys
from redlock_proj.django_celery import hold
first, second = hold.delay(sys.argv[1]), hold.delay(sys.argv[1])
print(first.id, second.id)
"""


def _publish_twice(env: ProjEnv, name: str, dedupe: str) -> tuple[str, str]:
    """Publish ``hold(name)`` twice from the Django-configured app, as a Django view would."""
    run_env = {
        k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "REDLOCK_TEST_"))
    }
    run_env.update(
        env.vars,
        REDLOCK_TEST_DJANGO_DEDUPE=dedupe,
        PYTHONPATH=os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    done = subprocess.run(
        [sys.executable, "-c", _PUBLISH_TWICE, name],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.split()
    return first, second


def test_celery_redlock_dedupe_from_django_decides_what_is_published(proj_env: ProjEnv) -> None:
    # No worker consumes: every message published stays in the queue.
    client = proj_env.client_app()
    marker = "redlock:{hold:y}:dedupe:redlock_django.hold"

    # CELERY_REDLOCK_DEDUPE = None: two identical publishes are two jobs.
    first, second = _publish_twice(proj_env, "x", "None")
    assert first != second
    assert queue_length(client, proj_env.queue) == 2
    # The default ("queued"), set the Django way: the second publish is the queued job.
    first, second = _publish_twice(proj_env, "y", "'queued'")
    assert first == second
    assert queue_length(client, proj_env.queue) == 3
    with proj_env.masters[0].client(decode_responses=True) as conn:
        assert conn.get(marker) == first


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
