"""What operators read: no forged log line, no terminal escape, no password, no crying wolf.

Issue 18, items 1, 3 and 8, through a real in-process worker (threads pool) on real masters:

* a lock key built from a task argument holding a newline, a fake CRITICAL line and ANSI
  escapes is logged on one line, escaped, and ``celery redlock ls`` prints no ESC byte;
* a lost lock is logged once, at WARNING;
* a contention storm (30 jobs on one key) logs a bounded number of lines;
* with masters whose error texts quote a password (redis-py < 7.4 printed a Sentinel's
  ``sentinel_kwargs`` password in its errors; simulated here by turning off redis-py's
  redaction), the password reaches neither the logs nor the result backend nor
  ``celery redlock check``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis

import celery_redlock
from celery_redlock import SingletonTask
from celery_redlock.testing import wait_for

from ..secret_masters import SECRETS, print_passwords_in_reprs, unreachable_masters
from .redlock_testkit import CeleryEnv, SignalLog, opened_on_exit, run_worker

pytestmark = pytest.mark.timeout(90)

FORGED = "CRITICAL celery_redlock.task: database wiped"
EVIL_EMAIL = f"a@b.example\n{FORGED}\x1b[2J\x1b[31m\r\u202e"
CELERY = Path(sys.executable).with_name("celery")
APP_MODULE = """
import json, os

from celery import Celery
from redis import connection

import celery_redlock

if os.environ.get("REDLOCK_OLD_REDIS_REPR"):
    # redis-py < 7.4 printed every connection argument, passwords too, in its reprs
    connection.ConnectionPool.SENSITIVE_REPR_KEYS = frozenset()
app = Celery("cliapp", broker="memory://")
app.conf.redlock_redis_urls = json.loads(os.environ["REDLOCK_CLI_MASTERS"])
app.conf.redlock_node_timeout = 0.2
celery_redlock.install(app)
"""


def _run_cli(tmp_path: Path, masters: list[Any], *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "cliapp.py").write_text(APP_MODULE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_")}
    env.update(
        REDLOCK_CLI_MASTERS=json.dumps(masters),
        # the celery_redlock under test, wherever this interpreter found it
        PYTHONPATH=os.pathsep.join([str(tmp_path), str(Path(celery_redlock.__file__).parents[1])]),
        REDLOCK_OLD_REDIS_REPR="1",
    )
    return subprocess.run(
        [str(CELERY), "-A", "cliapp", "redlock", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _lines(caplog: pytest.LogCaptureFixture, level: int = logging.INFO) -> list[str]:
    return [
        f"{r.levelname} {r.name}: {r.getMessage()}"
        for r in caplog.records
        if r.name.startswith("celery_redlock") and r.levelno >= level
    ]


@pytest.fixture
def old_redis_repr(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this redis-py print passwords in its reprs, as redis-py < 7.4 did."""
    print_passwords_in_reprs(monkeypatch)


# -- injection -----------------------------------------------------------------------------


