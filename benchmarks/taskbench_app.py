"""The Celery app the task benchmark's worker runs (configured from environment variables).

BENCH_BROKER: broker URL (Redis or RabbitMQ); BENCH_QUEUE: the queue (default
``celery``); BENCH_MASTERS: comma-separated Redlock masters; BENCH_COUNTER: Redis URL
where every body counts itself (``INCR bench:done``); a body that sleeps (a duplicate
storm's) also records when it ran (``RPUSH bench:runs:<i>``), and one asked to stamp (the
latency section's) first pushes the time it started (``RPUSH bench:started``).
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery
from celery_once import QueueOnce
from celery_singleton import Singleton

from celery_redlock import SingletonTask

app = Celery("taskbench", broker=os.environ["BENCH_BROKER"])
app.conf.update(
    redlock_redis_urls=os.environ["BENCH_MASTERS"].split(","),
    task_ignore_result=True,
    task_default_queue=os.environ.get("BENCH_QUEUE", "celery"),
    worker_prefetch_multiplier=8,
    # celery-singleton keeps its locks in this Redis; celery-once in the one below.
    singleton_backend_url=os.environ["BENCH_COUNTER"],
    ONCE={
        "backend": "celery_once.backends.Redis",
        "settings": {"url": os.environ["BENCH_COUNTER"], "default_timeout": 300},
    },
)
_counter = redis.Redis.from_url(os.environ["BENCH_COUNTER"])


def _done(pause: float, i: int, stamp: bool) -> None:
    if stamp:
        # time.monotonic() is one clock for every process on Linux (CLOCK_MONOTONIC).
        _counter.rpush("bench:started", repr(time.monotonic()))
    if pause:
        # A storm body: record when it ran, per argument (one storm each), so the benchmark
        # counts this storm's bodies and checks that none overlapped.
        started = time.time()  # noqa: TID251 - compared across the worker's processes
        time.sleep(pause)
        _counter.rpush(f"bench:runs:{i}", f"{started:.6f} {time.time():.6f}")  # noqa: TID251
    _counter.incr("bench:done")


@app.task(name="bench.plain")
def plain(i: int, pause: float = 0.0, stamp: bool = False) -> None:
    _done(pause, i, stamp)


@app.task(name="bench.redlock", base=SingletonTask, lock_ttl=30)
def redlocked(i: int, pause: float = 0.0, stamp: bool = False) -> None:
    _done(pause, i, stamp)


@app.task(name="bench.redlock_active", base=SingletonTask, lock_ttl=30, dedupe="active")
def redlocked_active(i: int, pause: float = 0.0, stamp: bool = False) -> None:
    _done(pause, i, stamp)


@app.task(
    name="bench.redlock_skip", base=SingletonTask, lock_ttl=30, on_contention="skip", dedupe=None
)
def redlocked_skip(i: int, pause: float = 0.0, stamp: bool = False) -> None:
    _done(pause, i, stamp)


@app.task(name="bench.singleton", base=Singleton, lock_expiry=300)
def singleton(i: int, pause: float = 0.0, stamp: bool = False) -> None:
    _done(pause, i, stamp)


@app.task(name="bench.once", base=QueueOnce, once={"graceful": True})
def once(i: int, pause: float = 0.0, stamp: bool = False) -> None:
    _done(pause, i, stamp)


TASKS: dict[str, Any] = {
    "plain task": plain,
    "SingletonTask": redlocked,
    "celery-singleton": singleton,
    "celery-once": once,
}
