"""The package as a user installs it: ``pip install celery-redlock``, no extras, Redis broker.

A fresh virtualenv gets the project and nothing else (no test extras, no Django), then a real
``celery worker`` from that virtualenv runs a SingletonTask published through a Redis broker.
This caught a missing dependency once: kombu's Redis transport imports ``packaging``, which
only ``celery[redis]`` brings.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
import venv
from pathlib import Path

import pytest

from celery_redlock.testing import RedisServer

ROOT = Path(__file__).resolve().parents[1]

APP = """
from celery import Celery
from celery_redlock import SingletonTask

app = Celery("bare", broker="{url}", backend="{url}")

@app.task(base=SingletonTask, lock_key="bare:{{n}}", lock_ttl=5)
def double(n):
    return n * 2
"""

PUBLISH = """
import bare
print(bare.double.delay(21).get(timeout=60))
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bare_install_runs_a_singleton_task_on_a_redis_broker(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    python = env_dir / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    # Only the runtime dependencies came in: no test extra leaked into the base install.
    listed = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=freeze"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.lower()
    for extra in ("pytest", "django", "hypothesis", "gevent"):
        assert f"\n{extra}==" not in f"\n{listed}", f"{extra} came with the bare install"

    with RedisServer() as broker:
        (tmp_path / "bare.py").write_text(APP.format(url=broker.url))
        (tmp_path / "publish.py").write_text(textwrap.dedent(PUBLISH))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "CELERY"))}
        env["PYTHONPATH"] = str(tmp_path)
        celery = env_dir / "bin" / "celery"
        worker = subprocess.Popen(
            [str(celery), "-A", "bare", "worker", "-P", "solo", "-c", "1", "--loglevel=INFO"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            published = subprocess.run(
                [str(python), "publish.py"],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
        finally:
            worker.terminate()
            try:
                output, _ = worker.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
                output, _ = worker.communicate()
        assert published.returncode == 0, (
            published.stdout + published.stderr + "\n--- worker ---\n" + output
        )
        assert published.stdout.strip() == "42", published.stdout
        assert "ModuleNotFoundError" not in output, output