def test_a_key_with_newlines_and_escapes_forges_no_log_line_and_no_terminal_codes(
    env: CeleryEnv,
    make_app: Any,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    caplog.set_level(logging.INFO, logger="celery_redlock")
    # Celery's own lines too: it logs our Retry's text (the worker sets the root's level).
    caplog.set_level(logging.INFO, logger="celery.app.trace")
    app = make_app()
    running, gate = threading.Event(), threading.Event()

    @app.task(bind=True, base=SingletonTask, lock_key="user:{email}", on_contention="skip")
    def notify(self: Any, email: str) -> str:
        running.set()
        gate.wait(20)
        return "sent"

    @app.task(bind=True, base=SingletonTask, lock_key="user:{email}")
    def remind(self: Any, email: str) -> str:
        return "reminded"

    with run_worker(app), opened_on_exit(gate):
        first = notify.delay(EVIL_EMAIL)
        assert running.wait(15)
        # A second job meets the lock: "held elsewhere; skipped" logs the key.
        second = notify.apply_async((EVIL_EMAIL,), task_id="second-job")
        wait_for(
            lambda: any("skipped" in line for line in _lines(caplog)),
            timeout=15,
            message="the skip was logged",
        )
        # A job of the retry policy is rescheduled: Celery logs "retry: <our Retry's text>".
        reminder = remind.delay(EVIL_EMAIL)
        wait_for(
            lambda: any(" retry: " in r.getMessage() for r in caplog.records),
            timeout=15,
            message="Celery logged the reschedule",
        )
        listed = _run_cli(tmp_path, env.masters.urls, "ls")
        gate.set()
        assert first.get(timeout=15) == "sent"
        assert reminder.get(timeout=15) == "reminded"
        del second

    text = caplog.text + "\n".join(_lines(caplog, logging.DEBUG))
    for line in text.splitlines():
        assert not line.lstrip().startswith(FORGED), f"forged line: {line!r}"
    for char in ("\x1b", "\r", "\u202e"):
        assert char not in text
    assert "\\nCRITICAL celery_redlock.task: database wiped" in text, "the key was not logged"
    assert listed.returncode == 0, listed.stderr
    assert "user:a@b.example" in listed.stdout, listed.stdout
    assert "\x1b" not in listed.stdout + listed.stderr
    assert not any(line.startswith(FORGED) for line in listed.stdout.splitlines())


# -- a lost lock, once ---------------------------------------------------------------------


def test_a_lost_lock_is_logged_once_at_warning(
    env: CeleryEnv, make_app: Any, caplog: pytest.LogCaptureFixture, signal_log: SignalLog
) -> None:
    caplog.set_level(logging.DEBUG, logger="celery_redlock")
    app = make_app()
    running = threading.Event()

    @app.task(bind=True, base=SingletonTask, lock_key="sweep:{n}", lock_ttl=1.5)
    def sweep(self: Any, n: int) -> str:
        running.set()
        deadline = time.monotonic() + 10
        while self.lease.held and time.monotonic() < deadline:
            time.sleep(0.02)
        return "finished"

    lock, meta = env.lock_names("sweep:3")
    with run_worker(app), opened_on_exit(running):
        result = sweep.delay(3)
        assert running.wait(10)
        wait_for(lambda: all(env.on_masters(lock)), timeout=5, message="lock on all masters")
        env.delete_on_masters(lock, meta)
        assert result.get(timeout=15) == "finished"

    assert signal_log.of("lock_lost", task_id=result.id)
    warnings = [line for line in _lines(caplog, logging.WARNING) if "lost" in line]
    assert len(warnings) == 1, warnings
    assert result.id in warnings[0]


# -- a contention storm --------------------------------------------------------------------

STORM_JOBS = 30


def test_a_contention_storm_logs_a_bounded_number_of_lines(
    env: CeleryEnv, make_app: Any, caplog: pytest.LogCaptureFixture, signal_log: SignalLog
) -> None:
    caplog.set_level(logging.INFO, logger="celery_redlock")
    app = make_app(redlock_contention_backoff=(0.02, 0.1))
    done: list[int] = []

    @app.task(bind=True, base=SingletonTask, lock_key="hot", dedupe=None)
    def hot(self: Any, n: int) -> int:
        time.sleep(0.05)
        done.append(n)
        return n

    with run_worker(app, concurrency=4):
        results = [hot.delay(n) for n in range(STORM_JOBS)]
        for result in results:
            result.get(timeout=60)

    reschedules = len(signal_log.of("lock_contended", action="retry"))
    assert reschedules > STORM_JOBS, "too little contention: the test tested nothing"
    lines = _lines(caplog)
    # One line for the storm, plus at most one summary per 30 s it lasted: never a line
    # per reschedule (before: one INFO line per reschedule, hundreds here).
    assert len(lines) <= 3, "\n".join(lines[:20])
    assert sorted(done) == list(range(STORM_JOBS))


# -- passwords -----------------------------------------------------------------------------


def test_no_password_reaches_logs_result_backend_or_check(
    env: CeleryEnv,
    make_app: Any,
    caplog: pytest.LogCaptureFixture,
    signal_log: SignalLog,
    old_redis_repr: None,
    tmp_path: Path,
) -> None:
    caplog.set_level(logging.DEBUG, logger="celery_redlock")
    masters = unreachable_masters()
    app = make_app(redlock_redis_urls=masters, redlock_node_timeout=0.2)

    @app.task(bind=True, base=SingletonTask, lock_key="report:{n}")
    def report(self: Any, n: int) -> int:
        return n

    with run_worker(app):
        result = report.delay(1)
        wait_for(
            lambda: signal_log.of("lock_unavailable", task_id=result.id),
            timeout=20,
            message="the job met the outage",
        )
        # The RETRY state stored for the job carries the QuorumUnavailable and its errors.
        wait_for(lambda: result.state == "RETRY", timeout=10, message="RETRY stored")
        stored = redis.Redis.from_url(env.backend_url).get(f"celery-task-meta-{result.id}")
        result.revoke()

    assert stored is not None
    [unavailable, *_] = signal_log.of("lock_unavailable", task_id=result.id)
    errors = json.dumps(unavailable["errors"])
    assert "No master found for 'mymaster'" in errors, "the sentinel error was not exercised"
    checked = _run_cli(tmp_path, masters, "check")
    checked_json = _run_cli(tmp_path, masters, "check", "--json")
    assert checked.returncode == 2, checked.stdout + checked.stderr
    outputs = {
        "logs": caplog.text + "\n".join(_lines(caplog, logging.DEBUG)),
        "signal errors": errors,
        "result backend": stored.decode(errors="replace"),
        "check": checked.stdout + checked.stderr,
        "check --json": checked_json.stdout + checked_json.stderr,
    }
    for where, text in outputs.items():
        for secret in SECRETS:
            assert secret not in text, f"{secret} in {where}"
