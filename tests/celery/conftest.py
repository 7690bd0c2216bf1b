"""Fixtures for the Celery-layer tests: apps, in-process workers, `celery worker` subprocesses.

Every Redis here is a harness ``redis-server`` (masters, and one server per test that is the
Redis broker, the result backend and the place subprocess task bodies record events);
RabbitMQ is used as the second broker when the ``env`` fixture is parametrized with it.

pytest imports this package with ``--import-mode=importlib`` (pyproject.toml), so
``tests/celery`` never shadows Celery itself; helpers are imported relatively
(``.redlock_testkit``). `celery` subprocesses get this directory on ``PYTHONPATH`` and load
the project as ``redlock_proj``.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import kombu
import pytest
from celery import Celery

from celery_redlock import signals
from celery_redlock.client import reset_clients
from celery_redlock.testing import Masters, RedisServer

from .redlock_testkit import SIGNAL_NAMES, CeleryEnv, CeleryProcess, ProjEnv, Recorder, SignalLog

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


#: Warnings raised inside Celery's worker threads, where `filterwarnings = error` turns them
#: into exceptions that Celery swallows: the task's result is then never stored and the test
#: waits for nothing. redis-py 8 deprecates SETEX, which Celery's Redis result backend calls.
THIRD_PARTY_WARNINGS = ("ignore:Call to deprecated setex:DeprecationWarning",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            for spec in THIRD_PARTY_WARNINGS:
                item.add_marker(pytest.mark.filterwarnings(spec))


@pytest.fixture(autouse=True)
def _fresh_master_identities() -> None:
    """Each test's masters are new servers, but ports are reused within a session, and a
    process that saw another server at the same address takes the new one for a restarted
    master and keeps it out of the quorum for a while (as it should in production): forget
    what earlier tests saw (run_ids, restarts, the longest TTL granted: all process-wide),
    so that every test starts as a fresh deployment."""
    from celery_redlock.lock import master

    master.forget_restarts()


@pytest.fixture
def recorder() -> Recorder:
    """Spans of in-process task bodies."""
    return Recorder()


@pytest.fixture
def signal_log() -> Iterator[SignalLog]:
    """Records every celery-redlock signal sent during the test."""
    log = SignalLog()
    for name in SIGNAL_NAMES:
        getattr(signals, name).connect(
            log.receiver(name), weak=False, dispatch_uid=f"tests.signal_log.{name}"
        )
    yield log
    for name in SIGNAL_NAMES:
        getattr(signals, name).disconnect(dispatch_uid=f"tests.signal_log.{name}")


# -- in-process apps and workers ------------------------------------------------------------------


@pytest.fixture
def broker_server(master_factory: Callable[..., RedisServer]) -> RedisServer:
    """A harness redis-server: Redis broker (db 0), result backend (db 1), events (db 2)."""
    return master_factory()


@pytest.fixture
def env(request: pytest.FixtureRequest, masters: Masters, broker_server: RedisServer) -> CeleryEnv:
    """Redis broker by default; ``@pytest.mark.parametrize("env", BROKERS, indirect=True)``
    runs the test on RabbitMQ too (a Redis result backend either way)."""
    kind = getattr(request, "param", "redis")
    if kind == "rabbitmq":
        broker_url = request.getfixturevalue("rabbitmq_url")
    else:
        broker_url = f"redis://127.0.0.1:{broker_server.port}/0"
    return CeleryEnv(
        kind=kind,
        broker_url=broker_url,
        backend_url=f"redis://127.0.0.1:{broker_server.port}/1",
        masters=masters,
        server=broker_server,
        queue=f"redlock-test-{uuid.uuid4().hex[:12]}",
    )


def forget_results(apps: list[Celery], server: RedisServer) -> None:
    """Keep AsyncResults of ``apps`` from reaching the result backend after the test.

    A collected AsyncResult unsubscribes from its result key; once the backend's server is
    gone, redis-py retries it for 20 s and the error fails whichever test is running then.
    Collect the garbage now, while the server runs, and make the stragglers (kept alive, e.g.
    by a logged exception's traceback in caplog) forget their subscription.

    Sockets to ``server`` (the test's Redis broker and result backend) that are reclaimed
    here unclosed are not reported: kombu's Redis transport opens a connection to give back
    a stopped worker's unacked messages and never closes it (seen on Python 3.12). Sockets
    to the masters, which are celery-redlock's, stay under ``filterwarnings = error``.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message=rf"unclosed <socket\.socket .*raddr=\('127\.0\.0\.1', {server.port}\)>",
            category=ResourceWarning,
        )
        gc.collect()
    # app.backend is per thread: an in-process worker's threads have result consumers of
    # their own, which the app's own backend does not reach. Find them all.
    from celery.backends.redis import ResultConsumer

    consumers = [
        app.backend.result_consumer for app in apps if hasattr(app.backend, "result_consumer")
    ]
    consumers += [
        obj
        for obj in gc.get_objects()
        if isinstance(obj, ResultConsumer) and getattr(obj, "app", None) in apps
    ]
    for consumer in consumers:
        consumer.subscribed_to.clear()
        # A thread still unwinding (a job republished after the test) would subscribe
        # again, and a straggler's unsubscribe would then reach a server that is gone.
        consumer.consume_from = lambda task_id: None
        consumer.cancel_for = lambda task_id: None


class TestApp(Celery):  # type: ignore[misc]
    """A Celery app whose tasks are not shared: Celery registers shared tasks (its default)
    in every app created afterwards, so one test's tasks would leak into the next test's app
    and collide by name."""

    __test__ = False

    def task(self, *args: Any, **opts: Any) -> Any:
        opts.setdefault("shared", False)
        return super().task(*args, **opts)


@pytest.fixture
def make_app(env: CeleryEnv) -> Iterator[Callable[..., Celery]]:
    """``make_app(**conf)``: a Celery app on ``env``; conf entries override the defaults.

    Contention backoff is short so that rescheduled jobs come back within a second.
    """
    apps: list[Celery] = []

    def make(**conf: Any) -> Celery:
        app = TestApp(f"redlock-{uuid.uuid4().hex[:8]}", set_as_current=False)
        app.conf.update(
            broker_url=env.broker_url,
            result_backend=env.backend_url,
            broker_connection_retry_on_startup=True,
            task_default_queue=env.queue,
            # Celery would clear the root logger's handlers (pytest's log capture among them).
            worker_hijack_root_logger=False,
            # With AMQP heartbeats on, an in-process worker takes ~10 s to notice it should stop.
            broker_heartbeat=0,
            redlock_redis_urls=env.masters.urls,
            redlock_contention_backoff=(0.05, 0.2),
            redlock_outage_backoff=(0.1, 0.3),
        )
        app.conf.update(conf)
        apps.append(app)
        return app

    yield make
    forget_results(apps, env.server)
    reset_clients()
    for app in apps:
        if env.kind == "rabbitmq":
            with contextlib.suppress(Exception), app.connection_for_write() as conn:
                conn.default_channel.queue_delete(env.queue)
        app.close()


# -- `celery` subprocesses -------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> Callable[[], None] | None:
    # The worker's main process dies with the test runner even after `kill -9` of pytest;
    # its pool children notice their parent is gone and exit too.
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def setup() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return setup


@pytest.fixture
def proj_env(
    request: pytest.FixtureRequest, masters: Masters, broker_server: RedisServer
) -> Iterator[ProjEnv]:
    """Where the subprocess project runs: the harness Redis broker by default;
    ``@pytest.mark.parametrize("proj_env", BROKERS, indirect=True)`` runs the test on
    RabbitMQ too (a Redis result backend and event list either way).

    The task queue and the control exchange are named after the test alone, and deleted
    on RabbitMQ afterwards (with whatever is left in them), so that messages of other tests,
    or of other runs on the same RabbitMQ, never reach this test's workers.
    """
    kind = getattr(request, "param", "redis")
    base = f"redis://127.0.0.1:{broker_server.port}"
    broker_url = request.getfixturevalue("rabbitmq_url") if kind == "rabbitmq" else f"{base}/0"
    queue = f"redlock-test-{uuid.uuid4().hex[:12]}"
    env = ProjEnv(
        kind=kind,
        masters=masters,
        server=broker_server,
        queue=queue,
        vars={
            "REDLOCK_TEST_BROKER": broker_url,
            "REDLOCK_TEST_BACKEND": f"{base}/1",
            "REDLOCK_TEST_EVENTS": f"{base}/2",
            "REDLOCK_TEST_MASTERS": ",".join(masters.urls),
            "REDLOCK_TEST_QUEUE": queue,
        },
    )
    yield env
    forget_results(env.apps, env.server)
    reset_clients()
    for app in env.apps:
        app.close()
    if kind == "rabbitmq":
        _delete_on_rabbitmq(broker_url, queue)


def _delete_on_rabbitmq(url: str, queue: str) -> None:
    """Purge and delete a test's queue, and the exchanges named after it (the task
    exchange, the control exchange and its reply exchange), each if it exists. Node
    control queues expire by themselves (``control_queue_expires``)."""
    with kombu.Connection(url, connect_timeout=5) as conn:
        conn.ensure_connection(max_retries=1)
        with conn.channel() as channel, contextlib.suppress(*conn.channel_errors):
            channel.queue_purge(queue)
        for delete, name in (
            ("queue_delete", queue),
            ("exchange_delete", queue),
            ("exchange_delete", f"{queue}.pidbox"),
            ("exchange_delete", f"reply.{queue}.pidbox"),
        ):
            # A missing queue or exchange (404) closes the channel: one channel each.
            with conn.channel() as channel, contextlib.suppress(*conn.channel_errors):
                getattr(channel, delete)(name)


@pytest.fixture
def celery_cmd(tmp_path: Path) -> Iterator[Callable[..., CeleryProcess]]:
    """``celery_cmd(env, "worker", ...)``: start ``python -m celery -A <app> worker ...`` (``app``:
    ``redlock_proj.celery_app`` unless given); every process group started is killed after the
    test."""
    started: list[CeleryProcess] = []

    def start(
        env_vars: Mapping[str, str],
        *args: str,
        nodename: str | None = None,
        app: str = "redlock_proj.celery_app",
    ) -> CeleryProcess:
        env = {
            k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "REDLOCK_TEST_"))
        }
        env.update(env_vars)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(HERE), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        env["PYTHONUNBUFFERED"] = "1"
        argv = [sys.executable, "-m", "celery", "-A", app, *args]
        log_path = tmp_path / f"celery-{len(started)}.log"
        with log_path.open("wb") as out:
            proc = subprocess.Popen(
                argv,
                cwd=tmp_path,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent(),  # prctl and getppid only: fork-safe
            )
        process = CeleryProcess(argv, proc, log_path, nodename)
        started.append(process)
        return process

    yield start
    for process in reversed(started):
        process.stop(timeout=5)


@pytest.fixture
def spawn_worker(
    proj_env: ProjEnv, celery_cmd: Callable[..., CeleryProcess]
) -> Callable[..., CeleryProcess]:
    """``spawn_worker("a")``: a ready `celery worker` (prefork, 2 children) named a@<host>;
    ``pool=`` another pool (Celery reads the first ``-P`` to monkey-patch gevent/eventlet)."""
    # proj_env comes first so that it is torn down last: after every worker has stopped
    # consuming from its queue.

    def spawn(
        name: str,
        *extra: str,
        conf: Mapping[str, Any] | None = None,
        app: str = "redlock_proj.celery_app",
        pool: str = "prefork",
    ) -> CeleryProcess:
        env_vars = dict(proj_env.vars)
        if conf:
            env_vars["REDLOCK_TEST_CONF"] = json.dumps(conf)
        nodename = f"{name}@{socket.gethostname()}"
        process = celery_cmd(
            env_vars,
            "worker",
            "-P",
            pool,
            "-c",
            "2",
            "--without-heartbeat",
            "--without-gossip",
            "--without-mingle",
            "-l",
            "info",
            "-n",
            nodename,
            *extra,
            nodename=nodename,
            app=app,
        )
        process.wait_ready()
        return process

    return spawn
