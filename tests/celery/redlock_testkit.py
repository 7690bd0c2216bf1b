"""Helpers shared by the Celery-layer tests (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_redlock.keys import redis_key
from celery_redlock.testing import Masters, RedisServer, wait_for

#: Both brokers, for the key scenarios:
#: ``@pytest.mark.parametrize("env", BROKERS, indirect=True)`` on a test that uses ``env``.
BROKERS = ["redis", pytest.param("rabbitmq", marks=pytest.mark.rabbitmq)]


# -- recording what task bodies do -------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """One run of a task body: ``enter`` and ``exit`` in ``time.monotonic_ns()``."""

    task_id: str
    enter: int
    exit: int


@dataclass
class Recorder:
    """Collects spans of in-process task bodies (threads pool) and lets tests gate them."""

    spans: list[Span] = field(default_factory=list)
    entered: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @contextlib.contextmanager
    def span(self, task_id: str) -> Iterator[None]:
        enter = time.monotonic_ns()
        with self.lock:
            self.entered.append(task_id)
        try:
            yield
        finally:
            exit_ = time.monotonic_ns()
            with self.lock:
                self.spans.append(Span(task_id, enter, exit_))

    def wait_entered(self, count: int = 1, timeout: float = 10) -> list[str]:
        return wait_for(
            lambda: list(self.entered) if len(self.entered) >= count else None,
            timeout=timeout,
            message=f"{count} task bodies to start",
        )


def assert_no_overlap(spans: list[Span]) -> list[Span]:
    """Assert the spans are disjoint in time; return them sorted by start."""
    ordered = sorted(spans, key=lambda s: s.enter)
    for first, second in itertools.pairwise(ordered):
        assert second.enter >= first.exit, (
            f"bodies overlapped: {first.task_id} ran until {first.exit}, "
            f"{second.task_id} started at {second.enter} ({(first.exit - second.enter) / 1e6:.1f}"
            " ms of overlap)"
        )
    return ordered


@dataclass
class CeleryEnv:
    """Where an in-process test's app talks to: a broker, a Redis result backend, masters."""

    kind: str
    broker_url: str
    backend_url: str
    masters: Masters
    server: RedisServer
    queue: str

    def lock_names(self, key: str) -> tuple[str, str]:
        """Redis names of the lock on ``key`` and of its metadata hash (default prefix)."""
        return redis_key("redlock", key), redis_key("redlock", key, "meta")

    def on_masters(self, name: str) -> list[bool]:
        """Whether ``name`` exists, per master."""
        found = []
        for server in self.masters:
            with server.client() as conn:
                found.append(bool(conn.exists(name)))
        return found

    def on_quorum(self, name: str) -> bool:
        """Whether ``name`` exists on a majority of the masters (what Redlock acts on: a
        command sent to the last master may still be on its way when a round decides)."""
        return sum(self.on_masters(name)) > len(self.masters) // 2

    def delete_on_masters(self, *names: str) -> None:
        for server in self.masters:
            with server.client() as conn:
                conn.delete(*names)


def queue_length(app: Celery, queue: str) -> int:
    """Messages waiting in ``queue`` (not yet delivered to a worker), on either broker."""
    with app.connection_for_write() as conn:
        return int(conn.default_channel.queue_declare(queue, passive=True).message_count)


@contextlib.contextmanager
def run_worker(app: Celery, concurrency: int = 2, **kwargs: Any) -> Iterator[Any]:
    """An in-process worker (threads pool) consuming ``app``'s default queue."""
    options: dict[str, Any] = {"loglevel": "WARNING", "shutdown_timeout": 20, **kwargs}
    with start_worker(
        app, pool="threads", concurrency=concurrency, perform_ping_check=False, **options
    ) as worker:
        yield worker


