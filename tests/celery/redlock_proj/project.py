"""The tasks of the subprocess project, built for a given environment.

:func:`make_app` is what ``celery_app.py`` calls with ``os.environ`` inside the worker,
and what a test calls with the same mapping to publish those tasks the way a user
would (``app.tasks[...].apply_async``), through SingletonTask's enqueue side.

Environment keys:

``REDLOCK_TEST_BROKER``    broker URL (a harness redis-server)
``REDLOCK_TEST_BACKEND``   result backend URL (a harness redis-server)
``REDLOCK_TEST_MASTERS``   comma-separated Redlock master URLs
``REDLOCK_TEST_EVENTS``    Redis URL where task bodies record what they do (list ``events``)
``REDLOCK_TEST_QUEUE``     optional name of the task queue, also the control exchange's, so
                          tests sharing one RabbitMQ never see each other's messages
``REDLOCK_TEST_CONF``      optional JSON object merged into ``app.conf`` last (bad settings)

Task bodies append JSON events ``{"event": "enter"|"exit"|"interrupted", "task_id", "name",
"host", "pid", "t": time.monotonic_ns()}`` to the ``events`` list. CLOCK_MONOTONIC is
system-wide on Linux, so the test process can compare those times with its own.

In a worker (``celery_app.py`` calls :func:`record_signals`), celery-redlock's signals are
appended to the ``signals`` list of the same database: ``{"signal", "task_id", "key",
"action", "countdown", "errors", "policy", "host", "pid", "t"}``.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

import redis
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded

import celery_redlock
from celery_redlock import LockLostInterrupt, SingletonTask
from celery_redlock import signals as redlock_signals

LOOP = "redlock_proj.loop"
CRASHY = "redlock_proj.crashy"
QUICK = "redlock_proj.quick"
#: Like ``quick``, each with one contention policy: a lock outage must reschedule them all.
QUICK_SKIP = "redlock_proj.quick_skip"
QUICK_RAISE = "redlock_proj.quick_raise"
QUICK_CAPPED = "redlock_proj.quick_capped"  # on_contention="retry", max_contention_retries=1
#: Pure-Python work with ``on_lock_lost="interrupt"`` and a 3 s lock TTL (renewed every 1 s).
SWEEP = "redlock_proj.sweep"
#: Like ``sweep``, its body made of 0.1 s sleeps (a greenlet is interrupted at a sleep).
NAPS = "redlock_proj.naps"
#: Like ``crashy`` (acks_late; a 6 s TTL), each with one contention policy.
CRASHY_SKIP = "redlock_proj.crashy_skip"
CRASHY_RAISE = "redlock_proj.crashy_raise"
#: Catches SoftTimeLimitExceeded (a revoke with SIGUSR1) and runs a 2 s cleanup.
SOFT = "redlock_proj.soft"

#: The pool matrix (test_pools.py): a body longer than its 1 s lock TTL made of sleeps,
#: returning how long each ``time.sleep`` really took; and one with ``on_lock_lost="log"``
#: that returns whether its lease still read as held at the end.
SLEEPER = "redlock_proj.sleeper"
#: A 1 s lock TTL, no dedupe; records ``alive`` every 50 ms for ``seconds``.
LIMITED = "redlock_proj.limited"
#: Like ``loop``, with the default enqueue dedupe ("queued").
LOOPQ = "redlock_proj.loopq"
#: Like ``loop``, with ``dedupe="active"``.
LOOPA = "redlock_proj.loopa"
WATCHER = "redlock_proj.watcher"

#: The signals :func:`record_signals` records.
RECORDED_SIGNALS = ("lock_contended", "lock_unavailable", "lock_lost", "duplicate_dropped")


class EventLog:
    """Where task bodies record what they do: the ``events`` list in a Redis database."""

    def __init__(self, url: str) -> None:
        self.redis = redis.Redis.from_url(url, socket_timeout=5)

    def record(self, event: str, task: Any, t: int | None = None) -> None:
        self.redis.rpush(
            "events",
            json.dumps(
                {
                    "event": event,
                    "task_id": task.request.id,
                    "name": task.name,
                    "host": task.request.hostname or socket.gethostname(),
                    "pid": os.getpid(),
                    "t": time.monotonic_ns() if t is None else t,
                }
            ),
        )

    def run_until_stopped(self, task: Any, name: str, seconds: float) -> str:
        # Short sleeps in a Python loop: soft time limits and interrupts land here.
        self.record("enter", task)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not self.redis.exists(f"stop:{name}"):
            time.sleep(0.02)
        self.record("exit", task)
        return name


def make_app(env: Mapping[str, str]) -> Celery:
    app = Celery("redlock_proj", set_as_current=False)
    app.conf.update(
        broker_url=env["REDLOCK_TEST_BROKER"],
        result_backend=env["REDLOCK_TEST_BACKEND"],
        redlock_redis_urls=env["REDLOCK_TEST_MASTERS"].split(","),
        broker_connection_retry_on_startup=True,
        # One message at a time per child: a job waiting behind a long one in the same
        # child would make the timings meaningless.
        worker_prefetch_multiplier=1,
        redlock_contention_backoff=(0.2, 0.5),
        redlock_outage_backoff=(0.3, 0.6),
    )
    queue = env.get("REDLOCK_TEST_QUEUE")
    if queue:
        app.conf.update(task_default_queue=queue, control_exchange=queue)
    app.conf.update(json.loads(env.get("REDLOCK_TEST_CONF") or "{}"))
    celery_redlock.install(app)
    events = EventLog(env["REDLOCK_TEST_EVENTS"])
    run_until_stopped, record = events.run_until_stopped, events.record

    def singleton(name: str, key: str, **options: Any) -> Any:
        """``app.task`` for a bound SingletonTask ``name`` locking ``<key>:{name}``."""
        return app.task(
            shared=False,
            bind=True,
            base=SingletonTask,
            name=name,
            lock_key=key + ":{name}",
            **options,
        )

    @singleton(LOOP, "loop", dedupe=None)
    def loop(self: Any, name: str, seconds: float = 60.0) -> str:
        """Runs until ``seconds`` pass or the ``stop:<name>`` key exists."""
        return run_until_stopped(self, name, seconds)

    @singleton(CRASHY, "crash", lock_ttl=3, acks_late=True, dedupe=None)
    def crashy(self: Any, name: str, seconds: float = 60.0) -> str:
        """Like ``loop``, with a 3 s lock TTL and late acks (redelivered after a crash)."""
        return run_until_stopped(self, name, seconds)

    @singleton(QUICK, "quick", lock_ttl=3)
    def quick(self: Any, name: str) -> str:
        record("enter", self)
        record("exit", self)
        return name

    @singleton(SWEEP, "sweep", lock_ttl=3, on_lock_lost="interrupt", dedupe=None)
    def sweep(self: Any, name: str, seconds: float = 30.0) -> str:
        """Pure-Python work for ``seconds`` (no I/O, no sleep: the interpreter checks for an
        interrupt between bytecodes); records ``interrupted`` when its lost lock stops it."""
        record("enter", self)
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                total = 0
                for i in range(1000):
                    total += i
        except LockLostInterrupt:
            record("interrupted", self)
            raise
        record("exit", self)
        return name

    @singleton(NAPS, "naps", lock_ttl=3, on_lock_lost="interrupt", dedupe=None)
    def naps(self: Any, name: str, seconds: float = 30.0) -> str:
        """0.1 s sleeps for ``seconds``; records ``interrupted`` when its lost lock stops it."""
        record("enter", self)
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                time.sleep(0.1)
        except LockLostInterrupt:
            record("interrupted", self)
            raise
        record("exit", self)
        return name

    @singleton(LIMITED, "limited", lock_ttl=1, dedupe=None)
    def limited(self: Any, name: str, seconds: float = 10.0) -> str:
        record("enter", self)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            record("alive", self)
            time.sleep(0.05)
        record("exit", self)
        return name

    @singleton(LOOPQ, "loopq")
    def loopq(self: Any, name: str, seconds: float = 60.0) -> str:
        return run_until_stopped(self, name, seconds)

    @singleton(LOOPA, "loopa", dedupe="active")
    def loopa(self: Any, name: str, seconds: float = 60.0) -> str:
        return run_until_stopped(self, name, seconds)

    @singleton(SLEEPER, "sleeper", lock_ttl=1, dedupe=None)
    def sleeper(self: Any, name: str, naps: int = 6, nap: float = 0.25) -> list[float]:
        # The first sleep comes right after the acquire, before any other I/O: a wake-up
        # left over from the acquire round (eventlet) would land in it. "enter" is
        # recorded afterwards, with the time the body began.
        entered = time.monotonic_ns()
        took = []
        for _ in range(naps):
            started = time.monotonic()
            time.sleep(nap)
            took.append(time.monotonic() - started)
        held = self.lease is not None and self.lease.held
        record("enter", self, entered)
        record("exit", self)
        if not held:
            raise RuntimeError("the lease was not held at the end of the body")
        return took

    @singleton(WATCHER, "watcher", lock_ttl=1, on_lock_lost="log", dedupe=None)
    def watcher(self: Any, name: str, seconds: float = 20.0) -> bool:
        """Sleeps until its lease reads as lost (or ``seconds`` pass); returns ``held``."""
        record("enter", self)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.lease is not None and self.lease.held:
            time.sleep(0.05)
        record("exit", self)
        return bool(self.lease is not None and self.lease.held)

    @singleton(SOFT, "soft", dedupe=None)
    def soft(self: Any, name: str, seconds: float = 60.0) -> str:
        """Sleeps until ``seconds`` pass; a soft kill makes it run a 2 s cleanup, then return."""
        record("enter", self)
        try:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                time.sleep(0.02)
        except SoftTimeLimitExceeded:
            record("soft", self)
            cleanup_until = time.monotonic() + 2.0
            while time.monotonic() < cleanup_until:
                time.sleep(0.02)
        record("exit", self)
        return name

    for crash_name, policy in ((CRASHY_SKIP, "skip"), (CRASHY_RAISE, "raise")):

        @singleton(
            crash_name,
            "crash-" + policy,
            # Longer than the Redis broker's redelivery in the tests (visibility timeout
            # 2 s, then the sweep): the redelivered job meets the dead run's lock.
            lock_ttl=6,
            acks_late=True,
            dedupe=None,
            on_contention=policy,
        )
        def crashy_variant(self: Any, name: str, seconds: float = 60.0) -> str:
            return run_until_stopped(self, name, seconds)

    for task_name, prefix, options in (
        (QUICK_SKIP, "skip", {"on_contention": "skip"}),
        (QUICK_RAISE, "raise", {"on_contention": "raise"}),
        (QUICK_CAPPED, "capped", {"on_contention": "retry", "max_contention_retries": 1}),
    ):

        @singleton(task_name, prefix, lock_ttl=3, **options)
        def quick_variant(self: Any, name: str) -> str:
            record("enter", self)
            record("exit", self)
            return name

    return app


def record_signals(env: Mapping[str, str]) -> None:
    """Append celery-redlock's signals sent in this process (and in the pool children it
    forks) to the ``signals`` list; for worker processes only, never the test process."""
    redis_client = redis.Redis.from_url(env["REDLOCK_TEST_EVENTS"], socket_timeout=5)

    def receiver(name: str) -> Any:
        def receive(sender: Any = None, **kwargs: Any) -> None:
            request = getattr(sender, "request", None)
            redis_client.rpush(
                "signals",
                json.dumps(
                    {
                        "signal": name,
                        "task_id": kwargs.get("task_id"),
                        "key": kwargs.get("key"),
                        "action": kwargs.get("action"),
                        "countdown": kwargs.get("countdown"),
                        "errors": sorted(kwargs.get("errors") or ()),
                        "policy": kwargs.get("policy"),
                        "host": getattr(request, "hostname", None) or socket.gethostname(),
                        "pid": os.getpid(),
                        "t": time.monotonic_ns(),
                    }
                ),
            )

        return receive

    for name in RECORDED_SIGNALS:
        getattr(redlock_signals, name).connect(
            receiver(name), weak=False, dispatch_uid=f"redlock_proj.record.{name}"
        )