@dataclass
class CeleryProcess:
    """A ``python -m celery ...`` subprocess in its own process group, output in a file."""

    args: list[str]
    proc: subprocess.Popen[bytes]
    log_path: Path
    nodename: str | None = None

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 40) -> None:
        """Wait for the worker's ``ready.`` line; fail with its output if it exits first."""

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"{' '.join(self.args)} exited with {self.proc.returncode}:\n{self.log[-4000:]}"
                )
            return " ready." in self.log

        wait_for(ready, timeout=timeout, interval=0.05, message=f"{self.nodename} to be ready")

    def signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signum)

    def kill(self) -> None:
        """SIGKILL the whole process group (main process and pool children) at once."""
        self.signal_group(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM (warm shutdown), then SIGKILL the group if it does not exit in time."""
        if self.proc.poll() is None:
            self.signal_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout)
        # Pool children that outlived their parent, and a main process that hung.
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


#: ``celery worker`` arguments of a worker that is expected to stop at start
FAILING_WORKER_ARGS = (
    "worker", "-P", "prefork", "-c", "1", "--without-heartbeat", "--without-gossip",
    "--without-mingle", "-l", "info",
)  # fmt: skip


def exit_code(process: CeleryProcess, timeout: float = 60) -> int:
    """The exit status of a ``celery`` process that must stop by itself (bad settings)."""
    try:
        return int(process.proc.wait(timeout=timeout))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running with bad settings:\n{process.log[-3000:]}") from None


@dataclass
class ProjEnv:
    """The environment of the subprocess project (``redlock_proj``) for one test.

    ``kind`` is the broker (``"redis"`` or ``"rabbitmq"``); ``queue`` the test's own task
    queue (and control exchange), so that nothing another test or run left on a shared
    RabbitMQ reaches this test's workers.
    """

    kind: str
    masters: Masters
    server: RedisServer
    queue: str
    vars: dict[str, str]
    apps: list[Celery] = field(default_factory=list)

    def events(self) -> list[dict[str, Any]]:
        with self.server.client(db=2) as conn:
            return [json.loads(raw) for raw in conn.lrange("events", 0, -1)]

    def signals(self, name: str | None = None) -> list[dict[str, Any]]:
        """celery-redlock signals the workers sent (``redlock_proj.project.record_signals``),
        in order; only those called ``name`` when given."""
        with self.server.client(db=2) as conn:
            sent = [json.loads(raw) for raw in conn.lrange("signals", 0, -1)]
        return [s for s in sent if name is None or s["signal"] == name]

    def stop_loop(self, name: str) -> None:
        """Ask ``loop``/``crashy`` bodies running with ``name`` to return."""
        with self.server.client(db=2) as conn:
            conn.set(f"stop:{name}", 1)

    def client_app(self) -> Celery:
        """The project's app in this process, to publish its tasks as a user would."""
        from .redlock_proj.project import make_app as make_proj_app

        if not self.apps:
            self.apps.append(make_proj_app(self.vars))
        return self.apps[0]


# -- our signals ---------------------------------------------------------------------------------

SIGNAL_NAMES = (
    "lock_acquired",
    "lock_released",
    "lock_contended",
    "lock_lost",
    "lock_unavailable",
    "duplicate_dropped",
)


@dataclass
class SignalLog:
    """What celery-redlock's signals sent during a test, in order (thread-safe)."""

    sent: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def receiver(self, name: str) -> Any:
        def receive(sender: Any = None, **kwargs: Any) -> None:
            kwargs.pop("signal", None)
            with self.lock:
                self.sent.append({"signal": name, "sender": sender, **kwargs})

        return receive

    def of(self, name: str, **match: Any) -> list[dict[str, Any]]:
        """Every sending of signal ``name`` whose arguments include ``match``."""
        with self.lock:
            return [
                s
                for s in self.sent
                if s["signal"] == name and all(s.get(k) == v for k, v in match.items())
            ]


@contextlib.contextmanager
def opened_on_exit(*gates: threading.Event) -> Iterator[None]:
    """Set ``gates`` when the block ends, pass or fail, so blocked bodies return and the
    worker can stop (use it inside ``run_worker(...)``, so it exits first)."""
    try:
        yield
    finally:
        for gate in gates:
            gate.set()
